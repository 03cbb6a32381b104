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
