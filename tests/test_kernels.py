"""megazero/kernels.py: the norm, SwiGLU and RoPE each device runs, what they keep for backward, and the start
line."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megazero import kernels
from megazero.census import OpCensus


def _saved_bytes(fn, *inputs) -> int:
    """Bytes of the tensors autograd keeps for backward while ``fn(*inputs)`` runs (inputs that require
    grad counted too: what a layer's forward leaves held)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*inputs)
    return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in saved}.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_bitwise_torchs_autograd_and_keeps_only_gate_and_up(dtype):
    """Forward and both gradients bitwise those of ``F.silu(gate) * up`` under torch's autograd, on strided
    inputs as SwiGLU's interleaved weight gives them; kept for backward: gate and up, not silu(gate) (2/3 of
    what torch's autograd keeps)."""
    torch.manual_seed(0)
    both = torch.randn(6, 3, 16, dtype=dtype)
    grad = torch.randn(6, 3, 8, dtype=dtype)
    results = []
    for fn in (lambda g, u: F.silu(g) * u, kernels.swiglu):
        leaf = both.clone().requires_grad_(True)
        out = fn(leaf[..., 0::2], leaf[..., 1::2])
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    (ref_out, ref_grad), (out, got_grad) = results
    assert torch.equal(out, ref_out) and torch.equal(got_grad, ref_grad)
    gate, up = (torch.randn(64, 32, dtype=dtype, requires_grad=True) for _ in range(2))
    tensor_bytes = gate.numel() * gate.element_size()
    assert _saved_bytes(kernels.swiglu, gate, up) == 2 * tensor_bytes
    assert _saved_bytes(lambda g, u: F.silu(g) * u, gate, up) == 3 * tensor_bytes


@pytest.mark.slow
def test_the_fused_swiglu_compiles_to_torchs_numerics():
    """The CUDA path (forward and backward each one compiled kernel), compiled here for the CPU: equal to torch's
    autograd within fp32 rounding."""
    torch.manual_seed(0)
    gate, up, grad = (torch.randn(32, 48) for _ in range(3))
    outs = []
    for fused in (False, True):
        g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
        out = kernels.SwiGLUFunction.apply(g, u, fused)
        out.backward(grad)
        outs.append((out.detach(), g.grad, u.grad))
    for plain, fused in zip(*outs):
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-7)


def _autograd_rope(x, cos, sin):
    """RoPE as torch's ops under torch's autograd (rotary.py's forward before :func:`kernels.rope`)."""
    def rotate_half(t):
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat((-t2, t1), dim=-1)
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def _rope_case(dtype, rotary: int):
    """x [s, b, heads, 16] (a view of a projection's output, as the attention's q is), a table slice
    [s, 1, 1, rotary] and an output gradient laid out as attention's backward gives it ([b, heads, s, d]
    permuted), with exact zeros of both signs in it."""
    torch.manual_seed(0)
    s, b, heads, d = 6, 2, 3, 16
    x = torch.randn(s, b, heads * d, dtype=dtype).view(s, b, heads, d)
    angles = torch.randn(s, 1, 1, rotary // 2)
    angles = torch.cat((angles, angles), dim=-1)
    grad = torch.randn(b, heads, s, d, dtype=dtype).permute(2, 0, 1, 3)
    grad[0] = -0.0
    grad[1, ..., :rotary] = 0.0
    return x, angles.cos().to(dtype), angles.sin().to(dtype), grad


@pytest.mark.parametrize("rotary", [16, 8], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bitwise_torchs_autograd_and_keeps_only_the_table(dtype, rotary):
    """Forward and the gradient of x bitwise (signs of zeros included) those of torch's ops under torch's
    autograd, full and partial rotary, the gradient laid out as autograd's (contiguous, so the reshape into the
    projection's backward copies nothing); kept for backward: cos and sin only."""
    x, cos, sin, grad = _rope_case(dtype, rotary)
    results = []
    for fn in (_autograd_rope, kernels.rope):
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf, cos, sin)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for ref, got in zip(*results):
        assert torch.equal(got.view(bits), ref.view(bits)) and got.stride() == ref.stride()
    leaf = x.clone().requires_grad_(True)
    assert _saved_bytes(kernels.rope, leaf, cos, sin) == 2 * cos.numel() * cos.element_size()


def test_rope_counts_as_one_kernel_each_way():
    """Under the op census the rotation is one ``rope`` kernel forward and one ``rope_backward`` backward."""
    x, cos, sin, grad = _rope_case(torch.float32, 16)
    leaf = x.clone().requires_grad_(True)
    with OpCensus() as counted:
        kernels.rope(leaf, cos, sin).backward(grad)
    got = counted.census
    assert (got.ops, got.by_op["rope"], got.by_op["rope_backward"]) == (2, 1, 1), got.line()


@pytest.mark.slow
@pytest.mark.parametrize("rotary", [16, 8], ids=["full", "partial"])
def test_the_fused_rope_compiles_to_torchs_numerics(rotary):
    """The CUDA path (forward and backward each one compiled kernel), compiled here for the CPU: equal to torch's
    autograd within fp32 rounding."""
    x, cos, sin, grad = _rope_case(torch.float32, rotary)
    leaf = x.clone().requires_grad_(True)
    ref = _autograd_rope(leaf, cos, sin)
    ref.backward(grad)
    out = kernels._compiled(kernels.rope_forward)(x, cos, sin)
    grad_x = kernels._compiled(kernels.rope_backward)(grad, cos, sin)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_x, leaf.grad, rtol=1e-6, atol=1e-7)


