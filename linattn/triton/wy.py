"""Stage 1 of the delta-rule kernels: the WY/UT factors of every chunk, in three plain kernels.

Notation as in linattn.chunk.delta: a chunk of C tokens, G_i the log-decay summed from the chunk
start (per key dimension for KDA, one per head for Gated DeltaNet, 0 for DeltaNet),
A_ij = β_i Σ_d k_id k_jd e^{G_id − G_jd} (i > j), Aqk_ij = scale Σ_d q_id k_jd e^{G_id − G_jd}
(j ≤ i), 𝒯 = (I + A)⁻¹, W = 𝒯 diag(β)(K ⊙ e^G), U = 𝒯 diag(β) V.

1. `_scores_kernel`, one program per (chunk, head), for KDA per (chunk, head, sub-chunk of 16):
   A (float32) and Aqk (tile dtype), row t of a [B, T, H, C] tensor holding its chunk's row.
   DeltaNet / Gated DeltaNet: one dot each (and a C×C decay factor). KDA: left of the diagonal,
   one dot split at the sub-chunk boundary; the 16×16 diagonal block by one float32 dot or, for
   gates that decay by 60 or more within the sub-chunk, column by column.
2. `_inverse_kernel`, one program per (chunk, head): 𝒯 from A in 16×16 blocks that move through
   memory — forward substitution on each diagonal block with its rows loaded by pointer, then
   𝒯_ij = −𝒯_ii Σ_{j≤m<i} A_im 𝒯_mj for the blocks below, one row of blocks after another.
3. `_wu_kernel`, one program per (chunk, head, part): W, U, or what stages 2 and 3
   need (K ⊙ e^{G_C − G}, e^{G_C}, and for per-dimension gates scale · Q ⊙ e^G): tiled matmuls
   and elementwise decays.

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
# KDA scores (diagonal blocks column by column) 2 / 4 / 8 warps 3.05 / 1.68 / 2.22 ms, W/U 4 warps 0.69 ms vs
# 8 warps 1.05, inverse 2 warps 0.36 ms vs 4 warps 0.66. (8 warps spill less when compiled for
# sm_90 on a CPU, yet ran slower.)
TUNING = dict(warps_scores=4, warps_inverse=2, warps_wu=4)


def scores_stage(q, k, g, beta, p) -> dict:
    """A [B,T,H,C] float32 (β_i on row i, strictly lower) and aqk [B,T,H,C] = scale · Aqk in the
    tile dtype (diagonal included); row t holds its chunk's row, zeros right of the diagonal."""
    a = outputs.empty((p.B, p.T, p.H, p.C), dtype=torch.float32, device=p.device)
    aqk = outputs.empty((p.B, p.T, p.H, p.C), dtype=p.work, device=p.device)
    # KDA: one program per (chunk, head, sub-chunk); else per (chunk, head)
    _scores_kernel[(p.NT, p.B * p.H, p.C // SUB if p.gate == 2 else 1)](
        q, k, g if p.gate else q, beta, a, aqk, p.scale, p.T, p.H,
        K=p.K, C=p.C, BK=p.BK, GATE=p.gate, DT=p.cdt, IEEE=p.ieee, X3=not interpreting(),
        num_warps=TUNING["warps_scores"])
    return dict(a=a, aqk=aqk)


def inverse_stage(a, p):
    """𝒯 = (I + A)⁻¹ per chunk, [B,T,H,C] float32 laid out like A (unit lower triangular)."""
    ai = outputs.empty((p.B, p.T, p.H, p.C), dtype=torch.float32, device=p.device)
    _inverse_kernel[(p.NT, p.B * p.H)](a, ai, p.T, p.H, C=p.C, X3=not interpreting(),
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
    _wu_kernel[(p.NT, B * H, 3 if p.gate else 2)](
        q, k, v, g if p.gate else q, beta, ai, w, u, qg if p.gate == 2 else w, kd,
        dl if p.gate else w, p.scale, T, p.NT, H,
        K=K, V=V, C=p.C, BK=p.BK, BV=BV, GATE=p.gate, DT=p.cdt, IEEE=p.ieee,
        num_warps=TUNING["warps_wu"])
    return dict(w=w, u=u, qg=qg, kd=kd, dl=dl)


def wy_stage(q, k, v, g, beta, p) -> dict:
    """Stage 1 whole: the three kernels above; returns the union of their tensors (a, ai too)."""
    s = scores_stage(q, k, g, beta, p)
    ai = inverse_stage(s["a"], p)
    return dict(s, ai=ai, **wu_stage(q, k, v, g, beta, ai, p))


# ---------------------------------------------------------------- device helpers

@triton.jit
def _f32(a, b, X3: tl.constexpr):
    """a @ b of float32 16×16 blocks (the inverse) at about float32 accuracy.

    On the GPU three tf32 tensor-core products (tf32x3, relative error ~2⁻²¹): plain tf32 keeps
    10 bits, IEEE products run on the FMA units. Under the interpreter (X3 false): exact float32."""
    if X3:
        return tl.dot(a, b, input_precision="tf32x3")
    return tl.dot(a, b, input_precision="ieee")


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


# ---------------------------------------------------------------- the three kernels

@triton.jit
def _scores_kernel(q, k, g, beta, a, aqk, scale, T, H, K: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
                   X3: tl.constexpr):
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t = n * C + tl.arange(0, C)
    tm = t < T
    # pointers to the chunk's first token of this head, then 32-bit offsets inside the chunk
    # (a [C, BK] tile of 64-bit addresses costs twice the registers)
    r0 = (b * T + n * C).to(tl.int64) * H + h
    q, k, beta, a, aqk = q + r0 * K, k + r0 * K, beta + r0, a + r0 * C, aqk + r0 * C
    if GATE == 2:
        g += r0 * K
    else:
        g += r0
    jc = tl.arange(0, C)
    row = jc * H                                                                  # [C] token rows
    dk = tl.arange(0, BK)
    mk = tm[:, None] & (dk[None, :] < K)
    if GATE == 2:
        _kda_subchunk(q, k, g, beta, a, aqk, tl.program_id(2), n, scale, T, H, K, C, BK, DT, IEEE, X3)
    else:
        kt = tl.load(k + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(DT)  # [C, BK]
        qt = tl.load(q + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(DT)
        A = dot(kt, tl.trans(kt), IEEE)                                           # [C, C]
        Aqk = dot(qt, tl.trans(kt), IEEE)
        if GATE == 1:
            G1 = tl.cumsum(tl.load(g + row, mask=tm, other=0.0).to(tl.float32), axis=0)  # [C]
            E = tl.exp(tl.minimum(G1[:, None] - G1[None, :], 0.0))                # ≤ 1 where kept
            A, Aqk = A * E, Aqk * E
        bt = tl.load(beta + row, mask=tm, other=0.0).to(tl.float32)               # [C]
        A = tl.where(jc[:, None] > jc[None, :], A, 0.0) * bt[:, None]             # β_i on row i
        Aqk = tl.where(jc[:, None] >= jc[None, :], Aqk, 0.0) * scale
        tl.store(a + row[:, None] * C + jc[None, :], A, mask=tm[:, None])
        tl.store(aqk + row[:, None] * C + jc[None, :], Aqk.to(aqk.dtype.element_ty), mask=tm[:, None])


@triton.jit
def _inverse_kernel(a, ai, T, H, C: tl.constexpr, X3: tl.constexpr):
    """(I + A)⁻¹ by rows of 16×16 blocks. Row block i needs A's row block i and the finished
    blocks 𝒯_mj of earlier row blocks, which this program stored and reads back (a barrier
    between), so no block is ever moved within registers."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    r0 = (b * T + n * C).to(tl.int64) * H + h
    a, ai = a + r0 * C, ai + r0 * C                                               # the chunk's row 0
    r = tl.arange(0, BS)
    jc = tl.arange(0, C)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)                           # [16, 16]
    # 1. the diagonal blocks, independent of each other (unrolled, so their chains interleave):
    # row m of R = 𝒯_ii − I solves R_m = −A_m − Σ_{l<m} A_ml R_l, with A_m read from memory
    # (no row is pulled out of a register tile); rows above m are final already
    for i in tl.static_range(C // BS):
        ti = n * C + i * BS + r
        ri = (i * BS + r) * H                                                     # [16] rows of block i
        R = tl.zeros((BS, BS), dtype=tl.float32)
        for m in tl.static_range(1, BS):
            am = tl.load(a + (i * BS + m) * H * C + i * BS + r,
                         mask=(r < m) & (n * C + i * BS + m < T), other=0.0)     # [16] A_m in block
            Rm = -am - tl.sum(am[:, None] * R, axis=0)
            R = tl.where(r[:, None] == m, Rm[None, :], R)
        tl.store(ai + ri[:, None] * C + i * BS + r[None, :], R + eye, mask=(ti < T)[:, None])
        # zeros right of the diagonal block (columns disjoint from every other store)
        tl.store(ai + ri[:, None] * C + jc[None, :], tl.zeros((BS, C), dtype=tl.float32),
                 mask=(ti < T)[:, None] & (jc[None, :] >= (i + 1) * BS))
    # 2. blocks below the diagonal, row block after row block: 𝒯_ij = −𝒯_ii Σ_{m=j}^{i−1} A_im 𝒯_mj
    for i in tl.static_range(1, C // BS):
        tl.debug_barrier()                                       # earlier row blocks are visible
        ti = n * C + i * BS + r
        ri = (i * BS + r) * H
        mi = (ti < T)[:, None]
        Dinv = tl.load(ai + ri[:, None] * C + i * BS + r[None, :], mask=mi, other=0.0)  # 𝒯_ii
        for j in tl.static_range(i):
            acc = tl.zeros((BS, BS), dtype=tl.float32)
            for m in tl.static_range(j, i):
                tmm = n * C + m * BS + r
                rm = (m * BS + r) * H
                Aim = tl.load(a + ri[:, None] * C + m * BS + r[None, :], mask=mi, other=0.0)
                Tmj = tl.load(ai + rm[:, None] * C + j * BS + r[None, :],
                              mask=(tmm < T)[:, None], other=0.0)                 # [16, 16]
                acc += _f32(Aim, Tmj, X3)
            tl.store(ai + ri[:, None] * C + j * BS + r[None, :], -_f32(Dinv, acc, X3), mask=mi)


@triton.jit
def _wu_kernel(q, k, v, g, beta, ai, w, u, qg, kd, dl, scale, T, NT, H, K: tl.constexpr,
               V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    # grid axis 2 splits the work into programs of similar size: part 0 computes W (and
    # scale · Q ⊙ e^G), with gates part 1 the decays for the state pass, the last all of U, V-block
    # by V-block, reading 𝒯 (float32, the largest tile here) once. (Computing W in that program
    # too gave wrong W for bf16 at K ≤ 32 when compiled for an H200, though right under the
    # interpreter; as one program per V-block, 𝒯 was read once more.)
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
    UP: tl.constexpr = 2 if GATE > 0 else 1                                       # the U part
    if part >= UP:
        Ti = tl.load(ai + row[:, None] * C + jc[None, :], mask=tm[:, None], other=0.0).to(DT)  # [C, C]
        for iv in tl.static_range(0, V, BV):
            dv = iv + tl.arange(0, BV)
            mv = tm[:, None] & (dv[None, :] < V)
            vt = tl.load(v + row[:, None] * V + dv[None, :], mask=mv, other=0.0).to(tl.float32)
            Ut = dot(Ti, (vt * bt[:, None]).to(DT), IEEE)                         # [C, BV]
            tl.store(u + row[:, None] * V + dv[None, :], Ut.to(u.dtype.element_ty), mask=mv)
    elif part == 0:
        _w_part(q, k, g, ai, bt, w, qg, scale, row, t, T, H, K, C, BK, GATE, DT, IEEE)
    else:
        _decay_part(k, g, kd, dl, row, t, n, bh, T, NT, H, K, C, BK, GATE)


@triton.jit
def _w_part(q, k, g, ai, bt, w, qg, scale, row, t, T, H, K: tl.constexpr, C: tl.constexpr,
            BK: tl.constexpr, GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    """W = 𝒯 (β K ⊙ e^G); with per-dimension gates also scale · Q ⊙ e^G (e^G ≤ 1: G from the
    chunk start)."""
    tm = t < T
    dk = tl.arange(0, BK)
    jc = tl.arange(0, C)
    mk = tm[:, None] & (dk[None, :] < K)
    kb = tl.load(k + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(tl.float32) * bt[:, None]
    if GATE > 0:
        if GATE == 2:
            eg = tl.exp(tl.cumsum(tl.load(g + row[:, None] * K + dk[None, :], mask=mk,
                                          other=0.0).to(tl.float32), axis=0))     # [C, BK]
        else:
            eg = tl.exp(tl.cumsum(tl.load(g + row, mask=tm, other=0.0).to(tl.float32), axis=0))[:, None]
        kb = kb * eg
        if GATE == 2:
            qt = tl.load(q + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(tl.float32)
            tl.store(qg + row[:, None] * K + dk[None, :], (qt * eg * scale).to(qg.dtype.element_ty),
                     mask=mk)
    Ti = tl.load(ai + row[:, None] * C + jc[None, :], mask=tm[:, None], other=0.0).to(DT)  # [C, C]
    Wt = dot(Ti, kb.to(DT), IEEE)                                                 # [C, BK]
    tl.store(w + row[:, None] * K + dk[None, :], Wt.to(w.dtype.element_ty), mask=mk)


@triton.jit
def _decay_part(k, g, kd, dl, row, t, n, bh, T, NT, H, K: tl.constexpr, C: tl.constexpr,
                BK: tl.constexpr, GATE: tl.constexpr):
    """For the state pass: K ⊙ e^{G_C − G} and e^{G_C}. G_C − G_i = g_{i+1} + … + g_C is summed
    from the chunk end over the gates shifted up one row, not as a difference of prefix sums
    (which loses the small remainder next to a large G_i); padded rows have g = 0."""
    tm = t < T
    dk = tl.arange(0, BK)
    jc = tl.arange(0, C)
    mk = tm[:, None] & (dk[None, :] < K)
    nxt = ((t + 1) < T) & (jc < C - 1)
    kt = tl.load(k + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(tl.float32)  # [C, BK]
    if GATE == 2:
        gsh = tl.load(g + (row + H)[:, None] * K + dk[None, :],
                      mask=nxt[:, None] & (dk[None, :] < K), other=0.0).to(tl.float32)
        gc = tl.sum(tl.load(g + row[:, None] * K + dk[None, :], mask=mk, other=0.0).to(tl.float32),
                    axis=0)                                                       # [BK] G_C
        tail = tl.exp(tl.cumsum(gsh, axis=0, reverse=True))                       # [C, BK]
    else:
        gsh = tl.load(g + row + H, mask=nxt, other=0.0).to(tl.float32)            # [C]
        gc = tl.zeros((BK,), dtype=tl.float32) + tl.sum(tl.load(g + row, mask=tm, other=0.0).to(tl.float32),
                                                        axis=0)
        tail = tl.exp(tl.cumsum(gsh, axis=0, reverse=True))[:, None]
    tl.store(kd + row[:, None] * K + dk[None, :], (kt * tail).to(kd.dtype.element_ty), mask=mk)
    tl.store(dl + (bh.to(tl.int64) * NT + n) * K + dk, tl.exp(gc), mask=dk < K)
