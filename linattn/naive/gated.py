"""Gated linear attention (GLA, and scalar decay: RetNet / Mamba-2 / Lightning-2), the ground truth.

    S_t = diag(exp g_t) S_{t-1} + k_tᵀ v_t,   o_t = scale · q_t S_t
g [B, T, H] is one log-decay per head and step (the same decay for every key dimension);
g [B, T, H, K] one per key dimension (GLA). Shapes: q, k [B, T, H, K]; v [B, T, H, V]; S [B, H, K, V].
"""
from __future__ import annotations

import torch

from .. import decay, outputs, packing
from ..validate import check_inputs
from .linear import initial


def gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Recurrent form: decay the state row by row, add k_tᵀ v_t, read it with q_t."""
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence(gla, dict(q=q, k=k, v=v, g=g), cu_seqlens, scale=scale,
                                    initial_state=initial_state, output_final_state=output_final_state)
    d = check_inputs(q, k, v, g=g, scale=scale, initial_state=initial_state, gate=True)
    q, k, v_ = (x.to(d.acc) for x in (q, k, v))
    a = decay.per_dim(g, q).to(d.acc).exp()                           # [B, T, H, K or 1]
    S = initial(initial_state, d, q.device)                           # [B, H, K, V]
    o = outputs.empty((d.B, d.T, d.H, d.V), dtype=d.acc, device=q.device)
    for t in range(d.T):
        # diag(α_t) S: row κ of S (key dimension κ) is scaled by α_t[κ]
        S = a[:, t, :, :, None] * S + k[:, t, :, :, None] * v_[:, t, :, None, :]
        o[:, t] = d.scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o.to(v.dtype), (S if output_final_state else None)


def attention_matrix(q, k, g):
    """The gated attention matrix in log space: P_ij = Σ_κ q_iκ k_jκ exp(b_iκ − b_jκ) for i ≥ j.

    q, k [..., L, K]; g [..., L, K] per-dimension or [..., L] scalar log-gates; returns [..., L, L]
    (no scale). b is the prefix sum of g; the exp runs on differences only and the upper triangle
    is masked *before* exp (there b_i − b_j > 0 could overflow to inf, and inf · 0 = NaN).
    The decay sits inside the sum over κ, so this is an elementwise product-and-reduce over an
    [L, L, K] tensor, not a matrix product: no tensor cores.
    """
    if g.dim() == q.dim() - 1:                                         # scalar: factor out of the sum
        return (q @ k.transpose(-1, -2)) * decay.decay_mask(g).to(q.dtype)
    b = decay.prefix(g).to(q.dtype)                                    # [..., L, K]
    diff = b[..., :, None, :] - b[..., None, :, :]                     # [..., L, L, K]: b_i − b_j
    L = q.shape[-2]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()[:, :, None]
    w = diff.masked_fill(~causal, float("-inf")).exp()                 # 0 above the diagonal
    return torch.einsum("...ik,...jk,...ijk->...ij", q, k, w)


def gla_parallel(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False):
    """Parallel form: O = scale · (P V + (Q ⊙ Λ) S_0), P the log-space gated attention matrix.

    Λ_t = exp(b_t) is the decay from the start to t; the final state is
    S_T = diag(exp b_T) S_0 + Σ_j (k_j ⊙ exp(b_T − b_j))ᵀ v_j. O(T² K) memory: a reference only.
    """
    d = check_inputs(q, k, v, g=g, scale=scale, initial_state=initial_state, gate=True)
    q, k, v_ = (x.to(d.acc).transpose(1, 2) for x in (q, k, v))       # [B, H, T, *]
    g = g.to(d.acc).transpose(1, 2)                                   # [B, H, T] or [B, H, T, K]
    S0 = initial(initial_state, d, q.device)                          # [B, H, K, V]
    P = attention_matrix(q, k, g)                                     # [B, H, T, T]
    g = decay.per_dim(g, q)                                           # [B, H, T, K or 1]
    o = d.scale * (P @ v_ + (q * decay.query_decay(g)) @ S0)
    S = None
    if output_final_state:
        S = decay.total_decay(g)[..., None] * S0 + (k * decay.key_decay(g)).transpose(-1, -2) @ v_
    return o.transpose(1, 2).to(v.dtype), S
