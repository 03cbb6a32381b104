"""megazero.checkpoint.hf_compare: the logits of a faithful export agree; a wrong weight or a tokenizer
that gives other ids fails the comparison. Needs the transformers test extra."""
import json

import pytest
from helpers.ckpt import MODEL

from megazero.checkpoint.hf import save_hf
from megazero.checkpoint.hf_compare import compare_with_hf
from megazero.config import DataConfig
from megazero.models.gpt import GPT, GPTConfig

pytest.importorskip("transformers", reason="the HF comparison needs the test extra: pip install transformers")


def _export(tmp_path):
    cfg = GPTConfig(**{**MODEL, "vocab_size": 4000})
    tensors = {n: (p.detach()[:cfg.vocab_size] if p.vocab_padded else p.detach()) + 0.01
               for n, p in GPT(cfg, seed=2).named_parameters()}
    save_hf(tmp_path / "hf", tensors, cfg, data_cfg=DataConfig())      # the embedded sample tokenizer
    return cfg, tensors


def test_a_faithful_export_passes_and_a_changed_weight_fails(tmp_path):
    cfg, tensors = _export(tmp_path)
    good = compare_with_hf(tmp_path / "hf", cfg, tensors, DataConfig())
    assert good.passed(1e-5) and good.ids_equal is True and good.tokens == cfg.seq_length
    assert "check ok" in good.describe(1e-5)
    changed = dict(tensors, **{"final_norm.bias": tensors["final_norm.bias"] + 0.05})
    bad = compare_with_hf(tmp_path / "hf", cfg, changed, DataConfig())
    assert bad.max_logit_diff > 1e-3 and not bad.passed(1e-4) and "FAILED" in bad.describe(1e-4)


def test_a_tokenizer_giving_other_ids_fails(tmp_path):
    cfg, tensors = _export(tmp_path)
    config_file = tmp_path / "hf" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "add_bos_token": True}))     # AutoTokenizer now prepends <s>
    result = compare_with_hf(tmp_path / "hf", cfg, tensors, DataConfig())
    assert result.ids_equal is False and not result.passed(1.0) and "DIFFER" in result.describe(1.0)


def test_without_a_tokenizer_pseudo_random_ids_are_compared(tmp_path):
    cfg, tensors = _export(tmp_path)
    result = compare_with_hf(tmp_path / "hf", cfg, tensors, DataConfig(mock_data=True))
    assert result.ids_equal is None and "pseudo-random" in result.note and result.passed(1e-5)
