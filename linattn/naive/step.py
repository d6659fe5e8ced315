"""One token of each recurrence: the decoding step, the ground truth for the fused Triton step.

A generating model holds the state S [B, H, K, V] and, for each new token, runs one step of the
recurrence the naive level runs T times:

    linear_attn  S ← S + kᵀ v
    gla          S ← diag(exp g) S + kᵀ v
    delta_rule   S ← S + β kᵀ (v − k S)
    kda          S ← D S + β kᵀ (v − k D S),   D = diag(exp g)    (g [B, H]: Gated DeltaNet)
    then         o = scale · q S

One token: q, k [B, H, K]; v [B, H, V]; g [B, H] or [B, H, K]; beta [B, H]; state [B, H, K, V] or
None (zeros). Each returns (o [B, H, V] in v's dtype, new state in the accumulation dtype), and is
differentiable (plain torch operations), so a layer can train through its token-by-token path.
The inputs are validated by the same `check_inputs` as the whole-sequence functions, viewed as a
sequence of length 1, and the delta-rule steps check the key norms like `naive.delta_rule`.
"""
from __future__ import annotations

import torch

from ..validate import InputError, check_inputs
from .delta import check_keys
from .linear import initial


def linear_attn_step(q, k, v, state=None, *, scale=None):
    d, q, k, v_, S = _prepare(q, k, v, state, scale)
    S = S + k[..., None] * v_[..., None, :]                            # [B, H, K, V]
    return _read(q, S, d, v.dtype)


def gla_step(q, k, v, g, state=None, *, scale=None):
    d, q, k, v_, S = _prepare(q, k, v, state, scale, g=g)
    S = _decay(g, S, d) + k[..., None] * v_[..., None, :]              # [B, H, K, V]
    return _read(q, S, d, v.dtype)


def delta_rule_step(q, k, v, beta, state=None, *, scale=None):
    d, q, k, v_, S = _prepare(q, k, v, state, scale, beta=beta)
    return _read(q, _delta_write(k, v_, beta, S, d), d, v.dtype)


def kda_step(q, k, v, g, beta, state=None, *, scale=None):
    d, q, k, v_, S = _prepare(q, k, v, state, scale, g=g, beta=beta)
    return _read(q, _delta_write(k, v_, beta, _decay(g, S, d), d), d, v.dtype)


def check_step(q, k, v, state, scale, *, g=None, beta=None):
    """Validate one token's inputs (the Triton step uses it too); returns the Dims (T = 1)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputError(f"{name} must be one token, shape [B, H, {'V' if name == 'v' else 'K'}], "
                             f"got {shape}")
    want = (q.shape[0], q.shape[1], q.shape[2], v.shape[2])
    if state is not None and (not isinstance(state, torch.Tensor) or tuple(state.shape) != want):
        got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise InputError(f"state must have shape [B, H, K, V] = {list(want)}, got {got}")
    seq = lambda x: None if x is None else x.unsqueeze(1)            # noqa: E731  one-token sequence
    d = check_inputs(seq(q), seq(k), seq(v), g=seq(g), beta=seq(beta), scale=scale,
                     initial_state=state, gate=g is not None, delta=beta is not None)
    if beta is not None:
        check_keys(seq(k), seq(beta))                                  # reports token 0
    return d


def _prepare(q, k, v, state, scale, *, g=None, beta=None):
    d = check_step(q, k, v, state, scale, g=g, beta=beta)
    S = initial(state, d, q.device)                                    # [B, H, K, V]
    return d, q.to(d.acc), k.to(d.acc), v.to(d.acc), S


def _decay(g, S, d):
    g = g.to(d.acc)
    a = (g[..., None] if g.dim() == 2 else g).exp()                   # [B, H, K or 1]
    return a[..., None] * S                                            # diag(exp g) S


def _delta_write(k, v, beta, S, d):
    r = v - torch.einsum("bhk,bhkv->bhv", k, S)                        # residual vs the (decayed) state
    return S + beta.to(d.acc)[..., None, None] * k[..., None] * r[..., None, :]


def _read(q, S, d, dtype):
    o = d.scale * torch.einsum("bhk,bhkv->bhv", q, S)                  # [B, H, V]
    return o.to(dtype), S
