"""HuggingFace ``tokenizer.json`` directories made from the test data (no download), as published
models ship them: the GPT-2 BPE of tests/data/gpt2, and a small BPE trained on the sample corpus whose
post-processor adds a beginning-of-sequence token (as Llama's does)."""
import json
from pathlib import Path

from helpers.data import GPT2_MERGES, GPT2_VOCAB


def gpt2_tokenizer_dir(path: Path) -> Path:
    """tokenizer.json of GPT-2's byte-level BPE + tokenizer_config.json naming its eos token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(str(GPT2_VOCAB), str(GPT2_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


def bos_tokenizer_dir(path: Path, text: str, vocab_size: int = 600) -> Path:
    """A byte-level BPE trained on ``text`` with ``<s>``/``</s>``, adding ``<s>`` in front of every
    encoded text; no tokenizer_config.json (the eos token is found by name)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def qwen2_tokenizer_dir(path: Path, text: str, vocab_size: int = 600) -> Path:
    """A Qwen2-style tokenizer.json trained on ``text`` (NFC, Qwen2's split pattern then byte-level,
    ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>`` special, no post-processor) with the
    tokenizer_config.json Qwen2 models ship (transformers loads every qwen2 model's tokenizer as
    Qwen2Tokenizer, which rebuilds this pipeline)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False}))
    return path
