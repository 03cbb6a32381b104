"""The data section: the training data (Megatron's .bin/.idx prefixes, weighted blends, or mock tokens) and
its tokenizer. Whether the files exist and agree is the pre-launch check's (:mod:`megazero.cli.preflight`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megazero.config.fields import FLAG, flag_field
from megazero.config.megatron_flags import MEGATRON_TOKENIZERS
from megazero.config.rules import fail, one_of

TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def unquoted(text: str) -> str:
    """``text`` without one pair of matching quotes around it: a launch script that passes ``"--split '99,1,0'"``
    inside a bash string hands the quotes on (``'99,1,0'`` -> ``99,1,0``)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


@dataclass
class DataConfig:
    """The training data and its tokenizer."""

    data_path: list[str] = flag_field([], "--data-path", nargs="+", group="data", metavar="PREFIX",
                                      help="the dataset's path prefix (PREFIX.bin, PREFIX.idx), or weight prefix pairs")
    split: str = flag_field("969,30,1", "--split", type=unquoted, group="data", metavar="T,V,T",
                            help="train, validation and test weights over the documents")
    mock_data: bool = flag_field(False, "--mock-data", action="store_true", group="data",
                                 help="synthetic tokens, no files")
    tokenizer_type: str | None = flag_field(
        None, "--tokenizer-type", choices=TOKENIZERS + tuple(MEGATRON_TOKENIZERS), group="data",
        metavar="NAME", help=f"{', '.join(TOKENIZERS)} (more: docs/megatron-flags.md); sets the vocabulary size")
    vocab_file: str | None = flag_field(None, "--vocab-file", group="data", help="GPT2BPETokenizer's vocab.json",
                                        metavar="PATH")
    merge_file: str | None = flag_field(None, "--merge-file", group="data", help="GPT2BPETokenizer's merges.txt",
                                        metavar="PATH")
    tokenizer_model: str | None = flag_field(
        None, "--tokenizer-model", group="data", metavar="PATH",
        help="a SentencePiece model, or a tokenizer.json or the directory holding it")
    data_cache_path: str | None = flag_field(None, "--data-cache-path", group="data", metavar="DIR",
                                             help="directory of the index caches (default: beside the data)")
    eod_mask_loss: bool = flag_field(False, "--eod-mask-loss", action="store_true", group="data",
                                     help="no loss on the end-of-document token")

    def check(self) -> None:
        """The split, the data paths (or mock data) and the tokenizer's files."""
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            weights = []
        if not weights or len(weights) > 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or weights[0] <= 0:
            fail(f"{FLAG.split} {self.split!r} must be up to three non-negative weights, the first (training) above 0, "
                  f"like 969,30,1")
        path, tokenizer = FLAG.data_path, FLAG.tokenizer_type
        if self.mock_data and self.data_path:
            fail(f"{FLAG.mock_data} and {path} are exclusive: drop one")
        if self.tokenizer_type is not None:
            one_of(self, "tokenizer_type")
        if self.tokenizer_type == "GPT2BPETokenizer" and not (self.vocab_file and self.merge_file):
            fail(f"{tokenizer} GPT2BPETokenizer needs {FLAG.vocab_file} and {FLAG.merge_file}")
        if self.tokenizer_type in ("SentencePieceTokenizer", "HuggingFaceTokenizer") and not self.tokenizer_model:
            hf = self.tokenizer_type == "HuggingFaceTokenizer"
            fail(f"{tokenizer} {self.tokenizer_type} needs {FLAG.tokenizer_model}"
                  + (" (a directory with tokenizer.json, or the file)" if hf else ""))
        if len(self.data_path) > 1:
            if len(self.data_path) % 2:
                fail(f"{path} with several datasets takes weight-prefix pairs: "
                      f"{path} 0.3 a_text_document 0.7 b_text_document")
            for w in self.data_path[0::2]:
                try:
                    weight = float(w)
                except ValueError:
                    fail(f"{path} weight {w!r} is not a number (expected weight-prefix pairs)")
                if not (math.isfinite(weight) and weight > 0):
                    fail(f"{path} weight {w!r} must be a positive number (a dataset with no weight: leave it out)")
        if self.data_path and self.tokenizer_type is None:
            fail(f"{path} needs {tokenizer} (with its {FLAG.vocab_file}/{FLAG.merge_file} or {FLAG.tokenizer_model}): "
                  "the tokenizer sets the vocabulary size")
