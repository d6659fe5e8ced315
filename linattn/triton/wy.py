"""Stage 1 of the delta-rule kernels: the WY/UT factors of every chunk.

Notation as in linattn.chunk.delta: a chunk of C tokens, G_i the log-decay summed from the chunk
start (per key dimension for KDA, one per head for Gated DeltaNet, 0 for DeltaNet),
A_ij = β_i Σ_d k_id k_jd e^{G_id − G_jd} (i > j), Aqk_ij = scale Σ_d q_id k_jd e^{G_id − G_jd}
(j ≤ i), 𝒯 = (I + A)⁻¹, W = 𝒯 diag(β)(K ⊙ e^G), U = 𝒯 diag(β) V.

1. The factor kernels give Aqk (tile dtype) and 𝒯, one program per (chunk, head):
   - DeltaNet / Gated DeltaNet: `_factor_kernel` computes A as its ten 16×16 blocks (the keys
     loaded as four row blocks, one dot per block, the C×C decay e^{G_i − G_j} per block) and
     inverts it in registers: A never goes to memory.
   - KDA: `_scores_kernel`, one program per (chunk, head, sub-chunk of 16), writes A (float32)
     and Aqk: left of the diagonal one dot split at the sub-chunk boundary, the 16×16 diagonal
     block by one float32 dot or, for gates that decay by 60 or more within the sub-chunk,
     column by column. Then `_inverse_kernel` loads A's ten blocks and inverts them the same way.
   The inversion (`_invert`): each diagonal block by doubling the inverted block side
   (X ← X − X L X, `_diag_inverse`), then 𝒯_ij = −𝒯_ii Σ_{j≤m<i} A_im 𝒯_mj for the six blocks
   below, all 16×16 tiles held as separate variables (no tile is cut out of a larger one), every
   product on the tensor cores.
2. `_wu_kernel`, two programs per (chunk, head): U; and W with what stages 2 and 3 need from
   the keys and gates (K ⊙ e^{G_C − G}, e^{G_C}, and for per-dimension gates scale · Q ⊙ e^G),
   K and the gates read once: tiled matmuls and elementwise decays.

𝒯 is stored in the tile dtype when only the forward reads it (the W/U dots round it to that
dtype anyway), in float32 when the backward will.

Decays. With log-gates down to −20 per token, e^{±G} over a chunk under- and overflows float32.
Every exponent here is ≤ 0 — a difference G_i − G_j with i ≥ j, or a tail G_C − G_i summed from
the chunk end — except in `_diag_dot`, whose factor e^{G_f − G_j} ≥ 1 is used only where a check
bounds it by e^{60}.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import outputs
from .common import block, dot, interpreting

SUB = 16          # sub-chunk: the side of the diagonal blocks done element by element
BS = tl.constexpr(SUB)  # the same, as kernels see it
# KDA diagonal blocks go through one dot with a factor e^{+x}, x ≤ this bound (e^60 ≈ 1e26, far
# from float32's 3e38 and its underflow): a sub-chunk whose gates decay more is done column by
# column instead (docs in _diag_dot)
DIAG_DOT_RANGE = tl.constexpr(60.0)
# Warps per program, measured on an H200 (bf16, H = 16, K = V = 128, C = 64, T = 1k and 32k):
# KDA scores (diagonal blocks column by column) 2 / 4 / 8 warps 3.05 / 1.68 / 2.22 ms, W/U 4 warps
# 0.69 ms vs 8 warps 1.05; factor kernel (Gated DeltaNet, tf32x3 products) 2 / 4 / 8 warps
# 0.38 / 0.62 / 1.17 ms, with tf32 products 1 and 2 warps alike (0.22); KDA scores + inverse
# with 1 / 2 / 4 warps for the inverse 1.78 / 1.89 / 2.13 ms. (8 warps spill less when compiled
# for sm_90 on a CPU, yet ran slower.)
TUNING = dict(warps_scores=4, warps_inverse=1, warps_factor=2, warps_wu=4)


def inverse_precision(p) -> str:
    """input_precision of the inversion's 16×16 float32 products: exact under the interpreter;
    natively tf32x3 (about float32) for float32 inputs, one tf32 pass (10-bit mantissa) for
    bf16/fp16 inputs, whose 𝒯 is rounded to 8 or 11 bits by the dots that read it anyway."""
    if interpreting():
        return "ieee"
    return "tf32x3" if p.ieee else "tf32"


def factor_stage(q, k, g, beta, p, ai_dtype=None, keep_a=False) -> dict:
    """aqk [B,T,H,C] = scale · Aqk in the tile dtype (diagonal included) and ai = 𝒯 [B,T,H,C]
    (unit lower triangular) in ai_dtype (default the tile dtype; float32 for the backward); row t
    holds its chunk's row, zeros right of the diagonal. KDA goes through A in memory
    (`scores_stage`, `inverse_stage`; keep_a: return it too); the other two compute and invert A
    in one kernel."""
    if p.gate == 2:
        s = scores_stage(q, k, g, beta, p)
        s["ai"] = inverse_stage(s["a"], p, ai_dtype)
        if not keep_a:
            del s["a"]
        return s
    aqk = outputs.empty((p.B, p.T, p.H, p.C), dtype=p.work, device=p.device)
    ai = outputs.empty((p.B, p.T, p.H, p.C), dtype=ai_dtype or p.work, device=p.device)
    _factor_kernel[(p.NT, p.B * p.H)](
        q, k, g if p.gate else q, beta, aqk, ai, p.scale, p.T, p.H,
        K=p.K, C=p.C, BK=p.BK, GATE=p.gate, DT=p.cdt, IEEE=p.ieee, PREC=inverse_precision(p),
        num_warps=TUNING["warps_factor"])
    return dict(aqk=aqk, ai=ai)


def scores_stage(q, k, g, beta, p) -> dict:
    """KDA only: A [B,T,H,C] float32 (β_i on row i, strictly lower) and aqk as in `factor_stage`."""
    if p.gate != 2:
        raise ValueError("scores_stage computes the per-dimension-gate (KDA) scores; DeltaNet and "
                         "Gated DeltaNet get theirs from factor_stage, which never stores A")
    a = outputs.empty((p.B, p.T, p.H, p.C), dtype=torch.float32, device=p.device)
    aqk = outputs.empty((p.B, p.T, p.H, p.C), dtype=p.work, device=p.device)
    # one program per (chunk, head, sub-chunk)
    _scores_kernel[(p.NT, p.B * p.H, p.C // SUB)](
        q, k, g, beta, a, aqk, p.scale, p.T, p.H,
        K=p.K, C=p.C, BK=p.BK, DT=p.cdt, IEEE=p.ieee, X3=not interpreting(),
        num_warps=TUNING["warps_scores"])
    return dict(a=a, aqk=aqk)


def inverse_stage(a, p, dtype=None):
    """𝒯 = (I + A)⁻¹ per chunk, [B,T,H,C] laid out like A (unit lower triangular), in dtype
    (default the tile dtype)."""
    ai = outputs.empty((p.B, p.T, p.H, p.C), dtype=dtype or p.work, device=p.device)
    _inverse_kernel[(p.NT, p.B * p.H)](a, ai, p.T, p.H, C=p.C, PREC=inverse_precision(p),
                                        num_warps=TUNING["warps_inverse"])
    return ai


def wu_stage(q, k, v, g, beta, ai, p) -> dict:
    """W [B,T,H,K], U [B,T,H,V]; with gates also kd = K ⊙ e^{G_C − G} [B,T,H,K] and
    dl = e^{G_C} [B,H,NT,K] float32, with per-dimension gates qg = scale · Q ⊙ e^G [B,T,H,K]
    (without gates qg, dl are None and kd is k). A per-head gate's e^G is one number per token:
    the output stage multiplies by it itself rather than read a [B,T,H,K] copy of Q."""
    B, T, H, K, V = p.B, p.T, p.H, p.K, p.V
    w = outputs.empty((B, T, H, K), dtype=p.work, device=p.device)
    u = outputs.empty((B, T, H, V), dtype=p.work, device=p.device)
    qg = outputs.empty((B, T, H, K), dtype=p.work, device=p.device) if p.gate == 2 else None
    kd = outputs.empty((B, T, H, K), dtype=p.work, device=p.device) if p.gate else k
    dl = outputs.empty((B, H, p.NT, K), dtype=torch.float32, device=p.device) if p.gate else None
    BV = min(block(V), 64)
    _wu_kernel[(p.NT, B * H, 2)](
        q, k, v, g if p.gate else q, beta, ai, w, u, qg if p.gate == 2 else w, kd,
        dl if p.gate else w, p.scale, T, p.NT, H,
        K=K, V=V, C=p.C, BK=p.BK, BV=BV, GATE=p.gate, DT=p.cdt, IEEE=p.ieee,
        num_warps=TUNING["warps_wu"])
    return dict(w=w, u=u, qg=qg, kd=kd, dl=dl)


def wy_stage(q, k, v, g, beta, p) -> dict:
    """Stage 1 whole, every tensor kept for inspection, 𝒯 in float32: aqk, ai, the W/U outputs,
    and for KDA the scores A too."""
    s = factor_stage(q, k, g, beta, p, torch.float32, keep_a=True)
    return dict(s, **wu_stage(q, k, v, g, beta, s["ai"], p))


# ---------------------------------------------------------------- device helpers

@triton.jit
def _f32(a, b, X3: tl.constexpr):
    """a @ b of float32 16×16 blocks (KDA's diagonal scores) at about float32 accuracy.

    On the GPU three tf32 tensor-core products (tf32x3, relative error ~2⁻²¹): plain tf32 keeps
    10 bits, IEEE products run on the FMA units. Under the interpreter (X3 false): exact float32."""
    if X3:
        return tl.dot(a, b, input_precision="tf32x3")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _mm32(a, b, PREC: tl.constexpr):
    """a @ b of float32 16×16 blocks of the inversion, at the precision `inverse_precision` chose."""
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _diag_dot(Ks, Qs, Gl, g0, X3: tl.constexpr):
    """The 16×16 diagonal block as products split at the sub-chunk's first token f:
    e^{G_i − G_j} = e^{G_i − G_f} · e^{G_f − G_j}. The second factor is ≥ 1, but the caller has
    checked it stays below e^{DIAG_DOT_RANGE} (no overflow, and e^{G_i − G_f} no underflow);
    entries above the diagonal (also bounded so) are masked by the caller. Float32 operands
    (tf32x3 on the GPU): a bf16 factor near e^{60} would round the small scores it multiplies."""
    dn = tl.exp(Gl - g0[None, :])                                                 # [16, BK] ≤ 1
    up = Ks * tl.exp(g0[None, :] - Gl)                                            # [16, BK] ≥ 1
    return _f32(Ks * dn, tl.trans(up), X3), _f32(Qs * dn, tl.trans(up), X3)      # [16, 16] each


@triton.jit
def _diag_columns(Ks, Qs, k, g, s, n, T, H, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """The 16×16 diagonal block for any gates, columns j = 15 … 0: E_i = e^{G_i − G_j} for i ≥ j,
    0 above. Moving from column j + 1 to j multiplies by e^{g_{j+1}} (≤ 1): one exponential per
    key dim per column, and no exponent is ever positive."""
    r = tl.arange(0, BS)
    dk = tl.arange(0, BK)
    E = tl.zeros((BS, BK), dtype=tl.float32)
    Da = tl.zeros((BS, BS), dtype=tl.float32)
    Dq = tl.zeros((BS, BS), dtype=tl.float32)
    for c in tl.static_range(BS):   # unrolled: the row loads of all columns can start at once
        jj = BS - 1 - c
        tj = n * C + s * BS + jj
        rj = (s * BS + jj) * H
        if jj + 1 < BS:
            gn = tl.load(g + (rj + H) * K + dk, mask=(dk < K) & (tj + 1 < T), other=0.0).to(tl.float32)
            E = E * tl.exp(gn)[None, :]                                           # × e^{g_{j+1}}
        E = tl.where(r[:, None] == jj, 1.0, E)                                    # [16, BK]
        kj = tl.load(k + rj * K + dk, mask=(dk < K) & (tj < T), other=0.0).to(tl.float32)  # [BK]
        wj = E * kj[None, :]
        Da = tl.where(r[None, :] == jj, tl.sum(Ks * wj, axis=1)[:, None], Da)    # column j
        Dq = tl.where(r[None, :] == jj, tl.sum(Qs * wj, axis=1)[:, None], Dq)
    return Da, Dq
@triton.jit
def _kda_subchunk(q, k, g, beta, a, aqk, s, n, scale, T, H,
                  K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                  IEEE: tl.constexpr, X3: tl.constexpr):
    """Rows 16 s … 16 s + 15 of A and Aqk for per-dimension gates; stores them.

    One program per sub-chunk s: four times the programs of one per chunk, to hide the latency
    of the column loop below, whose steps depend on each other."""
    r = tl.arange(0, BS)
    rows = tl.arange(0, C)
    dk = tl.arange(0, BK)
    ts = n * C + s * BS + r
    rs = (s * BS + r) * H                                                         # [16] rows in the chunk
    ms = (ts < T)[:, None] & (dk[None, :] < K)
    Ks = tl.load(k + rs[:, None] * K + dk[None, :], mask=ms, other=0.0).to(tl.float32)  # [16, BK]
    Qs = tl.load(q + rs[:, None] * K + dk[None, :], mask=ms, other=0.0).to(tl.float32)
    bs = tl.load(beta + rs, mask=ts < T, other=0.0).to(tl.float32)                # [16]
    Gl = tl.cumsum(tl.load(g + rs[:, None] * K + dk[None, :], mask=ms, other=0.0).to(tl.float32),
                   axis=0)                                                        # [16, BK] G_i − G_b
    Aoff = tl.zeros((BS, C), dtype=tl.float32)
    Qoff = tl.zeros((BS, C), dtype=tl.float32)
    if s > 0:
        # left of the diagonal block, b = the last token before the sub-chunk:
        # e^{G_i − G_j} = e^{G_i − G_b} e^{G_b − G_j}, both exponents ≤ 0, and one dot.
        # G_i − G_b: the sub-chunk's own prefix sums; G_b − G_j = g_{j+1} + … + g_b: summed from
        # b backwards over the gates shifted up one row (no difference of long prefix sums)
        t = n * C + rows
        row = rows * H                                                            # [C]
        early = (rows < s * BS) & (t < T)
        me = early[:, None] & (dk[None, :] < K)
        kt = tl.load(k + row[:, None] * K + dk[None, :], mask=me, other=0.0).to(tl.float32)  # [C, BK]
        gsh = tl.load(g + (row + H)[:, None] * K + dk[None, :],
                      mask=me & ((rows < s * BS - 1) & (t + 1 < T))[:, None], other=0.0).to(tl.float32)  # g_{j+1}
        up = kt * tl.exp(tl.cumsum(gsh, axis=0, reverse=True))                    # [C, BK] rows < 16 s
        down = tl.exp(Gl)
        Aoff = dot((Ks * down).to(DT), tl.trans(up).to(DT), IEEE)                # [16, C]
        Qoff = dot((Qs * down).to(DT), tl.trans(up).to(DT), IEEE)
    # diagonal block: by one float32 dot when the sub-chunk's decay spread G_first − G_last is
    # below DIAG_DOT_RANGE in every key dim (always, for gates of trained models), else column
    # by column (log-gates of −20 per token)
    g0 = tl.load(g + (s * BS * H) * K + dk, mask=(dk < K) & (n * C + s * BS < T),
                 other=0.0).to(tl.float32)                                        # [BK] Gl, row 0
    glast = tl.sum(tl.where(r[:, None] == BS - 1, Gl, 0.0), axis=0)              # [BK] (padding: g = 0)
    if tl.max(g0 - glast, axis=0) < DIAG_DOT_RANGE:
        Da, Dq = _diag_dot(Ks, Qs, Gl, g0, X3)
    else:
        Da, Dq = _diag_columns(Ks, Qs, k, g, s, n, T, H, K, C, BK)
    Da = tl.where(r[:, None] > r[None, :], Da, 0.0) * bs[:, None]
    Dq = tl.where(r[:, None] >= r[None, :], Dq, 0.0) * scale
    # store left blocks (zeros right of the diagonal block) and the diagonal block: disjoint columns
    off = (rows[None, :] // BS) != s
    mrow = (ts < T)[:, None]
    Aoff = tl.where(rows[None, :] < s * BS, Aoff, 0.0) * bs[:, None]
    Qoff = tl.where(rows[None, :] < s * BS, Qoff, 0.0) * scale
    tl.store(a + rs[:, None] * C + rows[None, :], Aoff, mask=mrow & off)
    tl.store(aqk + rs[:, None] * C + rows[None, :], Qoff.to(aqk.dtype.element_ty), mask=mrow & off)
    tl.store(a + rs[:, None] * C + s * BS + r[None, :], Da, mask=mrow)
    tl.store(aqk + rs[:, None] * C + s * BS + r[None, :], Dq.to(aqk.dtype.element_ty), mask=mrow)


# ---------------------------------------------------------------- the inversion, in registers

@triton.jit
def _join(X, A, s: tl.constexpr, PREC: tl.constexpr):
    """X inverts the diagonal blocks of side s of I + A (A strictly lower 16×16); return the
    inverse for blocks of side 2s. L, the entries joining two neighbours (rows in the lower
    half, columns in the upper), satisfies L X L = 0, so (X⁻¹ + L)⁻¹ = X − X L X exactly."""
    r = tl.arange(0, BS)
    i, j = r[:, None], r[None, :]
    L = tl.where((i // (2 * s) == j // (2 * s)) & (i // s != j // s), A, 0.0)   # [16, 16]
    return X - _mm32(X, _mm32(L, X, PREC), PREC)


@triton.jit
def _diag_inverse(A, PREC: tl.constexpr):
    """(I + A)⁻¹ of one strictly lower 16×16 block by doubling the inverted block side
    1 → 2 → 4 → 8 → 16: six 16×16 products on the tensor cores instead of a chain of 15
    dependent row steps (each a reduction across threads)."""
    r = tl.arange(0, BS)
    i, j = r[:, None], r[None, :]
    X = tl.where(i == j, 1.0, 0.0) - tl.where((i // 2 == j // 2) & (i > j), A, 0.0)  # side 2
    return _join(_join(_join(X, A, 2, PREC), A, 4, PREC), A, 8, PREC)


@triton.jit
def _invert(A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, PREC: tl.constexpr):
    """𝒯 = (I + A)⁻¹ for a chunk of up to 64 rows as ten 16×16 blocks (missing rows: zero A):
    the four independent diagonal blocks, then the blocks below,
    𝒯_ij = −𝒯_ii Σ_{m=j}^{i−1} A_im 𝒯_mj — the same join as inside a block, one level up."""
    T00 = _diag_inverse(A00, PREC)
    T11 = _diag_inverse(A11, PREC)
    T22 = _diag_inverse(A22, PREC)
    T33 = _diag_inverse(A33, PREC)
    T10 = -_mm32(T11, _mm32(A10, T00, PREC), PREC)
    T21 = -_mm32(T22, _mm32(A21, T11, PREC), PREC)
    T32 = -_mm32(T33, _mm32(A32, T22, PREC), PREC)
    T20 = -_mm32(T22, _mm32(A20, T00, PREC) + _mm32(A21, T10, PREC), PREC)
    T31 = -_mm32(T33, _mm32(A31, T11, PREC) + _mm32(A32, T21, PREC), PREC)
    T30 = -_mm32(T33, _mm32(A30, T00, PREC) + _mm32(A31, T10, PREC) + _mm32(A32, T20, PREC), PREC)
    return T00, T10, T11, T20, T21, T22, T30, T31, T32, T33


@triton.jit
def _block_ptrs(x, i: tl.constexpr, j: tl.constexpr, n, T, H, C: tl.constexpr):
    """Addresses [16, 16] of block (i, j) of a chunk's C×C matrix stored row t at x + t·H·C
    (x: the chunk's row 0), and the mask of its entries inside the sequence and the chunk
    (for C < 64 the blocks past C are masked whole)."""
    r = tl.arange(0, BS)
    rows = i * BS + r
    m = (n * C + rows < T) & (rows < C) & (j * BS < C)
    return x + rows[:, None] * (H * C) + j * BS + r[None, :], m[:, None]


@triton.jit
def _load_block(a, i: tl.constexpr, j: tl.constexpr, n, T, H, C: tl.constexpr):
    ptrs, m = _block_ptrs(a, i, j, n, T, H, C)
    return tl.load(ptrs, mask=m, other=0.0)


@triton.jit
def _store_block(ai, X, i: tl.constexpr, j: tl.constexpr, n, T, H, C: tl.constexpr):
    ptrs, m = _block_ptrs(ai, i, j, n, T, H, C)
    tl.store(ptrs, X.to(ai.dtype.element_ty), mask=m)


@triton.jit
def _store_inverse(ai, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, n, T, H,
                   C: tl.constexpr):
    """All sixteen blocks of 𝒯, zeros right of the diagonal (the W/U kernel reads whole rows)."""
    Z = tl.zeros((BS, BS), dtype=tl.float32)
    _store_block(ai, T00, 0, 0, n, T, H, C)
    _store_block(ai, Z, 0, 1, n, T, H, C)
    _store_block(ai, Z, 0, 2, n, T, H, C)
    _store_block(ai, Z, 0, 3, n, T, H, C)
    _store_block(ai, T10, 1, 0, n, T, H, C)
    _store_block(ai, T11, 1, 1, n, T, H, C)
    _store_block(ai, Z, 1, 2, n, T, H, C)
    _store_block(ai, Z, 1, 3, n, T, H, C)
    _store_block(ai, T20, 2, 0, n, T, H, C)
    _store_block(ai, T21, 2, 1, n, T, H, C)
    _store_block(ai, T22, 2, 2, n, T, H, C)
    _store_block(ai, Z, 2, 3, n, T, H, C)
    _store_block(ai, T30, 3, 0, n, T, H, C)
    _store_block(ai, T31, 3, 1, n, T, H, C)
    _store_block(ai, T32, 3, 2, n, T, H, C)
    _store_block(ai, T33, 3, 3, n, T, H, C)


# ---------------------------------------------------------------- the kernels

@triton.jit
def _key_block(k, g, beta, gsum, i: tl.constexpr, n, T, H, K: tl.constexpr, C: tl.constexpr,
               BK: tl.constexpr, GATE: tl.constexpr, DT: tl.constexpr):
    """Rows 16 i … 16 i + 15 of the chunk: keys [16, BK] (tile dtype), β [16], and for per-head
    gates G [16] summed from the chunk start (gsum: the gates of the rows before the block)."""
    r = tl.arange(0, BS)
    dk = tl.arange(0, BK)
    rows = i * BS + r
    rm = (n * C + rows < T) & (rows < C)
    kb = tl.load(k + (rows * H)[:, None] * K + dk[None, :], mask=rm[:, None] & (dk[None, :] < K),
                 other=0.0).to(DT)
    bb = tl.load(beta + rows * H, mask=rm, other=0.0).to(tl.float32)
    Gb = tl.zeros((BS,), dtype=tl.float32)
    if GATE == 1:
        Gb = tl.cumsum(tl.load(g + rows * H, mask=rm, other=0.0).to(tl.float32), axis=0) + gsum
    return kb, bb, Gb


@triton.jit
def _kkt_block(ki, kj, bi, Gi, Gj, DIAG: tl.constexpr, GATE: tl.constexpr, IEEE: tl.constexpr):
    """A_ij = β_i (k_i · k_j) e^{G_i − G_j}, one 16×16 block (strictly lower if DIAG)."""
    Aij = dot(ki, tl.trans(kj), IEEE)                                             # [16, 16]
    if GATE == 1:
        Aij = Aij * tl.exp(tl.minimum(Gi[:, None] - Gj[None, :], 0.0))
    if DIAG:
        r = tl.arange(0, BS)
        Aij = tl.where(r[:, None] > r[None, :], Aij, 0.0)
    return Aij * bi[:, None]


@triton.jit
def _factor_kernel(q, k, g, beta, aqk, ai, scale, T, H, K: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
                   PREC: tl.constexpr):
    """DeltaNet / Gated DeltaNet: Aqk and 𝒯 of one (chunk, head); A stays in registers."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t = n * C + tl.arange(0, C)
    tm = t < T
    # pointers to the chunk's first token of this head, then 32-bit offsets inside the chunk
    # (a [C, BK] tile of 64-bit addresses costs twice the registers)
    r0 = (b * T + n * C).to(tl.int64) * H + h
    q, k, g, beta, aqk, ai = q + r0 * K, k + r0 * K, g + r0, beta + r0, aqk + r0 * C, ai + r0 * C
    jc = tl.arange(0, C)
    row = jc * H                                                                  # [C] token rows
    dk = tl.arange(0, BK)
    mk = tm[:, None] & (dk[None, :] < K)
    # Aqk: one [C, C] dot
    kt = tl.load(k + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(DT)  # [C, BK]
    qt = tl.load(q + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(DT)
    Aqk = dot(qt, tl.trans(kt), IEEE)                                             # [C, C]
    gc = tl.zeros((C,), dtype=tl.float32)
    if GATE == 1:
        gc = tl.load(g + row, mask=tm, other=0.0).to(tl.float32)                  # [C]
        G1 = tl.cumsum(gc, axis=0)
        Aqk = Aqk * tl.exp(tl.minimum(G1[:, None] - G1[None, :], 0.0))            # ≤ 1 where kept
    Aqk = tl.where(jc[:, None] >= jc[None, :], Aqk, 0.0) * scale
    tl.store(aqk + row[:, None] * C + jc[None, :], Aqk.to(aqk.dtype.element_ty), mask=tm[:, None])
    # A: the ten blocks of four 16-row key blocks, each G offset by the gates before its block
    k0, b0, G0 = _key_block(k, g, beta, 0.0, 0, n, T, H, K, C, BK, GATE, DT)
    k1, b1, G1b = _key_block(k, g, beta, tl.sum(tl.where(jc < BS, gc, 0.0)), 1, n, T, H, K, C,
                             BK, GATE, DT)
    k2, b2, G2 = _key_block(k, g, beta, tl.sum(tl.where(jc < 2 * BS, gc, 0.0)), 2, n, T, H, K,
                            C, BK, GATE, DT)
    k3, b3, G3 = _key_block(k, g, beta, tl.sum(tl.where(jc < 3 * BS, gc, 0.0)), 3, n, T, H, K,
                            C, BK, GATE, DT)
    T00, T10, T11, T20, T21, T22, T30, T31, T32, T33 = _invert(
        _kkt_block(k0, k0, b0, G0, G0, True, GATE, IEEE),
        _kkt_block(k1, k0, b1, G1b, G0, False, GATE, IEEE),
        _kkt_block(k1, k1, b1, G1b, G1b, True, GATE, IEEE),
        _kkt_block(k2, k0, b2, G2, G0, False, GATE, IEEE),
        _kkt_block(k2, k1, b2, G2, G1b, False, GATE, IEEE),
        _kkt_block(k2, k2, b2, G2, G2, True, GATE, IEEE),
        _kkt_block(k3, k0, b3, G3, G0, False, GATE, IEEE),
        _kkt_block(k3, k1, b3, G3, G1b, False, GATE, IEEE),
        _kkt_block(k3, k2, b3, G3, G2, False, GATE, IEEE),
        _kkt_block(k3, k3, b3, G3, G3, True, GATE, IEEE), PREC)
    _store_inverse(ai, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, n, T, H, C)


@triton.jit
def _scores_kernel(q, k, g, beta, a, aqk, scale, T, H, K: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, X3: tl.constexpr):
    """KDA: rows of one sub-chunk of A and Aqk (see `_kda_subchunk`)."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    r0 = (b * T + n * C).to(tl.int64) * H + h
    q, k, g, beta, a, aqk = q + r0 * K, k + r0 * K, g + r0 * K, beta + r0, a + r0 * C, aqk + r0 * C
    _kda_subchunk(q, k, g, beta, a, aqk, tl.program_id(2), n, scale, T, H, K, C, BK, DT, IEEE, X3)


@triton.jit
def _inverse_kernel(a, ai, T, H, C: tl.constexpr, PREC: tl.constexpr):
    """KDA: 𝒯 of one (chunk, head) from A's ten 16×16 blocks, loaded at once."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    r0 = (b * T + n * C).to(tl.int64) * H + h
    a, ai = a + r0 * C, ai + r0 * C                                               # the chunk's row 0
    T00, T10, T11, T20, T21, T22, T30, T31, T32, T33 = _invert(
        _load_block(a, 0, 0, n, T, H, C), _load_block(a, 1, 0, n, T, H, C),
        _load_block(a, 1, 1, n, T, H, C), _load_block(a, 2, 0, n, T, H, C),
        _load_block(a, 2, 1, n, T, H, C), _load_block(a, 2, 2, n, T, H, C),
        _load_block(a, 3, 0, n, T, H, C), _load_block(a, 3, 1, n, T, H, C),
        _load_block(a, 3, 2, n, T, H, C), _load_block(a, 3, 3, n, T, H, C), PREC)
    _store_inverse(ai, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, n, T, H, C)


@triton.jit
def _wu_kernel(q, k, v, g, beta, ai, w, u, qg, kd, dl, scale, T, NT, H, K: tl.constexpr,
               V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    # grid axis 2 splits the work in two programs of similar size: part 0 everything that reads
    # K and the gates (W, the state pass's decays, scale · Q ⊙ e^G), part 1 all of U, V-block by
    # V-block, reading 𝒯 once. (Computing W in the U program too gave wrong W for bf16 at K ≤ 32
    # when compiled for an H200, though right under the interpreter.)
    n, bh, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    t = n * C + tl.arange(0, C)
    tm = t < T
    r0 = (b * T + n * C).to(tl.int64) * H + h                                    # the chunk's row 0
    q, k, v, beta, ai = q + r0 * K, k + r0 * K, v + r0 * V, beta + r0, ai + r0 * C
    w, u, qg, kd = w + r0 * K, u + r0 * V, qg + r0 * K, kd + r0 * K
    if GATE == 2:
        g += r0 * K
    else:
        g += r0
    jc = tl.arange(0, C)
    row = jc * H                                                                  # [C]
    bt = tl.load(beta + row, mask=tm, other=0.0).to(tl.float32)                   # [C]
    if part == 1:
        Ti = tl.load(ai + row[:, None] * C + jc[None, :], mask=tm[:, None], other=0.0).to(DT)  # [C, C]
        for iv in tl.static_range(0, V, BV):
            dv = iv + tl.arange(0, BV)
            mv = tm[:, None] & (dv[None, :] < V)
            vt = tl.load(v + row[:, None] * V + dv[None, :], mask=mv, other=0.0).to(tl.float32)
            Ut = dot(Ti, (vt * bt[:, None]).to(DT), IEEE)                         # [C, BV]
            tl.store(u + row[:, None] * V + dv[None, :], Ut.to(u.dtype.element_ty), mask=mv)
    else:
        _w_part(q, k, g, ai, bt, w, qg, kd, dl, scale, row, t, n, bh, T, NT, H, K, C, BK, GATE, DT, IEEE)


@triton.jit
def _w_part(q, k, g, ai, bt, w, qg, kd, dl, scale, row, t, n, bh, T, NT, H, K: tl.constexpr,
            C: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr, DT: tl.constexpr,
            IEEE: tl.constexpr):
    """Everything that reads K (and the gates), from one load of each: W = 𝒯 (β K ⊙ e^G); with
    gates, for the state pass, K ⊙ e^{G_C − G} and e^{G_C}; with per-dimension gates
    scale · Q ⊙ e^G. G_C − G_i = g_{i+1} + … + g_C comes from the sum taken from the chunk end
    minus g_i (never a difference of two long prefix sums); padded rows have g = 0."""
    tm = t < T
    dk = tl.arange(0, BK)
    jc = tl.arange(0, C)
    mk = tm[:, None] & (dk[None, :] < K)
    kt = tl.load(k + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(tl.float32)  # [C, BK]
    eg = tl.full((C, 1), 1.0, tl.float32)                                         # e^G, no gates
    if GATE == 2:
        gt = tl.load(g + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(tl.float32)  # [C, BK]
        eg = tl.exp(tl.cumsum(gt, axis=0))                                        # e^G ≤ 1
        tail = tl.exp(tl.cumsum(gt, axis=0, reverse=True) - gt)                   # e^{G_C − G}
        gc = tl.sum(gt, axis=0)                                                   # [BK] G_C
        qt = tl.load(q + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(tl.float32)
        tl.store(qg + row[:, None] * K + dk[None, :], (qt * eg * scale).to(qg.dtype.element_ty),
                 mask=mk)
    if GATE == 1:
        gt = tl.load(g + row, mask=tm, other=0.0).to(tl.float32)                  # [C]
        eg = tl.exp(tl.cumsum(gt, axis=0))[:, None]
        tail = tl.exp(tl.cumsum(gt, axis=0, reverse=True) - gt)[:, None]
        gc = tl.zeros((BK,), dtype=tl.float32) + tl.sum(gt, axis=0)
    if GATE > 0:
        tl.store(kd + row[:, None] * K + dk[None, :], (kt * tail).to(kd.dtype.element_ty), mask=mk)
        tl.store(dl + (bh.to(tl.int64) * NT + n) * K + dk, tl.exp(gc), mask=dk < K)
    Ti = tl.load(ai + row[:, None] * C + jc[None, :], mask=tm[:, None], other=0.0).to(DT)  # [C, C]
    Wt = dot(Ti, (kt * bt[:, None] * eg).to(DT), IEEE)                           # [C, BK]
    tl.store(w + row[:, None] * K + dk[None, :], Wt.to(w.dtype.element_ty), mask=mk)
