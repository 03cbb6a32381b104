"""A model family megazero has never seen, defined entirely here: a tiny post-norm transformer
(``x = LN(a x + Attn(x))``, ``x = LN(a x + MLP(x))``, untied head) with its own config class, its own
hyperparameter (``--residual-scale``, DeepNet's alpha ``a``, a flag the GPT family does not have) and
rules, and its own spec, registered by name.

Through the real trainer (``megazero.cli.main --model-family postnorm --residual-scale 0.8``) it trains at
tp 2 x pp 2 x dp 2 under ZeRO 1 and 3 exactly as its serial run (losses, gradient norms and the saved
weights), resumes under another layout (tp 1 x pp 2 x dp 4, ZeRO 3) from a tp 2 x pp 2 x dp 2 checkpoint
as the uninterrupted serial run, is refused by ``validate()`` alone for a bad value of its own
hyperparameter, and gets a memory estimate whose model states are the engine's. No line of
``megazero/`` names this model or its flag.
"""
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_on_ranks
from helpers.trainer import ROOT, assert_same_losses, main_body, read_metrics
from torch import nn

from megazero.checkpoint.offline import read_model
from megazero.cli.job import parse_job
from megazero.config import FLAG, JobConfig, ModelConfig, ParallelConfig, TrainConfig, ZeroConfig, flag_field, validate
from megazero.config.rules import fail, positive_float
from megazero.errors import ConfigError
from megazero.memory.estimate import estimate_memory
from megazero.parallel.params import set_tp_attributes
from megazero.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mask_padded_vocab,
    shard,
    vocab_parallel_cross_entropy,
)
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine
from megazero.spec import ModelSpec, build_model_chunks, get_model_spec, register_model_spec

FAMILY = "postnorm"


@dataclass
class PostNormConfig(ModelConfig):
    """The family's config: the sizes every family has, and its own residual scale."""

    residual_scale: float = flag_field(1.0, "--residual-scale", type=float, group="model",
                                       help="post-norm residual branch scale a: x = LN(a x + f(x)) (DeepNet's alpha)")

    def check(self, parallel: ParallelConfig) -> None:
        super().check(parallel)
        positive_float(self.residual_scale, "residual_scale")
        if parallel.sequence_parallel:
            fail(f"{FLAG.model_family} {FAMILY} has no sequence-parallel layers: drop {FLAG.sequence_parallel}")


class PostNormBlock(nn.Module):
    """One post-norm layer at tensor parallelism: heads and the MLP's width split over tp (column- then
    row-parallel linears), the norms replicated. Activations [s, b, h]."""

    def __init__(self, cfg: PostNormConfig, tp_group, tp: int, dtype, device):
        super().__init__()
        h, kw = cfg.hidden_size, dict(dtype=dtype, device=device)
        self.alpha = cfg.residual_scale
        self.heads, self.head_dim = cfg.num_attention_heads // tp, h // cfg.num_attention_heads
        self.qkv = ColumnParallelLinear(h, 3 * h, tp_group, **kw)          # per local head: [q; k; v] rows
        self.proj = RowParallelLinear(h, h, tp_group, **kw)
        self.fc1 = ColumnParallelLinear(h, cfg.ffn_hidden_size, tp_group, **kw)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, h, tp_group, **kw)
        self.norm1, self.norm2 = nn.LayerNorm(h, **kw), nn.LayerNorm(h, **kw)
        for norm in (self.norm1, self.norm2):
            for p in norm.parameters():
                set_tp_attributes(p, False)

    def forward(self, x):
        s, b, _ = x.shape
        q, k, v = self.qkv(x).view(s, b, self.heads, 3, self.head_dim).permute(3, 1, 2, 0, 4)  # each [b, n, s, d]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
        x = self.norm1(self.alpha * x + self.proj(a))
        return self.norm2(self.alpha * x + self.fc2(F.gelu(self.fc1(x))))


