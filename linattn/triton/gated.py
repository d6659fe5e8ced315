"""Chunkwise gated linear attention (GLA) in Triton, with secondary chunking; linear attention is g = 0.

Recurrence (state S is K×V): S_t = diag(exp g_t) S_{t-1} + k_tᵀ v_t, o_t = scale · q_t S_t, with
g [B,T,H] (one log-decay per head) or [B,T,H,K] (one per key dimension), or no gate at all.

Per chunk of C tokens starting at t0, with b_t = g_{t0} + … + g_t (cumulative log-gate inside the
chunk, float32) and S the state before the chunk:
    o_t   = scale · ((q_t ⊙ e^{b_t}) S  +  Σ_{s ≤ t in chunk} Σ_k q_tk k_sk e^{b_tk − b_sk} v_s)
    S_new = diag(e^{b_last}) S + Σ_s (k_s ⊙ e^{b_last − b_s})ᵀ v_s
Every exponent is a sum of log-gates over a stretch of tokens (b, or b_t − b_s with t ≥ s), so
every factor is ≤ 1: nothing overflows however strong the gates are; tiny products underflow to
0, which is what they are. No kernel reads b from memory: each sums the gates of the tile it loads
(tl.cumsum over its rows), so the gates are read once per use, with no float32 copy written.

The intra-chunk term for per-dimension gates cannot be one matmul (the decay sits inside the sum
over k). Secondary chunking splits the chunk into sub-chunks of c tokens; the output of sub-chunk
i is built from
- its inter-chunk part (q ⊙ e^{b}) S,
- one off-diagonal tile per earlier sub-chunk j < i, which factors through r_i, the cumulative gate
  just before sub-chunk i: e^{b_t − b_s} = e^{b_t − r_i} · e^{r_i − b_s}, both ≤ 1, so the tile is
  an ordinary (half-precision) tensor-core matmul of the decayed queries and keys;
- the diagonal tile (sub-chunk i with itself), which has no point between its queries and keys
  to split at. It is built in float32 column by column, from the last column to the first: the
  decay tile E_s[t, :] = e^{b_t − b_s} satisfies E_s[t] = E_{s+1}[t] · e^{g_{s+1}} (t > s) and
  E_s[s] = 1, so each column costs one exponential per key dimension instead of one per (t, k).
The matrix A = (those tiles) never leaves the chip: each tile multiplies its values right away.
For per-head gates the decay leaves the sum over k, and the whole chunk is one matmul times a
C×C decay mask.

Two ways to run the chunks (`mode`):
- "fused": one program per (batch·head, V-block) walks all chunks, the state stays on chip and is
  never materialised. Parallelism: B·H·V/BV programs.
- "states": a first kernel walks the chunks and writes the state before every chunk to memory
  (B·H·NT·K·V values, in the input dtype); a second kernel computes every chunk's output in
  parallel (B·H·NT·V/BV programs). More memory traffic, far more parallelism.
"auto" picks by measurement (see `choose_mode`). When the fused program's tiles do not fit the
GPU's shared memory, the call runs as "states" instead; `ran["mode"]` says which mode ran.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .. import outputs
from ..validate import InputError, check_chunk, check_inputs
from .common import block, check_kernel_inputs, compute_dtype, contiguous, dot, num_sms

MODES = ("auto", "fused", "states")
# The compiled kernel of each name's last launch (natively: n_regs, n_spills, metadata.shared),
# so chapter 09 can show the compiler's resource report without recompiling.
last_launch: dict = {}
ran: dict = {}          # ran["mode"]: the mode the last call actually used ("auto" resolved)
# Two pipeline stages for the fused chunk loop: three (Triton's default) needed 254 KB of shared
# memory for bf16 tiles at K = V = 128, C = 64 on an H200, over its 227 KB.
FUSED_STAGES = 2
# Launch parameters, set from measurements (docs/perf_notes.md); module constants so a sweep can
# change them without editing the kernels.
OUTPUT_WARPS = 4
STATE_WARPS = 4
STATE_STAGES = 2
STATE_BLOCKS = None     # (BK, BV) for the state pass; None: `state_blocks` decides
OUTPUT_SUBS = 1         # sub-chunks per output program (per-dimension gates)
NO_GATE, HEAD_GATE, DIM_GATE = 0, 1, 2


@triton.jit
def _state_step(S, k_base, v_base, g_base, t0, T, s_k, s_v, s_g, offs_k, offs_v, K, V,
                C: tl.constexpr, GATE: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr):
    """The state after the chunk starting at t0, from S (the state before it). S: [BK, BV] float32."""
    rows = t0 + tl.arange(0, C)
    rmask = rows < T
    kmask = offs_k < K
    k = tl.load(k_base + rows[:, None] * s_k + offs_k[None, :], mask=rmask[:, None] & kmask[None, :],
                other=0.0).to(COMPUTE)                                              # [C, BK]
    v = tl.load(v_base + rows[:, None] * s_v + offs_v[None, :],
                mask=rmask[:, None] & (offs_v < V)[None, :], other=0.0).to(COMPUTE)   # [C, BV]
    # Rows past T load g = 0: they add nothing to the sums below (and their keys are 0).
    # b_last − b_s, the gates after s in the chunk, is summed from the chunk's end over the gates
    # loaded one row down (g_{s+1}): exactly 0 on the last row, ≤ 0, and its rounding error stays
    # proportional to itself (b_last − b_s from two prefix sums would carry the error of b_last).
    nxt = (tl.arange(0, C) < C - 1) & (rows + 1 < T)
    if GATE == 2:
        g = tl.load(g_base + rows[:, None] * s_g + offs_k[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)                                                       # [C, BK]
        g_next = tl.load(g_base + (rows + 1)[:, None] * s_g + offs_k[None, :],
                         mask=nxt[:, None] & kmask[None, :], other=0.0)              # [C, BK]
        k = (k * tl.exp(tl.cumsum(g_next, 0, reverse=True))).to(COMPUTE)  # key decayed to the chunk end
        S = S * tl.exp(tl.sum(g, 0))[:, None]
    elif GATE == 1:
        g = tl.load(g_base + rows * s_g, mask=rmask, other=0.0)                      # [C]
        g_next = tl.load(g_base + (rows + 1) * s_g, mask=nxt, other=0.0)              # [C]
        k = (k * tl.exp(tl.cumsum(g_next, 0, reverse=True))[:, None]).to(COMPUTE)
        S = S * tl.exp(tl.sum(g, 0))
    return S + dot(tl.trans(k), v, IEEE)                                             # [BK, BV]


@triton.jit
def _offdiag_tile(qb, k_base, g_base, t_j, D, s_k, offs_k, kmask, c: tl.constexpr,
                  COMPUTE: tl.constexpr, IEEE: tl.constexpr):
    """A_ij [c, c] for a sub-chunk j (rows t_j…t_j+c−1, all < T) before the query sub-chunk i.

    qb [c, BK] (input dtype): q_i ⊙ e^{b − r_i}, queries decayed from the start of i.
    D [BK]: e^{r_i − r_{j+1}}, the decay between the end of j and the start of i.
    Returns the tile and e^{γ_j} [BK] (γ_j: the gates of j summed), which extends D to j − 1.
    """
    idx = tl.arange(0, c)
    p = (t_j + idx)[:, None] * s_k + offs_k[None, :]
    k_j = tl.load(k_base + p, mask=kmask[None, :], other=0.0).to(tl.float32)             # [c, BK]
    g_j = tl.load(g_base + p, mask=kmask[None, :], other=0.0)                            # [c, BK]
    # r_{j+1} − b_s: the gates after s in sub-chunk j, summed from its end (as in _state_step)
    g_next = tl.load(g_base + p + s_k, mask=(idx < c - 1)[:, None] & kmask[None, :], other=0.0)
    k_hat = (k_j * tl.exp(tl.cumsum(g_next, 0, reverse=True)) * D[None, :]).to(COMPUTE)  # [c, BK], ≤ |k|
    return dot(qb, tl.trans(k_hat), IEEE), tl.exp(tl.sum(g_j, 0))


@triton.jit
def _diag_tile(q_i, k_base, g_base, s0, T, s_k, offs_k, kmask, c: tl.constexpr):
    """A_ii [c, c] (float32) of the sub-chunk starting at s0: A[t, s] = Σ_k q_tk k_sk e^{b_tk − b_sk}, s ≤ t.

    Columns from last to first, the decay tile updated multiplicatively (module docstring):
    one exponential per key dimension per column, every factor ≤ 1, rows t < s exactly 0.
    """
    idx = tl.arange(0, c)
    E = tl.zeros_like(q_i)                                         # [c, BK] decay tile; rows t < s stay 0
    A = tl.zeros([c, c], dtype=tl.float32)
    for u in range(c):
        s = c - 1 - u
        p = (s0 + s) * s_k + offs_k
        k_s = tl.load(k_base + p, mask=kmask & (s0 + s < T), other=0.0).to(tl.float32)       # [BK]
        # g of the token after s (inside the sub-chunk and the sequence; else e^0, never used)
        g_n = tl.load(g_base + p + s_k, mask=kmask & (s + 1 < c) & (s0 + s + 1 < T), other=0.0)  # [BK]
        E = tl.where(idx[:, None] == s, 1.0, E * tl.exp(g_n)[None, :])                      # E_s
        col = tl.sum(q_i * k_s[None, :] * E, axis=1)                                          # [c]
        A = tl.where(idx[None, :] == s, col[:, None], A)
    return A


@triton.jit
def _sub_chunk_output(Sc, q_base, k_base, v_base, g_base, o_base, t0, i, T, K, V, scale, s_k, s_v,
                      offs_v, c: tl.constexpr, BK: tl.constexpr, COMPUTE: tl.constexpr,
                      IEEE: tl.constexpr):
    """Write o for sub-chunk i (rows t0+i·c …, < T) of the chunk at t0, per-dimension gates.

    Sc [BK, BV]: the state before the chunk, as the dot operand. A is never materialised: each
    tile is multiplied by its values as soon as it is built.
    """
    offs_k = tl.arange(0, BK)
    kmask = offs_k < K
    vmask = offs_v < V
    idx = tl.arange(0, c)
    s0 = t0 + i * c
    rows = s0 + idx
    rmask = rows < T
    m_qk = rmask[:, None] & kmask[None, :]
    p = rows[:, None] * s_k + offs_k[None, :]
    q_i = tl.load(q_base + p, mask=m_qk, other=0.0).to(tl.float32)                      # [c, BK]
    g_i = tl.load(g_base + p, mask=m_qk, other=0.0)                                     # [c, BK]
    qb = q_i * tl.exp(tl.cumsum(g_i, 0))                             # q ⊙ e^{b − r_i}, ≤ |q|
    qh = qb.to(COMPUTE)
    acc = tl.zeros([c, Sc.shape[1]], dtype=tl.float32)               # [c, BV]
    D = tl.full([BK], 1.0, tl.float32)                               # e^{r_i − r_{j+1}}
    for u in range(i):                                               # j = i−1 … 0: D grows by e^{γ_j}
        j = i - 1 - u
        A_ij, decay_j = _offdiag_tile(qh, k_base, g_base, t0 + j * c, D, s_k, offs_k, kmask, c,
                                      COMPUTE, IEEE)                                    # [c, c]
        v_j = tl.load(v_base + (t0 + j * c + idx)[:, None] * s_v + offs_v[None, :],
                      mask=vmask[None, :], other=0.0).to(COMPUTE)                       # [c, BV]
        acc += dot(A_ij.to(COMPUTE), v_j, IEEE)
        D = D * decay_j
    # D is now e^{r_i}, the decay from the chunk start to sub-chunk i: q ⊙ e^{b} = qb ⊙ D
    acc += dot((qb * D[None, :]).to(COMPUTE), Sc, IEEE)
    A_ii = _diag_tile(q_i, k_base, g_base, s0, T, s_k, offs_k, kmask, c)                # [c, c]
    v_i = tl.load(v_base + rows[:, None] * s_v + offs_v[None, :],
                  mask=rmask[:, None] & vmask[None, :], other=0.0).to(COMPUTE)          # [c, BV]
    acc += dot(A_ii.to(COMPUTE), v_i, IEEE)
    tl.store(o_base + rows[:, None] * s_v + offs_v[None, :], (scale * acc).to(o_base.dtype.element_ty),
             mask=rmask[:, None] & vmask[None, :])


@triton.jit
def _chunk_output(S, q_base, k_base, v_base, g_base, o_base, t0, i_lo, n_sub, T, K, V, scale,
                  s_k, s_v, s_g, offs_v, C: tl.constexpr, c: tl.constexpr, BK: tl.constexpr,
                  GATE: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr):
    """Write o for the chunk starting at t0, given S [BK, BV] (float32), the state before the chunk.

    Per-dimension gates: only its sub-chunks i_lo … i_lo+n_sub−1 (the whole chunk otherwise)."""
    offs_k = tl.arange(0, BK)
    kmask = offs_k < K
    if IEEE:
        # A fresh tensor for the operand, as the .to() makes for half precision. Natively (Triton
        # 3.6, H200) float32 fused mode failed its test while float32 states mode and bf16/fp16
        # fused passed; the difference is the loop-carried accumulator S feeding a dot directly.
        # Unverified workaround: docs/perf_notes.md.
        Sc = tl.where((offs_v < V)[None, :], S, 0.0)
    else:
        Sc = S.to(COMPUTE)
    if GATE == 2:
        for i in range(i_lo, i_lo + n_sub):
            _sub_chunk_output(Sc, q_base, k_base, v_base, g_base, o_base, t0, i, T, K, V, scale, s_k, s_v,
                              offs_v, c, BK, COMPUTE, IEEE)
    else:
        rows = t0 + tl.arange(0, C)
        rmask = rows < T
        m_qk = rmask[:, None] & kmask[None, :]
        q = tl.load(q_base + rows[:, None] * s_k + offs_k[None, :], mask=m_qk, other=0.0).to(COMPUTE)  # [C, BK]
        k = tl.load(k_base + rows[:, None] * s_k + offs_k[None, :], mask=m_qk, other=0.0).to(COMPUTE)  # [C, BK]
        v = tl.load(v_base + rows[:, None] * s_v + offs_v[None, :],
                    mask=rmask[:, None] & (offs_v < V)[None, :], other=0.0).to(COMPUTE)               # [C, BV]
        A = dot(q, tl.trans(k), IEEE)                                                               # [C, C]
        if GATE == 1:
            # a per-head decay leaves the sum over k: one matmul times a C×C decay mask
            b = tl.cumsum(tl.load(g_base + rows * s_g, mask=rmask, other=0.0), 0)                   # [C]
            A = A * tl.exp(tl.minimum(b[:, None] - b[None, :], 0.0))
            acc = dot((q * tl.exp(b)[:, None]).to(COMPUTE), Sc, IEEE)                               # [C, BV]
        else:
            acc = dot(q, Sc, IEEE)
        A = tl.where(rows[:, None] >= rows[None, :], A, 0.0)      # causal half of the chunk
        acc += dot(A.to(COMPUTE), v, IEEE)
        tl.store(o_base + rows[:, None] * s_v + offs_v[None, :],
                 (scale * acc).to(o_base.dtype.element_ty), mask=rmask[:, None] & (offs_v < V)[None, :])


@triton.jit
def _bases(q, k, v, g, o, i_b, i_h, T, H, K, V, GATE: tl.constexpr):
    # Pointers to (batch i_b, head i_h, token 0) of each [B, T, H, *] tensor, and the gate's row stride.
    q_base = q + i_b * T * H * K + i_h * K
    k_base = k + i_b * T * H * K + i_h * K
    v_base = v + i_b * T * H * V + i_h * V
    o_base = o + i_b * T * H * V + i_h * V
    if GATE == 2:
        g_base = g + i_b * T * H * K + i_h * K
        s_g = H * K
    else:
        g_base = g + i_b * T * H + i_h
        s_g = H
    return q_base, k_base, v_base, o_base, g_base, s_g


@triton.jit
def _states_kernel(k, v, g, h, s0, sT, T, H, K, V, NT, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, GATE: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr,
                   HAS_S0: tl.constexpr, STORE_ST: tl.constexpr):
    # One program per (K-block, V-block, batch·head): walk the chunks, write the state before each.
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    _, k_base, v_base, _, g_base, s_g = _bases(k, k, v, g, v, i_b, i_h, T, H, K, V, GATE)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    smask = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    s_offs = offs_k[:, None] * V + offs_v[None, :]
    if HAS_S0:
        S = tl.load(s0 + i_bh * K * V + s_offs, mask=smask, other=0.0)                      # [BK, BV]
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(NT):
        tl.store(h + (i_bh * NT + n) * K * V + s_offs, S.to(h.dtype.element_ty), mask=smask)
        S = _state_step(S, k_base, v_base, g_base, n * C, T, H * K, H * V, s_g, offs_k, offs_v, K, V,
                        C, GATE, COMPUTE, IEEE)
    if STORE_ST:
        tl.store(sT + i_bh * K * V + s_offs, S, mask=smask)


@triton.jit
def _output_kernel(q, k, v, g, h, o, T, H, K, V, NT, scale, C: tl.constexpr, c: tl.constexpr,
                   SUBS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                   COMPUTE: tl.constexpr, IEEE: tl.constexpr):
    # One program per (V-block, chunk part, batch·head): every chunk's output in parallel. A part
    # is SUBS sub-chunks for per-dimension gates (more, smaller programs), the whole chunk else.
    i_v, i_p, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_n = i_p // (C // c // SUBS)
    i_lo = i_p % (C // c // SUBS) * SUBS
    t0 = i_n * C
    if t0 + i_lo * c < T:
        q_base, k_base, v_base, o_base, g_base, s_g = _bases(q, k, v, g, o, i_b, i_h, T, H, K, V, GATE)
        offs_k = tl.arange(0, BK)
        offs_v = i_v * BV + tl.arange(0, BV)
        smask = (offs_k < K)[:, None] & (offs_v < V)[None, :]
        S = tl.load(h + (i_bh * NT + i_n) * K * V + offs_k[:, None] * V + offs_v[None, :],
                    mask=smask, other=0.0).to(tl.float32)                                   # [BK, BV]
        n_sub = tl.minimum(SUBS, tl.cdiv(T - t0, c) - i_lo)        # the last chunk may be short
        _chunk_output(S, q_base, k_base, v_base, g_base, o_base, t0, i_lo, n_sub, T, K, V, scale,
                      H * K, H * V, s_g, offs_v, C, c, BK, GATE, COMPUTE, IEEE)


@triton.jit
def _fused_kernel(q, k, v, g, o, s0, sT, T, H, K, V, NT, scale, C: tl.constexpr, c: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, COMPUTE: tl.constexpr,
                  IEEE: tl.constexpr, HAS_S0: tl.constexpr, STORE_ST: tl.constexpr):
    # One program per (V-block, batch·head): the state [K, BV] stays on chip across all chunks.
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    q_base, k_base, v_base, o_base, g_base, s_g = _bases(q, k, v, g, o, i_b, i_h, T, H, K, V, GATE)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    smask = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    s_offs = offs_k[:, None] * V + offs_v[None, :]
    if HAS_S0:
        S = tl.load(s0 + i_bh * K * V + s_offs, mask=smask, other=0.0)                      # [BK, BV]
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(NT):
        _chunk_output(S, q_base, k_base, v_base, g_base, o_base, n * C, 0, tl.cdiv(tl.minimum(T - n * C, C), c),
                      T, K, V, scale, H * K, H * V, s_g, offs_v, C, c, BK, GATE, COMPUTE, IEEE)
        S = _state_step(S, k_base, v_base, g_base, n * C, T, H * K, H * V, s_g, offs_k, offs_v, K, V,
                        C, GATE, COMPUTE, IEEE)
    if STORE_ST:
        tl.store(sT + i_bh * K * V + s_offs, S, mask=smask)


@triton.jit
def _intra_kernel(q, k, g, A, T, H, K, C: tl.constexpr, c: tl.constexpr, BK: tl.constexpr,
                  COMPUTE: tl.constexpr, IEEE: tl.constexpr):
    # The tiles _dim_gate_output multiplies away, written out: one program per (sub-chunk i,
    # chunk, batch·head) stores rows of sub-chunk i of A [B, T, H, C] (tiles j ≤ i). For teaching
    # (chapter 10) and tests; the forward pass never materialises A.
    i_i, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    s0 = t0 + i_i * c
    if s0 < T:
        base = i_b * T * H * K + i_h * K                     # q, k and g share the [B,T,H,K] layout
        offs_k = tl.arange(0, BK)
        kmask = offs_k < K
        idx = tl.arange(0, c)
        rows = s0 + idx
        rmask = rows < T
        p = rows[:, None] * H * K + offs_k[None, :]
        q_i = tl.load(q + base + p, mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)  # [c, BK]
        g_i = tl.load(g + base + p, mask=rmask[:, None] & kmask[None, :], other=0.0)                 # [c, BK]
        qh = (q_i * tl.exp(tl.cumsum(g_i, 0))).to(COMPUTE)
        p_a = A + i_b * T * H * C + i_h * C + rows[:, None] * H * C
        D = tl.full([BK], 1.0, tl.float32)
        for u in range(i_i):
            j = i_i - 1 - u
            A_ij, decay_j = _offdiag_tile(qh, k + base, g + base, t0 + j * c, D, H * K, offs_k, kmask, c,
                                          COMPUTE, IEEE)
            tl.store(p_a + (j * c + idx)[None, :], A_ij, mask=rmask[:, None])
            D = D * decay_j
        A_ii = _diag_tile(q_i, k + base, g + base, s0, T, H * K, offs_k, kmask, c)
        tl.store(p_a + (i_i * c + idx)[None, :], A_ii, mask=rmask[:, None])


def intra_attention(q, k, g, d, C, c):
    """The intra-chunk matrix A [B, T, H, C] (float32) for per-dimension gates g [B, T, H, K].

    Row t holds A[t, s] for the C positions s of t's chunk, s ≤ t (entries above the diagonal are
    not written). The same tiles as the forward pass, which multiplies them by V on chip instead.
    """
    B, T, H, K = d.B, d.T, d.H, d.K
    COMPUTE = compute_dtype(q.dtype)
    q, k, g = contiguous(q, k, g)
    A = torch.empty((B, T, H, C), dtype=torch.float32, device=q.device)
    last_launch["intra"] = _intra_kernel[(C // c, triton.cdiv(T, C), B * H)](
        q, k, g, A, T, H, K, C=C, c=c, BK=block(K), COMPUTE=COMPUTE, IEEE=COMPUTE == tl.float32,
        num_warps=2 if c <= 16 else 4)
    return A


def fused_blocks(K: int, V: int):
    """(BK, BV) for the fused program: all of K, and a [BK, BV] float32 state of ≤ 8192 values."""
    BK = block(K)
    return BK, max(16, min(block(V), 8192 // BK, 64))


def output_blocks(K: int, V: int, ieee: bool = False):
    """(BK, BV) for the states-mode output program: all of K, V up to 128 wide (then the
    per-dimension-gate tiles are built once per chunk part, not once per V-block), the state tile
    at most 128×128 half-precision or 128×64 float32 values (wider spilled registers when
    compiled for sm_90, and float32 tiles of 128×128 took 20–30 s to compile)."""
    BK = block(K)
    return BK, max(16, min(block(V), 128, (8192 if ieee else 16384) // BK))


def state_blocks(K: int, V: int, BH: int, sms: int | None = None):
    """(BK, BV) of the state pass: the widest blocks that still give every SM a program.

    B·H·⌈K/BK⌉·⌈V/BV⌉ programs walk the chunks in order; with one sequence of 16 heads 64×64
    blocks make 64 programs for an H200's 132 SMs. Narrower blocks shorten each sequential step;
    below 32×16 the tiles get too small to feed the tensor cores.
    """
    sms = num_sms() if sms is None else sms
    for bk, bv in ((64, 64), (64, 32), (32, 32), (32, 16)):
        BK, BV = min(block(K), bk), min(block(V), bv)
        if BH * triton.cdiv(K, BK) * triton.cdiv(V, BV) >= sms:
            return BK, BV
    return min(block(K), 32), min(block(V), 16)


def choose_mode(mode: str, gate: int, B: int, H: int, V: int) -> str:
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    if gate != NO_GATE:
        # Measured on an H200 (docs/perf_notes.md, bench of 2026-11-21): for both gate shapes the
        # states mode was faster at every T from 1k to 32k, its parallel output kernel carrying the
        # heavier per-chunk work the fused loop does in sequence.
        return "states"
    # Linear attention, same run: fused 0.29 ms against states 0.41 ms at T = 8192 (128 fused
    # programs on 132 SMs), states ahead from T = 16384 (64 programs: 0.45 against 0.53 ms).
    programs = B * H * triton.cdiv(V, fused_blocks(V, V)[1])
    return "fused" if programs > num_sms() // 2 else "states"


def forward(q, k, v, g, d, *, initial_state, output_final_state, chunk_size, sub_chunk_size, mode):
    """Run the chunk kernels; g is None (linear attention), [B,T,H] or [B,T,H,K]. Inputs validated."""
    check_kernel_inputs(q)
    gate = NO_GATE if g is None else (HEAD_GATE if g.dim() == 3 else DIM_GATE)
    C, c = chunk_size, min(sub_chunk_size, chunk_size)
    q, k, v, g = contiguous(q, k, v, g)
    s0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    B, T, H, K, V = d.B, d.T, d.H, d.K, d.V
    NT = triton.cdiv(T, C)
    COMPUTE = compute_dtype(q.dtype)
    IEEE = COMPUTE == tl.float32
    mode = choose_mode(mode, gate, B, H, V)
    g = q if g is None else g                        # unused pointer when there is no gate
    o = outputs.empty((B, T, H, V), dtype=v.dtype, device=q.device)
    sT = outputs.empty((B, H, K, V), dtype=torch.float32, device=q.device) if output_final_state else None
    common = dict(C=C, c=c, GATE=gate, COMPUTE=COMPUTE, IEEE=IEEE)
    if mode == "fused":
        BK, BV = fused_blocks(K, V)
        try:
            last_launch["fused"] = _fused_kernel[(triton.cdiv(V, BV), B * H)](
                q, k, v, g, o, s0 if s0 is not None else q, sT if sT is not None else q, T, H, K, V,
                NT, d.scale, BK=BK, BV=BV, HAS_S0=s0 is not None, STORE_ST=sT is not None,
                num_warps=4, num_stages=FUSED_STAGES, **common)
            ran["mode"] = "fused"
            return o, sT
        except OutOfResources as e:
            # The fused program holds a chunk's tiles and the state at once; for large tiles
            # (float32 at K = 128, or C = 256) that can exceed the SM's shared memory (seen on the
            # H200). The states mode computes the same result with smaller programs.
            ran["mode"] = f"states (fused did not fit: {str(e).split('.')[0]})"
    else:
        ran["mode"] = mode
    h, _ = chunk_states(k, v, None if gate == NO_GATE else g, d, s0=s0, sT=sT, chunk_size=C)
    BK, BV = output_blocks(K, V, IEEE)
    subs = min(OUTPUT_SUBS, C // c) if gate == DIM_GATE else C // c   # sub-chunks per program
    last_launch["output"] = _output_kernel[(triton.cdiv(V, BV), NT * (C // c // subs), B * H)](
        q, k, v, g, h, o, T, H, K, V, NT, d.scale, SUBS=subs, BK=BK, BV=BV, num_warps=OUTPUT_WARPS,
        **common)
    return o, sT


def chunk_states(k, v, g, d, *, s0=None, sT=None, chunk_size=64):
    """The state before every chunk, h [B, H, NT, K, V], from k, v and log-gates g (None, [B,T,H]
    or [B,T,H,K]), each chunk's gates summed in the kernel.

    Stored in the dtype the output kernel multiplies it in (the input's natively, float32 under
    the interpreter or for float32 inputs). Also the inter-chunk half of the work, timed alone in
    chapter 10. Fills sT [B, H, K, V] with the final state when given.
    """
    B, T, H, K, V, C = d.B, d.T, d.H, d.K, d.V, chunk_size
    gate = NO_GATE if g is None else (HEAD_GATE if g.dim() == 3 else DIM_GATE)
    k, v, g = contiguous(k, v, g)
    NT = triton.cdiv(T, C)
    COMPUTE = compute_dtype(k.dtype)
    IEEE = COMPUTE == tl.float32
    h = torch.empty((B, H, NT, K, V), dtype=torch.float32 if IEEE else k.dtype, device=k.device)
    SK, SV = STATE_BLOCKS or state_blocks(K, V, B * H)                # every entry written below
    last_launch["states"] = _states_kernel[(triton.cdiv(K, SK), triton.cdiv(V, SV), B * H)](
        k, v, k if g is None else g, h, s0 if s0 is not None else k, sT if sT is not None else k,
        T, H, K, V, NT, C=C, BK=SK, BV=SV, GATE=gate, COMPUTE=COMPUTE, IEEE=IEEE,
        HAS_S0=s0 is not None, STORE_ST=sT is not None, num_warps=4)
    return h, sT


def gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
        sub_chunk_size=16, mode="auto"):
    """Gated linear attention forward; g [B,T,H] or [B,T,H,K] log-decays ≤ 0. See the module doc."""
    d = check_inputs(q, k, v, g=g, scale=scale, initial_state=initial_state, gate=True)
    check_chunk(chunk_size, sub_chunk_size, power_of_two=True, minimum=16)
    return forward(q, k, v, g, d, initial_state=initial_state, output_final_state=output_final_state,
                   chunk_size=chunk_size, sub_chunk_size=sub_chunk_size, mode=mode)
