"""Input validation shared by every level.

Each public function calls `check_inputs` first, so bad input fails here with a message that names
the argument and what was expected, never deep inside a kernel or as a silently wrong result.

Non-finite inputs. With the value checks on (CPU tensors, by default) a NaN or inf in q, k, v, g,
beta or initial_state is refused, naming the argument and its first non-finite entry. With them off
(GPU tensors, by default) the values are not read, and a non-finite input makes the outputs of its
whole chunk non-finite at the chunk and Triton levels, earlier tokens of that chunk included (the
naive recurrence stays causal): inside a chunk the outputs are matmuls over all its tokens, masked
above the diagonal, and 0 · NaN = NaN inside a matmul, so a mask cannot keep a NaN value out of
earlier rows. Later chunks are non-finite too, through the state.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The accepted scale: models use K^-0.5 (≤ 1) or 1. Above MAX_SCALE the outputs, scale · q S, leave
# float32's range (3.4e38) for inputs of ordinary size (entries ≤ 1e3 over 2^20 tokens reach
# 1e4 · 1e3 · 1e3 · 1e3 · 2^20 ≈ 1e19, far inside it; scale = 1e300 is inf before any input is
# read). Below MIN_SCALE, scale rounds to 0 or loses its precision in float32 (tiny 1.2e-38).
MIN_SCALE, MAX_SCALE = 1e-30, 1e4
# None: automatic (on for CPU tensors, off for GPU tensors); True/False: forced by value_checks()
# or the environment variable LINATTN_CHECK_VALUES=1/0.
_value_checks: bool | None = None


class InputError(ValueError):
    """Raised for inputs a linattn function cannot compute with."""


@contextlib.contextmanager
def value_checks(on: bool | None):
    """Force the data-dependent checks (finite inputs, gate ≤ 0, β range, key norms) on or off.

    Shape, dtype and device checks always run: they read metadata only. The value checks read the
    tensors themselves: on a GPU each is a pass over the input plus a host synchronisation (on an
    H200 up to 1.5 ms per call, a third of a KDA forward), so by default they run for CPU tensors
    only, where they cost a small fraction of the computation and a reader learns the most from
    them. `with value_checks(True):` (or LINATTN_CHECK_VALUES=1 in the environment) turns them on
    for GPU tensors too, e.g. while debugging a model; `value_checks(None)` restores the default.
    """
    global _value_checks
    before, _value_checks = _value_checks, on
    try:
        yield
    finally:
        _value_checks = before


def checking_values(x: torch.Tensor) -> bool:
    """Whether the data-dependent checks run for inputs on x's device (see `value_checks`)."""
    if _value_checks is not None:
        return _value_checks
    env = os.environ.get("LINATTN_CHECK_VALUES", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise InputError(f"LINATTN_CHECK_VALUES must be 0 or 1, got {env!r}")
    return x.device.type == "cpu"


def refuse_grad(where: str, **tensors) -> None:
    """Raise if any input requires grad: for code that has no backward, so a result is never
    returned silently detached from the graph (its inputs would then never be trained)."""
    needy = [name for name, x in tensors.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    if needy and torch.is_grad_enabled():
        _fail(f"{where} has no backward pass, but {', '.join(needy)} require(s) grad: the result "
              "would be detached from the graph. Use linattn.chunk (or impl='chunk') to train; "
              "for impl='mine' with a Triton forward, pass the backward exercise of chapter 13 "
              "(ch13.gla_backward, for GLA) and impl='mine' trains through your backward. Or call "
              "under torch.no_grad() / pass detached tensors for inference.")


def autocast_off(fn):
    """Run fn with torch.autocast disabled (on the CPU and CUDA alike).

    The chunk level sets its own precision: inputs read in the accumulation dtype (float32, float64
    for float64 inputs), matmul operands rounded only to `inter_dtype`, o returned in v's dtype and
    the final state in float32. Under an autocast region PyTorch would instead round some of its
    matmuls to bf16 and leave others in float32, which mixes dtypes inside one expression (a crash)
    or returns the state in bf16. So an op is one unit to autocast, as a fused kernel is: its inputs'
    dtypes decide (a layer's projections under autocast hand it bf16 q, k, v)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for dev in ("cpu", "cuda"):
                if torch.is_autocast_enabled(dev):
                    stack.enter_context(torch.autocast(dev, enabled=False))
            return fn(*args, **kwargs)
    return wrapper


def func_transforms() -> set:
    """The torch.func transforms active now ({'vmap'}, {'grad'}, ...; empty outside them)."""
    try:
        stack = torch._C._functorch.get_interpreter_stack()
    except AttributeError:                                            # not in this torch: no check
        return set()
    return {str(i.key()).rsplit(".", 1)[-1].lower() for i in stack or ()}


def refuse_func_transforms(where: str) -> None:
    """For code whose backward is a hand-written torch.autograd.Function (the chunk and Triton
    levels): torch.func.grad / jacrev / jvp / vmap cannot pass through it (it defines no
    setup_context or vmap rule), so say so, and what works, before PyTorch fails inside it."""
    active = func_transforms()
    if active:
        _fail(f"{where} does not support torch.func transforms ({', '.join(sorted(active))} is "
              "active): its backward is a hand-written torch.autograd.Function without functorch "
              "rules. Use torch.autograd.grad / .backward() with it, or impl='naive' "
              "(linattn.naive), which torch.func.grad differentiates; for vmap, batch along B.")


class DoubleBackwardError(RuntimeError):
    """A second derivative through a hand-written, first-order backward."""


def first_order(where: str):
    """Decorator for the `backward` of a hand-written autograd.Function (`where` names the
    function, e.g. "linattn.chunk.gla"): the backward runs under no_grad, and when autograd asks for
    a graph of it (create_graph=True) its gradients come back tied to a node that raises
    DoubleBackwardError when differentiated. A hand-written backward is first-order: autograd
    through its arithmetic would miss what it reads without a graph (kept chunk states, recomputed
    factors) and give a wrong second derivative, so none is given.

    Like torch.autograd.function.once_differentiable, but the refusal does not depend on whether the
    incoming gradient requires grad (a second derivative through a gradient that does not would
    otherwise come back silently without this function's terms), and it says what to use instead."""
    def wrap(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                out = backward(ctx, *grads)
            if not torch.is_grad_enabled():                          # create_graph=False
                return out
            single = not isinstance(out, tuple)
            outs = (out,) if single else out
            idx = [i for i, x in enumerate(outs) if isinstance(x, torch.Tensor)]
            if not idx:
                return out
            # The node that refuses must lie on the path from the gradients to the inputs, or
            # autograd.grad(..., inputs) would prune it and return the second derivative without
            # this function's terms: its inputs are the saved inputs that require grad.
            anchors = [x for x in ctx.saved_tensors if isinstance(x, torch.Tensor) and x.requires_grad]
            refused = _Refuse.apply(where, len(idx), *(outs[i].detach() for i in idx), *anchors)
            refused = refused if isinstance(refused, tuple) else (refused,)
            outs = list(outs)
            for i, x in zip(idx, refused):
                outs[i] = x
            return outs[0] if single else tuple(outs)
        return wrapper
    return wrap


class _Refuse(torch.autograd.Function):
    """(where, n, n gradients, anchors...) → the n gradients; differentiating them raises
    DoubleBackwardError. The anchors (the Function's inputs) tie the node into the graph."""

    @staticmethod
    def forward(ctx, where, n, *xs):
        ctx.where = where
        ctx.mark_non_differentiable()
        return xs[0].clone() if n == 1 else tuple(x.clone() for x in xs[:n])

    @staticmethod
    def backward(ctx, *_):
        raise DoubleBackwardError(
            f"{ctx.where}: the backward is hand-written and first-order (once_differentiable), so "
            "it cannot be differentiated twice (a second grad after create_graph=True would be "
            "wrong). For gradients of gradients (a gradient penalty, Hessian-vector products) use "
            "impl='naive' (linattn.naive), which autograd differentiates to any order.")


@dataclass(frozen=True)
class Dims:
    B: int
    T: int
    H: int
    K: int
    V: int
    scale: float
    acc: torch.dtype  # accumulation dtype: float64 for float64 inputs, float32 otherwise


def _fail(msg: str):
    raise InputError(msg)


def _tensor(name, x, ndim, dtype=None, device=None):
    if not isinstance(x, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        _fail(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        _fail(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        _fail(f"{name} has dtype {x.dtype} but q has {dtype}; pass them in one dtype")
    if device is not None and x.device != device:
        _fail(f"{name} is on {x.device} but q is on {device}; put all inputs on one device")


def check_qkv(q, k, v, scale=None) -> Dims:
    _tensor("q", q, 4)
    _tensor("k", k, 4, q.dtype, q.device)
    _tensor("v", v, 4, q.dtype, q.device)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        _fail(f"k must have q's shape [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (B, T, H):
        _fail(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if min(B, T, H, K, v.shape[3]) < 1:
        _fail(f"every dimension must be ≥ 1, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    if scale is None:
        scale = K ** -0.5
    elif not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
              and MIN_SCALE <= scale <= MAX_SCALE):
        _fail(f"scale must be a positive finite number in [{MIN_SCALE:g}, {MAX_SCALE:g}] or None "
              f"(→ K^-0.5), got {scale!r}: the float32 computation multiplies every output by it")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return Dims(B, T, H, K, v.shape[3], float(scale), acc)


def check_state(initial_state, d: Dims, device):
    if initial_state is None:
        return
    _tensor("initial_state", initial_state, 4, None, device)
    want = (d.B, d.H, d.K, d.V)
    if tuple(initial_state.shape) != want:
        _fail(f"initial_state must have shape [B, H, K, V] = {list(want)}, got {tuple(initial_state.shape)}")


def check_gate(g, d: Dims, q):
    """g holds log-decays: [B,T,H] (one per head) or [B,T,H,K] (one per key dimension), all ≤ 0."""
    if not isinstance(g, torch.Tensor):
        _fail(f"g must be a torch.Tensor of log-decays, got {type(g).__name__}")
    if tuple(g.shape) not in ((d.B, d.T, d.H), (d.B, d.T, d.H, d.K)):
        _fail(f"g must have shape [B, T, H] = {[d.B, d.T, d.H]} or [B, T, H, K] = "
              f"{[d.B, d.T, d.H, d.K]}, got {tuple(g.shape)}")
    _tensor("g", g, g.dim(), None, q.device)
    if checking_values(g):
        lo, hi = torch.stack(torch.aminmax(g)).tolist()   # one pass, one sync; a NaN makes both NaN
        if hi != hi:
            _fail(f"g contains NaN {_first_nonfinite(g, 'g')}; gates must be finite log-decays ≤ 0")
        if hi > 0:
            _fail(f"g must hold log-decays ≤ 0 (a decay exp(g) ≤ 1), got max {hi:.4g}; "
                  "pass log(α), e.g. F.logsigmoid(x), not α itself")
        if lo == float("-inf"):
            _fail(f"g contains -inf {_first_nonfinite(g, 'g')}; clamp log-decays to a finite value "
                  "(e.g. ≥ -1e4)")


def check_beta(beta, d: Dims, q, low=0.0, high=2.0):
    """β scales each delta-rule write: [B,T,H] in [low, high] (β ∈ (1, 2] gives negative eigenvalues)."""
    if not isinstance(beta, torch.Tensor):
        _fail(f"beta must be a torch.Tensor, got {type(beta).__name__}")
    if tuple(beta.shape) != (d.B, d.T, d.H):
        _fail(f"beta must have shape [B, T, H] = {[d.B, d.T, d.H]}, got {tuple(beta.shape)}")
    _tensor("beta", beta, 3, None, q.device)
    if checking_values(beta):
        check_finite("beta", beta)
        lo, hi = beta.min().item(), beta.max().item()
        if lo < low or hi > high:
            _fail(f"beta must lie in [{low}, {high}], got values in [{lo:.4g}, {hi:.4g}]")


def check_chunk(chunk_size, sub_chunk_size=None, *, power_of_two=False, minimum=1, maximum=None):
    def ok(n):
        return isinstance(n, int) and not isinstance(n, bool) and n >= minimum and (
            not power_of_two or n & (n - 1) == 0) and (maximum is None or n <= maximum)

    need = f"an int ≥ {minimum}" + (f" and ≤ {maximum}" if maximum else "") + (
        " and a power of two" if power_of_two else "")
    if not ok(chunk_size):
        _fail(f"chunk_size must be {need}, got {chunk_size!r}")
    if sub_chunk_size is not None:
        if not ok(sub_chunk_size):
            _fail(f"sub_chunk_size must be {need} that divides chunk_size, got {sub_chunk_size!r}")
        if chunk_size % sub_chunk_size:
            # named as chunk_size's error: the caller usually passed only chunk_size, and the
            # sub-chunk size is its default
            _fail(f"chunk_size must be a multiple of sub_chunk_size={sub_chunk_size} (e.g. "
                  f"{', '.join(str(m * sub_chunk_size) for m in (1, 2, 4))}), got {chunk_size}; "
                  f"or pass a sub_chunk_size that divides {chunk_size}")


LAYOUTS = {"q": "[B, T, H, K]", "k": "[B, T, H, K]", "v": "[B, T, H, V]", "beta": "[B, T, H]",
           "initial_state": "[B, H, K, V]"}


def check_finite(name, x):
    """Refuse a NaN or ±inf in x, naming x and its first non-finite entry (a value check).

    Why refuse rather than pass it through: at the chunk and Triton levels a non-finite input at
    token t makes the outputs of t's whole chunk non-finite, earlier tokens included (a chunk is a
    few matmuls, and 0 · NaN = NaN inside a matmul), where the recurrence would keep them finite.
    The sum is the fast test (one pass, no temporary); only a non-finite sum, which a large finite
    input can also give, looks element by element."""
    s = x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    if bool(torch.isfinite(s)) or bool(torch.isfinite(x).all()):
        return
    _fail(f"{name} contains NaN or inf {_first_nonfinite(x, name)}: inputs must be finite")


def _first_nonfinite(x, name):
    at = (~torch.isfinite(x)).nonzero()[0].tolist()
    value = x[tuple(at)].item()
    layout = LAYOUTS.get(name, "[B, T, H]" if x.dim() == 3 else "[B, T, H, K]")
    return (f"({name}[{', '.join(map(str, at))}] = {value} is its first non-finite entry, index "
            f"{layout})")


def check_inputs(q, k, v, *, g=None, beta=None, scale=None, initial_state=None, gate=False,
                 delta=False) -> Dims:
    """Validate one call; `gate`/`delta` say whether the operation takes g / beta.

    With the value checks on (`checking_values`: CPU tensors by default) a NaN or inf in q, k, v,
    g, beta or initial_state is refused, naming the argument and its first non-finite entry. With
    them off (GPU tensors by default) nothing reads the values: a non-finite input then gives
    non-finite outputs, at the chunk and Triton levels for its whole chunk, earlier tokens included
    (see `check_finite`)."""
    d = check_qkv(q, k, v, scale)
    active = func_transforms()
    if "vmap" in active:
        _fail("linattn operations do not support torch.func.vmap at any level (the naive level "
              "writes its outputs in place, the others run hand-written autograd.Functions); "
              "every operation is batched already: stack the inputs along B (or H)")
    if checking_values(q):
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_finite(name, x)
    if gate:
        check_gate(g, d, q)
    if delta:
        check_beta(beta, d, q)
    check_state(initial_state, d, q.device)
    if initial_state is not None and checking_values(initial_state):
        check_finite("initial_state", initial_state)
    return d
