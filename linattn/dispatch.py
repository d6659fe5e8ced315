"""One entry point per operation, routed to a level: naive, chunk, triton, or the reader's own.

`impl="auto"` follows a preference set with `set_impl` (or by passing an exercise and choosing
"mine"), else Triton for CUDA tensors and the chunkwise level on the CPU. `which(op)` tells what
ran last, so a chapter can say which implementation produced its numbers.

Keywords go to the level chosen. The tuning knobs chunk_size, sub_chunk_size, recompute and mode
change how a result is computed, never what it is, so a level without one ignores it (one call runs
at every level). Any other keyword the level does not take raises `KeywordError` (a TypeError and
an InputError) naming it and its close match: `initial_sate=` is refused, not dropped, and so is
`inter_dtype=` (which changes the rounding) at a level without it.
"""
from __future__ import annotations

import difflib
import importlib
import inspect

import torch

from . import prepare
from .validate import InputError

OPS = ("linear_attn", "gla", "delta_rule", "kda")
LEVELS = ("naive", "chunk", "triton")
IMPLS = ("auto",) + LEVELS + ("mine",)
SEMANTIC = {"scale", "initial_state", "output_final_state", "cu_seqlens"}  # never dropped, unlike knobs

_preferred: dict[str, str] = {}
_last: dict[str, str] = {}
_in_mine: set[str] = set()  # ops whose reader's implementation is running now


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


def device_level(is_cuda: bool) -> str:
    """The level "auto" means when no level is preferred: Triton for CUDA tensors, else the chunk level."""
    return "triton" if is_cuda else "chunk"


def chosen(op: str, impl: str) -> str:
    """impl, with "auto" replaced by the level set_impl preferred for op (still "auto" without one)."""
    return _preferred.get(op, "auto") if impl == "auto" else impl


def resolve(op: str, impl: str, is_cuda: bool):
    """(function, description) that `impl` means for `op` on this device."""
    _check(op, impl)
    impl = chosen(op, impl)
    if impl == "auto":
        impl = device_level(is_cuda)
    if impl == "mine":
        from .grade.progress import load_mine

        return load_mine(op)
    return level_fn(op, impl), f"linattn.{impl}.{op} (reference)"


def call(op: str, impl: str, args: tuple, kwargs: dict):
    if torch.compiler.is_compiling() and _compilable(op, impl):
        return _custom_op(op, impl, args, kwargs)
    is_cuda = args[0].is_cuda if args and hasattr(args[0], "is_cuda") else False
    mine = chosen(op, impl) == "mine"
    if mine and op in _in_mine:
        # the reader's implementation calls linattn.<op> itself (e.g. wraps it): that inner call
        # runs the reference, or "mine" would call itself without end
        impl, mine = ("triton" if is_cuda else "chunk"), False
    fn, desc = resolve(op, impl, is_cuda)
    kwargs = keywords(op, fn, desc, kwargs)
    _last[op] = desc
    if not mine:
        return fn(*args, **kwargs)
    _in_mine.add(op)
    try:
        return fn(*args, **kwargs)
    finally:
        _in_mine.discard(op)
        _last[op] = desc   # the inner call said "reference"; what ran was the reader's


def _compilable(op, impl) -> bool:
    """Whether a call under torch.compile goes through the custom op (linattn.ops): every level of
    the library does; the reader's own implementation ("mine") is traced as it is written."""
    return chosen(op, impl) != "mine"


def _custom_op(op, impl, args, kwargs):
    """linattn.<op> under torch.compile: the custom op linattn::<op>, one node of the graph (dynamo
    cannot trace the levels themselves). Same results as the eager call: the op runs the same level.
    Keywords are checked against the op's options (unknown ones raise KeywordError); one the level
    lacks is refused or dropped when the op runs, as in `keywords`."""
    _check(op, impl)
    level = chosen(op, impl)
    kwargs = dict(kwargs)
    want_state = kwargs.pop("output_final_state", False)
    o, S = ops.call(op, args, level=level, **kwargs)
    _last[op] = f"linattn::{op} (custom op, level {level})"
    return o, (S if want_state else None)


# Keywords that choose how a result is computed, never what it is: every chunk size, sub-chunk
# size, recompute setting and Triton mode gives the same numbers. A level without them (the naive
# recurrence has no chunks) ignores them, so one call can be sent to any level. Every other keyword
# must be one the level takes: a misspelled `initial_sate=` dropped here would silently compute
# from a zero state.
KNOBS = frozenset({"chunk_size", "sub_chunk_size", "recompute", "mode"})


