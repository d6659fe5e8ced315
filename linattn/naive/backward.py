"""The backward pass, token by token: the reverse-time recurrences of chapter 12.

Each forward recurrence S_t = F(S_{t-1}, inputs_t), o_t = scale · q_t S_t is walked backwards,
t = T−1 … 0, carrying dS — the gradient of the loss with respect to the state S_t (K × V, like
S itself). At step t it first collects the read o_t = scale · q_t S_t, then hands dS through F to
the inputs of step t and to S_{t−1}:

    linear / GLA   S_t = diag(a_t) S_{t−1} + k_tᵀ v_t,  a_t = exp g_t (a_t = 1: linear attention)
        dS   += scale · q_tᵀ do_t          dq_t = scale · do_t S_tᵀ
        dk_t  = v_t dSᵀ                    dv_t = k_t dS
        dg_t  = a_t ⊙ rowsum(S_{t−1} ⊙ dS) (one log-gate per key row; summed over rows per head)
        dS    ← diag(a_t) dS               (the gradient of S_{t−1})

    delta rule / KDA   S' = D_t S_{t−1},  r_t = v_t − k_t S',  S_t = S' + β_t k_tᵀ r_t
        dβ_t = k_t dS r_tᵀ,  dk_t(write) = β_t r_t dSᵀ,  dr = β_t k_t dS = dv_t
        dk_t(read) = −dr S'ᵀ,  dS' = dS − k_tᵀ dr,  dg_t = rowsum(S' ⊙ dS'),  dS ← D_t dS'

The recurrence needs the states S_t; they are recomputed here by a forward walk and kept, T + 1
of them (O(T K V) memory: a reference for small sizes, like the rest of this level). The walk
ends with dS = the gradient of the initial state. An incoming gradient on the final state
(`dfinal_state`, when the forward returned it) is where dS starts instead of zero.

The gate gradient has a second, cheaper form that needs no state at all (`gate_grad_closed_form`,
seed 001, the GLA paper): with b_t = g_1 + … + g_t the cumulative log-gate,

    ∂L/∂b_t = q_t ⊙ dq_t − k_t ⊙ dk_t,     dg_t = Σ_{s ≥ t} ∂L/∂b_s  (a suffix sum)

Sign convention: the gates are log-decays g ≤ 0 and the decay from key j to query i is
exp(b_i − b_j), so b enters with + on the query side and − on the key side. (Seed 001's display
equation writes k ⊙ dk − q ⊙ dq, the gradient with respect to −b; its code comment has ours.)

Every function takes the forward's arguments plus `do` [B, T, H, V] and returns a dict of
gradients, each in its input's dtype (None for an initial state that was not given).
"""
from __future__ import annotations

import torch

from .. import decay, packing
from ..validate import InputError, check_inputs
from .linear import initial


def linear_attn_backward(q, k, v, do, *, scale=None, initial_state=None, dfinal_state=None,
                         cu_seqlens=None):
    """dq, dk, dv, dinitial_state of o_t = scale · q_t S_t, S_t = S_{t−1} + k_tᵀ v_t."""
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence_grads(linear_attn_backward, dict(q=q, k=k, v=v), do, cu_seqlens,
                                          scale=scale, initial_state=initial_state,
                                          dfinal_state=dfinal_state)
    d = check_inputs(q, k, v, scale=scale, initial_state=initial_state)
    grads = _gated_walk(q, k, v, None, do, d, initial_state, dfinal_state)
    return _typed(grads, q=q, k=k, v=v, initial_state=initial_state)


def gla_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None,
                 cu_seqlens=None):
    """dq, dk, dv, dg (from the recurrence), dinitial_state of GLA; g [B,T,H] or [B,T,H,K]."""
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence_grads(gla_backward, dict(q=q, k=k, v=v, g=g), do, cu_seqlens,
                                          scale=scale, initial_state=initial_state,
                                          dfinal_state=dfinal_state)
    d = check_inputs(q, k, v, g=g, scale=scale, initial_state=initial_state, gate=True)
    grads = _gated_walk(q, k, v, g, do, d, initial_state, dfinal_state)
    return _typed(grads, q=q, k=k, v=v, g=g, initial_state=initial_state)


