"""Check a conversion by running both sides: megazero's model on its whole tensors, and ``transformers``'
``AutoModelForCausalLM`` on the HF directory, on the same test text (``convert_checkpoint.py --check``).

    result = compare_with_hf(hf_dir, cfg, tensors, source_tokenizer=job.data)
    result.max_logit_diff      # max |ours - theirs| over every position and vocabulary entry, fp32
    result.ids_equal           # AutoTokenizer's ids == megazero's tokenizer's (None: no tokenizer on a side)

Both sides compute in fp32 from the same (written) weights, so the difference is the arithmetic's
alone. The text is tokenized by megazero's tokenizer (``source_tokenizer``) when it is known, else
fixed pseudo-random ids are used; ids the model's vocabulary does not hold are taken modulo it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megazero.checkpoint.hf_tokenizer import run_tokenizer
from megazero.config import DataConfig, ModelConfig
from megazero.errors import CheckpointError
from megazero.parallel.params import attribute
from megazero.spec import get_model_spec

DEFAULT_TEXT = ("The hacker's dictionary was compiled over decades: it holds 2,345 entries, some  spaced\n"
                "oddly, with accents (café) and symbols like <-> or {}. Nothing here is special.")


@dataclass(frozen=True)
class Comparison:
    max_logit_diff: float
    tokens: int
    ids_equal: bool | None          # None: one side has no tokenizer
    note: str = ""                  # how the test ids were made

    def describe(self, tolerance: float) -> str:
        ids = {None: "no tokenizer on both sides to compare", True: "AutoTokenizer gives megazero's ids",
               False: "AutoTokenizer's ids DIFFER from megazero's"}[self.ids_equal]
        verdict = "ok" if self.passed(tolerance) else "FAILED"
        return (f"check {verdict}: max |logit difference| {self.max_logit_diff:.3g} over {self.tokens} tokens "
                f"(tolerance {tolerance:g}){self.note}; {ids}")

    def passed(self, tolerance: float) -> bool:
        return self.max_logit_diff <= tolerance and self.ids_equal is not False


def compare_with_hf(hf_dir: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                    source_tokenizer: DataConfig | None = None, text: str = DEFAULT_TEXT) -> Comparison:
    """Logits of megazero's model (``cfg`` with ``tensors``) and of transformers' model loaded from
    ``hf_dir`` on ``text``; and whether AutoTokenizer (when ``hf_dir`` has a tokenizer) tokenizes it as
    megazero's tokenizer of ``source_tokenizer`` does."""
    try:
        import transformers
    except ImportError:
        raise CheckpointError("--check needs transformers: pip install 'megazero[hf]' (transformers, tokenizers, "
                              "protobuf)") from None
    transformers.utils.logging.set_verbosity_error()          # no length warnings or progress bars in the report
    transformers.utils.logging.disable_progress_bar()
    ours_ids, ids_equal = _tokenize(Path(hf_dir), source_tokenizer, text, transformers)
    note = ""
    if ours_ids is None:
        ours_ids = torch.randint(0, cfg.vocab_size, (cfg.seq_length,), generator=torch.Generator().manual_seed(0)).tolist()
        note = " (pseudo-random ids: no tokenizer known)"
    ids = torch.tensor(ours_ids[:cfg.seq_length], dtype=torch.long)
    if int(ids.max()) >= cfg.vocab_size:
        ids, note = ids % cfg.vocab_size, f" (ids taken modulo the model's vocabulary of {cfg.vocab_size})"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ours = _our_model(cfg, tensors)
    with torch.no_grad():
        hf_logits = theirs(ids[None]).logits.float()
        our_logits = ours(ids[None])[..., :cfg.vocab_size].float()
    diff = float((hf_logits - our_logits).abs().max())
    return Comparison(diff, len(ids), ids_equal, note)


def _tokenize(hf_dir: Path, source: DataConfig | None, text: str, transformers) -> tuple[list[int] | None, bool | None]:
    """(megazero's ids of ``text`` or None, whether AutoTokenizer of ``hf_dir`` agrees or None)."""
    tokenizer = run_tokenizer(source) if source is not None else None
    ours = tokenizer.tokenize(text) if tokenizer is not None else None
    has_tokenizer = any((hf_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    if ours is None or not has_tokenizer:
        return ours, None
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf_dir))(text).input_ids
    return ours, list(theirs) == list(ours)


def _our_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor]):
    """The whole model of ``cfg`` in fp32 holding ``tensors``, parameters and persistent buffers (vocabulary
    rows beyond ``vocab_size``: 0)."""
    model = get_model_spec(cfg.model_family).build_full(cfg, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = tensors[name].float()
            if attribute(p, "vocab_padded"):
                p.zero_()
                p[:t.shape[0]].copy_(t)
            else:
                p.copy_(t)
        for name, buffer in model.named_buffers():          # persistent model state (an MoE expert bias)
            if name in tensors:
                buffer.copy_(tensors[name])
    return model.eval()
