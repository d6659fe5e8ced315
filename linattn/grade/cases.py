"""Fresh random cases for exercises that implement a whole operation (library signature).

Every set mixes what catches the usual mistakes: T not a multiple of the chunk size (a dropped
last partial chunk), T shorter than one chunk, K ≠ V, an initial state and the final state, a
low-precision dtype, per-head and per-dimension gates, strong and weak decay.
"""
from __future__ import annotations

import random

import torch

from .. import testing
from .exercise import Case

# (B, T, H, K, V, dtype, gate, strength, initial_state)
_SHAPES = [
    (1, 37, 2, 16, 16, torch.float32, "per_dim", "normal", False),
    (2, 100, 2, 32, 24, torch.float32, "per_head", "strong", True),
    (1, 150, 1, 16, 32, torch.float32, "per_dim", "weak", True),
    (2, 64, 3, 24, 16, torch.float64, "per_dim", "strong", False),
    (1, 90, 2, 32, 32, torch.bfloat16, "per_dim", "normal", True),
    (1, 7, 1, 8, 8, torch.float32, "per_head", "normal", True),
]


def op_cases(op: str, seed: int, *, chunk_size=None, extra=None, shapes=_SHAPES) -> list:
    """Cases for `op`, each asking for the final state too; chunk_size is passed when given."""
    rng = random.Random(seed)
    cases = []
    for i, (B, T, H, K, V, dtype, gate, strength, init) in enumerate(shapes):
        T = max(1, T + rng.randint(-3, 3))  # fresh lengths each time, rarely chunk multiples
        kw = testing.make_inputs(op, B=B, T=T, H=H, K=K, V=V, dtype=dtype, gate=gate,
                                 strength=strength, initial_state=init, seed=seed * 31 + i)
        kw["output_final_state"] = True
        if chunk_size is not None:
            kw["chunk_size"] = chunk_size
        if extra:
            kw.update(extra)
        note = f"B={B} T={T} H={H} K={K} V={V} {str(dtype).replace('torch.', '')}"
        if op in ("gla", "kda"):
            note += f", {gate} gates ({strength})"
        note += ", initial state" if init else ""
        cases.append(Case(kwargs=kw, note=note, dtype=dtype))  # q's dtype, not g's (float32)
    return cases