def delta_rule_backward(q, k, v, beta, do, *, scale=None, initial_state=None, dfinal_state=None,
                        cu_seqlens=None):
    """dq, dk, dv, dbeta, dinitial_state of DeltaNet (and dk_read, the part of dk from k_t S')."""
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence_grads(delta_rule_backward, dict(q=q, k=k, v=v, beta=beta), do,
                                          cu_seqlens, scale=scale, initial_state=initial_state,
                                          dfinal_state=dfinal_state)
    d = check_inputs(q, k, v, beta=beta, scale=scale, initial_state=initial_state, delta=True)
    grads = _delta_walk(q, k, v, None, beta, do, d, initial_state, dfinal_state)
    return _typed(grads, q=q, k=k, v=v, beta=beta, initial_state=initial_state)


def kda_backward(q, k, v, g, beta, do, *, scale=None, initial_state=None, dfinal_state=None,
                 cu_seqlens=None):
    """KDA ([B,T,H,K] gates) / Gated DeltaNet ([B,T,H]): the delta rule's gradients plus dg."""
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence_grads(kda_backward, dict(q=q, k=k, v=v, g=g, beta=beta), do,
                                          cu_seqlens, scale=scale, initial_state=initial_state,
                                          dfinal_state=dfinal_state)
    d = check_inputs(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                     gate=True, delta=True)
    grads = _delta_walk(q, k, v, g, beta, do, d, initial_state, dfinal_state)
    return _typed(grads, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)


