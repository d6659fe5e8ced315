"""The chunkwise backward of the delta rule, Gated DeltaNet and KDA (forward: linattn.chunk.delta).

Per chunk, with S the entering state, G the log-gates summed from the chunk start (per key
dimension, or one per head), Λ = e^G, Γ = e^{G_C − G}, γ = e^{G_C} and the forward

    A = diag(β) Akk,  Akk_ij = Σ_d k_id k_jd e^{G_id − G_jd} (i > j),   T = (I + A)⁻¹
    U = T diag(β) V,  W = T diag(β) (K ⊙ Λ),  Ṽ = U − W S
    O = scale (Qg S + Aqk Ṽ),  Qg = Q ⊙ Λ,    S' = γ S + Kdecᵀ Ṽ,  Kdec = K ⊙ Γ

the backward takes dO and the gradient dS' of the state leaving the chunk (for the last chunk the
incoming gradient of the final state, else zero), and runs in three parts.

1. Reverse pass over the chunks: the only sequential part. With dO scaled by `scale`,
       dṼ = Aqkᵀ dO + Kdec dS',        dS = Qgᵀ dO − Wᵀ dṼ + γ dS'
   where S enters through the query term, through Ṽ = U − W S and through the decay γ S.
   dS after the first chunk is the gradient of the initial state. The entering states S are
   recomputed by a forward pass over the chunk states (recompute=True) or kept by the forward.
2. Per chunk, all chunks at once: dQg = dO Sᵀ, dAqk = tril(dO Ṽᵀ), dKdec = Ṽ dS'ᵀ,
   dγ = Σ_v dS' ⊙ S, dU = dṼ, dW = −dṼ Sᵀ.
3. Through the WY/UT transform. For X = T Y with T = (I + A)⁻¹: dY = Tᵀ dX and, from
   dT = −T dA T, dA = −Tᵀ dX Yᵀ Tᵀ = −(Tᵀ dX) Xᵀ, kept on the strict lower triangle where A lives.
   So with dY_v = Tᵀ dU and dY_k = Tᵀ dW:  dA = −tril₋₁(dY_v Uᵀ + dY_k Wᵀ),  dv = β dY_v,
   dβ_i = dY_v,i · v_i + dY_k,i · (k_i ⊙ Λ_i) + Σ_j dA_ij Akk_ij,  and dAkk = diag(β) dA.

Scores and gates. Both score matrices have the form P_ij = Σ_d a_id b_jd e^{G_id − G_jd}; for a
gradient M = dP, da_i = Σ_j M_ij b_j ⊙ e^{G_i − G_j} and db_j = Σ_i M_ij a_i ⊙ e^{G_i − G_j} — the
same decayed products as the forward, computed with the same sub-chunk blocks
(linattn.chunk.delta.SubChunkGates), so the exponents are those of the forward. The
gate gradient never needs e^{−G} either: ∂P_ij/∂G_id = a_id (…) and ∂P_ij/∂G_jd = −b_jd (…) give
dG = a ⊙ da − b ⊙ db, and every factor of the form x ⊙ e^{…} contributes x ⊙ e^{…} ⊙ dx.
A term that depends on the prefix G_i (Λ_i, the scores) reaches the raw log-gates g_s with s ≤ i,
so those are summed in reverse inside each chunk, dg_s = Σ_{i ≥ s} dG_i; Γ_i = e^{Σ_{s>i} g_s}
reaches g_s with s > i (an exclusive prefix sum) and γ every gate of its chunk. Adding Γ's term as
+G_C − G_i instead would cancel: in float32 that leaves an error of O(ε) times the terms, large
against the tiny gate gradients of strong decays. For the same reason the diagonal of Aqk, which
carries no decay, is left out of dG. A per-head gate sums its gradient over K.

Memory. The forward keeps its inputs, the C×C matrices Aqk, Akk and T ([B, H, N, C, C] each) and
U, W (the size of v and k): recomputing them would cost most of a forward. The chunk states
[B, H, N, K, V] are kept only with recompute=False.
"""
from __future__ import annotations

import torch

from .. import outputs
from ..naive.linear import initial
from ..validate import autocast_off, first_order
from . import delta