class PostNorm(nn.Module):
    """A pipeline chunk: its layers (by global index), the embeddings on the first stage, the untied
    head and the per-token loss on the last."""

    def __init__(self, cfg: PostNormConfig, placement, groups, *, seed=1234, dtype=torch.float32, device=None,
                 home_device=None):
        super().__init__()
        tp = groups.tp.size
        tp_group = groups.tp.group if tp > 1 else None
        kw = dict(dtype=dtype or torch.float32, device=device)
        self.cfg, self.seed, self.tp, self.tp_rank, self.tp_group = cfg, seed, tp, groups.tp.rank, tp_group
        self.placement, padded = placement, cfg.padded_vocab_size(tp)
        if placement.pre_process:
            self.word = VocabParallelEmbedding(padded, cfg.hidden_size, tp_group, **kw)
            self.word.weight.vocab_padded = True
            self.position = set_tp_attributes(nn.Parameter(torch.empty(cfg.max_position_embeddings,
                                                                       cfg.hidden_size, **kw)), False)
        self.layers = nn.ModuleDict({str(i): PostNormBlock(cfg, tp_group, tp, kw["dtype"], device)
                                     for i in placement.layer_ids})
        if placement.post_process:
            self.head = ColumnParallelLinear(cfg.hidden_size, padded, tp_group, bias=False, **kw)
            self.head.weight.vocab_padded = True
        if torch.device(device or "cpu").type != "meta":
            with torch.no_grad():
                for name, p in self.named_parameters():
                    p.copy_(self.initial_value(name))

    def initial_value(self, name: str) -> torch.Tensor:
        """This tp rank's slice of the parameter's whole value, drawn from a generator seeded by
        (seed, name): the same model at every layout."""
        p = self.get_parameter(name)
        full = list(p.shape)
        if p.tensor_parallel:
            full[p.partition_dim] *= self.tp
        if name.endswith("bias"):
            value = torch.zeros(full)
        elif ".norm" in name:
            value = torch.ones(full)
        else:
            seed = int.from_bytes(hashlib.blake2b(f"{self.seed}/{name}".encode(), digest_size=8).digest(), "little")
            value = torch.empty(full).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed >> 1))
            if getattr(p, "vocab_padded", False):
                value[self.cfg.vocab_size:] = 0.0
        return shard(value, p.partition_dim, self.tp_rank, self.tp)

    def forward(self, x, labels=None):
        if self.placement.pre_process:                    # token ids [b, s] -> [s, b, h]
            x = self.word(x).transpose(0, 1) + self.position[:x.shape[1]].unsqueeze(1)
        for layer in self.layers.values():
            x = layer(x)
        if not self.placement.post_process:
            return x
        logits = mask_padded_vocab(self.head(x), self.cfg.vocab_size, self.tp_rank * self.head.weight.shape[0])
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group).t()


def masked_mean(per_token, mask):
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


SPEC = register_model_spec(ModelSpec(
    name=FAMILY, config=PostNormConfig, build_chunk=PostNorm, loss=masked_mean,
    checkpoint_fields=ModelSpec.checkpoint_fields + ("residual_scale",),
    boundary_shape=lambda cfg, micro_batch, groups: (cfg.seq_length, micro_batch, cfg.hidden_size),
    flops_per_token=lambda cfg, vocab, recompute: 6.0 * cfg.hidden_size * (12 * cfg.num_layers * cfg.hidden_size
                                                                            + vocab)))

TINY = ["--model-family", FAMILY, "--residual-scale", "0.8", "--mock-data", "--vocab-size", "90", "--make-vocab-size-divisible-by", "8",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "2e-3", "--adam-eps", "1e-6",
        "--lr-warmup-iters", "1", "--lr-decay-iters", "6", "--log-interval", "1", "--eval-interval", "100",
        "--eval-iters", "0", "--seed", "3"]


def _main(rank, world_size, argv):
    """The trainer's main on a worker process, which imports this module (and so registers the model)."""
    return main_body(rank, world_size, argv)


def _run(tmp: Path, name: str, world: int, flags: list[str]):
    metrics = tmp / f"{name}.jsonl"
    assert run_on_ranks(world, _main, TINY + flags + ["--metrics-file", str(metrics)], timeout=300) == [0] * world
    return read_metrics(metrics)[0]


