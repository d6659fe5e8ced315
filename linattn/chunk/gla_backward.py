"""The chunkwise backward of gated linear attention (GLA, scalar decay, plain linear attention).

Inside chunk n (positions t = 1..C, b_t the log-gates summed from the chunk start, Λ, Γ, γ as in
`linattn.decay`, Q̂ = scale · Q) the forward is
    O = P V + (Q̂ ⊙ Λ) S_[n-1],   P_ij = Σ_κ q̂_iκ k_jκ exp(b_iκ − b_jκ) (i ≥ j),
    S_[n] = diag(γ) S_[n-1] + (K ⊙ Γ)ᵀ V.
Given dO and dS_[n] (the gradient reaching the state *after* chunk n), the backward is
    dS_[n-1] = diag(γ) dS_[n] + (Q̂ ⊙ Λ)ᵀ dO                       reverse pass over chunk states
    dP  = tril(dO Vᵀ)
    dV  = Pᵀ dO + (K ⊙ Γ) dS_[n]
    dQ̂_i = Σ_{j ≤ i} dP_ij k_j ⊙ exp(b_i − b_j) + Λ_i ⊙ (dO_i S_[n-1]ᵀ)
    dK_j = Σ_{i ≥ j} dP_ij q̂_i ⊙ exp(b_i − b_j) + Γ_j ⊙ (V_j dS_[n]ᵀ)
The reverse pass starts from the incoming gradient of the final state and ends at the gradient
of the initial state. The intra-chunk sums use the forward's absorption and secondary chunking
(`gla_tiles`): blocks below the diagonal are matmuls whose decay is split at the block boundary so
that both exponents are ≤ 0, the split repeated inside the diagonal tiles down to single tokens;
dQ̂ is the forward's tile product with dP for P and K for V, dK the same with the blocks transposed.

Gate gradient, in closed form. Every quantity of chunk n depends on its gates only through b_t:
q̂_t enters as q̂_t ⊙ e^{b_t}, k_t as k_t ⊙ e^{−b_t} and the state after the chunk carries
e^{b_C}. Hence (sign convention: db_t = ∂L/∂b_t, dg_s = ∂L/∂g_s, g the log-decay ≤ 0)
    db_t = q̂_t ⊙ dq̂_t − k_t ⊙ dk_t + [t = C] Σ_v (S_[n] ⊙ dS_[n])[:, v],
    dg_s = Σ_{t ≥ s, t in the chunk} db_t                        a reverse cumulative sum,
with dq̂, dk the full gradients above. The last term is the γ-decay of everything the state holds
at the chunk's end, S_[n-1] (the initial state for n = 1) included; it is paired with the
incoming state gradient dS_[n] (the final-state gradient for the last chunk). The suffix sum
runs inside each chunk only, over C terms: the same sum taken over the whole sequence would add up
T terms that largely cancel. Per-head gates: the per-dimension gradient summed over K.

Precision: the backward computes in the accumulation dtype (float32, float64 for float64 inputs)
without rounding matmul operands to `inter_dtype` (the chunk states it reads are the forward's,
rounding included); gradients are returned in each input's dtype.
"""
from __future__ import annotations

import torch

from .. import decay, outputs
from ..naive.linear import initial
from ..validate import autocast_off, first_order
from . import gla_tiles
from .gated import _state_pass, chunk_decays, dense_chunks, forward, scan_


class ChunkwiseGated(torch.autograd.Function):
    """(q, k, v, g or None, initial_state or None, plan) → (o, final state); chunkwise both ways."""

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, plan):
        o, S, Sin = forward(q, k, v, g, initial_state, plan, keep_states=not plan.recompute)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        kept = () if plan.recompute else (Sin, S)                    # recompute=False: keep the states
        ctx.save_for_backward(q, k, v, g, initial_state, *kept)
        return o, S

    @staticmethod
    @first_order("linattn.chunk.gla / linear_attn")
    @autocast_off             # a backward called inside an autocast region computes as the forward did
    def backward(ctx, do, dS_final):
        q, k, v, g, initial_state, *kept = ctx.saved_tensors
        return (*gradients(q, k, v, g, initial_state, do, dS_final, ctx.plan, kept), None)


