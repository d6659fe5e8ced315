"""The input options FLA's users pass to its kernels, in one place: an L2 norm of q and k, the gate
computed from raw logits and (A_log, dt_bias) with an optional lower bound, and β from logits.

    linattn.kda(q, k, v, g_raw, beta_logits, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)

computes what FLA 0.6.0's `chunk_kda` computes with the same flags (its formulas, eps included):

    q, k  ← x / sqrt(Σ_K x² + 1e-6)                                  use_qk_l2norm_in_kernel
    g     ← −exp(A_log) · softplus(g + dt_bias)                       use_gate_in_kernel
    g     ← lower_bound · sigmoid(exp(A_log) · (g + dt_bias))         … with lower_bound (A_log optional)
    β     ← sigmoid(β), or 2 · sigmoid(β) with allow_neg_eigval       use_beta_sigmoid_in_kernel

A_log is [H]; dt_bias is [H, K] or [H·K] for per-dimension gates (KDA), [H] for per-head gates
(Gated DeltaNet). The gate is computed in float32 (the kernels read float32 gates exactly), q and k
keep their dtype. Here the options run as PyTorch operations before whichever level computes the
recurrence — the same numbers and gradients at every level, and the same as doing it outside;
FLA fuses them into its kernels to save memory traffic, which the Triton level does not do yet.
`linattn.delta_rule` takes the norm and β options, `linattn.kda` all of them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .validate import InputError

L2NORM_EPS = 1e-6                      # FLA's l2norm_fwd default
OPTIONS = {
    "delta_rule": ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval"),
    "kda": ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias", "lower_bound",
            "use_beta_sigmoid_in_kernel", "allow_neg_eigval"),
}


def split(op: str, kwargs: dict) -> tuple[dict, dict]:
    """(the input options of `op` found in kwargs, the other keywords)."""
    names = OPTIONS.get(op, ())
    return ({n: kwargs[n] for n in names if n in kwargs}, {n: x for n, x in kwargs.items() if n not in names})


def apply(op: str, q, k, g, beta, o: dict):
    """(q, k, g, beta) after the options o (`split`; `g` is None for delta_rule). Checks them first."""
    _check_flags(o)
    if o.get("use_qk_l2norm_in_kernel"):
        q, k = l2norm(q), l2norm(k)
    if op == "kda":
        if o.get("use_gate_in_kernel"):
            g = gate(g, o.get("A_log"), o.get("dt_bias"), o.get("lower_bound"))
        else:
            for name in ("A_log", "dt_bias", "lower_bound"):
                if o.get(name) is not None:
                    raise InputError(f"{name}: given without use_gate_in_kernel=True; it is used only "
                                     "to compute the gate from raw logits")
    if o.get("use_beta_sigmoid_in_kernel"):
        beta = beta_from_logits(beta, bool(o.get("allow_neg_eigval")))
    elif o.get("allow_neg_eigval"):
        raise InputError("allow_neg_eigval: takes effect only with use_beta_sigmoid_in_kernel=True "
                         "(β = 2·sigmoid(logits)); pass β in [0, 2) yourself otherwise")
    return q, k, g, beta


def _check_flags(o):
    for name in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                 "allow_neg_eigval"):
        if name in o and not isinstance(o[name], bool):
            raise InputError(f"{name} must be True or False, got {o[name]!r}")


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σ_K x² + 1e-6) along the last dim, in float32 (float64 for float64 x), x's dtype."""
    w = x.to(_wide(x.dtype))
    return (w * torch.rsqrt((w * w).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def beta_from_logits(beta: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """sigmoid(β), or 2·sigmoid(β) (eigenvalues of I − β k kᵀ down to −1)."""
    b = torch.sigmoid(beta)
    return 2 * b if allow_neg_eigval else b


def gate(g: torch.Tensor, A_log, dt_bias, lower_bound) -> torch.Tensor:
    """Log-gates from raw logits g ([B,T,H,K] or [B,T,H]), float32 (float64 for float64 g)."""
    if not torch.is_tensor(g):
        raise InputError("g: with use_gate_in_kernel=True, g must be the raw gate logits, a tensor")
    per_dim = g.dim() == 4
    H = g.shape[2]
    K = g.shape[3] if per_dim else None
    wide = _wide(g.dtype)
    x = g.to(wide)
    if dt_bias is not None:
        x = x + _bias(dt_bias, H, K, g.device).to(wide)
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) or not (
                math.isfinite(lower_bound) and lower_bound < 0):
            raise InputError(f"lower_bound must be a finite negative number (the smallest log-gate), "
                             f"got {lower_bound!r}")
        if A_log is not None:
            x = _rate(A_log, H, per_dim, wide, g.device) * x
        return lower_bound * torch.sigmoid(x)
    if A_log is None:
        raise InputError("A_log: use_gate_in_kernel=True computes g = −exp(A_log)·softplus(g + dt_bias) "
                         "and needs A_log [H] (or lower_bound for lower_bound·sigmoid(g + dt_bias))")
    return -_rate(A_log, H, per_dim, wide, g.device) * F.softplus(x)


def _wide(dtype):
    """The dtype the options compute in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rate(A_log, H, per_dim, wide, device):
    """exp(A_log) [H], checked, shaped to broadcast over [B, T, H(, K)]."""
    if not torch.is_tensor(A_log) or A_log.shape != (H,):
        raise InputError(f"A_log must be a tensor of shape [H] = [{H}], got "
                         f"{tuple(A_log.shape) if torch.is_tensor(A_log) else type(A_log).__name__}")
    if A_log.device != device:
        raise InputError(f"A_log is on {A_log.device}, g on {device}")
    return A_log.to(wide).exp().view((1, 1, -1, 1) if per_dim else (1, 1, -1))


def _bias(dt_bias, H, K, device):
    want = ((H, K), (H * K,)) if K is not None else ((H,),)
    if not torch.is_tensor(dt_bias) or tuple(dt_bias.shape) not in want:
        shapes = " or ".join(str(list(s)) for s in want)
        raise InputError(f"dt_bias must be a tensor of shape {shapes}, got "
                         f"{tuple(dt_bias.shape) if torch.is_tensor(dt_bias) else type(dt_bias).__name__}")
    if dt_bias.device != device:
        raise InputError(f"dt_bias is on {dt_bias.device}, g on {device}")
    return dt_bias.reshape(H, K) if K is not None else dt_bias
