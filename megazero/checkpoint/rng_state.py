"""Random-number-generator states as JSON (no pickling): Python, NumPy, torch CPU/CUDA, TP trackers.

Each rank saves its own states (``rng/rank00003.json``). They are restored only when the loading
layout is the saving layout (same world size, tp, pp, dp, virtual stages and rank order): on another
layout the ranks' streams do not correspond, so the fresh, seed-derived streams are kept.
"""
from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def _generator_states(obj) -> dict[str, torch.Tensor]:
    """States of a TensorParallelRNG-like object (get_states) or a torch.Generator."""
    if isinstance(obj, torch.Generator):
        return {"generator": obj.get_state()}
    return obj.get_states()


def _set_generator_states(obj, states: dict[str, torch.Tensor]) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(states["generator"])
    else:
        obj.set_states(states)


def capture_rng_state(chunks, extra_rng: dict | None = None) -> dict:
    """This process's random states as a JSON-able dict."""
    version, mt, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(mt), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch_cpu": _b64(torch.get_rng_state()),
        "torch_cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "tp_trackers": [{k: _b64(v) for k, v in chunk.rng.get_states().items()} if hasattr(chunk, "rng") else {}
                        for chunk in chunks],
        "extra": {name: {k: _b64(v) for k, v in _generator_states(obj).items()}
                  for name, obj in (extra_rng or {}).items()},
    }
    return state


def restore_rng_state(state: dict, chunks, extra_rng: dict | None = None) -> None:
    """Inverse of :func:`capture_rng_state` (same number of chunks required)."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    if state["torch_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["torch_cuda"]])
    if len(state["tp_trackers"]) != len(chunks):
        raise ValueError(f"saved RNG states of {len(state['tp_trackers'])} model chunks, the model has {len(chunks)}")
    for chunk, saved in zip(chunks, state["tp_trackers"]):
        if saved:
            chunk.rng.set_states({k: _unb64(v) for k, v in saved.items()})
    for name, obj in (extra_rng or {}).items():
        if name in state["extra"]:
            _set_generator_states(obj, {k: _unb64(v) for k, v in state["extra"][name].items()})
