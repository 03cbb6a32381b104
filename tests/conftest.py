import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # `from helpers import run_on_ranks`

# oneDNN's AMX kernels for bf16 matmuls die with SIGILL on some virtual machines that advertise AMX
# (seen on a 2-core KVM guest, torch 2.13); the tests' tiny shapes gain nothing from AMX, so cap the
# instruction set for this process and the worker processes it spawns. A cap, not a requirement:
# machines without these instructions use what they have.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