class KeywordError(InputError, TypeError):
    """An unknown keyword argument: a TypeError, as Python raises for one, and an InputError."""


def keywords(op: str, fn, desc: str, kwargs: dict) -> dict:
    """The keyword arguments of `linattn.<op>(...)` that `fn` (the level chosen) receives.

    A keyword `fn` takes passes; a tuning knob it lacks (`KNOBS`: chunk_size, sub_chunk_size,
    recompute, mode) is dropped; anything else raises KeywordError (a TypeError and an InputError)
    naming it and, for a misspelling, the close match. A function taking **kwargs gets them all.
    """
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    names = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    out = {}
    for name, value in kwargs.items():
        if name in names:
            out[name] = value
        elif name not in KNOBS:
            raise KeywordError(_unknown(op, name, names, desc))
    return out


def _unknown(op, name, names, desc):
    if name == "cu_seqlens":
        return (f"linattn.{op}: {desc.split(' (')[0]} does not take cu_seqlens (packed sequences) yet; "
                f"linattn.chunk.{op} and linattn.naive.{op} do: pass impl='chunk'")
    known = sorted(names | KNOBS | {"impl"})
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        hint = f"; did you mean {close[0]!r}?"
    else:
        hint = f"; it takes {', '.join(n for n in known if n not in _POSITIONAL)}"
    if name in SEMANTIC or name == "inter_dtype":
        return f"linattn.{op}: {desc.split(' (')[0]} does not take the keyword argument {name!r}{hint}"
    return f"linattn.{op} got an unexpected keyword argument {name!r}{hint}"


_POSITIONAL = {"q", "k", "v", "g", "beta"}


def accepted(fn, kwargs):
    """The kwargs `fn` takes, tuning knobs it lacks dropped (the graders call ground-truth
    functions with a case's keywords this way). Semantic arguments always pass, so a function
    lacking one fails loudly. `linattn.<op>` itself checks strictly (`keywords`)."""
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
    """S_t = S_{t-1} + k_tᵀ v_t, o_t = scale · q_t S_t. Returns (o, final_state or None).

    Keywords go to the level `impl` picks; tuning knobs it lacks (chunk_size, sub_chunk_size,
    recompute, mode) are ignored, any other keyword it lacks raises KeywordError (see `keywords`).
    A NaN or inf input is refused where the value checks run (CPU tensors, by default); unchecked
    (GPU tensors) it makes its whole chunk non-finite at the chunk and Triton levels, earlier tokens
    included (see linattn.validate). The same holds for gla, delta_rule and kda."""
    return call("linear_attn", impl, (q, k, v), kwargs)


def gla(q, k, v, g, *, impl="auto", **kwargs):
    """S_t = diag(exp g_t) S_{t-1} + k_tᵀ v_t; g [B,T,H] or [B,T,H,K] log-decays ≤ 0."""
    return call("gla", impl, (q, k, v, g), kwargs)


def delta_rule(q, k, v, beta, *, impl="auto", **kwargs):
    """S_t = S_{t-1} + β_t k_tᵀ (v_t − k_t S_{t-1}) (DeltaNet); keys L2-normalised. Also takes FLA's
    use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel and allow_neg_eigval (`linattn.prepare`)."""
    options, kwargs = prepare.split("delta_rule", kwargs)
    q, k, _, beta = prepare.apply("delta_rule", q, k, None, beta, options)
    return call("delta_rule", impl, (q, k, v, beta), kwargs)


def kda(q, k, v, g, beta, *, impl="auto", **kwargs):
    """S_t = D_t S_{t-1} + β_t k_tᵀ (v_t − k_t D_t S_{t-1}), D_t = diag(exp g_t). Also takes FLA's
    use_qk_l2norm_in_kernel, use_gate_in_kernel (with A_log, dt_bias, lower_bound),
    use_beta_sigmoid_in_kernel and allow_neg_eigval (`linattn.prepare`)."""
    options, kwargs = prepare.split("kda", kwargs)
    q, k, g, beta = prepare.apply("kda", q, k, g, beta, options)
    return call("kda", impl, (q, k, v, g, beta), kwargs)


from . import ops  # noqa: E402  (the custom ops call back into this module's level_fn and keywords)
