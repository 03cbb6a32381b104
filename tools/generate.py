"""Generate text from a megazero checkpoint (any layout) in one process, on the CPU or one GPU.

    python tools/generate.py --load ckpt/ --prompt "The hacker" --max-new-tokens 40           # greedy
    python tools/generate.py --load ckpt/ --prompt-ids 5,17,42 --top-k 40 --top-p 0.9 --seed 1

The tokenizer is the one the run was trained with (from the checkpoint's config: --tokenizer-type and
its files, or the embedded sample tokenizer when the run used the default data); override it with the
tokenizer flags. Prints the continuation's token ids and, with a tokenizer, its text.
"""
from __future__ import annotations

import argparse
import sys

import torch

from megazero.checkpoint.offline import build_full_model
from megazero.config import TOKENIZERS
from megazero.errors import CheckpointError
from megazero.generation import generate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="a save directory (its latest checkpoint) or an iter_* directory")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, help="sample from the smallest set with this probability mass")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--tokenizer-type", choices=TOKENIZERS)
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--tokenizer-model", help="SentencePiece .model, or a tokenizer.json (or its directory)")
    p.add_argument("--no-kv-cache", action="store_true", help="re-run the whole context for every token")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.exit(2, f"{p.prog}: error: --max-new-tokens must be a positive integer, got {args.max_new_tokens}\n")
    return args


def _tokenizer(args, data_cfg):
    from megazero.data.tokenizers import build_tokenizer

    if args.tokenizer_type:
        return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                               tokenizer_model=args.tokenizer_model)
    if data_cfg.tokenizer_type:
        return build_tokenizer(data_cfg.tokenizer_type, vocab_file=data_cfg.vocab_file,
                               merge_file=data_cfg.merge_file, tokenizer_model=data_cfg.tokenizer_model)
    if not data_cfg.data_path and not data_cfg.mock_data:      # trained on the embedded sample corpus
        from megazero.data.sample import sample_tokenizer
        return sample_tokenizer()
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model, job = build_full_model(args.load, device=args.device)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tok = _tokenizer(args, job.data)
    if args.prompt_ids:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            print(f"error: --prompt-ids {args.prompt_ids!r} must be comma-separated integers", file=sys.stderr)
            return 1
    elif tok is None:
        print("error: --prompt needs a tokenizer: the checkpoint's run had none (mock data); pass "
              "--tokenizer-type and its files, or use --prompt-ids", file=sys.stderr)
        return 1
    else:
        ids = tok.tokenize(args.prompt)
    gen = torch.Generator().manual_seed(args.seed)
    try:
        new = generate(model, ids, args.max_new_tokens, top_k=args.top_k, top_p=args.top_p,
                       temperature=args.temperature, generator=gen, use_cache=not args.no_kv_cache)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("prompt ids:", ",".join(map(str, ids)))
    print("new ids:", ",".join(map(str, new)))
    if tok is not None:
        print("text:", tok.detokenize(ids + new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
