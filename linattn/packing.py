"""Packed sequences: documents of different lengths back to back in one row, cut by `cu_seqlens`.

The convention of flash-linear-attention. q, k, v (and g, beta) hold N sequences one after the
other in a single row, B = 1 and T their total length; `cu_seqlens` (int64, [N+1]) holds the
cumulative lengths 0 = c_0 ≤ c_1 ≤ … ≤ c_N = T, sequence n being the tokens c_n … c_{n+1} − 1.
Initial and final states are one per sequence, [N, H, K, V]. A sequence may be empty (its final
state is then its initial state).

The result is that of each sequence run alone, gradients included: no state, no chunk and no
gradient crosses a boundary. The naive and chunk levels get it the direct way, `per_sequence`:
each sequence is its own call, chunked from its own start, so a chunk never straddles a boundary
and a sequence's result does not depend on where it sits in the row. Autograd joins the pieces:
the slices and the concatenation route every gradient to its own sequence.
"""
from __future__ import annotations

import weakref

import torch

from .validate import Dims, InputError, _tensor, check_finite, check_inputs, checking_values


_REMEMBERED: dict = {}      # (id(cu_seqlens), key) -> (weak reference, version, value)


def remembered(cu_seqlens: torch.Tensor, key, make):
    """make(), computed once per cu_seqlens tensor while it lives unchanged (its in-place version
    counter), as flash-linear-attention caches its chunk tables. Reading the boundaries to the host
    synchronises with the GPU and building the kernels' chunk tables copies to it: natively (H200,
    bf16, H = 16, K = V = 128, eight documents, 32k tokens) that cost 0.3–0.8 ms per call, more than
    linear attention's whole packed forward. A training step passes the same cu_seqlens to every
    layer, forward and backward: only the first call pays."""
    try:
        version = cu_seqlens._version
    except RuntimeError:        # an inference tensor keeps no version counter: never remembered
        return make()
    slot = (id(cu_seqlens), key)
    hit = _REMEMBERED.get(slot)
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == version:
        return hit[2]
    value = make()
    ref = weakref.ref(cu_seqlens, lambda _, slot=slot, table=_REMEMBERED: table.pop(slot, None))
    _REMEMBERED[slot] = (ref, version, value)
    return value