def gradients(q, k, v, g, initial_state, do, dS_final, plan, kept=()):
    """dq, dk, dv, dg, d initial_state (None where not needed) for the incoming do, dS_final.

    Buffers are updated in place where the algebra allows: on a CPU a fresh buffer of a few
    MB can cost page faults comparable to the arithmetic done on it."""
    d, C = plan.d, plan.C
    dev = q.device
    qc = dense_chunks(q, C, d.acc).mul_(d.scale)                      # [B, H, N, C, K]  Q̂
    kc = dense_chunks(k, C, d.acc)                                    # [B, H, N, C, K]
    vc = dense_chunks(v, C, d.acc)                                    # [B, H, N, C, V]
    gc = None if g is None else dense_chunks(g, C, d.acc)             # [B, H, N, C] or [.., C, K]
    doc = dense_chunks(do, C, d.acc) if do is not None else torch.zeros_like(vc)  # [B, H, N, C, V]
    # Intra-chunk tiles first (dP needs nothing else; per-dimension gates then also give Λ, Γ, γ).
    # The diagonal of dP (i = j, decay 1) is kept apart: in the gate gradient its terms cancel
    # exactly (q̂_i dP_ii k_i − k_i dP_ii q̂_i), so they are never added in.
    dP = (doc @ vc.transpose(-1, -2)).tril_(-1)                       # [B, H, N, C, C] i > j
    dP_ii = torch.linalg.vecdot(doc, vc).unsqueeze(-1)                # [B, H, N, C, 1]
    sweep = None
    if gc is None or gc.dim() == qc.dim() - 1:
        # No gate or scalar gates: the decay factors out, P = (Q̂ Kᵀ) ⊙ D.
        D = decay.causal_mask(C, qc.dtype, dev) if gc is None else decay.decay_mask(gc).to(d.acc)  # [C, C]
        P = (qc @ kc.transpose(-1, -2)).mul_(D)                       # [B, H, N, C, C]
        dP.mul_(D)                                                    # [B, H, N, C, C]  dP ⊙ D
        dq_in, dk_in = dP @ kc, dP.transpose(-1, -2) @ qc             # [B, H, N, C, K] each, j < i
    else:
        # The forward's tiles (gla_tiles): blocks split at their boundary, factors ≤ 1.
        sweep = gla_tiles.Sweep(gc.exp())
        P, dq_in, dk_in = gla_tiles.intra_backward(dP, qc, kc, sweep)  # [.., C, C], [.., C, K] ×2
    del dP
    fast = None if gc is None else decay.split(decay.per_dim(gc, qc), plan.mm)
    if gc is None:
        lam = Gam = torch.ones((), dtype=d.acc, device=dev)           # no decay
        gam = None
    elif fast is not None:                                            # the forward's split factors
        lam, inv, gam = fast                                          # Λ, e^{−b} [.., C, K or 1], γ
        Gam = inv * gam[..., None, :]
    elif sweep is None:
        lam, Gam, gam = chunk_decays(gc, qc)                          # Λ, Γ [B, H, N, C, 1], γ
    else:
        lam, Gam, gam = sweep.query, sweep.key, sweep.total           # [B, H, N, C, K], [.., K]

    # The chunk states: kept by the forward, or recomputed (one matmul per chunk and a short loop)
    # exactly as the forward computed them, operand rounding included: both give one gradient.
    k_abs = kc * Gam if fast is None else (kc * inv).mul_(gam[..., None, :])  # [B, H, N, C, K]  K ⊙ Γ
    if kept:
        Sin, S_last = kept                                            # [B, H, N, K, V], [B, H, K, V]
    else:
        Sin, S_last = _state_pass(k_abs, vc, gam, initial(initial_state, d, dev), plan.mm)

    # Reverse pass over the chunk states: dS_out[n], the gradient of the state after chunk n,
    # overwrites (Q̂ ⊙ Λ)ᵀ dO in place; what is left at the start is the initial state's gradient.
    dS_out = (qc * lam).transpose(-1, -2) @ doc                       # [B, H, N, K, V]  (Q̂ ⊙ Λ)ᵀ dO
    dS = torch.zeros_like(S_last) if dS_final is None else dS_final.to(d.acc)  # [B, H, K, V]
    dS0 = scan_(dS_out, gam, dS, reverse=True)                        # [B, H, K, V]

    dv = (P.transpose(-1, -2) @ doc).add_(k_abs @ dS_out)             # [B, H, N, C, V]
    del P, k_abs
    read = (doc @ Sin.transpose(-1, -2)).mul_(lam)                    # [B, H, N, C, K]  from S_[n-1]
    write = (vc @ dS_out.transpose(-1, -2)).mul_(Gam)                 # [B, H, N, C, K]  into S_[n]
    dq_in.add_(read)                                                  # dQ̂ without dP's diagonal
    dg = None
    if g is not None and g.requires_grad:
        dg = gate_gradient(qc, kc, dq_in, dk_in, write, Sin, dS_out, gam, gc)
    dqc = dq_in.addcmul_(dP_ii, kc).mul_(d.scale)                     # [B, H, N, C, K]  dQ = scale · dQ̂
    dkc = dk_in.add_(write).addcmul_(dP_ii, qc)                       # [B, H, N, C, K]

    grads = [_out(dqc, q, d.T), _out(dkc, k, d.T), _out(dv, v, d.T), None, None]
    if dg is not None:
        grads[3] = _out(dg, g, d.T)
    if initial_state is not None and initial_state.requires_grad:
        dS0_out = outputs.empty(tuple(initial_state.shape), dtype=initial_state.dtype, device=dev)
        dS0_out[:] = dS0
        grads[4] = dS0_out
    return grads


