"""Megatron-LM's flags (megazero/config/megatron_flags.py): every row of docs/megatron-flags.md is what the parser
does; mapped flags and their conflicts; sample-based schedules; Megatron's tokenizer names; and two Megatron-LM
launch scripts (GPT-2 345M, Llama-2-7B, tiny sizes on CPU) through pretrain_gpt.py."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.cli.arguments import build_parser, megatron_reference_markdown, megatron_rows
from megazero.cli.job import parse_job
from megazero.config import megatron_flags as megatron

ROOT = Path(__file__).resolve().parents[1]
VALUES = {"--transformer-impl": "transformer_engine", "--attention-backend": "flash", "--data-impl": "mmap",
          "--dataloader-type": "single", "--distributed-backend": "gloo", "--muon-scalar-optimizer": "adam",
          "--muon-tp-mode": "distributed",
          "--ckpt-format": "torch_dist", "--tiktoken-pattern": "v2", "--kv-channels": "32"}
NO_OPS = " Megatron-LM implementation flags taken as no-ops here (what runs instead: docs/megatron-flags.md): "


def _parse(argv, capsys, world_size: int = 1):
    """(job or None, exit status, stdout lines, stderr lines) of parsing ``argv`` on ``world_size`` ranks."""
    try:
        job, status = parse_job(argv, world_size=world_size)[0], 0
    except SystemExit as e:
        job, status = None, e.code
    out, err = capsys.readouterr()
    return job, status, out.splitlines(), err.splitlines()


def test_the_table_is_generated_from_the_module():
    page = ROOT / "docs" / "megatron-flags.md"
    assert page.read_text() == megatron_reference_markdown(), \
        "docs/megatron-flags.md is stale: python -m megazero.cli.arguments --megatron-markdown > docs/megatron-flags.md"
    assert "megatron-flags.md" in (ROOT / "docs" / "flags.md").read_text()


def test_every_row_is_what_the_parser_does(capsys):
    parser = build_parser()
    options = getattr(parser, "_option_string_actions")
    for name, status, detail in megatron_rows():
        if status == "accepted as-is":
            assert name in options and "." in options[name].dest, name           # a config field's own flag
            continue
        argv = [name] + ([VALUES.get(name, "1")] if options.get(name) and options[name].nargs != 0 else [])
        if name == "--no-position-embedding":
            argv += ["--position-embedding-type", "rope"]
        job, code, out, err = _parse(argv, capsys)
        if status == "refused":
            assert code == 2 and err == [f"pretrain_gpt.py: error: {name}: {detail}"], (name, err)
        elif status == "implementation choice":
            shown = " ".join(argv[:2]) if len(argv) > 1 and not argv[1].startswith("--") else name
            assert code == 0 and out == [NO_OPS + shown], (name, out, err)
        elif status == "restated":
            assert code == 0 and out == [] and err == [], (name, out, err)   # 32 = hidden 128 / 4 heads
        else:
            assert status == "mapped" and code == 0, (name, err)
            for field_name, value in getattr(megatron.MAPPED.get(name), "sets", {}).items():
                section = next(s for s in ("model", "zero", "parallel") if hasattr(getattr(job, s), field_name))
                assert getattr(getattr(job, section), field_name) == value, name


def test_each_refused_flag_is_one_line_and_all_are_said_at_once(capsys):
    _, code, _, err = _parse(["--fp8-hybrid", "--num-layers", "2", "--no-save-optim",
                              "--rampup-batch-size", "16", "16", "100", "--tensor-parallel", "2"], capsys)
    assert code == 2 and len(err) == 4, err
    assert [line.split(":")[2].strip().split()[0] for line in err] == \
        ["--fp8-hybrid", "--no-save-optim", "--rampup-batch-size", "unrecognized"]
    assert err[0].endswith("--fp8-hybrid: Megatron-LM's older spelling: use --fp8-format hybrid")
    assert "did you mean --tensor-model-parallel-size" in err[3]


def test_distributed_optimizer_is_zero_stage_1_and_a_different_stage_is_refused(capsys, tmp_path):
    job, code, _, _ = _parse(["--use-distributed-optimizer", "--zero-stage", "1"], capsys)
    assert code == 0 and job.zero.zero_stage == 1
    _, code, _, err = _parse(["--use-distributed-optimizer", "--zero-stage", "2"], capsys)
    assert code == 2 and err == ["pretrain_gpt.py: error: --use-distributed-optimizer means --zero-stage 1, but "
                                 "--zero-stage 2 is given: for ZeRO stage 2 or 3 drop --use-distributed-optimizer"]
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    _, code, _, err = _parse(["--use-distributed-optimizer", "--deepspeed-config", str(ds)], capsys)
    assert code == 2 and len(err) == 1 and "--zero-stage (from --use-distributed-optimizer) is 1" in err[0]
    cfg = tmp_path / "run.toml"
    cfg.write_text("zero-stage = 2\n")                  # the command line overrides a --config file
    job, code, _, _ = _parse(["--use-distributed-optimizer", "--config", str(cfg)], capsys)
    assert code == 0 and job.zero.zero_stage == 1


def test_distributed_backend_is_backend(capsys):
    assert parse_job(["--distributed-backend", "gloo"], world_size=1)[1].backend == "gloo"


@pytest.mark.parametrize("argv,iters,decay,warmup", [
    (["--train-samples", "100", "--global-batch-size", "8"], 12, 13, 0),      # decay ends at sample 100
    (["--train-samples", "100", "--global-batch-size", "8", "--lr-decay-samples", "50", "--lr-warmup-samples", "9"],
     12, 7, 2),
    (["--train-samples", "160", "--global-batch-size", "8", "--lr-warmup-fraction", "0.1"], 20, 20, 2),
    (["--train-iters", "30", "--lr-decay-iters", "25", "--lr-warmup-fraction", "0.1"], 30, 25, 3),
    (["--train-iters", "30", "--lr-warmup-fraction", "0.01"], 30, 30, 1),
])
def test_sample_based_schedules_become_iterations(argv, iters, decay, warmup, capsys):
    job, code, _, err = _parse(argv, capsys)
    assert code == 0, err
    assert (job.train.train_iters, job.optimizer.lr_decay_iters, job.optimizer.lr_warmup_iters) == \
        (iters, decay, warmup)


@pytest.mark.parametrize("argv,message", [
    (["--train-iters", "10", "--train-samples", "80"], "--train-iters and --train-samples are exclusive"),
    (["--train-samples", "80", "--lr-decay-iters", "5"], "--lr-decay-iters belongs to an iteration-based run; "
                                                         "with --train-samples use --lr-decay-samples"),
    (["--lr-warmup-samples", "80"], "--lr-warmup-samples belongs to a sample-based run (--train-samples)"),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "--lr-warmup-fraction and --lr-warmup-iters both"),
    (["--train-samples", "4", "--global-batch-size", "8"], "--train-samples 4 is less than one --global-batch-size"),
])
def test_mixing_iterations_and_samples_is_refused_as_megatron_does(argv, message, capsys):
    _, code, _, err = _parse(argv, capsys)
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_megatron_tokenizer_names(capsys, tmp_path):
    job, code, out, _ = _parse(["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "sp.model"], capsys)
    assert code == 0 and job.data.tokenizer_type == "SentencePieceTokenizer"
    assert any(line.startswith(" --tokenizer-type Llama2Tokenizer: read as SentencePieceTokenizer") for line in out)
    _, code, _, err = _parse(["--tokenizer-type", "TikTokenizer"], capsys)
    assert code == 2 and err == ["pretrain_gpt.py: error: --tokenizer-type TikTokenizer does not exist here: use "
                                 "HuggingFaceTokenizer with the model's tokenizer.json"]
    job, code, _, _ = _parse(["--vocab-file", "v.json", "--merge-file", "m.txt"], capsys)
    assert code == 0 and job.data.tokenizer_type == "GPT2BPETokenizer"
    from megazero.data.tokenizers import build_tokenizer

    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (null.vocab_size, null.eod, null.tokenize("3 5 99")) == (101, 100, [3, 5, 99])


def test_no_position_embedding_needs_rope(capsys):
    _, code, _, err = _parse(["--no-position-embedding"], capsys)
    assert code == 2 and len(err) == 1 and "--no-position-embedding needs --position-embedding-type rope" in err[0]


# ------------------------------------------------------------------------------ Megatron-LM launch scripts
# The flags of Megatron-LM's examples/pretrain_gpt.sh (GPT-2 345M) and examples/llama/train_llama2.sh (Llama-2-7B,
# with the Megatron-core flags of its variants), unchanged but for tiny sizes on CPU (the real value after #),
# gloo for nccl, and the data swapped for mock data / the bundled sample corpus and its SentencePiece model.
GPT2_345M = """
--num-layers 2 --hidden-size 32 --num-attention-heads 4 --micro-batch-size 2 --global-batch-size 4
--seq-length 32 --max-position-embeddings 32 --train-iters 2 --lr-decay-iters 2
--save {ckpt} --load {ckpt} --mock-data --vocab-file {vocab} --merge-file {merges} --data-impl mmap
--split 949,50,1 --distributed-backend gloo --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine
--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --checkpoint-activations --log-interval 1
--save-interval 10000 --eval-interval 1000 --eval-iters 1 --fp16
--use-mcore-models --transformer-impl local --use-distributed-optimizer --overlap-grad-reduce
"""
# 24 layers, 1024 wide, 16 heads, micro 4, global 8, seq 1024, 500000 iterations, decay 320000, eval 10, nccl
LLAMA2_7B = """
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
--num-layers 2 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 --seq-length 32
--max-position-embeddings 64 --untie-embeddings-and-output-weights --position-embedding-type rope
--no-position-embedding --swiglu --disable-bias-linear --init-method-std 0.02 --attention-dropout 0.0
--hidden-dropout 0.0 --normalization RMSNorm --micro-batch-size 1 --global-batch-size 2 --train-iters 2
--no-async-tensor-model-parallel-allreduce --bf16 --no-masked-softmax-fusion
--lr 1e-4 --min-lr 1e-5 --lr-decay-iters 320000 --lr-decay-style cosine --weight-decay 1.0e-1 --clip-grad 1.0
--optimizer adam --adam-beta1 0.9 --adam-beta2 0.95
--tokenizer-type Llama2Tokenizer --tokenizer-model {sp_model} --data-path {data} --data-cache-path {cache}
--split 949,50,1 --dataloader-type cyclic --save-interval 200000 --log-interval 1 --eval-interval 320000
--eval-iters 1 --num-workers 8 --log-throughput --no-save-optim --no-save-rng
--group-query-attention --num-query-groups 4 --no-gradient-accumulation-fusion --distributed-backend gloo
--distributed-timeout-minutes 120 --overlap-grad-reduce --use-distributed-optimizer --overlap-param-gather
--use-flash-attn --use-mcore-models --transformer-impl local --rotary-percent 1.0 --save {ckpt}
"""
# 32 layers, 4096 wide, ffn 11008, 32 heads (32 query groups), seq 4096, max positions 32000, global 8, 12
# iterations, split 99990,8,2, eval 10, nccl
LLAMA2_REFUSED = ["--dataloader-type", "--no-save-optim", "--no-save-rng"]


def _run(flags: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *flags], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _without(flags: list[str], names: list[str]) -> list[str]:
    out, skip = [], False
    for token in flags:
        if token in names:
            skip = True
            continue
        if skip and not token.startswith("--"):
            continue
        skip = False
        out.append(token)
    return out


def test_megatron_gpt2_345m_script_runs_unchanged(tmp_path):
    flags = GPT2_345M.format(ckpt=tmp_path / "ckpt", vocab=ROOT / "tests/data/gpt2/vocab.json",
                             merges=ROOT / "tests/data/gpt2/merges.txt").split()
    run = _run(flags + ["--metrics-file", str(tmp_path / "m.jsonl")], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{NO_OPS}--data-impl mmap, --use-mcore-models, --transformer-impl local\n" in run.stdout
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.slow
def test_megatron_llama2_7b_script_stops_one_line_per_refused_flag_then_runs(tmp_path):
    from megazero.data.sample import default_sample, sample_tokenizer

    cache = tmp_path / "cache"
    flags = LLAMA2_7B.format(sp_model=sample_tokenizer().model_file, data=default_sample(cache), cache=cache,
                             ckpt=tmp_path / "ckpt").split()
    run = _run(flags, tmp_path)
    errors = [line for line in run.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert run.returncode == 2 and len(errors) == len(LLAMA2_REFUSED) == len(run.stderr.splitlines()), run.stderr
    assert [e.split()[2].rstrip(":") for e in errors] == LLAMA2_REFUSED
    run = _run(_without(flags, LLAMA2_REFUSED) + ["--metrics-file", str(tmp_path / "m.jsonl")], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert " --tokenizer-type Llama2Tokenizer: read as SentencePieceTokenizer" in run.stdout, run.stdout[:3000]
    no_ops = [line for line in run.stdout.splitlines() if line.startswith(NO_OPS)]
    assert len(no_ops) == 1 and set(no_ops[0][len(NO_OPS):].split(", ")) == {
        "--no-position-embedding", "--no-async-tensor-model-parallel-allreduce", "--no-masked-softmax-fusion",
        "--num-workers 8", "--log-throughput",
        "--use-flash-attn", "--use-mcore-models", "--transformer-impl local"}, no_ops
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2]


@pytest.mark.slow
def test_no_load_optim_no_load_rng_and_checkpoint_args_when_resuming(tmp_path):
    """--no-load-optim resumes the iteration with a fresh optimizer (the next loss differs from a full resume);
    --use-checkpoint-args takes the model's shape from the checkpoint (no model flags given)."""
    from helpers.trainer import TINY, read_metrics

    shape = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
    base = _without(TINY, ["--train-iters", "--num-layers", "--hidden-size", "--num-attention-heads"])
    saved = _run(base + shape + ["--train-iters", "2", "--save", str(tmp_path / "a")], tmp_path)
    assert saved.returncode == 0, saved.stderr[-3000:]
    losses = {}
    for name, extra in (("full", shape), ("fresh", ["--no-load-optim", "--no-load-rng", "--use-checkpoint-args"])):
        resumed = ["--train-iters", "4", "--load", str(tmp_path / "a"), "--override-opt_param-scheduler"]
        run = _run(base + extra + resumed + ["--metrics-file", str(tmp_path / f"{name}.jsonl")], tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        train, _ = read_metrics(tmp_path / f"{name}.jsonl")
        assert [r["iteration"] for r in train] == [3, 4]
        losses[name] = [r["loss"] for r in train]
        if name == "fresh":
            assert "at iteration 2" in run.stdout and "fresh optimizer and random states" in run.stdout
    assert losses["full"][0] == losses["fresh"][0]          # the same weights went into iteration 3 ...
    assert losses["full"][1] != losses["fresh"][1]          # ... whose update used fresh Adam moments


# The argv Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh hands pretrain_gpt.py with its mock-data
# defaults, after bash's word splitting (an array item "--split '99,1,0'" passes the quotes on), unchanged but
# for tiny sizes on CPU (the real values after #) and the directories.
# 32 layers, 4096 wide, ffn 14336, 32 heads, 8 query groups, kv-channels 128, seq and positions 8192, global
# batch 128, 1953125000 samples (decay 1949218748, warmup 3906252), vocab 128256, eval 32 batches
LLAMA3_8B = """
--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4
--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 2 --train-samples {samples} --lr-decay-samples {samples}
--lr-warmup-samples 2 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --data-cache-path {cache} --tiktoken-pattern v2
--split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 1 --eval-interval 100 --save-interval 1000 --log-throughput --profile
--profile-step-start {profile_start} --profile-step-end {profile_end} --ckpt-format torch_dist
--distributed-timeout-minutes 60 --save {ckpt} --load {ckpt} --tensorboard-dir {tb}
"""
LLAMA3_NO_OPS = ["--use-mcore-models", "--attention-backend fused",
                 "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level 1", "--tiktoken-pattern v2",
                 "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers 1",
                 "--log-throughput", "--ckpt-format torch_dist"]
# examples/gpt3/train_gpt3_175b_distributed.sh: 96 layers, 12288 wide, 96 heads, seq 2048, tp 8, pp 16 on 128
# ranks, global batch 1536 grown in steps from 16 ("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", tokens),
# 500000 iterations (decay 430000), its data and GPT-2 files for --mock-data.
GPT3_175B = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--attention-backend", "auto",
             "--micro-batch-size", "1", "--global-batch-size", "4",
             "--step-batch-size-schedule", "0:2 0.064K:4",
             "--train-iters", "5", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
             "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style",
             "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "4",
             "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--mock-data", "--vocab-file", str(ROOT / "tests/data/gpt2/vocab.json"),
             "--merge-file", str(ROOT / "tests/data/gpt2/merges.txt"), "--split", "949,50,1",
             "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", "ckpt",
             "--load", "ckpt", "--eval-iters", "10", "--tensorboard-dir", "tb"]