def test_rms_norm_on_a_cpu_keeps_x_and_the_statistic_and_zero_centred_scales_by_one_plus_weight():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 16, requires_grad=True)
    weight = torch.randn(16, requires_grad=True)
    out = kernels.rms_norm(x, weight, 1e-6)
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6, zero_centred=True),
                               kernels.rms_norm(x, weight + 1, 1e-6), rtol=0, atol=0)
    kept = _saved_bytes(lambda a, w: kernels.rms_norm(a, w, 1e-6), x, weight)
    assert kept == (x.numel() + weight.numel() + 5 * 2) * 4                  # x, the weight, one rstd per row


def _fake_liger(monkeypatch):
    """An installed liger-kernel, as far as imports go; its functions fail if a CPU tensor reaches them."""
    class Refusing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            raise AssertionError("Liger-Kernel ran on a CPU tensor")

    ops = types.ModuleType("liger_kernel.ops")
    rms, swi = types.ModuleType("liger_kernel.ops.rms_norm"), types.ModuleType("liger_kernel.ops.swiglu")
    rms.LigerRMSNormFunction, swi.LigerSiLUMulFunction = Refusing, Refusing
    for name, module in (("liger_kernel", types.ModuleType("liger_kernel")), ("liger_kernel.ops", ops),
                         ("liger_kernel.ops.rms_norm", rms), ("liger_kernel.ops.swiglu", swi)):
        monkeypatch.setitem(sys.modules, name, module)
    return Refusing


def test_liger_is_picked_on_cuda_only_and_the_start_line_names_each_kernel(monkeypatch):
    """Without liger-kernel: the CPU line names torch's kernels, a CUDA line the compiled SwiGLU and the missing
    package. With it: CUDA picks it (for RMSNorm unless apex's norms are in use, and not under --compile); a CPU
    tensor never reaches it."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)                  # not installed
    assert kernels.liger_kernels() is None and not kernels.use_liger(torch.device("cuda"))
    cpu_line = kernels.describe_kernels(torch.device("cpu"), compiling=False)
    assert "SwiGLU torch (CPU), keeps gate and up" in cpu_line and "RoPE torch (CPU)" in cpu_line
    assert "RoPE one compiled kernel each way" in kernels.describe_kernels(torch.device("cuda"), compiling=False)
    assert "SwiGLU one compiled kernel each way, liger-kernel not installed" in \
        kernels.describe_kernels(torch.device("cuda"), compiling=False)
    refusing = _fake_liger(monkeypatch)
    assert kernels.liger_kernels().silu_mul is refusing and kernels.use_liger(torch.device("cuda"))
    assert not kernels.use_liger(torch.device("cpu"))
    cuda_line = kernels.describe_kernels(torch.device("cuda"), compiling=False)
    assert "RMSNorm Liger-Kernel" in cuda_line and "SwiGLU Liger-Kernel" in cuda_line
    compiled_line = kernels.describe_kernels(torch.device("cuda"), compiling=True)
    assert "Liger" not in compiled_line and "SwiGLU compiled into each layer" in compiled_line
    assert "RoPE compiled into each layer" in compiled_line
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    assert torch.equal(kernels.swiglu(gate, up), F.silu(gate) * up)
    kernels.rms_norm(gate, torch.ones(8), 1e-6)