def _assert_same_weights(path_a: Path, path_b: Path) -> None:
    """Every saved tensor at 1e-5 relative, 1e-5 absolute: an element whose true gradient is ~0 moves by
    Adam-normalised fp32 rounding noise, up to ~1% of an lr step (as in helpers/gpt_parity.py)."""
    _, a, _ = read_model(path_a)
    _, b, _ = read_model(path_b)
    assert set(a) == set(b) and len(a) == 4 * 12 + 3           # 12 tensors a layer, embeddings, head
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_an_unseen_model_trains_resumes_and_is_estimated_through_the_trainer(tmp_path):
    serial = _run(tmp_path, "serial", 1, ["--train-iters", "6", "--save", str(tmp_path / "serial")])
    assert len(serial) == 6 and all(math.isfinite(r["loss"]) for r in serial)
    layout = ["--tp", "2", "--pp", "2"]
    zero3 = _run(tmp_path, "zero3", 8, layout + ["--zero-stage", "3", "--train-iters", "6",
                                                 "--save", str(tmp_path / "zero3")])
    assert_same_losses(zero3, serial, "loss")
    assert_same_losses(zero3, serial, "grad_norm")
    _assert_same_weights(tmp_path / "serial", tmp_path / "zero3")
    # ZeRO-1 at tp2 pp2 dp2 for 3 steps, saved; resumed at tp1 pp2 dp4 under ZeRO-3 for steps 4-6.
    first = _run(tmp_path, "zero1", 8, layout + ["--zero-stage", "1", "--train-iters", "3",
                                                 "--save", str(tmp_path / "half")])
    rest = _run(tmp_path, "resumed", 8, ["--pp", "2", "--zero-stage", "3", "--train-iters", "6",
                                         "--load", str(tmp_path / "half"), "--save", str(tmp_path / "resumed")])
    assert_same_losses(first + rest, serial, "loss")
    assert_same_losses(first + rest, serial, "grad_norm")
    _assert_same_weights(tmp_path / "serial", tmp_path / "resumed")


def _estimate_body(rank, world_size):
    """The engine's model states at tp2 pp2 dp2 (ZeRO 1 and 3) beside the estimate for the same job."""
    out = []
    for stage in (1, 3):
        job = validate(JobConfig(model=PostNormConfig(model_family=FAMILY, num_layers=4, hidden_size=32,
                                                      num_attention_heads=4, seq_length=16, vocab_size=90,
                                                      make_vocab_size_divisible_by=8, residual_scale=0.8),
                                 parallel=ParallelConfig(tp=2, pp=2), zero=ZeroConfig(zero_stage=stage),
                                 train=TrainConfig(micro_batch_size=2, global_batch_size=16)), world_size)
        topo = Topology(tp=2, pp=2)
        chunks = build_model_chunks(get_model_spec(FAMILY), job, topo, device="meta")
        engine = build_engine(chunks, topo, job.zero, job.optimizer)
        est = estimate_memory(job)[topo.pp_rank]
        measured = engine.model_state_bytes()
        out.append({k: (est.parts[k], measured[k]) for k in ("params", "grads", "master_weights", "optimizer_state")}
                   | {"total": est.total, "activations": est.activations})
    return out


def test_an_unseen_model_gets_a_memory_estimate_equal_to_the_engine_in_model_states():
    for per_stage in run_on_ranks(8, _estimate_body, timeout=300):
        for parts in per_stage:
            assert parts.pop("total") > 0 and parts.pop("activations") > 0
            for key, (estimated, measured) in parts.items():
                if key != "grads":                          # gradients are allocated in backward at ZeRO 2-3
                    assert estimated == measured, (key, estimated, measured)


def test_the_unseen_model_is_known_only_here(capsys):
    """Registered by name from this file: the trainer finds it and parses its flag, validate() alone runs
    its rules (its own hyperparameter's and what it cannot do), another family's flag is refused for it,
    and nothing in the package names it or its flag."""
    assert get_model_spec(FAMILY) is SPEC
    job, _ = parse_job(TINY + ["--train-iters", "2"], 1)
    assert type(job.model) is PostNormConfig and job.model.residual_scale == 0.8
    with pytest.raises(ConfigError, match=r"--residual-scale must be > 0, got -1.0"):
        validate(JobConfig(model=PostNormConfig(model_family=FAMILY, residual_scale=-1.0)), 1)
    with pytest.raises(ConfigError, match="no sequence-parallel layers"):
        validate(JobConfig(model=PostNormConfig(model_family=FAMILY),
                           parallel=ParallelConfig(tp=2, sequence_parallel=True)), 2)
    with pytest.raises(SystemExit):
        parse_job(TINY + ["--residual-scale", "0"], 1)
    assert "--residual-scale must be > 0, got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_job(TINY + ["--swiglu"], 1)
    assert f"--swiglu: not a setting of --model-family {FAMILY}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--model-family 'nope' is not a registered model: use one of (\w+, )*gpt\b"):
        get_model_spec("nope")
    named = [str(p.relative_to(ROOT)) for p in (ROOT / "megazero").rglob("*.py")
             if FAMILY in p.read_text().lower() or "residual-scale" in p.read_text()]
    assert not named, named
    assert math.isfinite(SPEC.flops_per_token(job.model, 96, False))
