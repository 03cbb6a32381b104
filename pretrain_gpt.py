"""Pretrain a GPT with tensor, pipeline and data parallelism and a ZeRO-sharded optimizer.

    python pretrain_gpt.py                                   # tiny GPT on the bundled sample corpus
    torchrun --nproc-per-node 8 pretrain_gpt.py --tp 2 --pp 2 --dp 2 --zero-stage 1

Every flag is validated before any process group, model or dataset is created.
"""
import sys

from megazero.arguments import parse_job


def main(argv=None) -> int:
    job, args = parse_job(argv)
    par = job.parallel
    print(f"megazero: valid layout tp={par.tp} pp={par.pp} dp={par.dp} zero={job.zero.zero_stage} "
          f"micro-batches={job.num_micro_batches}; the training loop is not implemented yet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
