"""Chunkwise delta rule, Gated DeltaNet and KDA: the WY/UT transform, then a pass over chunk states.

Inside a chunk of C tokens with state S at its start, write G_i = g_1 + … + g_i (log-decays summed
from the chunk start, per key dimension) and let Ṽ hold the β-weighted residuals
ṽ_i = β_i (v_i − k_i D_i s_{i-1}). Unrolling the recurrence gives a unit lower-triangular system

    (I + A) Ṽ = diag(β) V − diag(β) (K ⊙ e^G) S,   A_ij = β_i Σ_d k_id k_jd e^{G_id − G_jd}  (i > j)

so with T = (I + A)⁻¹ (forward substitution), U = T diag(β) V and W = T diag(β) (K ⊙ e^G), both
independent of S:  Ṽ = U − W S. Then, per chunk,

    O  = scale · ((Q ⊙ e^G) S + tril(A_qk) Ṽ),      (A_qk)_ij = Σ_d q_id k_jd e^{G_id − G_jd}, j ≤ i
    S' = diag(e^{G_C}) S + (K ⊙ e^{G_C − G})ᵀ Ṽ.

Stability: every exponential above is of a *difference* G_i − G_j with i ≥ j, or G_i − 0, or
G_C − G_i, all ≤ 0 — decays are measured from the chunk boundary or between two tokens in causal
order, never as e^{+G}. The factorised form (K ⊙ e^G)(K ⊙ e^{−G})ᵀ would overflow once the
summed log-decay passes ≈ −88 (float32); here log-gates of −20 per token are harmless.

Any T: the sequence is padded to whole chunks with k = v = q = 0, β = 0, g = 0, tokens whose
transition is the identity and whose write is zero, and the padded outputs are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import outputs
from ..naive.delta import check_keys
from ..naive.linear import initial
from ..validate import check_chunk, check_inputs


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               chunk_size=64):
    """Chunkwise DeltaNet; same results as `linattn.naive.delta_rule`."""
    d = check_inputs(q, k, v, beta=beta, scale=scale, initial_state=initial_state, delta=True)
    check_chunk(chunk_size)
    check_keys(k, beta)
    f = factors(q, k, v, None, beta, d, chunk_size, delta=True)
    return state_pass(f, d, initial(initial_state, d, q.device), output_final_state, v.dtype)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        chunk_size=64):
    """Chunkwise KDA (g [B,T,H,K]) / Gated DeltaNet (g [B,T,H]); same results as `naive.kda`."""
    d = check_inputs(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                     gate=True, delta=True)
    check_chunk(chunk_size)
    check_keys(k, beta)
    f = factors(q, k, v, g, beta, d, chunk_size, delta=True)
    return state_pass(f, d, initial(initial_state, d, q.device), output_final_state, v.dtype)


# ---------------------------------------------------------------- chunk layout and gates

def to_chunks(x, C):
    """[B, T, H, *] → [B, H, N, C, *], zero-padded to N = ⌈T / C⌉ whole chunks."""
    B, T, H = x.shape[:3]
    N = -(-T // C)
    x = x.transpose(1, 2)                                              # [B, H, T, *]
    pad = torch.zeros((B, H, N * C - T) + tuple(x.shape[3:]), dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], 2).reshape((B, H, N, C) + tuple(x.shape[3:]))


def from_chunks(x, T):
    """[B, H, N, C, V] → [B, T, H, V] (drops the padding)."""
    B, H, N, C = x.shape[:4]
    return x.reshape(B, H, N * C, -1)[:, :, :T].transpose(1, 2)


def chunk_gates(g, d, C, device):
    """Log-decays summed from each chunk's start, G_i = g_1 + … + g_i: [B, H, N, C, K or 1].

    Without gates (DeltaNet, linear attention) G = 0: every decay factor below becomes 1.
    Cumulative sums run in float32 at least (float64 for float64 inputs), never in half precision.
    """
    if g is None:
        N = -(-d.T // C)
        return torch.zeros(d.B, d.H, N, C, 1, dtype=d.acc, device=device)
    g = g.to(d.acc)
    g = g[..., None] if g.dim() == 3 else g                            # [B, T, H, K or 1]
    return to_chunks(g, C).cumsum(3)


def decayed_scores(a, b, G, *, strict):
    """(a_i · b_j) e^{G_i − G_j} on the lower triangle (strict: i > j, else i ≥ j), 0 above.

    a, b [.., C, K]; G [.., C, K or 1]. The exponent is a difference with i ≥ j, so ≤ 0.
    """
    C = a.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    if G.shape[-1] == 1:  # one decay per head: a C×C factor times a plain matmul
        E = torch.where(keep, G[..., :, None, 0] - G[..., None, :, 0], float("-inf")).exp()
        return (a @ b.transpose(-1, -2)) * E                           # [.., C, C]
    E = torch.where(keep[:, :, None], G[..., :, None, :] - G[..., None, :, :], float("-inf")).exp()
    return torch.einsum("...ik,...ijk,...jk->...ij", a, E, b)         # E: [.., C, C, K]


def unit_lower_inverse(A):
    """(I + A)⁻¹ for strictly lower-triangular A [.., C, C], by forward substitution.

    Row i of X = (I + A)⁻¹ solves X_i = e_i − Σ_{j<i} A_ij X_j; X is unit lower-triangular too,
    so row i only needs the first i columns of the rows above it.
    """
    C = A.shape[-1]
    X = torch.eye(C, dtype=A.dtype, device=A.device).expand(A.shape).clone()
    for i in range(1, C):
        X[..., i, :i] = -(A[..., i:i + 1, :i] @ X[..., :i, :i]).squeeze(-2)
    return X


# ---------------------------------------------------------------- the per-chunk factors

@dataclass
class Factors:
    """Everything about each chunk that does not depend on the state entering it.

    With S the state at a chunk's start and Ṽ = U − W S (W = 0 without the delta rule):
        O = scale · (Qg S + Aqk Ṽ),     S' = last · S + Kdecᵀ Ṽ.
    """
    Qg: torch.Tensor     # [B, H, N, C, K]  q_i ⊙ e^{G_i}
    Kdec: torch.Tensor   # [B, H, N, C, K]  k_i ⊙ e^{G_C − G_i}   (β lives in U, W)
    last: torch.Tensor   # [B, H, N, K, 1]  e^{G_C}, the decay across the whole chunk
    Aqk: torch.Tensor    # [B, H, N, C, C]  causal decayed q·k scores, diagonal included
    U: torch.Tensor      # [B, H, N, C, V]
    W: torch.Tensor | None  # [B, H, N, C, K]; None when there is no delta rule


def factors(q, k, v, g, beta, d, C, *, delta):
    """The WY factors of every chunk at once (for linear attention / GLA: U = V, W = None)."""
    dev = q.device
    q, k, v_ = (to_chunks(x.to(d.acc), C) for x in (q, k, v))        # [B, H, N, C, *]
    G = chunk_gates(g, d, C, dev)                                      # [B, H, N, C, K|1]
    GC = G[..., -1:, :]                                                # [B, H, N, 1, K|1]
    Qg = q * G.exp()
    Kdec = k * (GC - G).exp()
    last = GC.transpose(-1, -2).exp().expand(d.B, d.H, G.shape[2], d.K, 1)   # [B, H, N, K, 1]
    Aqk = decayed_scores(q, k, G, strict=False)                        # [B, H, N, C, C]
    if not delta:
        return Factors(Qg, Kdec, last, Aqk, v_, None)
    b = to_chunks(beta.to(d.acc)[..., None], C)                        # [B, H, N, C, 1]
    A = b * decayed_scores(k, k, G, strict=True)                       # β_i on row i
    Tinv = unit_lower_inverse(A)                                       # [B, H, N, C, C]
    U = Tinv @ (b * v_)                                                # [B, H, N, C, V]
    W = Tinv @ (b * k * G.exp())                                       # [B, H, N, C, K]
    return Factors(Qg, Kdec, last, Aqk, U, W)


def state_pass(f: Factors, d, S, output_final_state, out_dtype):
    """Walk the chunks in order: residuals from the entering state, outputs, next state."""
    B, H, N, C = f.Qg.shape[:4]
    o = outputs.empty((B, H, N, C, d.V), dtype=d.acc, device=f.Qg.device)
    for n in range(N):
        Vt = f.U[:, :, n] if f.W is None else f.U[:, :, n] - f.W[:, :, n] @ S   # [B, H, C, V]
        o[:, :, n] = d.scale * (f.Qg[:, :, n] @ S + f.Aqk[:, :, n] @ Vt)
        S = f.last[:, :, n] * S + f.Kdec[:, :, n].transpose(-1, -2) @ Vt       # [B, H, K, V]
    return from_chunks(o, d.T).to(out_dtype), (S if output_final_state else None)
