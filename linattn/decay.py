"""Decay machinery shared by every gated operation (GLA, Mamba-2/RetNet-style scalar decay, KDA).

Gates arrive as log-decays g ≤ 0 (a decay exp(g) ∈ (0, 1]). Nothing here ever forms a bare
cumulative product of decays: a product of a few hundred gates underflows in float32, and its
inverse overflows. Everything is a sum of log-gates over a *segment* of the sequence, computed
directly (not as the difference of two long prefix sums, which would cancel catastrophically),
and `exp` is only taken of sums that are ≤ 0.

Layout. Chunked tensors are [B, H, N, C, ...]: N chunks of C tokens. A per-head (scalar) gate is
carried as [..., C, 1] so that it broadcasts over the key dimension K exactly like a per-dimension
gate [..., C, K]; `per_dim` turns g [B, T, H] into that form.

Inside one chunk with log-gates g_1..g_C (rows of a [C, K] tile), write b_t = g_1 + … + g_t:
    Λ_t = exp(b_t)               query side: decay from the chunk start to t (inclusive)
    Γ_t = exp(b_C − b_t)         key side: decay from t (exclusive) to the chunk end
    γ   = exp(b_C)               total decay over the chunk
so that Λ_i Γ_j / γ = exp(b_i − b_j), the decay from key j to query i.

One guarded exception, `split`: where a chunk's gates decay by less than e^SPLIT_RANGE in every
dimension, exp(b_i − b_j) = e^{b_i} · e^{−b_j} with the second factor ≥ 1 but at most e^60, far
inside float32's range (≈ e^88). Then the whole C×C decayed score matrix is one matmul of
Q ⊙ e^{b} with K ⊙ e^{−b} (chapter 11's split, on the tensor cores). Each factor carries the
rounding of its prefix sum, ≈ ε·|b| ≤ 60 ε relative, against the few ulps of the segment sums;
stronger gates take the exact paths (segment sums, secondary chunking).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def gate_dtype(g: torch.Tensor) -> torch.dtype:
    """Cumulative sums run in float32 (float64 when the gates are float64, for references)."""
    return torch.float64 if g.dtype == torch.float64 else torch.float32


def per_dim(g: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """g [B, T, H] (one decay per head) → [B, T, H, 1]; g [B, T, H, K] is returned as it is."""
    return g.unsqueeze(-1) if g.dim() == q.dim() - 1 else g


def chunked(x: torch.Tensor, C: int, value: float = 0.0) -> torch.Tensor:
    """[B, T, H, ...] → [B, H, N, C, ...] with N = ceil(T / C), the tail padded with `value`.

    Padding q, k, v with 0 and g with 0 (decay 1) is exact: a zero key writes nothing and a unit
    decay leaves the state alone, so the padded tokens change neither outputs nor final state.
    """
    B, T, H = x.shape[:3]
    N = -(-T // C)
    x = x.movedim(2, 1)                                                # [B, H, T, ...]
    if N * C > T:                                                      # F.pad copies even when 0
        x = F.pad(x, [0, 0] * (x.dim() - 3) + [0, N * C - T], value=value)
    return x.reshape(B, H, N, C, *x.shape[3:])


def group_size(B: int, H: int, C: int, width: int, device: torch.device) -> int:
    """Chunks per group for the chunk level: on a CPU about 2^17 numbers (512 KB in float32) per
    [B, H, chunks, C, width] tensor, so that a group's matmuls and elementwise passes run from the
    cache (measured fastest among 4, 8, 16 and all 64 chunks at B = 1, H = 4, C = K = V = 64); on
    a GPU all chunks at once (every group is more kernel launches)."""
    if device.type != "cpu":
        return 1 << 62
    return max(1, (1 << 17) // (B * H * C * width))


def unchunked(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, N, C, ...] → [B, T, H, ...], dropping the padding."""
    B, H, N, C = x.shape[:4]
    return x.reshape(B, H, N * C, *x.shape[4:])[:, :, :T].movedim(1, 2)


