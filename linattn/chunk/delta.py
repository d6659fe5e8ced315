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
summed log-decay passes ≈ −88 (float32); here log-gates of −20 per token are harmless. The sums
themselves come from linattn.decay: a segment (j, i] or a tail (i, C] is summed on its own rather
than as the difference of two prefix sums, whose rounding (≈ 1e-4 at a prefix of −1000 in
float32) would swamp a short segment.

Any T: the sequence is padded to whole chunks with k = v = q = 0, β = 0, g = 0, tokens whose
transition is the identity and whose write is zero, and the padded outputs are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import decay, outputs
from ..naive.delta import check_keys
from ..naive.linear import initial
from ..validate import check_chunk, check_inputs


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               chunk_size=64, recompute=True):
    """Chunkwise DeltaNet; same results as `linattn.naive.delta_rule`.

    recompute: for training, whether the backward recomputes the chunk states (True, less memory)
    or the forward keeps them (False, [B, H, N, K, V] more memory, a faster backward).
    """
    d = check_inputs(q, k, v, beta=beta, scale=scale, initial_state=initial_state, delta=True)
    check_chunk(chunk_size)
    check_keys(k, beta)
    return _run(q, k, v, None, beta, d, initial_state, output_final_state, chunk_size, recompute)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        chunk_size=64, recompute=True):
    """Chunkwise KDA (g [B,T,H,K]) / Gated DeltaNet (g [B,T,H]); same results as `naive.kda`.

    recompute: see `delta_rule`.
    """
    d = check_inputs(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                     gate=True, delta=True)
    check_chunk(chunk_size)
    check_keys(k, beta)
    return _run(q, k, v, g, beta, d, initial_state, output_final_state, chunk_size, recompute)


def _run(q, k, v, g, beta, d, initial_state, output_final_state, C, recompute):
    """The plain forward, or, when a gradient is wanted, the same forward inside the
    autograd.Function whose backward is the chunkwise one (linattn.chunk.delta_backward)."""
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                       for x in (q, k, v, g, beta, initial_state)):
        from .delta_backward import DeltaChunkFunction   # imports this module: no cycle at load
        o, S = DeltaChunkFunction.apply(q, k, v, g, beta, initial_state, d, C, recompute)
        return o, (S if output_final_state else None)
    f = factors(q, k, v, g, beta, d, C, delta=True)
    return state_pass(f, d, initial(initial_state, d, q.device), output_final_state, v.dtype)


# ---------------------------------------------------------------- chunk layout and gates
# The gate algebra (segment sums, query/key-side decays) is linattn.decay, shared with GLA.

def to_chunks(x, C):
    """[B, T, H, *] → [B, H, N, C, *], zero-padded to N = ⌈T / C⌉ whole chunks."""
    return decay.chunked(x, C)


def from_chunks(x, T):
    """[B, H, N, C, V] → [B, T, H, V] (drops the padding)."""
    return decay.unchunked(x, T)


