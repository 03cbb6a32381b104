"""The tensor-parallel-aware dropout RNG (re-exported by :mod:`megazero.parallel.tensor`)."""
from __future__ import annotations

import contextlib

import torch


class TensorParallelRNG:
    """Dropout random streams that are the same on every tp rank outside TP regions and distinct inside.

    Two named streams, each a saved generator state, swapped into the global (CPU or CUDA) generator
    only while a ``with rng.fork(name):`` block runs, so the caller's global RNG is untouched:

    - ``"default"``: seeded with ``seed + offset``; identical across tp ranks (dropout on replicated
      activations: embedding and residual dropout without sequence parallel).
    - ``"tensor-parallel"``: seeded with ``seed + 2718 + offset + 97 * tp_rank``; differs across tp
      ranks (dropout inside a TP region: attention probabilities of this rank's heads; and any
      dropout on a sequence-parallel chunk).

    ``offset`` lets different model chunks/stages draw different streams. Everything derives from the
    seed, so runs are reproducible. ``get_states``/``set_states`` let activation checkpointing
    replay the exact masks.
    """

    DEFAULT = "default"
    TP = "tensor-parallel"

    def __init__(self, seed: int, tp_rank: int = 0, offset: int = 0, device=None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.states = {
            self.DEFAULT: self._seeded_state(seed + offset),
            self.TP: self._seeded_state(seed + 2718 + offset + 97 * tp_rank),
        }

    def _seeded_state(self, seed: int) -> torch.Tensor:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g.get_state()

    def _get_global(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_global(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self, name: str = TP):
        """Run the block with stream ``name`` as the global generator; save its advanced state."""
        saved = self._get_global()
        self._set_global(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get_global()
            self._set_global(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}