def prefix(g: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """b_t = Σ_{s ≤ t} g_s along `dim`, in float32 (float64 for float64 gates). Always ≤ 0."""
    return g.to(gate_dtype(g)).cumsum(dim)


def chunk_local_prefix(g: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """g [B, T, H] or [B, T, H, K] → the same shape, prefix sums restarting every `chunk_size` tokens.

    The layout kernels use for Λ, Γ and γ of each chunk (b at a chunk's last token is its total
    log-decay); float32, or float64 for float64 gates. The last chunk may be shorter.
    """
    T = g.shape[1]
    return unchunked(prefix(chunked(g, chunk_size), dim=3), T)


def suffix(g: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Σ_{s > t} g_s along `dim` (the decay from just after t to the end), summed from the end.

    Summing from the far end keeps the rounding error proportional to the result itself; the
    difference b_C − b_t of two prefix sums would carry the rounding error of b_C, which can be
    huge (strong gates) while b_C − b_t is tiny.
    """
    g = g.to(gate_dtype(g))
    from_t = g.flip(dim).cumsum(dim).flip(dim)                         # Σ_{s ≥ t} g_s
    # shift by one instead of subtracting g_t: from_t − g_t would cancel when g_t is huge
    L = g.shape[dim]
    return torch.cat([from_t.narrow(dim, 1, L - 1), torch.zeros_like(g.narrow(dim, 0, 1))], dim)


def query_decay(g: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Λ = exp(b_t): the decay from the start of the block to t, t included."""
    return prefix(g, dim).exp()


def key_decay(g: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Γ = exp(Σ_{s > t} g_s): the decay a key at t suffers until the end of the block."""
    return suffix(g, dim).exp()


def total_decay(g: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """γ = exp(Σ_s g_s): the decay over the whole block (the dimension `dim` is removed)."""
    return g.to(gate_dtype(g)).sum(dim).exp()


def segment_sums(g: torch.Tensor) -> torch.Tensor:
    """[..., L] → [..., L, L] with entry (i, j) = Σ_{j < s ≤ i} g_s for i ≥ j and −inf above.

    Each segment is summed on its own (a cumulative sum down each column of a masked copy), so a
    short segment is exact even where the prefix sums around it are large. exp of the result is
    the causal decay mask; −inf above the diagonal makes exp give exactly 0 there (never inf·0).
    Cost O(L²) per row: meant for chunks and sub-chunks, not whole sequences.
    """
    L = g.shape[-1]
    g = g.to(gate_dtype(g))
    x = g[..., :, None].expand(*g.shape, L)                            # [..., L(s), L(j)]: g_s
    strictly_below = torch.ones(L, L, dtype=torch.bool, device=g.device).tril(-1)
    x = x.masked_fill(~strictly_below, 0).cumsum(-2)                   # Σ_{j < s ≤ i} g_s
    causal = torch.ones(L, L, dtype=torch.bool, device=g.device).tril()
    return x.masked_fill(~causal, float("-inf"))


@functools.lru_cache(maxsize=64)
def causal_mask(C: int, dtype: torch.dtype, device: torch.device, strict: bool = False) -> torch.Tensor:
    """[C, C]: 1 on and below the diagonal (strict: below it only), 0 above, in dtype — the mask of
    no decay. Cached, so a chunk loop reads one tensor instead of building it every group: do not
    write into it."""
    return torch.ones(C, C, dtype=dtype, device=device).tril(-1 if strict else 0)


def decay_mask(g: torch.Tensor) -> torch.Tensor:
    """Scalar gates [..., L] → the causal decay mask D [..., L, L], D_ij = exp(b_i − b_j), i ≥ j."""
    return segment_sums(g).exp()


def pairwise_decay(g: torch.Tensor) -> torch.Tensor:
    """Per-dimension gates [..., L, K] → [..., L, L, K] with exp(b_ik − b_jk) for i ≥ j, else 0.

    This is the factor that sits *inside* the dot product of the GLA attention matrix; it cannot
    be pulled out as a matrix on either side, which is why such tiles are not matmuls.
    """
    return segment_sums(g.transpose(-1, -2)).exp().permute(*range(g.dim() - 2), -2, -1, -3)


SPLIT_RANGE = 60.0   # e^60 ≈ 1e26: a factor e^{−b} that stays this far inside float32's 3e38


def split(g: torch.Tensor, operand_dtype: torch.dtype = torch.float32):
    """Chunk log-gates [..., C, K or 1] → (Λ = e^{b}, e^{−b} [..., C, K or 1], γ = e^{b_C} [..., K or 1])
    when every chunk decays by less than e^SPLIT_RANGE (−b_C < SPLIT_RANGE everywhere), else None.

    Then exp(b_i − b_j) = Λ_i · e^{−b_j}: a decayed score matrix is (Q ⊙ Λ)(K ⊙ e^{−b})ᵀ, and the
    keys decayed to the chunk end are K ⊙ e^{−b} · γ. One host synchronisation (the bound).
    operand_dtype: what the matmul operands are rounded to; float16 (largest number 65504 ≈ e^11)
    cannot hold e^{−b}, so it never splits.
    """
    if operand_dtype == torch.float16:
        return None
    b = prefix(g)                                                      # [..., C, K or 1], ≤ 0
    if not bool(b[..., -1, :].amin() > -SPLIT_RANGE):                  # NaN gates fail this too
        return None
    lam = b.exp_()                                                     # ≥ e^−60: a normal float32
    return lam, lam.reciprocal(), lam[..., -1, :]                      # 1/Λ: ½ ulp more than e^{−b}