def gate_grad_closed_form(q, k, dq, dk, g, *, dk_read=None, final_state=None, dfinal_state=None):
    """dg without states: ∂L/∂b_t = q_t ⊙ dq_t − k_t ⊙ dk_t, then a suffix sum over t.

    Why it holds: absorb the decay into the inputs, q̂_t = q_t ⊙ e^{b_t}, k̃_t = k_t ⊙ e^{−b_t},
    S̃_t = diag(e^{−b_t}) S_t. Then S̃_t = S̃_{t−1} + k̃_tᵀ v_t and o_t = scale · q̂_t S̃_t: b_t
    appears only in q̂_t and k̃_t, and x ⊙ ∂L/∂x is the same for x and its rescaled copy.
    In the delta rule k_t has a second role, the read k_t S' = (k_t ⊙ e^{b_t}) S̃_{t−1}, which
    enters with +: pass its part of dk as `dk_read`. A final state handed on with a gradient
    adds rowsum(S_T ⊙ dS_T) at the last step (S_T = diag(e^{b_T}) S̃_T).
    Shapes: q, k, dq, dk [B, T, H, K]; g [B, T, H] (the result is summed over K) or [B, T, H, K].
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, dq, dk = (x.to(acc) for x in (q, k, dq, dk))
    db = q * dq - k * dk                                               # [B, T, H, K]
    if dk_read is not None:                                            # + k ⊙ dk_read − k ⊙ dk_write
        db = db + 2 * k * dk_read.to(acc)
    if dfinal_state is not None:
        if final_state is None:
            raise InputError("final_state: needed with dfinal_state (the term rowsum(S_T ⊙ dS_T))")
        db[:, -1] += (final_state.to(acc) * dfinal_state.to(acc)).sum(-1)  # [B, H, K]
    dg = db.flip(1).cumsum(1).flip(1)                                  # Σ_{s ≥ t}: inclusive suffix
    return (dg.sum(-1) if g.dim() == 3 else dg).to(g.dtype)


def states(q, k, v, g, beta, d, initial_state):
    """The forward walk, keeping every state: [T + 1, B, H, K, V], S_0 first (in d.acc)."""
    k, v = k.to(d.acc), v.to(d.acc)
    a = None if g is None else decay.per_dim(g, q).to(d.acc).exp()    # [B, T, H, K or 1]
    S = [initial(initial_state, d, q.device)]
    for t in range(d.T):
        prev = S[-1] if a is None else a[:, t, :, :, None] * S[-1]     # D_t S_{t−1}
        kt = k[:, t, :, :, None]                                       # [B, H, K, 1]
        if beta is None:
            S.append(prev + kt * v[:, t, :, None, :])
        else:
            r = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], prev)  # [B, H, V]
            S.append(prev + beta[:, t, :, None, None].to(d.acc) * kt * r[:, :, None, :])
    return torch.stack(S)


def _gated_walk(q, k, v, g, do, d, initial_state, dfinal_state):
    _check_do(do, d)
    S = states(q, k, v, g, None, d, initial_state)                    # [T+1, B, H, K, V]
    q, k, v, do = (x.to(d.acc) for x in (q, k, v, do))
    a = None if g is None else decay.per_dim(g, q).to(d.acc).exp()    # [B, T, H, K or 1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg = None if g is None else torch.empty_like(q)                   # per dimension; summed later
    dS = _start(dfinal_state, d, q.device)                            # [B, H, K, V]
    for t in reversed(range(d.T)):
        dS = dS + d.scale * q[:, t, :, :, None] * do[:, t, :, None, :]  # the read o_t = scale q_t S_t
        dq[:, t] = d.scale * torch.einsum("bhv,bhkv->bhk", do[:, t], S[t + 1])
        dk[:, t] = torch.einsum("bhv,bhkv->bhk", v[:, t], dS)
        dv[:, t] = torch.einsum("bhk,bhkv->bhv", k[:, t], dS)
        if a is not None:
            at = a[:, t, :, :, None]                                   # [B, H, K or 1, 1]
            dg[:, t] = (at * S[t] * dS).sum(-1)                        # ∂/∂g of exp(g) · S_{t−1}
            dS = at * dS                                               # dS_{t−1}
    out = dict(dq=dq, dk=dk, dv=dv, dinitial_state=dS if initial_state is not None else None)
    if g is not None:
        out["dg"] = dg.sum(-1) if g.dim() == 3 else dg
    return out


def _delta_walk(q, k, v, g, beta, do, d, initial_state, dfinal_state):
    _check_do(do, d)
    S = states(q, k, v, g, beta, d, initial_state)                    # [T+1, B, H, K, V]
    q, k, v, beta, do = (x.to(d.acc) for x in (q, k, v, beta, do))
    a = None if g is None else decay.per_dim(g, q).to(d.acc).exp()    # [B, T, H, K or 1]
    dq, dk, dk_read, dv = (torch.empty_like(x) for x in (q, k, k, v))
    dbeta = torch.empty_like(beta)
    dg = None if g is None else torch.empty_like(q)
    dS = _start(dfinal_state, d, q.device)
    for t in reversed(range(d.T)):
        at = None if a is None else a[:, t, :, :, None]               # [B, H, K or 1, 1]
        prev = S[t] if at is None else at * S[t]                       # S' = D_t S_{t−1}
        kt, bt = k[:, t], beta[:, t, :, None]                          # [B, H, K], [B, H, 1]
        r = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, prev)          # [B, H, V] residual
        dS = dS + d.scale * q[:, t, :, :, None] * do[:, t, :, None, :]
        dq[:, t] = d.scale * torch.einsum("bhv,bhkv->bhk", do[:, t], S[t + 1])
        dSr = torch.einsum("bhkv,bhv->bhk", dS, r)                     # dS r_tᵀ: [B, H, K]
        dbeta[:, t] = (kt * dSr).sum(-1)
        dr = bt * torch.einsum("bhk,bhkv->bhv", kt, dS)                # [B, H, V]
        dv[:, t] = dr
        dk_read[:, t] = -torch.einsum("bhv,bhkv->bhk", dr, prev)
        dk[:, t] = bt * dSr + dk_read[:, t]
        dS = dS - kt[..., None] * dr[:, :, None, :]                    # dS' (through the residual)
        if at is not None:
            dg[:, t] = (prev * dS).sum(-1)                             # ∂/∂g of exp(g) · S_{t−1}
            dS = at * dS                                               # dS_{t−1}
    out = dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta, dk_read=dk_read,
               dinitial_state=dS if initial_state is not None else None)
    if g is not None:
        out["dg"] = dg.sum(-1) if g.dim() == 3 else dg
    return out


def _check_do(do, d):
    if not isinstance(do, torch.Tensor) or tuple(do.shape) != (d.B, d.T, d.H, d.V):
        raise InputError(f"do must be a tensor of the output's shape [B, T, H, V] = "
                         f"{[d.B, d.T, d.H, d.V]}, got {getattr(do, 'shape', type(do).__name__)}")


def _start(dfinal_state, d, device):
    """dS at the end of the sequence: the incoming final-state gradient, or zero."""
    if dfinal_state is None:
        return torch.zeros(d.B, d.H, d.K, d.V, dtype=d.acc, device=device)
    if tuple(dfinal_state.shape) != (d.B, d.H, d.K, d.V):
        raise InputError(f"dfinal_state must have shape [B, H, K, V] = {[d.B, d.H, d.K, d.V]}, "
                         f"got {tuple(dfinal_state.shape)}")
    return dfinal_state.to(d.acc)


def _typed(grads, **inputs):
    """Each gradient in its input's dtype (dk_read follows k)."""
    like = {"dk_read": "k"}
    return {n: None if x is None else x.to(inputs[like.get(n, n[1:])].dtype) for n, x in grads.items()}