def _llama3(tmp_path: Path, samples: int = 16, profile=(4, 6)) -> list[str]:
    return LLAMA3_8B.format(samples=samples, cache=tmp_path / "cache", ckpt=tmp_path / "ckpt", tb=tmp_path / "tb",
                            profile_start=profile[0], profile_end=profile[1]).split()


def test_llama3_8b_script_runs_through_parsing_and_validation_as_written(tmp_path, capsys):
    job, code, out, err = _parse(_llama3(tmp_path), capsys)
    assert code == 0, err
    assert out == [NO_OPS + ", ".join(LLAMA3_NO_OPS)]            # one line names every implementation flag
    assert err == ["pretrain_gpt.py: warning: --sequence-parallel turned off: it splits activations over the "
                   "tensor-parallel ranks and --tensor-model-parallel-size/--tp is 1 (as Megatron-LM does)"]
    assert (job.data.split, job.parallel.sequence_parallel, job.zero.zero_stage) == ("99,1,0", False, 1)
    assert job.zero.accumulate_allreduce_grads_in_fp32 is False       # --grad-reduce-in-bf16
    assert (job.model.head_dim, job.model.num_query_groups, job.train.train_iters) == (16, 2, 8)
    assert job.train.exit_duration_in_mins == 235                     # the script's wall-clock limit, kept
    assert job.model.apply_layernorm_1p and job.model.normalization == "RMSNorm"     # zero-centred RMSNorm
    assert (job.optimizer.decoupled_lr, job.optimizer.decoupled_min_lr) == (5.0e-4, 4.5e-5)   # built: not refused
    assert (job.fp8.fp8_format, job.fp8.recipe, job.fp8.history_len, job.fp8.amax_compute_algo,
            job.fp8.fp8_param_gather) == ("hybrid", "delayed", 1024, "max", True)      # Megatron's default recipe