def gate_gradient(qc, kc, dq_read, dk_in, write, Sin, dS_out, gam, gc):
    """dg [B, H, N, C, K] (or [B, H, N, C] per head) from the pieces of dQ̂ and dK, chunk by chunk.

    dq_read = dq̂^{j<t} + read_t (dQ̂ without dP's diagonal), dk_in = dk^{i>t} (the intra part
    without it), write_t = Γ_t ⊙ (v_t dS_[n]ᵀ) (the part through the state after the chunk).
    The closed form, dg_s = Σ_{t ≥ s} (q̂_t ⊙ dq̂_t − k_t ⊙ dk_t) + Σ_v S_[n] ⊙ dS_[n], is evaluated
    without its cancelling terms: the diagonal of dP is left out of dq̂ and dk (it cancels term by
    term), and since S_[n] = diag(γ) S_[n-1] + Σ_j (k_j ⊙ Γ_j)ᵀ v_j, the state term minus the
    write part of Σ_{t ≥ s} k_t ⊙ dk_t leaves the writes *before* s: an exclusive prefix sum.
        dg_s = Σ_{t ≥ s} (q̂_t ⊙ dq_read_t − k_t ⊙ dk_in_t)
             + Σ_v (diag(γ) S_[n-1] ⊙ dS_[n]) + Σ_{j < s} k_j ⊙ write_j.
    Under strong gates the true gradient is tiny where the raw closed form subtracts O(1) numbers.
    """
    db = (qc * dq_read).addcmul_(kc, dk_in, value=-1)                 # [B, H, N, C, K]
    dg = db.flip(-2).cumsum_(-2).flip(-2)                             # Σ_{t ≥ s}
    kw = (kc * write).cumsum_(-2)                                     # [B, H, N, C, K]  Σ_{j ≤ s}
    dg[..., 1:, :] += kw[..., :-1, :]                                 # Σ_{j < s}: shifted, not cumsum − kw
    carried = torch.linalg.vecdot(Sin, dS_out)                        # [B, H, N, K]  Σ_v S_[n-1] ⊙ dS_[n]
    if gam is not None:
        carried = carried * gam                                       # diag(γ) S_[n-1]
    dg += carried[:, :, :, None, :]                                   # same for every s in the chunk
    return dg.sum(-1) if gc.dim() == qc.dim() - 1 else dg


def _out(x, like, T):
    """A chunked gradient [B, H, N, C, ...] → a new buffer shaped and typed like the input."""
    out = outputs.empty(tuple(like.shape), dtype=like.dtype, device=like.device)
    out[:] = decay.unchunked(x, T)
    return out
