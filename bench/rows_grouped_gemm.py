"""Grouped GEMM: one MoE layer's experts as two ``torch._grouped_mm`` (``--moe-grouped-gemm``) vs the
per-expert loop.

One process, one torch thread. The real :class:`megazero.models.gpt.moe.MoELayer` of a one-layer GPT
(router, top-k routing, sort by expert, experts, weighted combine) runs forward + backward on the same
random tokens with the flag off and on (fine-grained experts as DeepSeek's: ffn = hidden / 2, top-8) (the same layer and weights: only ``experts.grouped_gemm`` is
switched), the two alternating, which goes first swapping each round. Reported: the median CPU time
of each, the median over rounds of grouped / loop, the largest difference between the two outputs and
input gradients (zero in fp32 on CPU), and what the grouped path adds: building the [experts, out, in]
operands of the local experts' weights in forward (:func:`megazero.models.gpt.moe.stack_experts`, a view
of the buffer the experts' weights share) and handing each expert its slice of the stacked gradient in
backward, timed alone, and the bytes it copies (none while the weights lie at one stride).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bench.common import median, ratio_of_medians_per_round, ratio_range
from megazero.models.gpt import GPT, GPTConfig
from megazero.models.gpt.moe import stack_experts


@dataclass(frozen=True)
class GroupedGemmSpec:
    experts: int = 64
    topk: int = 8
    hidden: int = 128
    ffn: int = 64
    tokens: int = 256
    swiglu: bool = True
    rounds: int = 40

    def shape(self) -> str:
        return f"E {self.experts}, top-{self.topk}, h {self.hidden}, ffn {self.ffn}, {self.tokens} tokens"

    def model_cfg(self) -> GPTConfig:
        return GPTConfig(num_layers=1, hidden_size=self.hidden, num_attention_heads=4, seq_length=self.tokens,
                         vocab_size=256, num_experts=self.experts, moe_router_topk=self.topk, swiglu=self.swiglu,
                         ffn_hidden_size=self.ffn, add_bias_linear=False, moe_grouped_gemm=True)


GROUPED_GEMM_SHAPES = (GroupedGemmSpec(), GroupedGemmSpec(hidden=256, ffn=128, tokens=512))
QUICK_GROUPED_GEMM = (GroupedGemmSpec(experts=8, topk=2, hidden=32, ffn=32, tokens=64, rounds=2),)


def _timed(fn) -> float:
    """CPU seconds of this process spent in ``fn()`` (one thread: on these shared cores the wall time
    also counts the time other jobs held the core)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def run_grouped_gemm(spec: GroupedGemmSpec, log=print) -> dict:
    """Times and checks of the grouped path against the loop on one MoE layer (see the module docstring)."""
    torch.manual_seed(0)
    layer = GPT(spec.model_cfg(), seed=1234).layers["0"].mlp
    experts = layer.experts
    x = torch.randn(spec.tokens, 1, spec.hidden)
    grad_out = torch.randn(spec.tokens, 1, spec.hidden)
    results = {}

    def step(grouped: bool):
        experts.grouped_gemm = grouped
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.backward(grad_out)
        results[grouped] = (out.detach(), xi.grad)

    w1 = [e.fc1.weight for e in experts.values()]
    w2 = [e.fc2.weight for e in experts.values()]
    g1, g2 = torch.randn(len(w1), *w1[0].shape), torch.randn(len(w2), *w2[0].shape)

    def stack():
        torch.autograd.backward([stack_experts(w1), stack_experts(w2)], [g1, g2])

    times = {False: [], True: [], "stack": []}
    for r in range(spec.rounds + 1):
        order = (False, True) if r % 2 == 0 else (True, False)
        measured = {grouped: _timed(lambda g=grouped: step(g)) for grouped in order}
        layer.zero_grad(set_to_none=True)               # as in a step: the gradients start empty
        measured["stack"] = _timed(stack)
        if r:
            for key, t in measured.items():
                times[key].append(t)
        log(f"grouped-gemm round {r}: loop {1e3 * measured[False]:.1f} ms, grouped {1e3 * measured[True]:.1f} ms "
            f"(CPU time)")
    diff = max(float((a - b).abs().max()) for a, b in zip(results[True], results[False]))
    stacked_bytes = sum(w[0].numel() * w[0].element_size() * len(w) for w in (w1, w2)
                        if stack_experts(w).data_ptr() != w[0].data_ptr())
    return {"loop": times[False], "grouped": times[True], "stack": times["stack"], "diff": diff,
            "stacked_bytes": stacked_bytes}


def grouped_gemm_section(results: list[tuple[GroupedGemmSpec, dict]]) -> list[str]:
    """The BENCHMARKS.md section of :func:`run_grouped_gemm`'s results, a row per shape."""
    rounds = ", ".join(sorted({str(spec.rounds) for spec, _ in results}))
    out = ["## MoE experts: grouped GEMM vs the per-expert loop (one layer, CPU)", "",
           "One MoE layer of SwiGLU experts without biases, dropless, fp32, 1 process, 1 thread, "
           f"{rounds} rounds after one untimed. The real MoE layer (router, dispatch, experts, combine) forward + backward, "
           "`--moe-grouped-gemm` on and off on the same layer, alternating; ms: median CPU time of the process "
           "(one thread; these cores are shared, and wall time also counts other jobs' turns); grouped/loop: median over rounds of "
           "the per-round ratio (range). operand: building the stacked [experts, out, in] operands of the local "
           "experts' fc1 and fc2 weights (a view of the buffer they share) and handing each expert its slice "
           "of the stacked gradient, timed alone (part of the grouped time); copied bytes: what that copies "
           "(none while the weights lie at one stride; a ZeRO layout that breaks it costs a stacked copy, "
           "held from forward to backward). |diff|: largest difference of the layer's output "
           "and input gradient between the two.", "",
           "| shape | rows per expert | loop ms | grouped ms | grouped/loop | operand ms | copied bytes | max abs diff |",
           "|---|---|---|---|---|---|---|---|"]
    for spec, res in results:
        loop, grouped = res["loop"], res["grouped"]
        out.append(f"| {spec.shape()} | {spec.tokens * spec.topk // spec.experts} (mean) | {1e3 * median(loop):.1f} | "
                   f"{1e3 * median(grouped):.1f} | {ratio_of_medians_per_round(grouped, loop):.2f}"
                   f"{ratio_range(grouped, loop)} | {1e3 * median(res['stack']):.2f} | "
                   f"{res['stacked_bytes'] / 2**20:.2f} MiB | {res['diff']:.1e} |")
    return out + [""]