def test_gpt3_175b_script_runs_through_parsing_and_validation_with_its_batch_size_schedule(capsys):
    job, code, out, err = _parse(GPT3_175B, capsys, world_size=4)
    assert code == 0, err
    assert (job.parallel.tp, job.parallel.pp, job.parallel.dp, job.data.split) == (2, 2, 1, "949,50,1")
    assert job.train.batch_schedule == ((0, 2), (2, 4)) and job.train.global_batch_size == 4   # 64 tokens: 2 samples
    assert [job.train.global_batch_at(c) for c in (0, 1, 2, 6)] == [2, 2, 4, 4]
    assert out == [NO_OPS + "--attention-backend auto", " --vocab-file and --merge-file without "
                   "--tokenizer-type: GPT2BPETokenizer"] and err == []


@pytest.mark.slow                  # four ranks through torchrun: the full suite only
def test_gpt3_175b_script_runs_its_batch_size_schedule_on_four_ranks(tmp_path):
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          str(ROOT / "pretrain_gpt.py"), *_without(GPT3_175B, ["--tensorboard-dir"]),   # optional
                          "--metrics-file", str(tmp_path / "m.jsonl")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [(r["iteration"], r["global_batch_size"], r["consumed_samples"]) for r in train] == [(5, 4, 2 + 4 * 4)]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"


