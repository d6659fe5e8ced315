"""Data-dependent forget gates, produced in log space.

The GLA paper's gate (Yang et al., seed 002): §3.1 defines α_t = σ(x_t W_α + b_α) with a temperature
τ, and its footnote applies τ in log space, log α_t = log σ(·) / 16 — the 16th root of a sigmoid stays
near 1 (σ saturates fast), so the state remembers long. §3.4 (the GLA-Transformer) makes W_α low-rank,
W_α¹ W_α² of shapes d×16 and 16×d_k, so the gate costs O(d·16 + 16·d_k) parameters instead of
O(d·d_k), and drops the value-side gate (β_t = 1). The kernels take log-decays:

    log α_t = logsigmoid(x_t W₁ W₂ + b) / τ   ≤ 0

logsigmoid never rounds to log 0 = −inf the way log(sigmoid(·)) does for large negative inputs, and
nothing is exponentiated here: the kernels exp only differences of cumulative sums.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TAU = 16.0
RANK = 16
# Bias of the gate at initialisation: log α = logsigmoid(4)/16 ≈ −0.0011 per token, a memory
# half-life of about 600 tokens. A model starts out remembering (as an ungated layer would) and
# learns where to forget; with b = 0 the half-life is 16 tokens, and a model that cannot yet
# retrieve anything gets little gradient telling it to keep its state longer.
GATE_BIAS = 4.0


def log_gate(z, tau: float = TAU):
    """log α = logsigmoid(z) / τ for gate pre-activations z (float32; float64 stays float64)."""
    return F.logsigmoid(z if z.dtype == torch.float64 else z.float()) / tau


class LogGate(nn.Module):
    """log α [B, T, H, K] (per key dimension, `per_dim=True`) or [B, T, H] (one per head)."""

    def __init__(self, d_model: int, n_heads: int, head_k: int, *, per_dim=True, rank=RANK, tau=TAU):
        super().__init__()
        self.n_heads, self.tau = n_heads, tau
        out = n_heads * head_k if per_dim else n_heads
        self.per_dim = per_dim
        # Low rank for the per-dimension gate (the paper's W₁W₂); a per-head gate is small already.
        self.proj = nn.Sequential(nn.Linear(d_model, rank, bias=False), nn.Linear(rank, out)) \
            if per_dim else nn.Linear(d_model, out)
        nn.init.constant_(self.out_layer.bias, GATE_BIAS)

    @property
    def out_layer(self) -> nn.Linear:
        """The linear layer whose output is the gate pre-activation z (its bias sets α at the start)."""
        return self.proj[-1] if self.per_dim else self.proj

    def forward(self, x):
        z = self.proj(x)                                              # [B, T, H·K] or [B, T, H]
        g = log_gate(z, self.tau)                                     # log α ≤ 0, float32 (kernels' rule)
        return g.unflatten(-1, (self.n_heads, -1)) if self.per_dim else g
