"""The backward pass of gated linear attention (GLA) and linear attention in Triton.

Forward, per chunk of C tokens starting at t0 (gated.py), with b the chunk-local cumulative
log-gate, h the state before the chunk and scale s:
    o_t    = s · ((q_t ⊙ e^{b_t}) h + Σ_{j ≤ t} A_tj v_j),   A_tj = Σ_k q_tk k_jk e^{b_tk − b_jk}
    h_next = diag(e^{b_last}) h + Σ_j (k_j ⊙ e^{b_last − b_j})ᵀ v_j
Given dO and the gradient of the final state, with D the gradient of the state *after* the chunk
and dA_tj = s · dO_t · v_j (j ≤ t):
    D_prev = diag(e^{b_last}) D + s · (Q ⊙ e^{b})ᵀ dO                      reverse pass (sequential)
    dq_t   = s · (dO_t hᵀ) ⊙ e^{b_t}        + Σ_{j ≤ t} dA_tj k_j ⊙ e^{b_t − b_j}
    dk_j   = (v_j Dᵀ) ⊙ e^{b_last − b_j}    + Σ_{t ≥ j} dA_tj q_t ⊙ e^{b_t − b_j}
    dv_j   = (k_j ⊙ e^{b_last − b_j}) D     + s · Σ_{t ≥ j} A_tj dO_t
Only the reverse pass walks the chunks in order (cut into segments where its walks leave most SMs
idle: segments.py); everything else is parallel over chunks.

The gate gradient has a closed form, taken chunk by chunk as linattn.chunk takes it. Inside chunk
n, q and k enter only through q_t ⊙ e^{b_t} and k_t ⊙ e^{−b_t}, the state after the chunk through
e^{b_last} h and k_j ⊙ e^{b_last − b_j}; everything later sees g_u only through that state, whose
gradient D already carries it. So, for u in the chunk,
    dg_u = Σ_{t ≥ u} (q_t ⊙ dq_t − k_t ⊙ dk^intra_t) + Σ_{j < u} k_j ⊙ write_j + e^{b_last} ⊙ Σ_v h ⊙ D,
both sums over the chunk only, write_j = (v_j Dᵀ) ⊙ e^{b_last − b_j} the part of dk_j through the
state. Two cancellations are left out: the diagonal of dA (it enters q ⊙ dq and k ⊙ dk alike), and
the final state's decay against every write into it (e^{b_last} Σ_v S_after ⊙ D minus the writes
from u on leaves the writes before u: the exclusive prefix). The same sum taken from the sequence
start (∂L/∂B_t with B the cumulative gate of the whole sequence, suffix-summed over all T tokens)
is exact algebra too, but it adds T terms of size |q ⊙ dq| that cancel to a gradient that strong
gates make tiny: in bf16 its relative error was 4–40× FLA's. Per-head gates sum over k.

The intra-chunk sums have the structure of A itself, so they use the forward's secondary
chunking (sub-chunks of c tokens):
- an off-diagonal tile splits e^{b_t − b_s} at a point r between the two sub-chunks into two
  factors ≤ 1 and becomes one tensor-core matmul. For dq (query sub-chunk i, keys j < i) r is b
  just before sub-chunk i; for dk (key sub-chunk i, queries i' > i) r is b at the last token of
  sub-chunk i, so one reference serves all the tiles one program sums;
- a diagonal tile is summed in float32 with decay tiles built one gate factor (≤ 1) at a time:
  for dq a column walk, E_s[t] = e^{b_t − b_s} from E_{s+1}[t] · e^{g_{s+1}}; for dk a
  row walk, F_t[s] = F_{t−1}[s] · e^{g_t}, which adds one rank-one tile per row instead of summing
  across rows.

Kernels, in the order the backward runs them (`backward`):
  chunk_states (gated.py)  h, the state before every chunk (recomputed when recompute=True)
  _dstates_kernel          D for every chunk and dinitial_state: the reverse pass
  _dA_kernel               dA = s · dO Vᵀ (lower triangle of every chunk), float32
  _intra_grad_kernel       the intra-chunk parts of dq and dk (secondary chunking), float32
  intra_attention (gated.py) A for per-dimension gates (only when the forward's A is not at hand)
  _dv_kernel               dv
  _dqk_kernel              dq, dk (state parts added), and ∂L/∂b for the gate gradient
  _dg_kernel               dg = Σ_{s ≥ t} ∂L/∂b_s: each row block's own sums plus the later blocks' totals
Without per-dimension gates, for half-precision inputs in chunks of at most 64 tokens (`fused_intra`),
_dqk_kernel computes dA and the intra parts itself, and _dA_kernel and _intra_grad_kernel do not run.

Packed sequences (`cu_seqlens`) are indexed as in the forward (gated.py, "Packed sequences"): the
reverse pass runs one program per (sequence, head, block) over that sequence's chunks from its last,
dh [1, H, NT, K, V] holding a sequence's chunks from chunk_offsets[n] on and dsT, ds0 [N, H, K, V];
every other kernel is parallel over the row's chunks (or row blocks, NB = NT · C/BR of them) and
takes its (sequence n, chunk i) from chunk_indices. Nothing crosses a chunk boundary here, so
nothing crosses a sequence's: an empty sequence has no chunk, and its ds0 is its dsT.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import outputs
from ..validate import InputError, first_order
from .common import (block, compute_dtype, contiguous, decayed_dtype, dot, dot_input, dot_split, gate_floor,
                     kernel, launch, operand, stage, warps)
from . import gated, segments
from .gated import (DIM_GATE, HEAD_GATE, NO_GATE, ROW_BLOCK, STATE_BLOCK, _gate_row, _packed_chunk, _packed_seq,
                    packed_args, row_chunks)

last_launch: dict = {}
# Width of the K- and V-blocks of the gradient kernels: their float32 accumulators are [64, 64] at
# most, whatever K is (K = 256 in one block would be [64, 256] twice, far over the registers).
GRAD_BLOCK = 64


@triton.jit
def _load_b(b_base, rows, rmask, s_b, offs_k, kmask, GATE: tl.constexpr):
    """Chunk-local cumulative gates of `rows`: [R, BK] per dimension, [R] per head, 0 past T.

    One return statement: natively every return of a jitted function must have one type, and a
    return after an `if` is compiled even when a constexpr branch above it already returned."""
    if GATE == 2:
        x = tl.load(b_base + rows[:, None] * s_b + offs_k[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
    else:
        x = tl.load(b_base + rows * s_b, mask=rmask, other=0.0)
    return x


@triton.jit
def _load_b_last(b_base, t0, T, s_b, offs_k, kmask, C: tl.constexpr, GATE: tl.constexpr):
    """b at the last token of the chunk starting at t0: [BK] per dimension, a scalar per head."""
    last = tl.minimum(t0 + C, T) - 1
    if GATE == 2:
        x = tl.load(b_base + last * s_b + offs_k, mask=kmask, other=0.0)
    else:
        x = tl.load(b_base + last * s_b)
    return x


@kernel
def _dstates_kernel(q, do, b, dh, dsT, ds0, T, H, K, V, NT, scale, C: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, GATE: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr,
                    QDT: tl.constexpr, HAS_DST: tl.constexpr, STORE_DS0: tl.constexpr, cu_seqlens=None,
                    chunk_offsets=None, VARLEN: tl.constexpr = False, decay=None, STORE_DH: tl.constexpr = True,
                    STORE_DECAY: tl.constexpr = False):
    # One program per (K-block, V-block, batch·head) walks the chunks from last to first:
    # dh[n] = D, the gradient of the state after chunk n; then D ← diag(e^{b_last}) D + s (Q ⊙ e^b)ᵀ dO.
    # Step 1 of a pass cut into segments (segments.py) writes no dh, only ds0 and, with STORE_DECAY, the summed
    # log-decay decay [N, H, K] (per dimension) or [N, H] (per head).
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_hs, NT_h = i_bh, NT                                     # dh's row i_hs of NT_h chunks
    if VARLEN:
        # packed (B = 1, NT the row's chunks): i_bh = (sequence i_b, head i_h), dsT and ds0
        # [N, H, K, V]; dh [1, H, NT, K, V] holds this sequence's chunks from chunk_offsets[i_b] on
        bos, T = _packed_seq(cu_seqlens, i_b)
        q, do, b = q + bos * H * K, do + bos * H * V, _gate_row(b, bos, H, K, GATE)
        dh += tl.load(chunk_offsets + i_b) * K * V
        i_hs, NT = i_h, tl.cdiv(T, C)
        i_b = 0
    q_base = q + i_b * T * H * K + i_h * K
    do_base = do + i_b * T * H * V + i_h * V
    if GATE == 2:
        b_base = b + i_b * T * H * K + i_h * K
        s_b = H * K
    else:
        b_base = b + i_b * T * H + i_h
        s_b = H
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    kmask, vmask = offs_k < K, offs_v < V
    smask = kmask[:, None] & vmask[None, :]
    s_offs = offs_k[:, None] * V + offs_v[None, :]
    if HAS_DST:
        D = tl.load(dsT + i_bh * K * V + s_offs, mask=smask, other=0.0).to(tl.float32)        # [BK, BV]
    else:
        D = tl.zeros([BK, BV], dtype=tl.float32)
    if GATE == 2:
        total = tl.zeros([BK], dtype=tl.float32)
    else:
        total = 0.0
    for u in range(NT):
        n = NT - 1 - u
        if STORE_DH:
            tl.store(dh + (i_hs * NT_h + n) * K * V + s_offs, D.to(dh.dtype.element_ty), mask=smask)
        rows = n * C + tl.arange(0, C)
        rmask = rows < T
        q_n = tl.load(q_base + rows[:, None] * H * K + offs_k[None, :], mask=rmask[:, None] & kmask[None, :],
                      other=0.0).to(tl.float32)                                                # [C, BK]
        do_n = tl.load(do_base + rows[:, None] * H * V + offs_v[None, :], mask=rmask[:, None] & vmask[None, :],
                       other=0.0).to(COMPUTE)                                                  # [C, BV]
        if GATE != 0:
            b_n = _load_b(b_base, rows, rmask, s_b, offs_k, kmask, GATE)                       # [C, BK] or [C]
            b_last = _load_b_last(b_base, n * C, T, s_b, offs_k, kmask, C, GATE)               # [BK] or scalar
            if GATE == 2:
                q_n = q_n * tl.exp(b_n)                        # queries decayed from the chunk start (≤ |q|)
                D = D * tl.exp(b_last)[:, None]
            else:
                q_n = q_n * tl.exp(b_n)[:, None]
                D = D * tl.exp(b_last)
            if STORE_DECAY:
                total += b_last
        D += scale * dot(tl.trans(operand(q_n, QDT, IEEE)), do_n.to(QDT), IEEE)                # [BK, BV]
    if STORE_DS0:
        tl.store(ds0 + i_bh * K * V + s_offs, D, mask=smask)
    if STORE_DECAY:
        if i_v == 0:
            if GATE == 2:
                tl.store(decay + i_bh * K + offs_k, total, mask=kmask)
            else:
                if i_k == 0:
                    tl.store(decay + i_bh, total)


@kernel
def _dA_kernel(do, v, dA, T, H, V, scale, C: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
               COMPUTE: tl.constexpr, IEEE: tl.constexpr, cu_seqlens=None, chunk_indices=None,
               VARLEN: tl.constexpr = False):
    # One program per (row block of a chunk, batch·head): dA[t, j] = s · dO_t · v_j for j ≤ t in
    # the chunk, 0 above the diagonal (written, so later kernels may multiply by it).
    i_nr, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, r0 = i_nr // (C // BR), (i_nr % (C // BR)) * BR
    i_b, i_h = i_bh // H, i_bh % H
    if VARLEN:              # packed (B = 1): the row's chunk i_n is chunk i of its sequence
        i_n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, i_n)
        do, v, dA = do + bos * H * V, v + bos * H * V, dA + bos * H * C
    t0 = i_n * C
    do_base = do + i_b * T * H * V + i_h * V
    v_base = v + i_b * T * H * V + i_h * V
    a_base = dA + i_b * T * H * C + i_h * C
    idx = tl.arange(0, BR)
    rows = t0 + r0 + idx
    rmask = rows < T
    p_a = a_base + rows[:, None] * H * C
    for c0 in range(0, r0 + BR, BR):                          # column blocks up to the diagonal
        cols = t0 + c0 + idx
        acc = tl.zeros([BR, BR], dtype=tl.float32)
        for v0 in range(0, V, BV):
            offs_v = v0 + tl.arange(0, BV)
            vmask = offs_v < V
            do_r = tl.load(do_base + rows[:, None] * H * V + offs_v[None, :], mask=rmask[:, None] & vmask[None, :],
                           other=0.0).to(COMPUTE)                                              # [BR, BV]
            v_c = tl.load(v_base + cols[:, None] * H * V + offs_v[None, :],
                          mask=(cols < T)[:, None] & vmask[None, :], other=0.0).to(COMPUTE)   # [BR, BV]
            acc += dot(do_r, tl.trans(v_c), IEEE)                                              # [BR, BR]
        acc = tl.where(rows[:, None] >= cols[None, :], scale * acc, 0.0)
        tl.store(p_a + (c0 + idx)[None, :], acc, mask=rmask[:, None])
    for c0 in range(r0 + BR, C, BR):                          # above the diagonal: zeros
        tl.store(p_a + (c0 + idx)[None, :], tl.zeros([BR, BR], dtype=tl.float32), mask=rmask[:, None])


# T stays specialised here: without knowing that T is a multiple of 16 Triton masks every row of
# every tile separately, and this kernel took 2.7 ms instead of 2.0 (GLA backward, H200, bf16, H = 16,
# K = V = 128, 32k tokens at T = 4k). Masking full chunks at their own end recovered only part of it.
@kernel(keep=("T",))
def _intra_grad_kernel(q, k, g, b, dA, dqi, dki, T, H, K, C: tl.constexpr, c: tl.constexpr, BK: tl.constexpr,
                       GATE: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr, cu_seqlens=None,
                       chunk_indices=None, VARLEN: tl.constexpr = False):
    # One program per (K-block, sub-chunk i of chunk n, batch·head): the intra-chunk parts
    #   dq_t = Σ_{s ≤ t} dA_ts k_s ⊙ e^{b_t − b_s} for the rows t of sub-chunk i (tiles j ≤ i),
    #   dk_s = Σ_{t ≥ s} dA_ts q_t ⊙ e^{b_t − b_s} for the rows s of sub-chunk i (tiles i' ≥ i).
    # Given dA, every key dimension is independent, so K is split into blocks.
    i_kb, i_ni, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_n, i_i = i_ni // (C // c), i_ni % (C // c)
    i_b, i_h = i_bh // H, i_bh % H
    if VARLEN:              # packed (B = 1): the row's chunk i_n is chunk i of its sequence
        i_n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, i_n)
        q, k, g, dqi, dki = q + bos * H * K, k + bos * H * K, g + bos * H * K, dqi + bos * H * K, dki + bos * H * K
        b, dA = _gate_row(b, bos, H, K, GATE), dA + bos * H * C
    t0 = i_n * C
    s0 = t0 + i_i * c
    if s0 < T:
        base = i_b * T * H * K + i_h * K                       # q, k, g (per dim), b (per dim): [B, T, H, K]
        if GATE == 2:
            b_base = b + base
            s_b = H * K
        else:
            b_base = b + i_b * T * H + i_h
            s_b = H
        a_base = dA + i_b * T * H * C + i_h * C                 # dA: [B, T, H, C]
        offs_k = i_kb * BK + tl.arange(0, BK)
        kmask = offs_k < K
        idx = tl.arange(0, c)
        rows = s0 + idx
        rmask = rows < T
        m_i = rmask[:, None] & kmask[None, :]
        p_i = rows[:, None] * H * K + offs_k[None, :]
        q_i = tl.load(q + base + p_i, mask=m_i, other=0.0).to(tl.float32)                    # [c, BK]
        k_i = tl.load(k + base + p_i, mask=m_i, other=0.0).to(tl.float32)                    # [c, BK]
        b_i = _load_b(b_base, rows, rmask, s_b, offs_k, kmask, GATE)                          # [c, BK] or [c]
        n_sub = tl.minimum(C // c, (T - t0 + c - 1) // c)       # sub-chunks of this chunk that hold tokens
        dq = tl.zeros([c, BK], dtype=tl.float32)
        dk = tl.zeros([c, BK], dtype=tl.float32)
        # --- dq: key sub-chunks j < i (all their rows < T) ---
        if GATE == 2:
            # reference r: b just before sub-chunk i; b_t − r ≤ 0 and r − b_s ≤ 0
            r = tl.load(b_base + (s0 - 1) * s_b + offs_k, mask=kmask & (i_i > 0), other=0.0)   # [BK]
            for j in range(i_i):
                p_j = (t0 + j * c + idx)[:, None] * H * K + offs_k[None, :]
                k_j = tl.load(k + base + p_j, mask=kmask[None, :], other=0.0).to(tl.float32)
                b_j = tl.load(b_base + p_j, mask=kmask[None, :], other=0.0)
                k_hat = k_j * tl.exp(r[None, :] - b_j)                                        # [c, BK], ≤ |k|
                dA_ij = tl.load(a_base + rows[:, None] * H * C + (j * c + idx)[None, :], mask=rmask[:, None],
                                other=0.0)                                                    # [c, c]
                # float32 operands (tf32 for half inputs), rounded: `common.operand`
                dq += dot(operand(dA_ij, tl.float32, IEEE), operand(k_hat, tl.float32, IEEE), IEEE)
            dq = dq * tl.exp(tl.minimum(b_i - r[None, :], 0.0))
        else:
            for j in range(i_i):
                cols = t0 + j * c + idx
                k_j = tl.load(k + base + cols[:, None] * H * K + offs_k[None, :], mask=kmask[None, :],
                              other=0.0).to(COMPUTE)                                          # [c, BK]
                dA_ij = tl.load(a_base + rows[:, None] * H * C + (j * c + idx)[None, :], mask=rmask[:, None],
                                other=0.0)                                                    # [c, c]
                if GATE == 1:
                    b_j = tl.load(b_base + cols * s_b)
                    dA_ij = dA_ij * tl.exp(tl.minimum(b_i[:, None] - b_j[None, :], 0.0))
                dq += dot_input(dA_ij, k_j, COMPUTE, IEEE)
        # --- dk: query sub-chunks i' > i (rows past T masked) ---
        last = tl.minimum(s0 + c, T) - 1
        if GATE == 2:
            # reference r: b at the last token of sub-chunk i; b_t − r ≤ 0 and r − b_s ≤ 0
            r = tl.load(b_base + last * s_b + offs_k, mask=kmask, other=0.0)                     # [BK]
            for j in range(i_i + 1, n_sub):
                rows_j = t0 + j * c + idx
                m_j = (rows_j < T)[:, None] & kmask[None, :]
                p_j = rows_j[:, None] * H * K + offs_k[None, :]
                q_j = tl.load(q + base + p_j, mask=m_j, other=0.0).to(tl.float32)
                b_j = tl.load(b_base + p_j, mask=m_j, other=0.0)
                # the clamp keeps rows past T (b = 0 there, q = 0) from overflowing
                q_hat = q_j * tl.exp(tl.minimum(b_j - r[None, :], 0.0))                        # [c, BK]
                dA_ji = tl.load(a_base + rows_j[:, None] * H * C + (i_i * c + idx)[None, :],
                                mask=(rows_j < T)[:, None], other=0.0)                         # [c, c]
                dk += dot(tl.trans(operand(dA_ji, tl.float32, IEEE)), operand(q_hat, tl.float32, IEEE), IEEE)
            dk = dk * tl.exp(tl.minimum(r[None, :] - b_i, 0.0))
        else:
            for j in range(i_i + 1, n_sub):
                rows_j = t0 + j * c + idx
                jmask = rows_j < T
                q_j = tl.load(q + base + rows_j[:, None] * H * K + offs_k[None, :],
                              mask=jmask[:, None] & kmask[None, :], other=0.0).to(COMPUTE)     # [c, BK]
                dA_ji = tl.load(a_base + rows_j[:, None] * H * C + (i_i * c + idx)[None, :], mask=jmask[:, None],
                                other=0.0)                                                    # [c, c]
                if GATE == 1:
                    b_j = tl.load(b_base + rows_j * s_b, mask=jmask, other=0.0)
                    dA_ji = dA_ji * tl.exp(tl.minimum(b_j[:, None] - b_i[None, :], 0.0))
                dk += dot_input(tl.trans(dA_ji), q_j, COMPUTE, IEEE)
        # --- the diagonal tile, float32 ---
        if GATE == 2:
            # dq: columns s from last to first with the decay tile E[t] = e^{b_t − b_s} (rows t < s: 0),
            # each step one more gate factor ≤ 1, so nothing overflows
            E = tl.zeros([c, BK], dtype=tl.float32)
            for u in range(c):
                s = c - 1 - u
                p = (s0 + s) * H * K + offs_k
                k_s = tl.load(k + base + p, mask=kmask & (s0 + s < T), other=0.0).to(tl.float32)      # [BK]
                g_n = gate_floor(tl.load(g + base + p + H * K, mask=kmask & (s + 1 < c) & (s0 + s + 1 < T),
                              other=0.0))
                E = tl.where(idx[:, None] == s, 1.0, E * tl.exp(g_n)[None, :])                        # E_s
                a_s = tl.load(a_base + rows * H * C + i_i * c + s, mask=rmask, other=0.0)              # [c] dA[:, s]
                dq += a_s[:, None] * k_s[None, :] * E
            # dk: rows t from first to last with F[s] = e^{b_t − b_s} (columns s > t: 0). Row by row,
            # dk[s] += dA[t, s] q_t F[s] is a rank-one update of the whole tile: no sum across rows
            # and no scatter into row s, which column by column needed.
            F = tl.zeros([c, BK], dtype=tl.float32)
            for t in range(c):
                p = (s0 + t) * H * K + offs_k
                live = s0 + t < T
                q_t = tl.load(q + base + p, mask=kmask & live, other=0.0).to(tl.float32)             # [BK]
                g_t = gate_floor(tl.load(g + base + p, mask=kmask & live, other=0.0))             # [BK]
                F = tl.where(idx[:, None] == t, 1.0, F * tl.exp(g_t)[None, :])                        # F_t
                a_t = tl.load(a_base + (s0 + t) * H * C + i_i * c + idx, mask=live, other=0.0)        # [c] dA[t, :]
                dk += a_t[:, None] * q_t[None, :] * F
        else:
            dA_ii = tl.load(a_base + rows[:, None] * H * C + (i_i * c + idx)[None, :], mask=rmask[:, None],
                            other=0.0)                                                                 # [c, c]
            if GATE == 1:
                dA_ii = dA_ii * tl.exp(tl.minimum(b_i[:, None] - b_i[None, :], 0.0))
            dA_ii = tl.where(idx[:, None] >= idx[None, :], dA_ii, 0.0)
            # without a per-dimension decay the diagonal tile is a masked matmul, as in the forward.
            # dA is a float32 intermediate against keys and queries exact in their dtype: two parts
            # (`common.dot_input`), as every tile here. Rounded to bf16 first, dA left linear
            # attention's dk up to 1.43x less precise than FLA's on a single token (H200, conformance
            # case linear_attn-extra-157, T = 1: 2.88e-3 against 2.01e-3), where it is the whole gradient
            dq += dot_input(dA_ii, k_i, COMPUTE, IEEE)
            dk += dot_input(tl.trans(dA_ii), q_i, COMPUTE, IEEE)
        tl.store(dqi + base + p_i, dq, mask=m_i)
        tl.store(dki + base + p_i, dk, mask=m_i)


@kernel
def _dv_kernel(q, k, b, A, do, dh, dv, T, H, K, V, NT, scale, C: tl.constexpr, BR: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr,
               cu_seqlens=None, chunk_indices=None, VARLEN: tl.constexpr = False):
    # One program per (V-block, row block of a chunk, batch·head):
    #   dv_j = (k_j ⊙ e^{b_last − b_j}) D + s · Σ_{t ≥ j} A_tj dO_t   for the BR keys j of the block.
    i_v, i_nr, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_n, r0 = i_nr // (C // BR), (i_nr % (C // BR)) * BR
    i_b, i_h = i_bh // H, i_bh % H
    i_hn = i_n                                                # dh's chunk (packed: the row's, dh [1, H, NT, K, V])
    if VARLEN:              # packed (B = 1): the row's chunk i_n is chunk i of its sequence
        i_n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, i_n)
        q, k, A = q + bos * H * K, k + bos * H * K, A + bos * H * C
        b, do, dv = _gate_row(b, bos, H, K, GATE), do + bos * H * V, dv + bos * H * V
    t0 = i_n * C
    base = i_b * T * H * K + i_h * K
    v_base = i_b * T * H * V + i_h * V
    if GATE == 2:
        b_base = b + base
        s_b = H * K
    else:
        b_base = b + i_b * T * H + i_h
        s_b = H
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    kmask, vmask = offs_k < K, offs_v < V
    idx = tl.arange(0, BR)
    cols = t0 + r0 + idx                                        # the keys j of this program
    cmask = cols < T
    k_j = tl.load(k + base + cols[:, None] * H * K + offs_k[None, :], mask=cmask[:, None] & kmask[None, :],
                  other=0.0).to(tl.float32)                                                    # [BR, BK]
    D = tl.load(dh + (i_bh * NT + i_hn) * K * V + offs_k[:, None] * V + offs_v[None, :],
                mask=kmask[:, None] & vmask[None, :], other=0.0).to(COMPUTE)                   # [BK, BV]
    k_dec = k_j
    b_j = tl.zeros([BR], dtype=tl.float32)
    if GATE != 0:
        b_j = _load_b(b_base, cols, cmask, s_b, offs_k, kmask, GATE)                           # [BR, BK] or [BR]
        b_last = _load_b_last(b_base, t0, T, s_b, offs_k, kmask, C, GATE)
        if GATE == 2:
            k_dec = k_j * tl.exp(tl.minimum(b_last[None, :] - b_j, 0.0))   # keys decayed to the chunk end
        else:
            k_dec = k_j * tl.exp(tl.minimum(b_last - b_j, 0.0))[:, None]
    acc = dot(k_dec.to(COMPUTE), D, IEEE)                                                      # [BR, BV]
    k_c = k_j.to(COMPUTE)
    for c0 in range(r0, tl.minimum(C, T - t0), BR):           # query row blocks at and after the keys
        rows = t0 + c0 + idx
        rmask = rows < T
        do_t = tl.load(do + v_base + rows[:, None] * H * V + offs_v[None, :], mask=rmask[:, None] & vmask[None, :],
                       other=0.0).to(COMPUTE)                                                  # [BR, BV]
        if GATE == 2:
            # A from gated.intra_attention (secondary chunking); above the diagonal unwritten
            A_tj = tl.load(A + i_b * T * H * C + i_h * C + rows[:, None] * H * C + (r0 + idx)[None, :],
                           mask=rmask[:, None], other=0.0)                                     # [BR, BR]
        else:
            q_t = tl.load(q + base + rows[:, None] * H * K + offs_k[None, :], mask=rmask[:, None] & kmask[None, :],
                          other=0.0).to(COMPUTE)                                               # [BR, BK]
            A_tj = dot(q_t, tl.trans(k_c), IEEE)                                               # [BR, BR]
            if GATE == 1:
                b_t = tl.load(b_base + rows * s_b, mask=rmask, other=0.0)
                A_tj = A_tj * tl.exp(tl.minimum(b_t[:, None] - b_j[None, :], 0.0))
        A_tj = tl.where(rows[:, None] >= cols[None, :], A_tj, 0.0)   # a select: unwritten entries never leak
        if GATE == 2:
            # A is a float32 intermediate: rounded to bf16 (or tf32) here it cost dv ~1.2× FLA's
            # error, which takes this product in full float32 precision
            acc += scale * dot_split(tl.trans(A_tj), do_t, IEEE)
        else:
            acc += scale * dot(tl.trans(A_tj).to(COMPUTE), do_t, IEEE)
    tl.store(dv + v_base + cols[:, None] * H * V + offs_v[None, :], acc.to(dv.dtype.element_ty),
             mask=cmask[:, None] & vmask[None, :])


@kernel
def _dqk_kernel(q, k, v, b, do, h, dh, dqi, dki, dq, dk, db, tot, totw, T, H, K, V, NT, scale, C: tl.constexpr,
                BR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, COMPUTE: tl.constexpr,
                IEEE: tl.constexpr, cu_seqlens=None, chunk_indices=None, VARLEN: tl.constexpr = False,
                INTRA: tl.constexpr = False):
    # One program per (K-block, row block of a chunk, batch·head): the state parts
    #   dq_t += s · (dO_t hᵀ) ⊙ e^{b_t},   dk_t += (v_t Dᵀ) ⊙ e^{b_last − b_t}   (the "write" part)
    # added to the intra parts; writes dq, dk and, for gates, the row block's share of the gate
    # gradient in the chunk-local form (module docstring), for every row t of the block:
    #   db_t = Σ_{s ≥ t} (q_s ⊙ dq_s − k_s ⊙ dk^intra_s) + Σ_{j < t} k_j ⊙ write_j + e^{b_last} ⊙ Σ_v h ⊙ D
    # with both sums over the block's rows only; the block totals of the two sums (tot, totw
    # [B, NB, H, K], NB row blocks per sequence) let `_dg_kernel` add the other row blocks of the chunk.
    # INTRA (no per-dimension gate, the row block a whole chunk): the intra parts are computed here
    # instead of read from dqi, dki; the V loop that reads dO and v for the state parts also sums
    #   dA = s · dO Vᵀ (lower triangle, × e^{b_t − b_j} per head),  dq^intra = dA K,  dk^intra = dAᵀ Q,
    # what `_dA_kernel` and `_intra_grad_kernel`'s diagonal tile compute, without dA's round trip
    # through memory ([B, T, H, C] float32 written once and read once per K-block).
    i_kb, i_nr, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_n, r0 = i_nr // (C // BR), (i_nr % (C // BR)) * BR
    i_b, i_h = i_bh // H, i_bh % H
    i_hn = i_n                                  # h's and dh's chunk (packed: the row's, [1, H, NT, K, V])
    if VARLEN:
        # packed (B = 1): the row's chunk i_n is chunk i of its sequence; tot and totw stay indexed
        # by the row's row block i_nr ([1, NB, H, K], NB the row's row blocks)
        i_n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, i_n)
        q, k, dqi, dki, dq, dk = (q + bos * H * K, k + bos * H * K, dqi + bos * H * K, dki + bos * H * K,
                                  dq + bos * H * K, dk + bos * H * K)
        v, do, b, db = v + bos * H * V, do + bos * H * V, _gate_row(b, bos, H, K, GATE), db + bos * H * K
    t0 = i_n * C
    base = i_b * T * H * K + i_h * K
    v_base = i_b * T * H * V + i_h * V
    offs_k = i_kb * BK + tl.arange(0, BK)
    kmask = offs_k < K
    rows = t0 + r0 + tl.arange(0, BR)
    rmask = rows < T
    dq_s = tl.zeros([BR, BK], dtype=tl.float32)
    dk_s = tl.zeros([BR, BK], dtype=tl.float32)
    hD = tl.zeros([BK], dtype=tl.float32)                       # Σ_v h ⊙ D: the chunk's carried decay
    dA = tl.zeros([BR, BR], dtype=tl.float32)                   # INTRA: dO Vᵀ of the chunk
    s_base = (i_bh * NT + i_hn) * K * V
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        vmask = offs_v < V
        m_rv = rmask[:, None] & vmask[None, :]
        m_kv = kmask[:, None] & vmask[None, :]
        do_t = tl.load(do + v_base + rows[:, None] * H * V + offs_v[None, :], mask=m_rv, other=0.0).to(COMPUTE)
        v_t = tl.load(v + v_base + rows[:, None] * H * V + offs_v[None, :], mask=m_rv, other=0.0).to(COMPUTE)
        h_n = tl.load(h + s_base + offs_k[:, None] * V + offs_v[None, :], mask=m_kv, other=0.0)   # [BK, BV] f32
        D = tl.load(dh + s_base + offs_k[:, None] * V + offs_v[None, :], mask=m_kv, other=0.0)     # [BK, BV] f32
        dq_s += dot(do_t, tl.trans(h_n.to(COMPUTE)), IEEE)                                     # [BR, BK]
        dk_s += dot(v_t, tl.trans(D.to(COMPUTE)), IEEE)                                        # [BR, BK]
        if INTRA:
            dA += dot(do_t, tl.trans(v_t), IEEE)                                               # [BR, BR]
        if GATE != 0:
            hD += tl.sum(h_n * D, axis=1)                                                      # [BK], float32
    m = rmask[:, None] & kmask[None, :]
    p = base + rows[:, None] * H * K + offs_k[None, :]
    dq_s = scale * dq_s
    if GATE == 2:
        last = tl.minimum(t0 + C, T) - 1
        b_t = tl.load(b + p, mask=m, other=0.0)                                                # [BR, BK]
        b_last = tl.load(b + base + last * H * K + offs_k, mask=kmask, other=0.0)             # [BK]
        dq_s = dq_s * tl.exp(b_t)
        dk_s = dk_s * tl.exp(tl.minimum(b_last[None, :] - b_t, 0.0))
        hD = hD * tl.exp(b_last)
    elif GATE == 1:
        last = tl.minimum(t0 + C, T) - 1
        b_t = tl.load(b + i_b * T * H + rows * H + i_h, mask=rmask, other=0.0)                # [BR]
        b_last = tl.load(b + i_b * T * H + last * H + i_h)
        dq_s = dq_s * tl.exp(b_t)[:, None]
        dk_s = dk_s * tl.exp(tl.minimum(b_last - b_t, 0.0))[:, None]
        hD = hD * tl.exp(b_last)
    if INTRA:
        # as `_dA_kernel` and the diagonal tile of `_intra_grad_kernel` (c = C): float32 dA against
        # keys and queries in two parts (`common.dot_input`); rows and columns past T are zero
        idx = tl.arange(0, BR)
        dA = scale * dA
        if GATE == 1:
            dA = dA * tl.exp(tl.minimum(b_t[:, None] - b_t[None, :], 0.0))
        dA = tl.where(idx[:, None] >= idx[None, :], dA, 0.0)
        q_c = tl.load(q + p, mask=m, other=0.0)                                                # [BR, BK]
        k_c = tl.load(k + p, mask=m, other=0.0)                                                # [BR, BK]
        dq_t = dq_s + dot_input(dA, k_c, COMPUTE, IEEE)
        dk_in = dot_input(tl.trans(dA), q_c, COMPUTE, IEEE)
    else:
        dq_t = dq_s + tl.load(dqi + p, mask=m, other=0.0)
        dk_in = tl.load(dki + p, mask=m, other=0.0)
    dk_t = dk_s + dk_in
    tl.store(dq + p, dq_t.to(dq.dtype.element_ty), mask=m)
    tl.store(dk + p, dk_t.to(dk.dtype.element_ty), mask=m)
    if GATE != 0:
        q_t = tl.load(q + p, mask=m, other=0.0).to(tl.float32)
        k_t = tl.load(k + p, mask=m, other=0.0).to(tl.float32)
        # The diagonal of dA enters q ⊙ dq and k ⊙ dk alike (dA_tt q_t ⊙ k_t) and cancels; the
        # writes into the state after the chunk enter as an exclusive prefix (module docstring).
        d_b = q_t * dq_t - k_t * dk_in                                                         # [BR, BK]
        w = k_t * dk_s                                                                         # [BR, BK]
        x = tl.cumsum(d_b, axis=0, reverse=True) + (tl.cumsum(w, axis=0) - w) + hD[None, :]
        tl.store(db + p, x, mask=m)
        NB = tl.num_programs(1)
        t_off = ((i_b * NB + i_nr) * H + i_h) * K + offs_k
        tl.store(tot + t_off, tl.sum(d_b, axis=0), mask=kmask)
        tl.store(totw + t_off, tl.sum(w, axis=0), mask=kmask)


@kernel
def _dg_kernel(db, carry, dg, T, H, K, BR: tl.constexpr, BK: tl.constexpr, HEAD: tl.constexpr,
               HAS_CARRY: tl.constexpr, cu_seqlens=None, chunk_indices=None, R: tl.constexpr = 1,
               VARLEN: tl.constexpr = False):
    # One program per (K-block, row block, batch·head): dg = the row block's own sums (`db`) + those
    # of the chunk's other row blocks (`carry`, when a chunk has several); per-head gates sum over K
    # (BK covers all of K).
    i_kb, i_nr, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    NB = tl.num_programs(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_r = i_nr                                                # the row block within the row
    if VARLEN:
        # packed (B = 1): the row's row block i_nr is row block i_nr % R of the row's chunk i_nr // R
        # (R = C / BR), chunk i of its sequence: its rows from that chunk's start; carry stays [1, NB, H, K]
        i_c, bos, T = _packed_chunk(cu_seqlens, chunk_indices, i_nr // R)
        i_r = i_c * R + i_nr % R
        db = db + bos * H * K
        if HEAD:
            dg = dg + bos * H
        else:
            dg = dg + bos * H * K
    rows = i_r * BR + tl.arange(0, BR)
    offs_k = i_kb * BK + tl.arange(0, BK)
    rmask, kmask = rows < T, offs_k < K
    m = rmask[:, None] & kmask[None, :]
    x = tl.load(db + i_b * T * H * K + rows[:, None] * H * K + i_h * K + offs_k[None, :], mask=m, other=0.0)
    if HAS_CARRY:
        x += tl.load(carry + ((i_b * NB + i_nr) * H + i_h) * K + offs_k, mask=kmask, other=0.0)[None, :]
    if HEAD:
        tl.store(dg + i_b * T * H + rows * H + i_h, tl.sum(x, axis=1).to(dg.dtype.element_ty), mask=rmask)
    else:
        tl.store(dg + i_b * T * H * K + rows[:, None] * H * K + i_h * K + offs_k[None, :],
                 x.to(dg.dtype.element_ty), mask=m)


def gate_kind(g) -> int:
    return NO_GATE if g is None else (HEAD_GATE if g.dim() == 3 else DIM_GATE)


def state_dtype(gate: int):
    """The dtype of the states h and their gradients D in the backward: float32 with gates, whose
    gradient e^{b_C} ⊙ Σ_v h ⊙ D is an elementwise sum that bf16 states round to three digits
    (FLA keeps them in float32 for the same reason); without gates None (the dtype the products
    with dO and v take anyway)."""
    return None if gate == NO_GATE else torch.float32


# Launches of `_dv_kernel` and `_dqk_kernel` with half-precision inputs, timed natively (H200, Triton
# 3.6; bf16, B = 8, T = 4096, H = 16, K = V = 128, chunk 64, per-dimension gates, torch.profiler):
# _dqk_kernel with float32 states 1.79 ms at 8 warps and 3 stages, 1.78 at 4 warps and 3, 1.20 at 4
# warps and 2; _dv_kernel 0.95 ms at 8 warps, 0.45 at 4 (per-dimension gates: its A·dO are two bf16
# products per tile, `common.dot_split`). Without gates the states keep the input's dtype and the
# 8-warp launches stay (with 4, ptxas for sm_90 spilled 648 bytes per thread in _dqk_kernel, bf16,
# K = 128, C = 64); per-head gates keep 8 warps for _dv_kernel (not timed with 4).
def dv_warps(gate: int, ieee: bool, BV: int) -> int:
    """Warps of `_dv_kernel`: 4 for float32 tiles and for per-dimension gates, else 8 where wide."""
    return 4 if ieee or gate == DIM_GATE else warps(8, BV)


def fused_intra(gate: int, C: int, dtype: torch.dtype) -> bool:
    """Whether `_dqk_kernel` computes the intra-chunk parts of dq and dk itself (INTRA): without
    per-dimension gates a chunk's dA is one [C, C] tile and its intra parts one product each, so
    where a row block is the whole chunk (C ≤ ROW_BLOCK) dA never goes to memory. Per-dimension
    gates need the secondary chunking of `_intra_grad_kernel`; larger chunks span row blocks.
    Half-precision inputs only, decided by the dtype (so the interpreter takes the native path):
    timed natively (H200, Triton 3.6, H = 16, K = V = 128, C = 64, 32k tokens, forward + backward),
    bf16 linear attention 1.87 → 1.46 ms at T = 1k and 2.23 → 1.80 at T = 32k, per-head gates 2.98 →
    2.46 and 3.65 → 3.13 (with 8 warps instead of 4: 3.11–3.21 at T = 1k); float32 inputs got slower,
    55.8 → 58.2 ms (linear attention, T = 4k), as ptxas for sm_90 spills 340–512 bytes per thread in
    the fused kernel with IEEE products (none unfused, none fused in bf16)."""
    return gate != DIM_GATE and C <= ROW_BLOCK and dtype in (torch.bfloat16, torch.float16)


def dqk_launch(gate: int, ieee: bool, BK: int, BV: int) -> tuple[int, int]:
    """(warps, most pipeline stages) of `_dqk_kernel`: 4 and 2 where gated half-precision inputs
    meet float32 states (`state_dtype`), else 8 where wide and 3."""
    if gate != NO_GATE and not ieee:
        return 4, 2
    return warps(8, BK, BV), 3


# The backward's two sequential passes write float32 states from half-precision inputs (`state_dtype`):
# twice the bytes of the forward's bf16 states, and other launches win. Timed natively (H200, Triton
# 3.6, bf16, H = 16, K = V = 128, chunk 64, normal gates, triton.testing.do_bench median of each pass
# alone, every launch tried giving the same states bit for bit; tools/state_pass_sweep.py repeats it,
# docs/data/gpu_training/state_pass_launches.md has the whole sweep):
#   per-dimension gates, B = 8, T = 4096 (512 programs): recomputed states 0.44 ms with the forward's
#   launch (32×128, 3 stages), 0.31 with 4 stages; reverse pass 0.53 ms with 64×64 blocks, 0.38 with
#   32×128 and 2 stages;
#   B = 1, T = 32768 (few programs, `gated.few_programs`): recomputed states 0.82 → 0.62 ms and reverse
#   pass 1.51 → 0.88 ms with 32×64 blocks and 4 stages;
#   per-head gates, B = 8, T = 4096: recomputed states 0.28 → 0.22 ms, reverse pass 0.31 → 0.25 ms
#   with 64×128 blocks, 2 stages and 8 warps (few programs not timed: there, as for float32 inputs and
#   linear attention, the forward's launch and 64×64 reverse blocks).
# 32-wide key blocks keep 4 warps (`common.warps`). Only chunks up to 64 were timed: a larger chunk
# holds larger k, v and q tiles per pipeline stage, and at chunk 256 the 128-wide V-blocks did not fit
# a T4's 64 KB of shared memory even with one stage (tools/arch_check.py), where 64×64 blocks do.
def state_launches(K: int, V: int, BH: int, gate: int, ieee: bool, chunk_size: int = 64,
                   sms=None) -> tuple[tuple, tuple]:
    """(BK, BV, pipeline stages, warps) of the backward's recomputed state pass (`gated.chunk_states`)
    and of its reverse pass (`_dstates_kernel`); BH counts the busy rows' heads (`gated.busy_rows`)."""
    BK, BV, stages = gated.state_config(K, V, BH, gate, sms)
    states, reverse = (BK, BV, stages, 4), (STATE_BLOCK, STATE_BLOCK, 3, 4)
    few = gated.few_programs(K, V, BH, sms)
    timed = not ieee and chunk_size <= 64
    if timed and gate == DIM_GATE:
        states, reverse = ((32, 64, 4, 4),) * 2 if few else ((32, 128, 4, 4), (32, 128, 2, 4))
    elif timed and gate == HEAD_GATE and not few:
        states = reverse = (64, 128, 2, 8)

    def fit(bk, bv, st, w):                     # K, V padded, never below MIN_TILE (`common.block`)
        bk, bv = min(block(K), bk), min(block(V), bv)
        return bk, bv, st, warps(w, bk, bv)
    return fit(*states), fit(*reverse)