class DeltaChunkFunction(torch.autograd.Function):
    """(q, k, v, g or None, beta, initial_state or None, dims, C, recompute) → (o, final state)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, d, C, recompute):
        f, Akk, Tm = delta.chunk_factors(q, k, v, g, beta, d, C, delta=True)
        Sin, S, Vt = delta.entering_states(f, initial(initial_state, d, q.device))
        o = outputs.empty((d.B, d.T, d.H, d.V), dtype=v.dtype, device=v.device)
        delta.write_outputs(o, f, Sin, Vt, d.scale)
        ctx.d, ctx.C = d, C
        # kept: the inputs and the C×C matrices and WY factors, whose recomputation would be most
        # of a forward; the chunk states only with recompute=False
        ctx.save_for_backward(q, k, v, g, beta, initial_state, f.Aqk, Akk, Tm, f.U, f.W,
                              None if recompute else Sin)
        return o, S

    @staticmethod
    @first_order("linattn.chunk.delta_rule / kda")  # kept factors have no graph: no 2nd derivative
    @autocast_off             # a backward called inside an autocast region computes as the forward did
    def backward(ctx, do, dS_final):
        q, k, v, g, beta, initial_state, *kept = ctx.saved_tensors
        grads = chunk_backward(q, k, v, g, beta, initial_state, kept, do, dS_final, ctx.d, ctx.C,
                               gate_grad_wanted=ctx.needs_input_grad[3])
        dq, dk, dv, dg, dbeta, dS0 = (
            None if x is None else _as_grad(x, ref)
            for x, ref in zip(grads, (q, k, v, g, beta, initial_state)))
        return dq, dk, dv, dg, dbeta, dS0, None, None, None


def _as_grad(x, like):
    """A gradient in its input's dtype, written into a buffer from outputs.empty."""
    out = outputs.empty(like.shape, dtype=like.dtype, device=like.device)
    out.copy_(x)
    return out


def chunk_backward(q, k, v, g, beta, initial_state, kept, do, dS_final, d, C,
                   gate_grad_wanted=True):
    """Gradients (dq, dk, dv, dg or None, dβ, dS₀ or None) in d.acc; see the module docstring.

    kept: Aqk, Akk, T [B, H, N, C, C], U, W and the entering states (None: recompute them) as the
    forward left them.
    """
    acc, dev = d.acc, q.device
    Aqk, Akk, Tm, U, W, Sin = kept
    qc, kc, vc = (delta.to_chunks(x.to(acc), C) for x in (q, k, v))   # [B, H, N, C, *]
    bc = delta.to_chunks(beta.to(acc)[..., None], C)                  # [B, H, N, C, 1]
    geo = delta.gate_geometry(None if g is None else delta.chunk_gates(g, d, C, dev))
    Lam, Gam, gam = geo.decays()                                      # None without gates
    Qg, Kl, Kdec = (delta.decayed(x, e) for x, e in ((qc, Lam), (kc, Lam), (kc, Gam)))  # [.., C, K]
    shape = (d.B, d.H, qc.shape[2], d.K, 1)
    last = qc.new_ones(shape) if gam is None else gam[..., None].expand(shape)   # [B, H, N, K, 1]
    f = delta.Factors(Qg, Kdec, last, Aqk, U, W)
    if Sin is None:                                                   # recompute=True
        Sin, _, Vt = delta.entering_states(f, initial(initial_state, d, dev))   # [B, H, N, K, V]
    else:
        Vt = delta.residuals(f, Sin)                                  # [B, H, N, C, V]

    # 1. reverse pass: dS' of every chunk and dṼ
    dO = delta.to_chunks((do if do is not None else torch.zeros_like(v)).to(acc), C) * d.scale
    X = Qg.transpose(-1, -2) @ dO                                     # [B, H, N, K, V]
    Y = Aqk.transpose(-1, -2) @ dO                                    # [B, H, N, C, V]
    dSout, dVt, dS = reverse_pass(X, Y, Kdec, W, last, dS_final, Sin)

    # 2. per-chunk factor gradients
    St = Sin.transpose(-1, -2)                                        # [B, H, N, V, K]
    dQg = dO @ St                                                     # [B, H, N, C, K]
    dAqk = dO @ Vt.transpose(-1, -2)                                  # [B, H, N, C, C]
    diag = dAqk.diagonal(0, -2, -1)[..., None].clone()                # [B, H, N, C, 1]
    dAqk.tril_(-1)    # the diagonal goes separately (below); above it Aqk is 0
    dKdec = Vt @ dSout.transpose(-1, -2)                              # [B, H, N, C, K]
    mdW = dVt @ St                                                    # −dW [B, H, N, C, K]

    # 3. through the WY/UT transform (signs: mdY_k = −dY_k, mdA = −dA)
    Tt = Tm.transpose(-1, -2)
    dYv, mdYk = Tt @ dVt, Tt @ mdW                                    # [.., C, V], [.., C, K]
    mdA = (dYv @ U.transpose(-1, -2)).sub_(mdYk @ W.transpose(-1, -2)).tril_(-1)   # [.., C, C]
    dv = bc * dYv
    dbeta = (dYv * vc).sum(-1) - (mdYk * Kl).sum(-1) - (mdA * Akk).sum(-1)   # [B, H, N, C]
    dKl = mdYk.mul_(-bc)                                              # [B, H, N, C, K]

    # scores: Aqk(q, k) and Akk(k, k). The diagonal of Aqk carries no decay (e^0), so it stays out
    # of the gate gradient: its two terms q⊙dq and −k⊙dk would cancel exactly in exact
    # arithmetic, but in float32 they leave an O(ε) error against a gate gradient that strong
    # decays make tiny.
    dq_s, dk_s = geo.grad(dAqk, qc, kc)
    dk_a, dk_b = geo.grad(mdA.mul_(-bc), kc, kc)
    dq = (dq_s + diag * kc).add_(delta.decayed(dQg, Lam))
    dk = (dk_s + diag * qc).add_(dk_a).add_(dk_b).add_(delta.decayed(dKl, Lam))
    dk.add_(delta.decayed(dKdec, Gam))
    dg = None
    if g is not None and gate_grad_wanted:
        dg = gate_grad(g, d, qc, kc, Qg, Kl, Kdec, gam, dq_s, dk_s, dk_a, dk_b, dQg, dKl, dKdec,
                       (dSout * Sin).sum(-1))
    return (delta.from_chunks(dq, d.T), delta.from_chunks(dk, d.T), delta.from_chunks(dv, d.T),
            dg, delta.from_chunks(dbeta[..., None], d.T)[..., 0],
            dS if initial_state is not None else None)


