"""Allocation of output tensors.

Every level allocates its outputs here. Under `linattn.testing.poisoned()` the buffers come back
filled with NaN instead of uninitialised memory, so an element a kernel forgot to write cannot
pass a test by luck (torch.empty often returns zeros or stale correct values).

Under `guarded()` every buffer is also the middle of a larger allocation whose two ends (the
guards) hold a byte pattern; `Guards.check()` afterwards names every buffer whose guards changed.
A compiled kernel that stores past the end of its buffer (or before its start) writes into a guard
instead of into a neighbouring tensor, silently: natively nothing else would notice. The caller
gets a contiguous view with its own storage offset, so later `.view()`s and reshapes still work.
"""
from __future__ import annotations

import contextlib
import sys

import torch

_poison = False
_guards: list | None = None          # the active Guards' list of buffers, or None

GUARD_BYTE = 0xA5                    # as float32 −2.9e-16, as bf16 −2.9e-16: no kernel's natural result
GUARD_MIN_BYTES = 4096               # each side: at least a 32 × 32 float32 tile past the end
GUARD_MAX_BYTES = 64 << 20


def empty(shape, *, dtype, device) -> torch.Tensor:
    if _guards is not None:
        return _guarded_empty(shape, dtype, device, poison=_poison)
    if _poison:
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def scratch(shape, *, dtype, device) -> torch.Tensor:
    """A work buffer whose kernels write only the entries they later read (e.g. the lower triangle
    of a chunk matrix): never NaN-poisoned, but guarded under `guarded()` like `empty`."""
    if _guards is not None:
        return _guarded_empty(shape, dtype, device, poison=False)
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


class GuardError(AssertionError):
    """A kernel wrote outside the buffer it was given."""


class Guards:
    """The buffers allocated under one `guarded()` block (kept alive until checked)."""

    def __init__(self):
        self.buffers = []            # (whole flat allocation [n + 2g], g, n, shape, dtype, site)

    def __len__(self):
        return len(self.buffers)

    def overwritten(self) -> list[str]:
        """One line per buffer whose guard bytes changed: where it was allocated, its shape and
        dtype, which side and how many bytes."""
        bad = []
        for whole, g, n, shape, dtype, site in self.buffers:
            raw = whole.view(torch.uint8)                                  # [(n + 2g) · element size]
            es = whole.element_size()
            for side, part in (("before", raw[:g * es]), ("after", raw[(g + n) * es:])):
                hit = int((part != GUARD_BYTE).sum())
                if hit:
                    bad.append(f"{site}: buffer {list(shape)} {str(dtype).replace('torch.', '')} — "
                               f"{hit} guard byte(s) {side} it overwritten")
        return bad

    def check(self):
        bad = self.overwritten()
        if bad:
            raise GuardError("out-of-bounds write into a guard region:\n  " + "\n  ".join(bad))


@contextlib.contextmanager
def guarded():
    """Allocate every buffer with guard regions while the block runs; yields the `Guards` to
    check afterwards (`g.check()`). Nested blocks share the outermost list."""
    global _guards
    if _guards is not None:
        outer = Guards()
        outer.buffers = _guards
        yield outer
        return
    g = Guards()
    _guards = g.buffers
    try:
        yield g
    finally:
        _guards = None


def _guard_elements(nbytes: int, es: int) -> int:
    """Guard length in elements: half the buffer, between GUARD_MIN_BYTES and GUARD_MAX_BYTES, a
    multiple of 256 bytes so the buffer keeps the alignment the kernels are compiled for."""
    b = min(max(GUARD_MIN_BYTES, nbytes // 2), GUARD_MAX_BYTES)
    b = -(-b // 256) * 256
    return b // es


def _guarded_empty(shape, dtype, device, *, poison):
    shape = tuple(torch.Size(shape)) if not isinstance(shape, int) else (shape,)
    n = 1
    for s in shape:
        n *= s
    es = torch.empty((), dtype=dtype).element_size()
    g = _guard_elements(n * es, es)
    whole = torch.empty(n + 2 * g, dtype=dtype, device=device)             # [g | n | g]
    whole.view(torch.uint8).fill_(GUARD_BYTE)
    mid = whole[g:g + n]
    if poison:
        mid.fill_(float("nan") if dtype.is_floating_point else -1)
    f = sys._getframe(2)                                                     # the library's call site
    site = f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno} ({f.f_code.co_name})"
    _guards.append((whole, g, n, shape, dtype, site))
    return mid.view(shape)
