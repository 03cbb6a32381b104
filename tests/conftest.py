import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # `from helpers import run_on_ranks`

# oneDNN's AMX kernels for bf16 matmuls die with SIGILL on some virtual machines that advertise AMX
# (seen on a 2-core KVM guest, torch 2.13); the tests' tiny shapes gain nothing from AMX, so cap the
# instruction set for this process and the worker processes it spawns. A cap, not a requirement:
# machines without these instructions use what they have.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

# ATen's CPU kernels in their AVX2 flavour on every machine (a machine with AVX-512 would pick those, which
# sum in another order): the suite's figures, and the fp32 margins of its parity rules, are then the same on
# any x86 CPU the suite runs on. Seen: fuzzer draw 2020's one weight element moves 1.24e-5 from serial with
# AVX-512 kernels against an allowance of 1.2e-5, and passes with AVX2's. Before torch is imported; the
# worker processes and torchrun ranks inherit it.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

# torch.compile's on-disk cache does not key its compiled graphs on ATEN_CPU_CAPABILITY: a graph compiled by a
# process with AVX-512 kernels (any run outside this suite, which leaves the variable unset) is reloaded here
# with AVX2's vector width and computes NaN. The suite keeps its own cache, one per capability.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_tests_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}"))


def _gpu_tier(config) -> bool:
    return "gpu" in (config.getoption("markexpr") or "").replace("not gpu", "")


def pytest_configure(config):
    """The CPU suite runs on CPU with gloo even where a GPU is visible (several ranks on one GPU over
    NCCL is not what it tests); the GPU tier (`pytest -m gpu`) picks the backend from the hardware."""
    if not _gpu_tier(config):
        os.environ.setdefault("MEGAZERO_BACKEND", "gloo")


def pytest_collection_modifyitems(config, items):
    """GPU tests run only when asked for (`-m gpu`), and then need CUDA."""
    import pytest

    if not _gpu_tier(config):
        kept = [i for i in items if "gpu" not in i.keywords]
        config.hook.pytest_deselected(items=[i for i in items if "gpu" in i.keywords])
        items[:] = kept
        return
    import torch

    if not torch.cuda.is_available():
        for item in items:
            item.add_marker(pytest.mark.skip(reason="-m gpu: this machine has no CUDA device"))
