"""Train a SentencePiece model on text files, with settings under which text round-trips exactly.

    python tools/train_tokenizer.py --input corpus.txt --model-prefix out/my_sp --vocab-size 4000

Settings: identity normalisation (no NFKC), whitespace kept as is (no dummy prefix, runs of spaces
kept, whitespace-only pieces allowed), byte fallback (any character outside the vocab is spelled
as UTF-8 bytes), digits split into single pieces. So ``decode(encode(text)) == text`` for any text.
Ids: 0 <unk>, 1 <s>, 2 </s> (the end-of-document id), then the 256 byte pieces, then the learned ones.
Writes ``{model_prefix}.model`` and ``{model_prefix}.vocab``. Deterministic for the same input.
"""
from __future__ import annotations

import argparse
import os
import sys


def train(inputs: list[str], model_prefix: str, vocab_size: int, model_type: str = "bpe",
          max_sentence_length: int = 1 << 16, input_sentence_size: int = 0) -> str:
    """Train and write ``{model_prefix}.model``; returns its path."""
    import sentencepiece as spm

    for path in inputs:
        if not os.path.isfile(path):
            raise SystemExit(f"--input {path!r}: no such file")
        if os.path.getsize(path) == 0:
            raise SystemExit(f"--input {path!r} is empty")
    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            input=inputs, model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
            normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=True,
            character_coverage=0.9999, max_sentence_length=max_sentence_length,
            input_sentence_size=input_sentence_size, shuffle_input_sentence=False,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    except RuntimeError as e:                    # SentencePiece's C++ checks: one line, never a traceback
        raise SystemExit(_training_error(str(e), vocab_size)) from None
    return model_prefix + ".model"


def _training_error(text: str, vocab_size: int) -> str:
    """SentencePiece's message (``INTERNAL: src/trainer_interface.cc(638) [...] Vocabulary size is smaller
    than required_chars. 300 vs 667. ...``) as one line naming the flag and the fix."""
    import re

    chars = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", text)
    if chars:
        need = int(chars.group(2))
        return (f"--vocab-size {vocab_size} is below the {need} pieces the input's distinct characters (and the "
                f"special pieces) need: use --vocab-size {need} or more")
    too_big = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", text)
    if too_big:
        return (f"--vocab-size {vocab_size} is more than the input can fill (at most {too_big.group(2)}): use a "
                f"smaller --vocab-size or more text")
    first = text.strip().splitlines()[0] if text.strip() else "training failed"
    first = re.sub(r"^INTERNAL: \S+ \[.*?\] ", "", first)
    return f"SentencePiece could not train on --input: {first}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text files (one sentence/line per line)")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=4000)
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--input-sentence-size", type=int, default=0, help="sample this many lines (0: all)")
    args = p.parse_args(argv)
    if args.vocab_size < 262:
        raise SystemExit(f"--vocab-size {args.vocab_size} is too small: 3 special + 256 byte pieces need >= 262")
    try:
        path = train(args.input, args.model_prefix, args.vocab_size, args.model_type,
                     input_sentence_size=args.input_sentence_size)
    except SystemExit as e:                      # train()'s one-line refusals
        if isinstance(e.code, str):
            p.exit(1, f"{p.prog}: error: {e.code}\n")
        raise
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
