"""Out-of-bounds loads and stores of the reader's Triton kernels, caught under the interpreter.

On a GPU an unmasked load past the end of a tensor reads whatever lies there (or faults, far from
the line that caused it). Triton's interpreter (3.7) runs every tl.load / tl.store through one
builder method with the raw addresses and the mask, and checks nothing either. While `checked()`
is active those two methods are wrapped: every address a load or store touches with its mask on
must lie inside the one tensor its lowest address belongs to, among the tensors passed to the
kernel launch. Otherwise OutOfBounds is raised *inside* the kernel, so its traceback ends at the
reader's `tl.load` line. (Kernels that use block pointers or tensor descriptors go through other
builder methods and are not checked; natively nothing is checked.)
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..device import triton_mode


class OutOfBounds(Exception):
    """A kernel loaded or stored outside the tensors it was given."""


_launches: list = []  # per active kernel launch: [(start, end, argument name)] of its tensors


@contextlib.contextmanager
def checked():
    """Check every load/store of kernels launched while the block runs (interpreter only).
    Re-entrant: a check run from inside a graded function finds the methods already wrapped."""
    if triton_mode() == "native" or _depth[0]:
        yield
        return
    _depth[0] += 1
    try:
        with _wrapped():
            yield
    finally:
        _depth[0] -= 1


_depth = [0]


@contextlib.contextmanager
def _wrapped():
    from triton.runtime import interpreter as I

    builder, executor = I.interpreter_builder, I.GridExecutor
    load, store, call = builder.create_masked_load, builder.create_masked_store, executor.__call__

    def launch(self, *args, **kwargs):
        _launches.append(_ranges(self.arg_names, args, kwargs))
        try:
            return call(self, *args, **kwargs)
        finally:
            _launches.pop()

    def masked_load(ptrs, mask, *rest):
        _check(ptrs, mask, "loads")
        return load(ptrs, mask, *rest)

    def masked_store(ptrs, value, mask, *rest):
        _check(ptrs, mask, "stores")
        return store(ptrs, value, mask, *rest)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    executor.__call__ = launch
    try:
        yield
    finally:
        executor.__call__ = call
        del builder.create_masked_load, builder.create_masked_store  # back to the class's methods


def _ranges(names, args, kwargs):
    out = []
    named = list(zip(names, args)) + list(kwargs.items())
    for name, a in named:
        for t in (a if isinstance(a, tuple) else (a,)):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                out.append((s.data_ptr(), s.data_ptr() + s.nbytes(), name))
    return out


def _check(ptrs, mask, what):
    if not _launches:
        return
    on = np.broadcast_to(mask.data.astype(bool), ptrs.data.shape)  # a mask may come as int32
    addr = ptrs.data[on].astype(np.int64)
    if addr.size == 0:
        return
    size = ptrs.get_element_ty().primitive_bitwidth // 8
    lo, hi = int(addr.min()), int(addr.max()) + size
    for start, end, name in _launches[-1]:
        if start <= lo < end:
            if hi <= end:
                return
            past = (hi - end) // size
            raise OutOfBounds(f"the kernel {what} up to {past} element(s) past the end of `{name}` "
                              "(an unmasked or wrongly masked tl.load/tl.store: mask the rows "
                              "beyond the sequence, e.g. mask=offs < T)")
    below = [(lo - end) // size for start, end, _ in _launches[-1] if end <= lo]
    where = (f"{min(below)} element(s) beyond the end of the nearest tensor" if below
             else "before the start of every tensor")
    raise OutOfBounds(f"the kernel {what} outside every tensor it was given ({where}): "
                      "check the offsets and the mask of this tl.load/tl.store")
