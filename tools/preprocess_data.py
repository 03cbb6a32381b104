"""Tokenize a text corpus into Megatron's indexed-dataset format (``.bin`` + ``.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my_corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2
    # -> data/my_corpus_text_document.bin / .idx   (train with --data-path data/my_corpus_text_document)

Input: ``.jsonl``/``.json`` with one JSON object per line (``--json-keys`` fields, default ``text``;
one output per key) or plain text, where documents are separated by ``--txt-separator`` (default a
blank line). The input is streamed (memory does not grow with its size); malformed lines are
skipped and reported with their line numbers. The files read by Megatron-LM as they are.
"""
from __future__ import annotations

import argparse
import codecs
import sys

from megazero.config import TOKENIZERS
from megazero.data.indexed_dataset import IndexedDatasetError
from megazero.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from megazero.errors import TokenizerError


def parse_args(argv=None) -> PreprocessConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    g = p.add_argument_group("input / output")
    g.add_argument("--input", required=True, help=".jsonl (one JSON object per line) or plain text")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to tokenize (default: text)")
    g.add_argument("--txt-separator", default="\\n\\n",
                   help="plain text: document separator, backslash escapes allowed (default: \\n\\n)")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    g.add_argument("--overwrite", action="store_true", help="replace existing outputs (refused otherwise)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZERS)
    g.add_argument("--vocab-file", help="GPT-2 vocab.json / encoder.json")
    g.add_argument("--merge-file", help="GPT-2 merges.txt / vocab.bpe")
    g.add_argument("--tokenizer-model", help="SentencePiece .model, or for HuggingFaceTokenizer a tokenizer.json "
                                             "(or the directory holding it)")
    g.add_argument("--append-eod", action="store_true", help="end every document with the EOD id")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="encoding processes (1: encode in this process)")
    g.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    a = p.parse_args(argv)
    return PreprocessConfig(input=a.input, output_prefix=a.output_prefix, tokenizer_type=a.tokenizer_type,
                            vocab_file=a.vocab_file, merge_file=a.merge_file, tokenizer_model=a.tokenizer_model,
                            json_keys=tuple(a.json_keys), append_eod=a.append_eod, workers=a.workers,
                            txt_separator=codecs.decode(a.txt_separator, "unicode_escape"),
                            log_interval=a.log_interval, overwrite=a.overwrite)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    try:
        res = preprocess(cfg)
    except (PreprocessError, TokenizerError, IndexedDatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for key, prefix in res.outputs.items():
        print(f"wrote {prefix}.bin / .idx ({key})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
