"""Intra-chunk tiles of per-dimension GLA by repeated halving: matmuls only, every exponent ≤ 0.

Secondary chunking splits the decay exp(b_i − b_j) (b the log-gates summed inside the chunk) at the
boundary m between a query tile (rows ≥ m) and a key tile (columns < m):
    exp(b_i − b_j) = exp(Σ_{m ≤ t ≤ i} g_t) · exp(Σ_{j < t < m} g_t),   both sums ≤ 0,
so the tile is the matmul (Q ⊙ F_q)(K ⊙ F_k)ᵀ. Two-level chunking does this for the tiles between
sub-chunks and computes each c × c diagonal tile elementwise, an [c, c, K] tensor of exponentials
per sub-chunk (`intra_chunk_matrix`, chapter 05). Here the split is applied again inside the
diagonal tiles: halve the chunk, the lower-left block is one matmul split at the midpoint, and
recurse into the two diagonal halves down to single tokens (whose decay is exp(0) = 1). A chunk
of C tokens takes log2(C) levels; level s holds C/2s blocks of s × s, all batched into one matmul,
and needs exponentials of [C, K] numbers only, instead of the C·c·K of the elementwise tiles.
The factors of all levels come from one sweep of multiplications (`Sweep`), which also gives the
chunk's Λ, Γ and γ.

Precision: each factor is the decay of one segment (a prefix or a suffix inside a half), a product
of decays ≤ 1 built from the totals of its sub-blocks; nothing is divided, so no factor exceeds 1
and none is the inverse of a decay. When a factor underflows, the true product is smaller still.
The blocks of c × c and larger are the tensor-core tiles whose operands are rounded to
`inter_dtype`; smaller blocks (inside the diagonal sub-chunk tiles) stay in float32, as the
diagonal tiles of two-level chunking do.

C need not be a power of two: the chunk is padded (q = k = 0, decay 1) to one for the tiles.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Sweep:
    """The split factors level by level, and afterwards the chunk's own decays Λ, Γ, γ.

    Built on decays = exp(g) [..., C, K] (the decay of each single step), which the sweep
    overwrites: pass a tensor of your own. Iterating gives (s, F_q, F_k) for s = 1, 2, …, C2/2
    (C2 = C padded to a power of two):
    F_q = exp(Σ_{m ≤ t ≤ i} g_t) for the rows of each second half, F_k = exp(Σ_{j < t < m} g_t) for
    the columns of each first half, both [..., C2/2s, s, K] (views: read them, do not write them).
    Once the sweep is done, .query [..., C, K] holds Λ_t = exp(Σ_{s ≤ t} g_s), .key holds
    Γ_t = exp(Σ_{s > t} g_s) and .total [..., K] holds γ = exp(Σ_s g_s), over the chunk.

    Blocks of 2s tokens are built from two of s: the second half's prefix decays are multiplied by
    the first half's total decay, the first half's suffix decays by the second half's. So the only
    exponentials are those of the single log-gates, exp(g_t) ≤ 1, and every factor is a product of
    at most log2(C) + 1 such decays: its relative error stays a few ulps at any gate strength
    (exp of a long float32 sum would carry the sum's absolute rounding, ≈ 1e-5 at a sum of −100).
    Nothing is ever divided, so no factor exceeds 1; a product underflows to 0 only where the true
    decay is smaller than float32 can hold. Level by level, each level's factors are only views.
    """

    def __init__(self, decays):
        self.decays = decays
        self.query = self.key = self.total = None

    def __iter__(self):
        C = self.decays.shape[-2]
        pre = _pad(self.decays, 1.0)                                  # [..., C2, K] prefix decays, blocks of 1
        suf = torch.ones_like(pre)                                    # [..., C2, K] suffix decays, blocks of 1
        s = 1
        while s < pre.shape[-2]:
            p, u = pre.unflatten(-2, (-1, 2, s)), suf.unflatten(-2, (-1, 2, s))  # [.., C2/2s, 2, s, K]
            yield s, p[..., 1, :, :], u[..., 0, :, :]
            u[..., 0, :, :] *= p[..., 1, -1:, :]                      # × total decay of the second half
            p[..., 1, :, :] *= p[..., 0, -1:, :]                      # × total decay of the first half
            s *= 2
        self.query, self.key, self.total = pre[..., :C, :], suf[..., :C, :], pre[..., -1, :]


def intra_matrix(q, k, sweep, c, mm):
    """P_ij = Σ_κ q_iκ k_jκ exp(b_iκ − b_jκ) for i ≥ j, 0 above: q, k [..., C, K] → [..., C, C].

    sweep = Sweep(exp(g)), run here. Blocks of s ≥ c round their operands to `mm`, smaller ones stay in
    q's dtype."""
    C = q.shape[-2]
    q, k = _pad(q), _pad(k)                                           # [..., C2, K]
    P = q.new_zeros(*q.shape[:-1], q.shape[-2])                       # [..., C2, C2]
    P.diagonal(dim1=-2, dim2=-1).copy_(torch.linalg.vecdot(q, k))    # i = j: decay exp(0) = 1
    qa, ka = _half_buffers(q)                                         # reused by every level
    for s, qf, kf in sweep:
        q_abs = torch.mul(_half(q, s, 1), qf, out=qa.unflatten(-2, (-1, s)))  # [.., C2/2s, s, K] rows ≥ m
        k_abs = torch.mul(_half(k, s, 0), kf, out=ka.unflatten(-2, (-1, s)))  # [.., C2/2s, s, K] cols < m
        _blocks(P, s).copy_(_dot(q_abs, k_abs, mm if s >= c else q.dtype))
    return P[..., :C, :C]


def intra_backward(dP, q, k, sweep):
    """P (unrounded) and, for dP [..., C, C] strictly lower-triangular (the gradient of P with its
    diagonal left out), dq_i = Σ_{j < i} dP_ij k_j ⊙ exp(b_i − b_j) and
    dk_j = Σ_{i > j} dP_ij q_i ⊙ exp(b_i − b_j): the blocks and factors of `intra_matrix`.
    Returns P [..., C, C], dq, dk [..., C, K]."""
    C = q.shape[-2]
    q, k = _pad(q), _pad(k)                                           # [..., C2, K]
    dP = _pad(_pad(dP).transpose(-1, -2)).transpose(-1, -2)           # [..., C2, C2]
    P = q.new_zeros(*q.shape[:-1], q.shape[-2])                       # [..., C2, C2]
    P.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)                 # [..., C2, K]
    qa, ka = _half_buffers(q)                                         # reused by every level
    for s, qf, kf in sweep:
        q_abs = torch.mul(_half(q, s, 1), qf, out=qa.unflatten(-2, (-1, s)))  # [.., C2/2s, s, K]
        k_abs = torch.mul(_half(k, s, 0), kf, out=ka.unflatten(-2, (-1, s)))  # [.., C2/2s, s, K]
        _blocks(P, s).copy_(_dot(q_abs, k_abs, q.dtype))
        dPb = _blocks(dP, s)                                          # [..., C2/2s, s, s]
        _half(dq, s, 1).addcmul_(qf, _tile_mm(dPb, k_abs))            # rows ≥ m read keys < m
        _half(dk, s, 0).addcmul_(kf, _tile_mm(dPb.transpose(-1, -2), q_abs))
    return P[..., :C, :C], dq[..., :C, :], dk[..., :C, :]