def sequential_launches(K, V, H, C, gate, ieee, B, T, device, seqs=None):
    """((launch, segments) of the recomputed state pass, (launch, segments) of the reverse pass):
    each pass is cut into segments where its launch in one walk has few programs (segments.py),
    and then takes the launch timed for that many programs."""
    rows = gated.busy_rows(B, seqs)
    passes = []
    for which in range(2):
        config = state_launches(K, V, rows * H, gate, ieee, C)[which]
        segs = gated.segment_plan(B, T, C, H, K, V, config[:2], device, seqs, gate)
        if segs is not None:
            config = state_launches(K, V, segs.S * H, gate, ieee, C)[which]
        passes.append((config, segs))
    return passes


def reverse_pass(q, do, b, dsT, *, gate, scale, chunk_size, dh_dtype, with_ds0=True, seqs=None, config=None,
                 segs="auto"):
    """Step 1 of `backward`, `_dstates_kernel` over every chunk from the last: dh [B, H, NT, K, V]
    (dh_dtype; the gradient of the state after each chunk) and ds0 [B, H, K, V] float32 (None unless
    with_ds0). b: the chunk-local gate sums (None without gates); dsT: the final state's gradient
    (None: zeros). The grader of workbook 13 launches the library's pass through this too.
    config: (BK, BV, pipeline stages, warps); None: 64×64 blocks, 3 stages, 4 warps.
    seqs (`gated.Packed`): one program per (sequence, head, block); dh [1, H, NT, K, V] over the
    row's chunks, dsT and ds0 [N, H, K, V].
    segs: "auto" (`gated.segment_plan`), None, or the `segments.Segments` to cut the sequences into
    (segments.py: each segment from a zero gradient at its end, the segments combined from the last,
    each segment again from the gradient at its own end)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    N = B if seqs is None else seqs.N
    q, do, b = contiguous(q, do, b)
    COMPUTE = compute_dtype(q.dtype)
    NT = row_chunks(T, chunk_size, seqs)
    dh = outputs.empty((B, H, NT, K, V), dtype=dh_dtype, device=q.device)   # all written
    ds0 = outputs.empty((N, H, K, V), dtype=torch.float32, device=q.device) if with_ds0 else None
    dsT = None if dsT is None else dsT.to(torch.float32).contiguous()
    SK, SV, stages, nw = config or (min(block(K), STATE_BLOCK), min(block(V), STATE_BLOCK), 3, 4)
    if segs == "auto":
        segs = gated.segment_plan(B, T, chunk_size, H, K, V, (SK, SV), q.device, seqs, gate)
    args = (q, do, q if b is None else b, dh)
    kw = dict(C=chunk_size, BK=SK, BV=SV, GATE=gate, COMPUTE=COMPUTE, IEEE=COMPUTE == tl.float32,
              QDT=decayed_dtype(q.dtype) if gate != NO_GATE else COMPUTE, num_warps=nw, max_stages=stages)
    grid = (triton.cdiv(K, SK), triton.cdiv(V, SV))
    if segs is None:
        last_launch["dstates"] = launch(
            _dstates_kernel, (*grid, N * H), *args, dsT if dsT is not None else q, ds0 if ds0 is not None else q,
            T, H, K, V, NT, scale, HAS_DST=dsT is not None, STORE_DS0=with_ds0, **kw,
            **packed_args(seqs, "cu_seqlens", "chunk_offsets"))
        return dh, ds0
    # in segments (segments.py): each segment's gradient at its start from zero at its
    # end, the segments combined from the last, then each segment from the gradient at its end
    tables = packed_args(segs, "cu_seqlens", "chunk_offsets")
    F, decay = segments.buffers(segs, H, K, V, gate, q.device)
    launch(_dstates_kernel, (*grid, segs.S * H), *args, q, F, T, H, K, V, NT, scale, HAS_DST=False,
           STORE_DS0=True, decay=decay, STORE_DH=False, STORE_DECAY=decay is not None, **kw, **tables)
    d_in = segments.combine(F, decay, dsT, ds0, segs, gate=gate, reverse=True)
    last_launch["dstates"] = launch(_dstates_kernel, (*grid, segs.S * H), *args, d_in, q, T, H, K, V, NT,
                                    scale, HAS_DST=True, STORE_DS0=False, **kw, **tables)
    return dh, ds0


def backward(do, dsT, q, k, v, g, s0, d, *, chunk_size, sub_chunk_size, h=None, A=None, b=None, timer=None,
             seqs=None):
    """Gradients (dq, dk, dv, dg, ds0) of the gated forward (module docstring).

    do: gradient of o (None: zero); dsT: gradient of the final state (None: zero); h, A, b: the
    states, intra matrix and cumulated gates kept by the forward (recomputed when None). dg is None
    without gates, ds0 None without s0.
    timer: a dict that receives the milliseconds of each stage (chapter 13, tools/bench.py).
    seqs: `gated.Packed` for packed sequences (B = 1; s0, dsT and ds0 [N, H, K, V]), else None.
    """
    gate = gate_kind(g)
    B, T, H, K, V = d.B, d.T, d.H, d.K, d.V
    C = chunk_size
    c = min(sub_chunk_size, chunk_size) if gate == DIM_GATE else min(C, ROW_BLOCK)   # ≤ 64: linattn.support
    NT = row_chunks(T, C, seqs)
    chunks = packed_args(seqs, "cu_seqlens", "chunk_indices")          # the chunk-parallel launches
    COMPUTE = compute_dtype(q.dtype)
    IEEE = COMPUTE == tl.float32
    dev = q.device
    q, k, v, g, do = contiguous(q, k, v, g, do)
    if do is None:
        do = torch.zeros_like(v)
    s0f = None if s0 is None else s0.to(torch.float32).contiguous()
    states_launch, reverse_launch = sequential_launches(K, V, H, C, gate, IEEE, B, T, dev, seqs)
    with stage(timer, "recompute states"):
        if b is None:
            b = gated.gate_sums(g, C, seqs)                            # b: [B, T, H(, K)] float32
        if h is None:
            h, _ = gated.chunk_states(k, v, g, d, b=b, s0=s0f, chunk_size=C, dtype=state_dtype(gate), seqs=seqs,
                                      config=states_launch[0], segs=states_launch[1])
    common = dict(C=C, GATE=gate, COMPUTE=COMPUTE, IEEE=IEEE)
    bp = q if b is None else b                                          # an unused pointer without gates

    # 1. reverse pass over the chunks: D for every chunk, dinitial_state
    with stage(timer, "reverse pass dS"):
        dh, ds0 = reverse_pass(q, do, b, dsT, gate=gate, scale=d.scale, chunk_size=C,
                               dh_dtype=state_dtype(gate) or h.dtype, with_ds0=s0 is not None, seqs=seqs,
                               config=reverse_launch[0], segs=reverse_launch[1])

    BR = min(C, ROW_BLOCK)
    BK = min(block(K), GRAD_BLOCK)
    dqi = dki = None
    fused = fused_intra(gate, C, q.dtype)
    if not fused:
        # 2. dA = s · dO Vᵀ, lower triangle of every chunk
        dA = outputs.empty((B, T, H, C), dtype=torch.float32, device=dev)    # every entry of rows < T written
        BVa = min(block(V), 64)
        with stage(timer, "dA"):
            last_launch["dA"] = launch(_dA_kernel, (NT * (C // BR), B * H), do, v, dA, T, H, V, d.scale, C=C,
                                       BR=BR, BV=BVa, COMPUTE=COMPUTE, IEEE=IEEE, num_warps=4, **chunks)

        # 3. intra-chunk parts of dq, dk
        dqi = outputs.empty((B, T, H, K), dtype=torch.float32, device=dev)
        dki = outputs.empty((B, T, H, K), dtype=torch.float32, device=dev)
        with stage(timer, "intra dq, dk"):
            last_launch["intra"] = launch(
                _intra_grad_kernel, (triton.cdiv(K, BK), NT * (C // c), B * H), q, k, g if gate == DIM_GATE else q,
                bp, dA, dqi, dki, T, H, K, C=C, c=c, BK=BK, GATE=gate, COMPUTE=COMPUTE, IEEE=IEEE,
                num_warps=2 if c <= 16 else 4, **chunks)

    # 4. dv
    if gate == DIM_GATE and A is None:
        with stage(timer, "recompute A"):
            A = gated.intra_attention(q, k, g, d, C, min(sub_chunk_size, C), b=b, seqs=seqs)
    dv = outputs.empty((B, T, H, V), dtype=v.dtype, device=dev)
    BKv, BVv = gated.blocks(K, V)
    # ptxas for sm_90 at K = V = 128, C = 64: float32 tiles of 64 rows spilled 7–14 KB of stack per
    # thread, 32 rows none; bf16 with 64 rows and 8 warps none (4 warps: 104 bytes, per-head gates)
    BRv = min(C, 32) if IEEE else BR
    with stage(timer, "dv"):
        last_launch["dv"] = launch(
            _dv_kernel, (triton.cdiv(V, BVv), NT * (C // BRv), B * H), q, k, bp, A if A is not None else q, do, dh,
            dv, T, H, K, V, NT, d.scale, BR=BRv, BK=BKv, BV=BVv, num_warps=dv_warps(gate, IEEE, BVv), **common,
            **chunks)

    # 5. dq, dk (state parts added; with `fused_intra` the intra parts too) and ∂L/∂b
    dq = outputs.empty((B, T, H, K), dtype=q.dtype, device=dev)
    dk = outputs.empty((B, T, H, K), dtype=k.dtype, device=dev)
    db = tot = totw = None
    NB = NT * (C // BR)                                                 # row blocks per sequence (packed: the row)
    if gate != NO_GATE:
        db = outputs.empty((B, T, H, K), dtype=torch.float32, device=dev)  # every entry written
        tot = outputs.empty((B, NB, H, K), dtype=torch.float32, device=dev)
        totw = outputs.empty((B, NB, H, K), dtype=torch.float32, device=dev)
    BVq = min(block(V), GRAD_BLOCK)
    with stage(timer, "dq, dk"):
        w, most = dqk_launch(gate, IEEE, BK, BVq)
        last_launch["dqk"] = launch(
            _dqk_kernel, (triton.cdiv(K, BK), NB, B * H), q, k, v, bp, do, h, dh, q if fused else dqi,
            q if fused else dki, dq, dk, db if db is not None else q, tot if tot is not None else q,
            totw if totw is not None else q, T, H, K, V, NT, d.scale, BR=BR, BK=BK, BV=BVq, num_warps=w,
            max_stages=most, INTRA=fused, **common, **chunks)

    # 6. dg: each row block's own sums were written by _dqk_kernel; when a chunk has several row
    # blocks (C > BR), each adds the reverse totals of the chunk's later blocks and the write totals
    # of its earlier ones. Nothing crosses a chunk boundary (module docstring).
    dg = None
    if gate != NO_GATE:
        with stage(timer, "dg"):
            R = C // BR                                                 # row blocks per chunk
            carry = None
            if R > 1:
                rev, fwd = tot.view(B, NT, R, H, K), totw.view(B, NT, R, H, K)
                carry = torch.zeros_like(rev)                           # [B, NT, R, H, K]
                carry[:, :, :-1] = rev.flip(2).cumsum(2).flip(2)[:, :, 1:]   # Σ of the later blocks
                carry[:, :, 1:] += fwd.cumsum(2)[:, :, :-1]             # Σ of the earlier blocks' writes
                carry = carry.view(B, NB, H, K)
            dg = outputs.empty(g.shape, dtype=g.dtype, device=dev)
            BKg = block(K) if gate == HEAD_GATE else BK
            last_launch["dg"] = launch(_dg_kernel, (triton.cdiv(K, BKg), NB, B * H), db,
                                       carry if carry is not None else db, dg, T, H, K, BR=BR, BK=BKg,
                                       HEAD=gate == HEAD_GATE, HAS_CARRY=carry is not None,
                                       num_warps=8 if BKg > 64 else 4,
                                       **(dict(chunks, R=R) if seqs is not None else {}))
    if ds0 is not None:
        ds0 = ds0.to(s0.dtype)
    return dq, dk, dv, dg, ds0


def forward_keep(q, k, v, g, d, *, initial_state, output_final_state, chunk_size, sub_chunk_size, seqs=None):
    """The states-mode forward that also returns what the backward needs: (o, sT, h, A, b).
    seqs: `gated.Packed` for packed sequences, else None."""
    gate = gate_kind(g)
    C, c = chunk_size, min(sub_chunk_size, chunk_size)
    q, k, v, g = contiguous(q, k, v, g)
    B, T, H, K, V = d.B, d.T, d.H, d.K, d.V
    NT = row_chunks(T, C, seqs)
    N = B if seqs is None else seqs.N
    COMPUTE = compute_dtype(q.dtype)
    IEEE = COMPUTE == tl.float32
    s0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    b = gated.gate_sums(g, C, seqs)
    A = gated.intra_attention(q, k, g, d, C, c, b=b, seqs=seqs) if gate == DIM_GATE else None
    sT = outputs.empty((N, H, K, V), dtype=torch.float32, device=q.device) if output_final_state else None
    h, _ = gated.chunk_states(k, v, g, d, b=b, s0=s0, sT=sT, chunk_size=C, dtype=state_dtype(gate), seqs=seqs)
    o = outputs.empty((B, T, H, V), dtype=v.dtype, device=q.device)
    BK, BV = gated.output_blocks(K, V, gate, IEEE)
    BR = min(C, ROW_BLOCK)
    launch(gated._output_kernel, (triton.cdiv(V, BV), NT * (C // BR), B * H),
           q, k, v, q if b is None else b, A if A is not None else q, h, o, T, H, K, V, NT, d.scale, C=C, BR=BR,
           BK=BK, BV=BV, GATE=gate, COMPUTE=COMPUTE, IEEE=IEEE, num_warps=4,
           **packed_args(seqs, "cu_seqlens", "chunk_indices"))
    gated.ran["mode"] = "states (kept for the backward)"
    return o, sT, h, A, b


class GatedAttention(torch.autograd.Function):
    """o, final state = gated.forward(...), with the Triton backward of this module.

    recompute=True computes the states h [B, H, NT, K, V] again in the backward, as in the GLA
    paper: they are the large intermediate (K·V numbers per chunk). For per-dimension gates it keeps
    the cumulated gates b [B, T, H, K] and the intra matrix A [B, T, H, C] from the forward, as FLA
    does: input-sized, and computing A again cost about as much as the states. recompute=False keeps
    h as well (in float32, as the backward recomputes it): more memory, one kernel fewer.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, d, output_final_state, chunk_size, sub_chunk_size, mode,
                recompute, seqs=None):
        ctx.set_materialize_grads(False)
        if recompute:
            kept = {}
            o, sT = gated.forward(q, k, v, g, d, initial_state=initial_state, output_final_state=output_final_state,
                                  chunk_size=chunk_size, sub_chunk_size=sub_chunk_size, mode=mode, keep=kept,
                                  seqs=seqs)
            h, A, b = None, kept.get("A"), kept.get("b")
        else:
            o, sT, h, A, b = forward_keep(q, k, v, g, d, initial_state=initial_state,
                                          output_final_state=output_final_state, chunk_size=chunk_size,
                                          sub_chunk_size=sub_chunk_size, seqs=seqs)
        ctx.save_for_backward(q, k, v, g, initial_state, h, A, b)
        ctx.cfg = (d, chunk_size, sub_chunk_size, seqs)
        return o, sT

    @staticmethod
    @first_order("linattn.triton.gla / linear_attn")   # kernels: no graph, a double backward raises
    def backward(ctx, do, dsT):
        q, k, v, g, s0, h, A, b = ctx.saved_tensors
        d, C, c, seqs = ctx.cfg
        dq, dk, dv, dg, ds0 = backward(do, dsT, q, k, v, g, s0, d, chunk_size=C, sub_chunk_size=c,
                                       h=h, A=A, b=b, seqs=seqs)
        return dq, dk, dv, dg, ds0, None, None, None, None, None, None, None


def needs_grad(*xs) -> bool:
    """Whether the autograd path must run: grad mode on and some input requires grad."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def run(q, k, v, g, d, *, initial_state, output_final_state, chunk_size, sub_chunk_size, mode, recompute,
        seqs=None):
    """gated.forward, through GatedAttention when a gradient is needed (no overhead otherwise).
    seqs: `gated.Packed` for packed sequences (`gated.check_packed`), else None."""
    if not isinstance(recompute, bool):
        raise InputError(f"recompute must be True or False, got {recompute!r}")
    if not needs_grad(q, k, v, g, initial_state):
        return gated.forward(q, k, v, g, d, initial_state=initial_state, output_final_state=output_final_state,
                             chunk_size=chunk_size, sub_chunk_size=sub_chunk_size, mode=mode, seqs=seqs)
    return GatedAttention.apply(q, k, v, g, initial_state, d, output_final_state, chunk_size, sub_chunk_size,
                                mode, recompute, seqs)