def chunk_gates(g, d, C, device):
    """Raw log-gates per chunk, [B, H, N, C, K or 1] (a per-head gate broadcasts over K).

    Without gates (DeltaNet, linear attention) they are 0: every decay factor below becomes 1.
    """
    if g is None:
        return torch.zeros(d.B, d.H, -(-d.T // C), C, 1, dtype=d.acc, device=device)
    g = g[..., None] if g.dim() == 3 else g                            # [B, T, H, K or 1]
    return decay.chunked(g.to(d.acc), C)


def decayed_scores(a, b, gc, *, strict):
    """(a_i · b_j) e^{G_i − G_j} on the lower triangle (strict: i > j, else i ≥ j), 0 above.

    a, b [.., C, K]; gc the chunk's raw log-gates [.., C, K or 1]. G_i − G_j is summed over the
    segment (j, i] itself (decay.segment_sums), never as a difference of two long prefix sums.
    """
    C = a.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    if gc.shape[-1] == 1:  # one decay per head: a C×C factor times a plain matmul
        E = decay.decay_mask(gc[..., 0]) * keep                        # [.., C, C]
        return (a @ b.transpose(-1, -2)) * E
    E = decay.pairwise_decay(gc) * keep[:, :, None]                    # [.., C, C, K]
    return torch.einsum("...ik,...ijk,...jk->...ij", a, E, b)


def unit_lower_inverse(A):
    """(I + A)⁻¹ for strictly lower-triangular A [.., C, C], by forward substitution.

    Row i of X = (I + A)⁻¹ solves X_i = e_i − Σ_{j<i} A_ij X_j; X is unit lower-triangular too,
    so row i only needs the first i columns of the rows above it. Out of place (rows are
    collected, then stacked), so autograd can differentiate through it as well.
    """
    C = A.shape[-1]
    eye = torch.eye(C, dtype=A.dtype, device=A.device).expand(A.shape)
    rows = [eye[..., 0, :]]                                            # [.., C] each
    for i in range(1, C):
        above = torch.stack(rows, -2)                                  # [.., i, C]
        rows.append(eye[..., i, :] - (A[..., i:i + 1, :i] @ above).squeeze(-2))
    return torch.stack(rows, -2)


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
    gc = chunk_gates(g, d, C, dev)                                     # [B, H, N, C, K|1]
    Qg = q * decay.query_decay(gc)                                     # e^{G_i}, ≤ 1
    Kdec = k * decay.key_decay(gc)                                     # e^{G_C − G_i}, summed from the end
    last = decay.total_decay(gc)[..., None].expand(d.B, d.H, gc.shape[2], d.K, 1)  # [B, H, N, K, 1]
    Aqk = decayed_scores(q, k, gc, strict=False)                       # [B, H, N, C, C]
    if not delta:
        return Factors(Qg, Kdec, last, Aqk, v_, None)
    U, W = wy_factors(k, v_, gc, to_chunks(beta.to(d.acc)[..., None], C)[..., 0])
    return Factors(Qg, Kdec, last, Aqk, U, W)


def wy_factors(k, v, g, beta):
    """U, W of one chunk (any leading dims): Ṽ = U − W S for every state S entering the chunk.

    k [.., C, K]; v [.., C, V]; g [.., C, K or 1] the chunk's raw log-gates; beta [.., C].
    (I + A) Ṽ = diag(β)(V − (K ⊙ e^G) S) with A_ij = β_i (k_i ⊙ e^{G_i − G_j}) · k_j for i > j.
    """
    b = beta[..., None]                                                # [.., C, 1]: β_i on row i
    A = b * decayed_scores(k, k, g, strict=True)                       # [.., C, C]
    Tinv = unit_lower_inverse(A)
    return Tinv @ (b * v), Tinv @ (b * k * decay.query_decay(g))      # [.., C, V], [.., C, K]


def state_pass(f: Factors, d, S, output_final_state, out_dtype):
    """Walk the chunks in order: residuals from the entering state, outputs, next state."""
    Sin, S = entering_states(f, S)                                     # [B, H, N, K, V]
    o = outputs.empty(f.U.shape[:4] + (d.V,), dtype=d.acc, device=f.Qg.device)
    o[:] = chunk_outputs(f, Sin, d.scale)
    return from_chunks(o, d.T).to(out_dtype), (S if output_final_state else None)


def entering_states(f: Factors, S):
    """The only sequential part: the state entering every chunk [B, H, N, K, V], and the last one.

    Per chunk two small matmuls, Ṽ = U − W S and S' = e^{G_C} S + Kdecᵀ Ṽ; the outputs, which
    need only the entering state, follow for all chunks at once (`chunk_outputs`).
    """
    entering = []
    for n in range(f.U.shape[2]):
        entering.append(S)
        Vt = f.U[:, :, n] if f.W is None else f.U[:, :, n] - f.W[:, :, n] @ S   # [B, H, C, V]
        S = f.last[:, :, n] * S + f.Kdec[:, :, n].transpose(-1, -2) @ Vt       # [B, H, K, V]
    return torch.stack(entering, 2), S


def residuals(f: Factors, Sin):
    """Ṽ = U − W S of every chunk [B, H, N, C, V], from the entering states Sin [B, H, N, K, V]."""
    return f.U if f.W is None else f.U - f.W @ Sin


def chunk_outputs(f: Factors, Sin, scale):
    """O = scale · (Qg S + Aqk Ṽ) of every chunk at once, [B, H, N, C, V]."""
    return scale * (f.Qg @ Sin + f.Aqk @ residuals(f, Sin))
