"""Paths of the data the tests carry (tests/data/, see each folder's README for its licence)."""
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
GPT2_VOCAB, GPT2_MERGES = DATA / "gpt2" / "vocab.json", DATA / "gpt2" / "merges.txt"