@pytest.mark.parametrize("argv,line", [
    (["--kv-channels", "32"], None),                                  # default model: 128 wide, 4 heads
    (["--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
      "--kv-channels", "8"], None),
    (["--kv-channels", "64"], "--kv-channels 64: the head size here is hidden size / attention heads (--hidden-size "
                              "128 / --num-attention-heads 4 = 32), and another does not exist: drop it or give 32"),
])
def test_kv_channels_is_accepted_when_it_is_the_head_size(argv, line, capsys):
    _, code, _, err = _parse(argv, capsys)
    assert (code, err) == ((0, []) if line is None else (2, [f"pretrain_gpt.py: error: {line}"]))


def test_sequence_parallel_is_turned_off_at_tp_1_and_kept_above(capsys):
    job, code, _, err = _parse(["--sequence-parallel"], capsys)
    assert code == 0 and job.parallel.sequence_parallel is False and len(err) == 1 and "warning: --sequence" in err[0]
    job = parse_job(["--sequence-parallel", "--tp", "2"], world_size=2)[0]
    assert job.parallel.sequence_parallel is True and capsys.readouterr().err == ""


@pytest.mark.parametrize("given,split", [("'99,1,0'", "99,1,0"), ('"99,1,0"', "99,1,0"), ("99,1,0", "99,1,0"),
                                         ("969,30,1", "969,30,1"), ("'99,1,0\"", None), ("'99,1,0", None)])
