"""Allocation of output tensors.

Every level allocates its outputs here. Under `linattn.testing.poisoned()` the buffers come back
filled with NaN instead of uninitialised memory, so an element a kernel forgot to write cannot
pass a test by luck (torch.empty often returns zeros or stale correct values).
"""
from __future__ import annotations

import contextlib

import torch

_poison = False


def empty(shape, *, dtype, device) -> torch.Tensor:
    if _poison:
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@contextlib.contextmanager
def poisoned(on: bool = True):
    """Fill every output buffer with NaN while the block runs."""
    global _poison
    before, _poison = _poison, on
    try:
        yield
    finally:
        _poison = before


def poisoning() -> bool:
    return _poison