def _half_buffers(q):
    """Two buffers [..., C2/2, K] for the absorbed halves: every level has C2/2 rows of each."""
    shape = (*q.shape[:-2], q.shape[-2] // 2, q.shape[-1])
    return q.new_empty(shape), q.new_empty(shape)


def _half(x, s, which):
    """[..., C, K] → the first (0) or second (1) halves of its blocks of 2s rows: [..., C/2s, s, K]."""
    return x.unflatten(-2, (-1, 2, s))[..., which, :, :]


def _blocks(P, s, row=1, col=0):
    """A view [..., C/2s, s, s] of one s × s block (row, col ∈ {0, 1}) of each 2s × 2s diagonal
    block of P; by default the lower-left one."""
    n = P.shape[-1] // (2 * s)
    v = P.unflatten(-1, (n, 2, s)).unflatten(-4, (n, 2, s))           # [..., n, 2, s, n, 2, s]
    return v.diagonal(dim1=-6, dim2=-3)[..., row, :, col, :, :].movedim(-1, -3)


def _dot(a, b, mm):
    """a bᵀ for [..., s, K] blocks, operands rounded to `mm`."""
    if mm != a.dtype and a.dtype.itemsize > mm.itemsize:
        a, b = a.to(mm).to(a.dtype), b.to(mm).to(a.dtype)
    if a.shape[-2] <= SMALL:
        return (a[..., :, None, :] * b[..., None, :, :]).sum(-1)      # [..., s, s]
    return a @ b.transpose(-1, -2)


def _tile_mm(A, X):
    """A X for tiles A [..., s, s] and X [..., s, K]."""
    if A.shape[-1] <= SMALL:
        return (A[..., :, :, None] * X[..., None, :, :]).sum(-2)      # [..., s, K]
    return A @ X


# Blocks this small are products and sums, not batched matmuls: thousands of 1 × 1 or 2 × 2
# matmuls cost far more in per-matrix overhead than their arithmetic.
SMALL = 2


def _pad(x, value=0.0):
    """Pad dim −2 to a power of two (zero queries/keys, decay 1: the padding changes nothing)."""
    C = x.shape[-2]
    C2 = 1 << (C - 1).bit_length()
    return x if C2 == C else F.pad(x, (0, 0, 0, C2 - C), value=value)