def reverse_pass(X, Y, Kdec, W, last, dS_final, Sin):
    """dS' (the gradient of the state leaving each chunk) [B, H, N, K, V], dṼ [B, H, N, C, V] and
    the gradient of the initial state, chunk by chunk from the last:
        dṼ = Y + Kdec dS',   dS = X − Wᵀ dṼ + γ dS'   (X = Qgᵀ dO, Y = Aqkᵀ dO, all chunks at once)."""
    B, H, N = X.shape[:3]
    X, Y, Kdec, W, last = (x.flatten(0, 1) for x in (X, Y, Kdec, W, last))   # [B·H, N, ...]
    dS = X.new_zeros(X[:, 0].shape) if dS_final is None else dS_final.to(X.dtype).flatten(0, 1)
    dSouts, dVts = [], []
    for n in reversed(range(N)):
        dSouts.append(dS)                                             # [B·H, K, V]
        dVt = torch.baddbmm(Y[:, n], Kdec[:, n], dS)                  # [B·H, C, V]
        dVts.append(dVt)
        dS = torch.baddbmm(X[:, n], W[:, n].transpose(-1, -2), dVt, alpha=-1).addcmul_(last[:, n], dS)
    unflat = (lambda xs: torch.stack(xs[::-1], 1).unflatten(0, (B, H)))
    return unflat(dSouts), unflat(dVts), dS.unflatten(0, (B, H))


def gate_grad(g, d, qc, kc, Qg, Kl, Kdec, gam, dq_s, dk_s, dk_a, dk_b, dQg, dKl, dKdec, dgam):
    """dg in g's shape from the gradients of everything the gates decay (module docstring).

    dq_s, dk_s: of Aqk without its diagonal; dk_a, dk_b: of Akk's two key sides; dQg, dKl,
    dKdec: of Q ⊙ Λ, K ⊙ Λ and K ⊙ Γ; dgam [B, H, N, K]: of γ, Σ_v dS' ⊙ S.
    """
    # dG_i for the terms that depend on the prefix G_i (they reach g_s, s ≤ i) ...
    dG = qc * dq_s
    dG.addcmul_(kc, (dk_a - dk_b).sub_(dk_s)).addcmul_(Qg, dQg).addcmul_(Kl, dKl)  # [B, H, N, C, K]
    KdK, dgam = Kdec * dKdec, gam * dgam                              # [.., C, K], [B, H, N, K]
    if g.dim() == 3:                                                  # one gate per head: sum over K
        dG, KdK, dgam = dG.sum(-1, keepdim=True), KdK.sum(-1, keepdim=True), dgam.sum(-1, keepdim=True)
    C = dG.shape[-2]
    ones = torch.ones(C, C, dtype=dG.dtype, device=dG.device)
    dgc = ones.triu() @ dG                                            # dg_s = Σ_{i ≥ s} dG_i
    # ... Γ_i = e^{Σ_{s > i} g_s} reaches g_s for s > i only: an exclusive prefix sum (added
    # directly rather than as +G_C −G_i, which would cancel) ...
    dgc.add_(ones.tril(-1) @ KdK)                                     # Σ_{i < s} Kdec_i ⊙ dKdec_i
    # ... and γ = e^{G_C} reaches every gate of the chunk
    dgc.add_(dgam[..., None, :])                                      # [B, H, N, C, K or 1]
    dg = delta.from_chunks(dgc, d.T)
    return dg[..., 0] if g.dim() == 3 else dg
