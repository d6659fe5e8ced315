"""How strong are forget gates? A chunk's total log-decay, per key dimension, for several gates.

The kernels of chapters 05, 07, 10 and 11 take a fast path (the split, `decay.split`) in a chunk
only where its gates decay by less than e^SPLIT_RANGE = e^60 in every key dimension; stronger
chunks take the exact paths. Whether the fast path is the common case depends on the gates, so
this module measures it: for log-gates g [B, T, H, K] (or [B, T, H]), the decay of each whole chunk
of C tokens, −b_C = −(g_1 + … + g_C) ≥ 0, and a summary (percentiles, the fraction past the bound).

Gate parametrisations measured here besides the GLA gate of `nn/gates.py`:

    SoftplusGate   log α = −exp(A_log) · softplus(x W + dt_bias): Mamba-2's discretised decay
                   (one per head; Gated DeltaNet) and KDA's (one per key dimension), with
                   A = e^{A_log} ~ U(1, 16) and dt_bias = softplus⁻¹(dt), dt log-uniform in
                   [1e-3, 0.1] (Mamba-2's initialisation), or dt_bias = 0 (`dt_init="zero"`).

`tools/gate_strength.py` runs every distribution and writes book/data/gate_strength.json.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .decay import SPLIT_RANGE

PERCENTILES = (1, 5, 50, 95, 99)


def chunk_decays(g: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """g [B, T, H, K] or [B, T, H] (log-gates ≤ 0) → −b_C [B·N, H, K or 1] for the N whole chunks
    (a ragged tail is dropped: its decay is not a chunk's). Summed in float64."""
    if g.dim() == 3:
        g = g[..., None]
    B, T, H, K = g.shape
    N = T // chunk_size
    if N == 0:
        raise ValueError(f"T = {T} holds no whole chunk of {chunk_size} tokens")
    g = g[:, :N * chunk_size].double().reshape(B, N, chunk_size, H, K)
    return -g.sum(2).reshape(B * N, H, K)


def frac_past_bound(g: torch.Tensor, size: int, bound: float = SPLIT_RANGE) -> float:
    """The fraction of (run of `size` tokens, head) pairs of log-gates g whose gates decay by at
    least e^bound in some key dimension. With size = C those are the chunks the split refuses; with
    size = 16, the 16-row blocks that would still refuse a split whose reference point moves to each
    block's start (`docs/performance.md`, "Gate strength")."""
    return (chunk_decays(g, size).amax(-1) >= bound).double().mean().item()


def summary(decays: torch.Tensor, bound: float = SPLIT_RANGE) -> dict:
    """decays [chunks, H, K]: −b_C per (chunk, head, key dimension) → a JSON-ready dict:
    min/max/mean and percentiles over (chunk, head, dimension) entries; the fraction of entries at
    or past the bound; the fraction of (chunk, head) pairs the split refuses (some dimension past
    the bound: what the kernels decide on), and percentiles of each pair's strongest dimension."""
    d = decays.double()
    flat = d.flatten()
    per_pair = d.amax(-1).flatten()                       # the strongest dimension of each (chunk, head)
    q = torch.tensor([p / 100 for p in PERCENTILES], dtype=torch.float64)
    pct = torch.quantile(flat[:16_000_000], q)                # quantile's limit on its input size
    pair_pct = torch.quantile(per_pair, q)
    return {
        "entries": int(flat.numel()),
        "chunk_head_pairs": int(per_pair.numel()),
        "min": flat.min().item(),
        "mean": flat.mean().item(),
        "max": flat.max().item(),
        "percentiles": {str(p): v for p, v in zip(PERCENTILES, pct.tolist())},
        "strongest_dim_percentiles": {str(p): v for p, v in zip(PERCENTILES, pair_pct.tolist())},
        "frac_entries_past_bound": (flat >= bound).double().mean().item(),
        "frac_chunks_past_bound": (per_pair >= bound).double().mean().item(),
        "bound": bound,
    }


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y (y > 0): x = y + log(1 − e^{−y}), exact for small y too."""
    return y + torch.log(-torch.expm1(-y))


class SoftplusGate(nn.Module):
    """log α = −exp(A_log) · softplus(x W + dt_bias) ≤ 0: [B, T, H, K] (`head_k` given: KDA's
    per-dimension gate, W low rank d → `rank` → H·K as in KDA) or [B, T, H] (Mamba-2 / Gated
    DeltaNet, W full rank d → H). A_log = log U(1, 16) per head; dt_bias per output from Mamba-2's
    dt (log-uniform in [dt_min, dt_max], floored at 1e-4) or zero (`dt_init="zero"`)."""

    def __init__(self, d_model: int, n_heads: int, head_k: int | None = None, *, rank: int | None = None,
                 dt_init: str = "mamba2", dt_min: float = 1e-3, dt_max: float = 0.1, generator=None):
        super().__init__()
        self.n_heads, self.head_k = n_heads, head_k
        out = n_heads * head_k if head_k else n_heads
        self.proj = (nn.Sequential(nn.Linear(d_model, rank or head_k, bias=False),
                                   nn.Linear(rank or head_k, out, bias=False))
                     if head_k else nn.Linear(d_model, out, bias=False))
        A = torch.empty(n_heads).uniform_(1, 16, generator=generator)
        self.A_log = nn.Parameter(A.log())
        if dt_init == "mamba2":
            u = torch.rand(out, generator=generator)
            dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
            self.dt_bias = nn.Parameter(inverse_softplus(dt))
        elif dt_init == "zero":
            self.dt_bias = nn.Parameter(torch.zeros(out))
        else:
            raise ValueError(f"dt_init must be 'mamba2' or 'zero', got {dt_init!r}")

    def forward(self, x):
        z = F.softplus(self.proj(x).float() + self.dt_bias)            # [B, T, H·K] or [B, T, H]
        if self.head_k:
            z = z.unflatten(-1, (self.n_heads, self.head_k))            # [B, T, H, K]
            return -self.A_log.exp()[:, None] * z
        return -self.A_log.exp() * z
