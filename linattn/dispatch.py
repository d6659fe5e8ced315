"""One entry point per operation, routed to a level: naive, chunk, triton, or the reader's own.

`impl="auto"` follows a preference set with `set_impl` (or by passing an exercise and choosing
"mine"), else Triton for CUDA tensors and the chunkwise level on the CPU. `which(op)` tells what
ran last, so a chapter can say which implementation produced its numbers.
"""
from __future__ import annotations

import importlib
import inspect

from .validate import InputError

OPS = ("linear_attn", "gla", "delta_rule", "kda")
LEVELS = ("naive", "chunk", "triton")
IMPLS = ("auto",) + LEVELS + ("mine",)
SEMANTIC = {"scale", "initial_state", "output_final_state"}  # never dropped, unlike tuning knobs

_preferred: dict[str, str] = {}
_last: dict[str, str] = {}


def set_impl(op: str, impl: str = "auto") -> None:
    """Route `linattn.<op>(..., impl="auto")` to `impl` from now on ("auto" clears the choice)."""
    _check(op, impl)
    if impl == "auto":
        _preferred.pop(op, None)
    else:
        _preferred[op] = impl


def which(op: str) -> str:
    """What the last `linattn.<op>` call ran, e.g. 'linattn.chunk.gla (reference)'."""
    return _last.get(op, "nothing yet")


def level_fn(op: str, level: str):
    """The reference function of a level, e.g. level_fn('gla', 'chunk') is linattn.chunk.gla."""
    module = importlib.import_module(f"linattn.{level}")
    fn = getattr(module, op, None)
    if fn is None:
        raise InputError(f"linattn.{level} has no {op} (not implemented at that level)")
    return fn


def resolve(op: str, impl: str, is_cuda: bool):
    """(function, description) that `impl` means for `op` on this device."""
    _check(op, impl)
    if impl == "auto":
        impl = _preferred.get(op) or ("triton" if is_cuda else "chunk")
    if impl == "mine":
        from .grade.progress import load_mine

        return load_mine(op)
    return level_fn(op, impl), f"linattn.{impl}.{op} (reference)"


def call(op: str, impl: str, args: tuple, kwargs: dict):
    fn, desc = resolve(op, impl, args[0].is_cuda if args and hasattr(args[0], "is_cuda") else False)
    _last[op] = desc
    return fn(*args, **accepted(fn, kwargs))


def accepted(fn, kwargs):
    # Tuning knobs (chunk_size, sub_chunk_size, ...) mean nothing to a level without chunks: drop
    # them there. Semantic arguments always pass, so a level lacking one fails loudly.
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {n: a for n, a in kwargs.items() if n in params or n in SEMANTIC}


def _check(op, impl):
    if op not in OPS:
        raise InputError(f"op must be one of {OPS}, got {op!r}")
    if impl not in IMPLS:
        raise InputError(f"impl must be one of {IMPLS}, got {impl!r}")


def linear_attn(q, k, v, *, impl="auto", **kwargs):
    """S_t = S_{t-1} + k_tᵀ v_t, o_t = scale · q_t S_t. Returns (o, final_state or None)."""
    return call("linear_attn", impl, (q, k, v), kwargs)


def gla(q, k, v, g, *, impl="auto", **kwargs):
    """S_t = diag(exp g_t) S_{t-1} + k_tᵀ v_t; g [B,T,H] or [B,T,H,K] log-decays ≤ 0."""
    return call("gla", impl, (q, k, v, g), kwargs)


def delta_rule(q, k, v, beta, *, impl="auto", **kwargs):
    """S_t = S_{t-1} + β_t k_tᵀ (v_t − k_t S_{t-1}) (DeltaNet); keys L2-normalised."""
    return call("delta_rule", impl, (q, k, v, beta), kwargs)


def kda(q, k, v, g, beta, *, impl="auto", **kwargs):
    """S_t = D_t S_{t-1} + β_t k_tᵀ (v_t − k_t D_t S_{t-1}), D_t = diag(exp g_t)."""
    return call("kda", impl, (q, k, v, g, beta), kwargs)