def test_split_takes_the_quoted_form_a_bash_string_passes(given, split, capsys):
    job, code, _, err = _parse(["--mock-data", "--split", given], capsys)
    assert (job.data.split if job else None) == split, err
    assert split is not None or (code == 2 and len(err) == 1 and "--split" in err[0])


def test_per_token_loss_is_a_no_op_only_with_equal_loss_tokens_per_micro_batch(capsys):
    _, code, out, _ = _parse(["--calculate-per-token-loss"], capsys)
    assert code == 0 and out == [NO_OPS + "--calculate-per-token-loss"]
    _, code, _, err = _parse(["--calculate-per-token-loss", "--eod-mask-loss"], capsys)
    assert code == 2 and err == ["pretrain_gpt.py: error: --calculate-per-token-loss and --eod-mask-loss do not go "
                                 "together here (" + megatron.IMPLEMENTATION["--calculate-per-token-loss"].why
                                 + "): drop one"]


def test_ckpt_format_is_a_no_op_only_for_megatrons_default(capsys):
    assert _parse(["--ckpt-format", "torch_dist"], capsys)[1] == 0
    _, code, _, err = _parse(["--ckpt-format", "torch"], capsys)
    assert code == 2 and err == ["pretrain_gpt.py: error: --ckpt-format torch: Megatron-LM's other checkpoint formats "
                                 "are not written here; checkpoints are in megazero's own format (docs/checkpoints.md): "
                                 "drop it"]


