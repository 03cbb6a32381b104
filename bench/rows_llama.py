"""GPT-2 style against Llama style at equal parameter count: step time on one process (CPU, fp32).

Both sides are megazero's GPT with the bench spec's layers, hidden size, heads, sequence and
vocabulary. The Llama side has RoPE, RMSNorm, SwiGLU, 2 key/value groups, no biases and an untied
output layer; its SwiGLU width is chosen so that the two parameter counts match (to 0.1% at the
bench sizes: the untied output layer and the smaller key/value projections are paid for by a narrower
MLP). Same batches, megazero's engine at dp = 1 (ZeRO-0, the same AdamW and clipping), one step of
each side per round in a rotated order (``common.run_variants``). The ratio is Llama / GPT-2.
"""
from __future__ import annotations

from dataclasses import replace

from bench.common import GPT, Spec, Variant, num_params, run_variants, spawn, step_batches
from bench.steps import engine_step
from megazero.config import ZeroConfig
from megazero.models.gpt import GPTConfig
from megazero.models.gpt.spec import flops_per_token as model_flops_per_token
from megazero.parallel.topology import Topology
from megazero.parallel.zero import build_engine

LLAMA_FLAGS = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, group_query_attention=True,
                   num_query_groups=2, add_bias_linear=False, untie_embeddings_and_output_weights=True)


# Where the bytes are real: about 36M parameters on both sides.
LLAMA_LARGE = Spec(layers=10, hidden=512, heads=8, seq=128, vocab=8192, micro_batch=1, micro_batches=2, rounds=8)


def llama_cfg(spec: Spec) -> GPTConfig:
    """The Llama-style config whose parameter count is closest to the GPT-2 spec's."""
    gpt2 = num_params(spec.model_cfg())
    probe = replace(spec.model_cfg(), **LLAMA_FLAGS, ffn_hidden_size=1)
    per_unit = 3 * spec.hidden * spec.layers                      # SwiGLU: 3 matrices of h x ffn per layer
    ffn = max(1, round((gpt2 - num_params(probe) + per_unit) / per_unit))
    return replace(probe, ffn_hidden_size=ffn)


def _build(cfg: GPTConfig, spec: Spec, topo):
    model = GPT(cfg, seed=1234)
    engine = build_engine(model, topo, ZeroConfig(zero_stage=0), spec.opt_cfg())
    return lambda micro: engine_step(model, engine, micro)


def worker(rank: int, world: int, spec: Spec) -> dict:
    topo = Topology()
    cfgs = {"gpt2-style": spec.model_cfg(), "llama-style": llama_cfg(spec)}
    variants = [Variant(name, lambda c=c: _build(c, spec, topo)) for name, c in cfgs.items()]
    res = run_variants(variants, step_batches(spec, spec.rounds, 1, 0))
    for name, c in cfgs.items():
        res[name]["extra"] = {"params": num_params(c), "ffn": c.ffn_hidden_size,
                              "flops_per_token": model_flops_per_token(c, c.padded_vocab_size(1))}
    return res


def run_llama(spec: Spec) -> dict:
    return spawn(1, worker, spec)[0]
