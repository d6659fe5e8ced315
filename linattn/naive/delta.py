"""The delta rule and its gated forms, token by token — the ground truth for chapters 06–08.

    DeltaNet          S_t = S_{t-1} + β_t k_tᵀ (v_t − k_t S_{t-1})
    Gated DeltaNet    S_t = D_t S_{t-1} + β_t k_tᵀ (v_t − k_t D_t S_{t-1}),  D_t = exp(g_t) I
    KDA               the same with D_t = diag(exp g_t), one log-decay per key dimension
    o_t = scale · q_t S_t

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; g [B, T, H] or [B, T, H, K];
state S [B, H, K, V].

Keys. The write is S ← (I − β kᵀk) S + β kᵀv; the transition I − β kᵀk has eigenvalue 1 − β‖k‖²
along k and 1 elsewhere. It stays a contraction only while β‖k‖² ≤ 2, which is why the models
L2-normalise their keys. `check_keys` rejects inputs that break that bound with an InputError
naming `k` (the recurrence would grow geometrically); `linattn.validate.value_checks(False)`
switches it off together with the other data-dependent checks (on GPU tensors they are off by
default; `value_checks(True)` turns them on).
"""
from __future__ import annotations

import torch

from .. import outputs, packing, validate
from ..validate import InputError, check_inputs
from .linear import initial

# Room for keys normalised in low precision: a bf16 unit vector has ‖k‖² = 1 ± a few 2⁻⁸.
KEY_SLACK = 2.0 ** -6


def check_keys(k, beta):
    """Raise InputError (naming `k`) unless β_t ‖k_t‖² ≤ 2 for every token and head."""
    if not validate.checking_values(k):  # a pass over k and β and a device sync: see value_checks
        return
    # float32 (float64 for float64 keys) is ample against the 1/64 slack, and a fraction of the cost;
    # vector_norm is one fused pass over k (on a 2-core CPU 0.09 ms against 0.22 for square().sum())
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    load = beta.to(acc) * torch.linalg.vector_norm(k, dim=-1, dtype=acc).square()   # [B, T, H]
    worst = load.max().item()
    if worst > 2.0 * (1.0 + KEY_SLACK):
        b, t, h = (int(i) for i in torch.unravel_index(load.argmax().cpu(), load.shape))
        raise InputError(
            f"k: the delta rule needs β_t‖k_t‖² ≤ 2 (L2-normalised keys, β ∈ [0, 2]); got "
            f"β‖k‖² = {worst:.4g} at batch {b}, token {t}, head {h}, ‖k‖ = "
            f"{k[b, t, h].double().norm().item():.4g}. Normalise the keys, e.g. "
            "F.normalize(k, dim=-1); linattn.validate.value_checks(False) skips this check.")


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None):
    """DeltaNet: S_t = S_{t-1} + β_t k_tᵀ (v_t − k_t S_{t-1}), o_t = scale · q_t S_t."""
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence(delta_rule, dict(q=q, k=k, v=v, beta=beta), cu_seqlens,
                                    scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state)
    d = check_inputs(q, k, v, beta=beta, scale=scale, initial_state=initial_state, delta=True)
    check_keys(k, beta)
    return _recurrence(q, k, v, None, beta, d, initial_state, output_final_state)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None):
    """KDA ([B,T,H,K] gates) / Gated DeltaNet ([B,T,H] gates):
    S_t = D_t S_{t-1} + β_t k_tᵀ (v_t − k_t D_t S_{t-1}), D_t = diag(exp g_t)."""
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence(kda, dict(q=q, k=k, v=v, g=g, beta=beta), cu_seqlens,
                                    scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state)
    d = check_inputs(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                     gate=True, delta=True)
    check_keys(k, beta)
    return _recurrence(q, k, v, g, beta, d, initial_state, output_final_state)


def _recurrence(q, k, v, g, beta, d, initial_state, output_final_state):
    q, k, v_, beta = (x.to(d.acc) for x in (q, k, v, beta))
    if g is not None:
        g = g.to(d.acc)
        g = g[..., None] if g.dim() == 3 else g                        # [B, T, H, K or 1]
    S = initial(initial_state, d, q.device)                           # [B, H, K, V]
    o = outputs.empty((d.B, d.T, d.H, d.V), dtype=d.acc, device=q.device)
    for t in range(d.T):
        if g is not None:
            S = g[:, t, :, :, None].exp() * S                          # decay first: D_t S_{t-1}
        kt = k[:, t]                                                   # [B, H, K]
        r = v_[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)            # residual vs the decayed state
        S = S + beta[:, t, :, None, None] * kt[..., None] * r[:, :, None, :]
        o[:, t] = d.scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o.to(v.dtype), (S if output_final_state else None)