@pytest.mark.parametrize("unknown,suggested", [
    ("--grad-reduce-in-bf16", []), ("--fp8-param-gather", []),
    ("--no-mmap-bin-files", []), ("--exit-duration-in-mins", []),       # the report's unrelated suggestions
    ("--num-layer", ["--num-layers"]), ("--hidden", ["--hidden-size"]),
    ("--tensor-parallel", ["--tensor-model-parallel-size"]), ("--log-intervall", ["--log-interval"]),
    ("--bf61", ["--bf16"]), ("--seq-len", ["--seq-length"]),
])
def test_did_you_mean_names_only_near_spellings(unknown, suggested):
    """Each name checked against the parser's flags without itself, as when it was not known."""
    known = [s for s in getattr(build_parser(), "_option_string_actions") if s.startswith("--") and s != unknown]
    assert megatron.close_flags(unknown, known)[:len(suggested) or 3] == suggested


def test_megatron_llama3_8b_script_trains_two_iterations(tmp_path):
    flags = _llama3(tmp_path, samples=4, profile=(1, 2))               # FP8 (hybrid, delayed, FP8 gathers) included
    if importlib.util.find_spec("tensorboard") is None:     # an optional extra: its refusal is tested elsewhere
        flags = _without(flags, ["--tensorboard-dir"])
    run = _run(flags + ["--metrics-file", str(tmp_path / "m.jsonl")], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2]
    steps = [r for r in records if "loss" in r]           # one warmup iteration, then the decay's start
    assert [x for r in steps for x in (r["lr"], r["decoupled_lr"])] == pytest.approx([1.5e-4, 5.0e-4] * 2)