def check_cu_seqlens(cu_seqlens, d: Dims, device, initial_state=None) -> list[int]:
    """Refuse a bad `cu_seqlens` (and an initial_state that is not one per sequence) before any
    work, naming the argument; return the boundaries [c_0, …, c_N] as ints.

    Reads the N + 1 boundaries to the host (one synchronisation): the levels that take packed
    sequences loop over them anyway. Never writes to cu_seqlens."""
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail(f"cu_seqlens must be a torch.Tensor (int64, [N+1]), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1:
        _fail(f"cu_seqlens must be 1-D, [N+1] cumulative lengths, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype != torch.int64:
        # int32 is flash-attention's convention; converting is cheap but a copy, so it is the caller's
        _fail(f"cu_seqlens must have dtype torch.int64 (torch.long), got {cu_seqlens.dtype}; "
              "pass cu_seqlens.long()")
    if cu_seqlens.numel() < 2:
        _fail(f"cu_seqlens must hold N+1 ≥ 2 boundaries [0, …, T], got {cu_seqlens.tolist()}")
    if cu_seqlens.device != device:
        _fail(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}; put it on q's device")
    if d.B != 1:
        _fail(f"with cu_seqlens the sequences are packed into one row: q must have B = 1, got "
              f"B = {d.B}; concatenate the rows along T and pass their boundaries")
    bounds = remembered(cu_seqlens, "bounds", cu_seqlens.tolist)
    if bounds[0] != 0:
        _fail(f"cu_seqlens must start at 0, got cu_seqlens[0] = {bounds[0]}")
    if bounds[-1] != d.T:
        _fail(f"cu_seqlens must end at T = {d.T} (q's length), got cu_seqlens[-1] = {bounds[-1]}")
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b < a:
            _fail(f"cu_seqlens must be non-decreasing (cumulative lengths), got cu_seqlens[{i}] = "
                  f"{a} > cu_seqlens[{i + 1}] = {b}")
    if initial_state is not None:
        _tensor("initial_state", initial_state, 4, None, device)
        want = [len(bounds) - 1, d.H, d.K, d.V]
        if list(initial_state.shape) != want:
            _fail(f"initial_state must have shape [N, H, K, V] = {want} with cu_seqlens (one state "
                  f"per sequence, N = len(cu_seqlens) − 1), got {tuple(initial_state.shape)}")
        if checking_values(initial_state):
            check_finite("initial_state", initial_state)
    return bounds


def per_sequence(fn, inputs: dict, cu_seqlens, *, scale=None, initial_state=None,
                 output_final_state=False, **knobs):
    """Run `fn` (a level's operation) on each packed sequence alone; join outputs and final states.

    inputs: fn's positional tensors by name (q, k, v and g and/or beta), all [1, T, H, ...].
    The whole row is validated first, so an error names positions in the row, not in a piece.
    Returns (o [1, T, H, V], final states [N, H, K, V] or None)."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    g, beta = inputs.get("g"), inputs.get("beta")
    d = check_inputs(q, k, v, g=g, beta=beta, scale=scale, gate="g" in inputs, delta="beta" in inputs)
    bounds = check_cu_seqlens(cu_seqlens, d, q.device, initial_state)
    if beta is not None:
        from .naive.delta import check_keys          # naive.delta imports this module
        check_keys(k, beta)
    outs, finals = [], []
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        if start == end:                              # empty: the state passes through unchanged
            finals.append(torch.zeros(1, d.H, d.K, d.V, dtype=d.acc, device=q.device)
                          if h0 is None else h0.to(d.acc))
            continue
        o, S = fn(*(x[:, start:end] for x in inputs.values()), scale=scale, initial_state=h0,
                  output_final_state=output_final_state, **knobs)
        outs.append(o)
        finals.append(S)
    o = torch.cat(outs, dim=1)
    return o, (torch.cat(finals) if output_final_state else None)


def per_sequence_grads(fn, inputs: dict, do, cu_seqlens, *, scale=None, initial_state=None,
                       dfinal_state=None) -> dict:
    """Run a reverse walk of `linattn.naive.backward` on each packed sequence alone; join the
    gradients (dinitial_state along N, the others along T).

    do [1, T, H, V]; dfinal_state [N, H, K, V] or None. An empty sequence has no tokens, so the
    gradient of its initial state is the incoming gradient of its final state."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    g, beta = inputs.get("g"), inputs.get("beta")
    d = check_inputs(q, k, v, g=g, beta=beta, scale=scale, gate="g" in inputs, delta="beta" in inputs)
    bounds = check_cu_seqlens(cu_seqlens, d, q.device, initial_state)
    N = len(bounds) - 1
    if not isinstance(do, torch.Tensor) or list(do.shape) != [1, d.T, d.H, d.V]:
        _fail(f"do must be a tensor of the output's shape [1, T, H, V] = {[1, d.T, d.H, d.V]}, "
              f"got {getattr(do, 'shape', type(do).__name__)}")
    if dfinal_state is not None and (not isinstance(dfinal_state, torch.Tensor)
                                     or list(dfinal_state.shape) != [N, d.H, d.K, d.V]):
        _fail(f"dfinal_state must have shape [N, H, K, V] = {[N, d.H, d.K, d.V]} with cu_seqlens, "
              f"got {getattr(dfinal_state, 'shape', type(dfinal_state).__name__)}")
    parts, dh0 = [], []
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        dS = None if dfinal_state is None else dfinal_state[n:n + 1]
        if start == end:
            if h0 is not None:
                dh0.append(torch.zeros_like(h0) if dS is None else dS.to(h0.dtype))
            continue
        part = fn(*(x[:, start:end] for x in inputs.values()), do[:, start:end], scale=scale,
                  initial_state=h0, dfinal_state=dS)
        if h0 is not None:
            dh0.append(part["dinitial_state"])
        parts.append(part)
    out = {name: torch.cat([p[name] for p in parts], dim=1) for name in parts[0]
           if name != "dinitial_state"}
    out["dinitial_state"] = None if initial_state is None else torch.cat(dh0)
    return out


def _fail(msg: str):
    raise InputError(msg)
