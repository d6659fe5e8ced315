"""Linear attention, the ground truth: the recurrence token by token, and the masked quadratic form.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; state S [B, H, K, V]. o_t = scale · q_t S_t.
"""
from __future__ import annotations

import torch

from .. import outputs, packing
from ..validate import check_inputs


def initial(initial_state, d, device):
    """The state before the first token: zeros, or the given one in the accumulation dtype."""
    if initial_state is None:
        return torch.zeros(d.B, d.H, d.K, d.V, dtype=d.acc, device=device)
    return initial_state.to(d.acc).clone()


def linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None):
    """Recurrent form: S_t = S_{t-1} + k_tᵀ v_t, then o_t = scale · q_t S_t."""
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence(linear_attn, dict(q=q, k=k, v=v), cu_seqlens, scale=scale,
                                    initial_state=initial_state, output_final_state=output_final_state)
    d = check_inputs(q, k, v, scale=scale, initial_state=initial_state)
    q, k, v_ = (x.to(d.acc) for x in (q, k, v))
    S = initial(initial_state, d, q.device)                          # [B, H, K, V]
    o = outputs.empty((d.B, d.T, d.H, d.V), dtype=d.acc, device=q.device)
    for t in range(d.T):
        S = S + k[:, t, :, :, None] * v_[:, t, :, None, :]           # outer product k_tᵀ v_t
        o[:, t] = d.scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o.to(v.dtype), (S if output_final_state else None)


def linear_attn_parallel(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
    """Parallel form: O = (scale · Q Kᵀ ⊙ M) V + scale · Q S_0, M the causal (lower-triangular) mask."""
    d = check_inputs(q, k, v, scale=scale, initial_state=initial_state)
    q, k, v_ = (x.to(d.acc).transpose(1, 2) for x in (q, k, v))       # [B, H, T, *]
    S0 = initial(initial_state, d, q.device)
    mask = torch.ones(d.T, d.T, dtype=torch.bool, device=q.device).tril()
    P = (q @ k.transpose(-1, -2)).masked_fill(~mask, 0)                 # [B, H, T, T]
    o = d.scale * (P @ v_ + q @ S0)
    S = S0 + k.transpose(-1, -2) @ v_ if output_final_state else None
    return o.transpose(1, 2).to(v.dtype), S
