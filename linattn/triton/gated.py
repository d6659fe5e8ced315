"""Chunkwise gated linear attention (GLA) in Triton, with secondary chunking; linear attention is g = 0.

Recurrence (state S is K×V): S_t = diag(exp g_t) S_{t-1} + k_tᵀ v_t, o_t = scale · q_t S_t, with
g [B,T,H] (one log-decay per head) or [B,T,H,K] (one per key dimension), or no gate at all.

Per chunk of C tokens starting at t0, with b_t = g_{t0} + … + g_t (cumulative log-gate inside the
chunk, float32) and S the state before the chunk:
    o_t   = scale · ((q_t ⊙ e^{b_t}) S  +  Σ_{s ≤ t in chunk} Σ_k q_tk k_sk e^{b_tk − b_sk} v_s)
    S_new = diag(e^{b_last}) S + Σ_s (k_s ⊙ e^{b_last − b_s})ᵀ v_s
Every exponent is a sum of log-gates over a stretch of tokens (b, or b_t − b_s with t ≥ s), so
every factor is ≤ 1: nothing overflows however strong the gates are; tiny products underflow to
0, which is what they are. The gates are summed once, by _local_cumsum_kernel, into b (float32,
shaped like g), which the later kernels read (see `forward` for what was measured): no scan is
left in the sequential chunk loop.

The intra-chunk term for per-dimension gates cannot be one matmul (the decay sits inside the sum
over k). Secondary chunking (_intra_kernel) splits the chunk into sub-chunks of c tokens:
- an off-diagonal tile (sub-chunk i attends to j < i) factors through the reference r = b just
  before sub-chunk i: e^{b_t − b_s} = e^{b_t − r} · e^{r − b_s}, both ≤ 1, so the tile is an
  ordinary (half-precision) tensor-core matmul of absorbed queries and keys;
- a diagonal tile (i attends to itself) has no point between its queries and keys to split at.
  It is built in float32 row by row: the decayed keys R_t[s, :] = k_s ⊙ e^{b_t − b_s} (s ≤ t)
  satisfy R_t = R_{t−1} ⊙ e^{g_t} with row t set to k_t, so each row costs one exponential per
  key dimension instead of one per (s, k), and row t of A is R_t q_t.
It writes the chunk's C×C matrix A (float32) in parallel over (sub-chunk, chunk, batch·head); the
output step then needs two matmuls per chunk, as for per-head gates, where the decay leaves the
k-sum and the whole chunk is one matmul times a C×C decay mask.

The split (chapter 11's, for KDA): where a chunk decays by less than e^60 in every key dimension,
which the gates of trained models always do, e^{b_t − b_s} = e^{b_t} · e^{−b_s} with both factors
in range, so the chunk's A is one tensor-core product (Q ⊙ e^b)(K ⊙ e^{−b})ᵀ, its operands in
float32 (tf32 products for bf16/fp16 inputs, as the off-diagonal tiles: `common.split_dtype`). The
plain forward builds it that way inside the output kernel and _intra_kernel fills A only for the
chunks past the bound (`_split_flag` decides for both); a forward that keeps A for the backward
computes all of it.

Two ways to run the chunks (`mode`):
- "fused": one program per (batch·head, V-block) walks all chunks, the state stays on chip and is
  never materialised. Parallelism: B·H·V/BV programs.
- "states": a first kernel walks the chunks and writes the state before every chunk to memory
  (B·H·NT·K·V values, in the input dtype); a second kernel computes every chunk's output in
  parallel (B·H·NT·V/BV programs). More memory traffic, far more parallelism.
"auto" picks by measurement (`choose_mode`). A state pass whose walks leave most SMs idle (one long
sequence, few heads) is cut into segments along the sequence (segments.py, `segment_plan`). When the
fused program's tiles do not fit the GPU's shared memory (float32 at K = 128, or C = 256), the call
runs as "states" instead; `ran["mode"]` says which mode the last call used.

Chunks of 16 to 256 tokens (powers of two). Beyond 64 the output step works in row blocks of 64
(`ROW_BLOCK`) and the state pass may run with fewer pipeline stages (`common.launch`).

Packed sequences (`cu_seqlens`, linattn.packing: B = 1, N sequences back to back in the row) run in
the same launches, one per kernel, each sequence chunked from its own start (`Packed`, built on the
host from the boundaries): chunk_indices [NT, 2] lists (sequence n, chunk i within n) for the NT
chunks of the row, chunk_offsets [N + 1] the row's first chunk of each sequence. A chunk-parallel
kernel (cumulated gates, intra matrix, output) reads its (n, i) from chunk_indices at its program
id; a walk over the chunks (state pass, fused kernel) runs one program per (sequence, head, block)
over that sequence's own chunks. Either way a program then moves its base pointers to the
sequence's first token bos = cu_seqlens[n], masks by the sequence's length T_n instead of T, and
runs the unpacked code; h holds the row's chunks, [1, H, NT, K, V], a sequence's from
chunk_offsets[n] on; initial and final states are [N, H, K, V]. The constexpr VARLEN selects that
prologue, so the unpacked kernels compile exactly as without it. An empty sequence has no chunk:
its final state is its initial state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .. import outputs
from .. import packing
from . import segments
from ..support import check_triton
from ..validate import InputError, check_inputs
from .common import (MIN_TILE, SPLIT_RANGE, block, check_kernel_inputs, compute_dtype, contiguous, dot, dot_input, gate_floor,
                     kernel, launch, num_sms, operand, split_dtype, warps)

MODES = ("auto", "fused", "states")
# The compiled kernel of each name's last launch (natively: n_regs, n_spills, metadata.shared),
# so chapter 09 can show the compiler's resource report without recompiling.
last_launch: dict = {}
ran: dict = {}          # ran["mode"]: the mode the last call actually used ("auto" resolved)
# Two pipeline stages for the fused chunk loop: three (Triton's default) needed 254 KB of shared
# memory for bf16 tiles at K = V = 128, C = 64 on an H200, over its 227 KB.
FUSED_STAGES = 2
# Two stages for the intra-chunk kernel: its off-diagonal loop's buffers then take 17 KB of
# shared memory instead of 30, and ten programs fit an H200 SM instead of seven (0.50 ms with
# three stages, 0.42 with two, at the benchmark size).
INTRA_STAGES = 2
# Width of the state passes' K and V blocks (`state_config` narrows one of them where that pays).
STATE_BLOCK = 64
# Rows of a chunk one output step handles at once: chunks larger than this go in row blocks, so no
# [C, C] tile is bigger than 64×64 (C = 256 in float32 would not fit an SM's registers).
ROW_BLOCK = 64
NO_GATE, HEAD_GATE, DIM_GATE = 0, 1, 2


@dataclass(frozen=True)
class Packed:
    """Packed sequences as the kernels index them (module docstring), for one chunk size C."""
    cu_seqlens: torch.Tensor       # [N + 1] int64, the caller's boundaries (read, never written)
    chunk_indices: torch.Tensor    # [NT, 2] int32: (sequence n, chunk i within n) of every chunk of the row
    chunk_offsets: torch.Tensor    # [N + 1] int64: the row's first chunk of each sequence; [N] = NT
    N: int                         # sequences
    NT: int                        # chunks of the row, Σ_n ⌈T_n / C⌉
    C: int
    rows: int                      # ⌊ΣT_n / max T_n⌋ ≥ 1: rows of the longest sequence the tokens fill
    lengths: tuple = ()            # T_n of every sequence (segments.py cuts the long ones)


def packed(cu_seqlens, bounds, chunk_size: int) -> Packed:
    """The chunk tables of a packed row whose boundaries `bounds` (cu_seqlens validated and read to
    the host by `linattn.packing.check_cu_seqlens`) are those of `cu_seqlens`. An empty sequence
    has no chunk, and its entry in chunk_offsets equals the next one's."""
    lengths = [e - s for s, e in zip(bounds, bounds[1:])]
    counts = [triton.cdiv(n, chunk_size) for n in lengths]
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    pairs = [(n, i) for n, count in enumerate(counts) for i in range(count)]
    dev = cu_seqlens.device
    indices = torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2).to(dev)
    rows = max(1, sum(lengths) // max(1, max(lengths, default=0)))
    return Packed(cu_seqlens, indices, torch.tensor(offsets, dtype=torch.int64, device=dev),
                  len(counts), offsets[-1], chunk_size, rows, tuple(lengths))


def busy_rows(B: int, seqs=None) -> int:
    """The rows a launch's grid heuristics count (how many programs keep the SMs busy): B, or for a
    packed row `Packed.rows`. A kernel that walks a sequence's chunks in order (state pass, fused
    forward, reverse pass) lasts as long as its longest sequence, so a packed row of N sequences
    keeps the GPU as busy as ΣT_n / max T_n rows of that length, not N rows: on an H200 (bf16,
    H = 16, K = V = 128, documents of 256 to 16,384 tokens, 32k in all) choosing by N = 8 picked
    the fused forward, whose 16k-token walk took linear attention's packed forward 3× as long as
    eight rows of 4k tokens."""
    return B if seqs is None else seqs.rows


def check_packed(cu_seqlens, d, q, initial_state, chunk_size):
    """None without cu_seqlens; else `Packed` for the row, once cu_seqlens and the initial states
    [N, H, K, V] passed `linattn.packing.check_cu_seqlens` (before any launch)."""
    if cu_seqlens is None:
        return None
    bounds = packing.check_cu_seqlens(cu_seqlens, d, q.device, initial_state)
    return packing.remembered(cu_seqlens, ("chunks", chunk_size), lambda: packed(cu_seqlens, bounds, chunk_size))


@triton.jit
def _packed_seq(cu_seqlens, n):
    """Sequence n of a packed row: its first token bos (int64) and its length T_n."""
    bos = tl.load(cu_seqlens + n)
    return bos, (tl.load(cu_seqlens + n + 1) - bos).to(tl.int32)


@triton.jit
def _packed_chunk(cu_seqlens, chunk_indices, i_c):
    """Chunk i_c of a packed row: (chunk i within its sequence, the sequence's bos, its length T_n)."""
    n = tl.load(chunk_indices + 2 * i_c)
    bos, T = _packed_seq(cu_seqlens, n)
    return tl.load(chunk_indices + 2 * i_c + 1), bos, T


@triton.jit
def _gate_row(gate, bos, H, K, GATE: tl.constexpr):
    """gate moved to token bos of its [1, T, H(, K)] row (per-dimension gates: H·K values a token)."""
    if GATE == 2:
        x = gate + bos * H * K
    else:
        x = gate + bos * H
    return x


@kernel
def _local_cumsum_kernel(g, b, T, W, C: tl.constexpr, BW: tl.constexpr, cu_seqlens=None, chunk_indices=None,
                         VARLEN: tl.constexpr = False):
    # g viewed as [B, T, W] (W = H·K or H): b = cumulative sum along T, restarting every C tokens.
    # Summed in float64, rounded once: every kernel takes differences b_t − b_s of these sums, whose
    # error grows with |b| (a chunk of strong gates or a reset puts it in the hundreds); a float32
    # scan adds a rounding per token on top of the final one (2–2.5× the error, measured under the
    # interpreter for float32 inputs at C = 256 with resets).
    i_w, i_n, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    if VARLEN:              # packed (B = 1): program i_n is the row's chunk i_n, chunk i of its sequence
        i_n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, i_n)
        g, b = g + bos * W, b + bos * W
    idx = tl.arange(0, C)
    rows = i_n * C + idx
    cols = i_w * BW + tl.arange(0, BW)
    cmask = cols < W
    mask = (rows < T)[:, None] & cmask[None, :]
    offs = i_b * T * W + rows[:, None] * W + cols[None, :]
    x = gate_floor(tl.load(g + offs, mask=mask, other=0.0))       # [C, BW]
    tl.store(b + offs, tl.cumsum(x.to(tl.float64), axis=0).to(tl.float32), mask=mask)

@triton.jit
def _state_step(S, k_base, v_base, gate_base, graw_base, t0, T, s_k, s_v, s_gate, offs_k, offs_v, K, V,
                C: tl.constexpr, GATE: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr):
    """The state after the chunk starting at t0, from S (the state before it). S: [BK, BV] float32.
    gate_base: the cumulated gates b (`local_cumsum`); graw_base: the raw log-gates g. Also returns
    the chunk's log-decay b_last ([BK], a scalar per head, 0 ungated) for a pass cut into segments (segments.py).

    A key decays to the chunk end by e^{b_C − b_j}. For float32 inputs (IEEE) that difference is
    summed here as a suffix of the chunk's own gates instead: behind a reset the prefix sums reach
    −C·110, where float32 resolves |b|·6e-8, and b_C − b_j for the last keys (the ones that matter)
    kept that absolute error (GLA's float32 final state at C = 128: 1.7e-5 against 3.4e-7). For
    bf16/fp16 inputs the decayed key is rounded to 8 or 11 bits right after, which hides it (the
    same final-state errors, measured natively), and the scan in this sequential loop cost 0.3 ms
    of GLA's 1.0 ms forward at T = 4k and 1.2 of 1.4 ms at 32k (H200, bf16, H = 16)."""
    rows = t0 + tl.arange(0, C)
    rmask = rows < T
    kmask = offs_k < K
    last = tl.minimum(t0 + C, T) - 1                                                 # last token of the chunk
    k = tl.load(k_base + rows[:, None] * s_k + offs_k[None, :], mask=rmask[:, None] & kmask[None, :],
                other=0.0).to(COMPUTE)                                              # [C, BK]
    v = tl.load(v_base + rows[:, None] * s_v + offs_v[None, :],
                mask=rmask[:, None] & (offs_v < V)[None, :], other=0.0).to(COMPUTE)   # [C, BV]
    if GATE == 2:
        if IEEE:
            g = gate_floor(tl.load(graw_base + rows[:, None] * s_gate + offs_k[None, :],
                                   mask=rmask[:, None] & kmask[None, :], other=0.0))  # [C, BK], 0 past T
            after = tl.cumsum(g, axis=0, reverse=True) - g                           # Σ_{i>j} g_i ≤ 0
            k = k * tl.exp(after)
            b_last = tl.sum(g, axis=0)                       # the whole chunk's log-decay
            S = S * tl.exp(b_last)[:, None]
        else:
            b = tl.load(gate_base + rows[:, None] * s_gate + offs_k[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0)             # [C, BK]
            # b_last taken from the tile, not loaded on its own: a load in this loop that feeds no
            # dot operand stops Triton from software-pipelining the loop's loads (seen in the SASS).
            b_last = tl.sum(tl.where((rows == last)[:, None], b, 0.0), axis=0)      # [BK]
            k = (k * tl.exp(b_last[None, :] - b)).to(COMPUTE)  # key decayed to the chunk end (≤ 1)
            S = S * tl.exp(b_last)[:, None]
    elif GATE == 1:
        if IEEE:
            g = gate_floor(tl.load(graw_base + rows * s_gate, mask=rmask, other=0.0))   # [C]
            k = k * tl.exp(tl.cumsum(g, axis=0, reverse=True) - g)[:, None]
            b_last = tl.sum(g, axis=0)
            S = S * tl.exp(b_last)
        else:
            # b_last reaches the dot operand through the key decay, so the loop stays pipelined.
            b = tl.load(gate_base + rows * s_gate, mask=rmask, other=0.0)            # [C]
            b_last = tl.load(gate_base + last * s_gate)                              # Σ of the chunk's gates
            k = (k * tl.exp(b_last - b)[:, None]).to(COMPUTE)  # key decayed to the chunk end (≤ 1)
            S = S * tl.exp(b_last)
    else:
        b_last = 0.0
    return S + dot(tl.trans(k), v, IEEE), b_last                                     # [BK, BV], log-decay


@triton.jit
def _diag_rows(k_base, q_base, g_base, a_row0, s0, T, s_k, s_a, offs_k, kmask, c: tl.constexpr):
    """The diagonal tile A_ii of the sub-chunk starting at s0, stored row by row at a_row0 (row
    stride s_a): A[t, s] = Σ_k q_tk k_sk e^{b_tk − b_sk} for s ≤ t, 0 above the diagonal.

    Rows walked in order with the decayed keys R_t[s] = k_s ⊙ e^{b_t − b_s} (s ≤ t), updated by
    R_t = R_{t−1} ⊙ e^{g_t} and row t set to k_t: one exponential per key dimension per row,
    every factor ≤ 1, and row t of A is R_t q_t, stored as one contiguous vector. The key rows
    are held in two halves of c/2: while t < c/2 the second half is all zero and skipped, after
    that the first half only decays (no select) — a quarter less tile work. Row t + 1's query
    and gate are loaded while row t is computed."""
    HALF: tl.constexpr = c // 2
    h = tl.arange(0, HALF)
    p_lo = (s0 + h)[:, None] * s_k + offs_k[None, :]
    k_lo = tl.load(k_base + p_lo, mask=((s0 + h) < T)[:, None] & kmask[None, :],
                   other=0.0).to(tl.float32)                                         # [c/2, BK]
    k_hi = tl.load(k_base + p_lo + HALF * s_k, mask=((s0 + HALF + h) < T)[:, None] & kmask[None, :],
                   other=0.0).to(tl.float32)                                         # [c/2, BK]
    R_lo = tl.zeros_like(k_lo)
    R_hi = tl.zeros_like(k_hi)
    zeros = tl.zeros([HALF], dtype=tl.float32)
    q_t = tl.load(q_base + s0 * s_k + offs_k, mask=kmask & (s0 < T), other=0.0)        # [BK]
    # raw gates in their own dtype, widened on load: Triton's exp takes float32/float64 only
    g_t = gate_floor(tl.load(g_base + s0 * s_k + offs_k, mask=kmask & (s0 < T), other=0.0))  # [BK]
    for t in range(HALF):                       # rows 0 … c/2 − 1: every key s ≤ t in the first half
        nxt = kmask & (s0 + t + 1 < T)
        q_n = tl.load(q_base + (s0 + t + 1) * s_k + offs_k, mask=nxt, other=0.0)
        g_n = gate_floor(tl.load(g_base + (s0 + t + 1) * s_k + offs_k, mask=nxt, other=0.0))
        R_lo = tl.where(h[:, None] == t, k_lo, R_lo * tl.exp(g_t)[None, :])
        p = a_row0 + t * s_a + h
        tl.store(p, tl.sum(R_lo * q_t.to(tl.float32)[None, :], axis=1), mask=s0 + t < T)
        tl.store(p + HALF, zeros, mask=s0 + t < T)                                    # s > t
        q_t, g_t = q_n, g_n
    for t in range(HALF, c):                    # rows c/2 … c − 1: the first half only decays
        nxt = kmask & (t + 1 < c) & (s0 + t + 1 < T)
        q_n = tl.load(q_base + (s0 + t + 1) * s_k + offs_k, mask=nxt, other=0.0)
        g_n = gate_floor(tl.load(g_base + (s0 + t + 1) * s_k + offs_k, mask=nxt, other=0.0))
        e = tl.exp(g_t)[None, :]
        qf = q_t.to(tl.float32)[None, :]
        R_lo = R_lo * e
        R_hi = tl.where(h[:, None] == t - HALF, k_hi, R_hi * e)
        p = a_row0 + t * s_a + h
        tl.store(p, tl.sum(R_lo * qf, axis=1), mask=s0 + t < T)
        tl.store(p + HALF, tl.sum(R_hi * qf, axis=1), mask=s0 + t < T)
        q_t, g_t = q_n, g_n


@triton.jit
def _split_flag(b_base, t0, T, s_b, offs_k, kmask, C: tl.constexpr):
    """1 where the chunk starting at t0 decays by less than e^{SPLIT_RANGE} in every key dimension
    (its cumulated gates at the last token, b_C > −SPLIT_RANGE), else 0. The intra and output kernels
    decide from this one load alike, so a chunk's A is built by exactly one of them."""
    last = tl.minimum(t0 + C, T) - 1
    b_end = tl.load(b_base + last * s_b + offs_k, mask=kmask, other=0.0)                # [BK]
    return (tl.min(b_end, axis=0) > -SPLIT_RANGE).to(tl.int32)


@kernel
def _intra_kernel(q, k, g, b, A, T, H, K, C: tl.constexpr, c: tl.constexpr, BK: tl.constexpr,
                  COMPUTE: tl.constexpr, IEEE: tl.constexpr, SKIP_SPLIT: tl.constexpr, cu_seqlens=None,
                  chunk_indices=None, VARLEN: tl.constexpr = False):
    # One program per (sub-chunk i, chunk n, batch·head): rows of sub-chunk i of the intra-chunk
    # matrix A[t, s] = Σ_k q_tk k_sk e^{b_tk − b_sk} for s ≤ t in the chunk (tiles j ≤ i).
    i_i, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if VARLEN:              # packed (B = 1): the row's chunk i_n is chunk i of its sequence
        i_n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, i_n)
        q, k, g, b, A = q + bos * H * K, k + bos * H * K, g + bos * H * K, b + bos * H * K, A + bos * H * C
    t0 = i_n * C
    s0 = t0 + i_i * c
    base = i_b * T * H * K + i_h * K                         # q, k, g and b share the [B,T,H,K] layout
    offs_k = tl.arange(0, BK)
    kmask = offs_k < K
    todo = s0 < T
    if SKIP_SPLIT:          # the output kernel builds this chunk's A itself (`_split_flag`)
        todo = todo & (_split_flag(b + base, t0, T, H * K, offs_k, kmask, C) == 0)
    if todo:
        a_base = A + i_b * T * H * C + i_h * C                # A is [B, T, H, C]
        idx = tl.arange(0, c)
        rows = s0 + idx
        rmask = rows < T
        if i_i > 0:                                           # the first sub-chunk has no tile j < i
            m_qk = rmask[:, None] & kmask[None, :]
            p_rows = rows[:, None] * H * K + offs_k[None, :]
            q_i = tl.load(q + base + p_rows, mask=m_qk, other=0.0).to(tl.float32)            # [c, BK]
            b_i = tl.load(b + base + p_rows, mask=m_qk, other=0.0)                           # [c, BK]
            # reference r: cumulative gate just before sub-chunk i
            r = tl.load(b + base + (s0 - 1) * H * K + offs_k, mask=kmask, other=0.0)          # [BK]
            # b ≤ r on real rows; the clamp keeps rows past T (b = 0 there) from overflowing
            # decayed operands stay float32 (tf32 products for half inputs): `common.split_dtype`
            q_hat = operand(q_i * tl.exp(tl.minimum(b_i - r[None, :], 0.0)), tl.float32, IEEE)  # [c, BK], ≤ |q|
            p_a = a_base + rows[:, None] * H * C
            for j in range(i_i):                              # off-diagonal tiles: tensor-core matmuls
                p_j = (t0 + j * c + idx)[:, None] * H * K + offs_k[None, :]                   # rows all < T
                k_j = tl.load(k + base + p_j, mask=kmask[None, :], other=0.0).to(tl.float32)
                b_j = tl.load(b + base + p_j, mask=kmask[None, :], other=0.0)
                k_hat = operand(k_j * tl.exp(r[None, :] - b_j), tl.float32, IEEE)            # [c, BK], ≤ |k|
                A_ij = dot(q_hat, tl.trans(k_hat), IEEE)                                     # [c, c]
                tl.store(p_a + (j * c + idx)[None, :], A_ij, mask=rmask[:, None])
        # the diagonal tile in float32 by the multiplicative row walk, stored row by row
        _diag_rows(k + base, q + base, g + base, a_base + s0 * H * C + i_i * c, s0, T, H * K, H * C,
                   offs_k, kmask, c)
        # tiles above the diagonal are never written: the output step selects them away (tl.where)


@triton.jit
def _block_av(q, qe, b, split, b_r, rows, rmask, k_base, v_base, gate_base, a_base, t0, c0, T, K, V, s_k,
              s_v, s_gate, s_a, offs_v, BR: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr,
              COMPUTE: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, SDT: tl.constexpr,
              SAME: tl.constexpr):
    """A[rows, cols] V[cols] for the BR columns of the chunk from c0 on ([BR, BV], float32).
    qe: the rows' queries decayed from the chunk start, q ⊙ e^b in SDT (per-dimension gates)."""
    offs_k = tl.arange(0, BK)
    cols = t0 + c0 + tl.arange(0, BR)
    cmask = cols < T
    v = tl.load(v_base + cols[:, None] * s_v + offs_v[None, :], mask=cmask[:, None] & (offs_v < V)[None, :],
                other=0.0).to(COMPUTE)                                                          # [BR, BV]
    if GATE == 2:
        # the intra-chunk matrix: from _intra_kernel (secondary chunking), unless the chunk splits
        p_a = a_base + rows[:, None] * s_a + (c0 + tl.arange(0, BR))[None, :]
        if SPLIT:
            if split != 0:
                # e^{b_t − b_s} = e^{b_t} · e^{−b_s}, the second factor ≤ e^{SPLIT_RANGE}: one product
                m_k = cmask[:, None] & (offs_k < K)[None, :]
                p_k = cols[:, None] * s_k + offs_k[None, :]
                k = tl.load(k_base + p_k, mask=m_k, other=0.0).to(tl.float32)                 # [BR, BK]
                if SAME:            # the columns are the rows (C ≤ 64): b at hand, not reloaded
                    b_c = b
                else:
                    b_c = tl.load(gate_base + p_k, mask=m_k, other=0.0)                       # [BR, BK]
                A = dot(qe, tl.trans(operand(k * tl.exp(-b_c), SDT, IEEE)), IEEE)             # [BR, BR]
            else:
                A = tl.load(p_a, mask=rmask[:, None], other=0.0)                              # [BR, BR]
        else:
            A = tl.load(p_a, mask=rmask[:, None], other=0.0)
    else:
        k = tl.load(k_base + cols[:, None] * s_k + offs_k[None, :], mask=cmask[:, None] & (offs_k < K)[None, :],
                    other=0.0).to(COMPUTE)                                                      # [BR, BK]
        A = dot(q, tl.trans(k), IEEE)                                                           # [BR, BR]
        if GATE == 1:
            # a per-head decay leaves the sum over k: one matmul times a decay mask
            b_c = tl.load(gate_base + cols * s_gate, mask=cmask, other=0.0)                     # [BR]
            A = A * tl.exp(tl.minimum(b_r[:, None] - b_c[None, :], 0.0))
    A = tl.where(rows[:, None] >= cols[None, :], A, 0.0)   # a select, not a product: unwritten entries never leak
    if COMPUTE == tl.float16 or GATE == 2:
        # A is computed (float32) and v exact in COMPUTE: two parts (`common.dot_input`), not A
        # rounded first. Emulated, fp16 o 2.94e-4 → 2.54e-4 (linear attention, K = V = 128); GLA
        # bf16 o 2.51e-3 → 1.66e-3 (strong gates, where A's entries span many binades). For linear
        # attention and per-head gates in bf16 the two parts gained 3–4 % for 6 % more forward time
        # (linear attention, H200, B·T = 32k, H = 16, K = V = 128), so they keep one product
        return dot_input(A, v, COMPUTE, IEEE)
    return dot(A.to(COMPUTE), v, IEEE)


@triton.jit
def _chunk_output(S, q_base, k_base, v_base, gate_base, a_base, o_base, t0, r0, T, K, V, scale,
                  s_k, s_v, s_gate, s_a, offs_v, C: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                  GATE: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr = False,
                  SDT: tl.constexpr = tl.bfloat16):
    """Write o for rows r0 … r0+BR−1 of the chunk starting at t0, given S [BK, BV] (float32), the
    state before the chunk. BR = C up to 64; larger chunks go in row blocks of 64, each summing the
    column blocks up to its diagonal (a 256×256 float32 tile would not fit an SM)."""
    offs_k = tl.arange(0, BK)
    kmask = offs_k < K
    rows = t0 + r0 + tl.arange(0, BR)
    rmask = rows < T
    m_qk = rmask[:, None] & kmask[None, :]
    if IEEE:
        # A fresh tensor for the operand, as the .to() makes for half precision. Natively (Triton
        # 3.6, H200) float32 fused mode failed its test while float32 states mode and bf16/fp16
        # fused passed; the difference is the loop-carried accumulator S feeding a dot directly.
        # Unverified workaround: docs/performance.md.
        Sc = tl.where((offs_v < V)[None, :], S, 0.0)
    else:
        Sc = S.to(COMPUTE)
    q = tl.load(q_base + rows[:, None] * s_k + offs_k[None, :], mask=m_qk, other=0.0).to(COMPUTE)    # [BR, BK]
    b_r = tl.zeros([BR], dtype=tl.float32)
    b = tl.zeros([BR, BK], dtype=tl.float32)
    qe = tl.zeros([BR, BK], dtype=SDT)
    split = 0
    if GATE == 2:
        # queries decayed from the chunk start
        b = tl.load(gate_base + rows[:, None] * s_gate + offs_k[None, :], mask=m_qk, other=0.0)     # [BR, BK]
        qb = q.to(tl.float32) * tl.exp(b)
        # q ⊙ e^b is computed, the state operand exact in the compute dtype: two parts
        # (`common.dot_input`). Rounding q ⊙ e^b to the input dtype first made o up to 1.18× less
        # precise (emulated: fp16 4.09e-4 → 3.64e-4, `gla-strength-073`; bf16 3.05e-3 → 2.59e-3,
        # `gla-strength-067`), for 5–7 % more forward time (H200, bf16, B·T = 32k, H = 16, K = V = 128)
        acc = dot_input(qb, Sc, COMPUTE, IEEE)                                                      # [BR, BV]
        qe = operand(qb, SDT, IEEE)               # the same tile where SDT is the compute dtype
        if SPLIT:
            split = _split_flag(gate_base, t0, T, s_gate, offs_k, kmask, C)
    elif GATE == 1:
        b_r = tl.load(gate_base + rows * s_gate, mask=rmask, other=0.0)                             # [BR]
        # the decay after the product, as FLA does: q stays the input it is. Rounding q · e^{b_r}
        # into the operand made o up to 1.16× less precise (emulated: bf16 3.33e-3 → 2.86e-3,
        # fp16 4.03e-4 → 3.52e-4, `simple_gla-extra-082`, `-149`)
        acc = dot(q, Sc, IEEE) * tl.exp(b_r)[:, None]
    else:
        acc = dot(q, Sc, IEEE)
    if C == BR:
        acc += _block_av(q, qe, b, split, b_r, rows, rmask, k_base, v_base, gate_base, a_base, t0, 0, T, K,
                         V, s_k, s_v, s_gate, s_a, offs_v, BR, BK, GATE, COMPUTE, IEEE, SPLIT, SDT, True)
    else:
        for c0 in range(0, r0 + BR, BR):                      # column blocks up to the diagonal
            acc += _block_av(q, qe, b, split, b_r, rows, rmask, k_base, v_base, gate_base, a_base, t0, c0, T,
                             K, V, s_k, s_v, s_gate, s_a, offs_v, BR, BK, GATE, COMPUTE, IEEE, SPLIT, SDT, False)
    tl.store(o_base + rows[:, None] * s_v + offs_v[None, :],
             (scale * acc).to(o_base.dtype.element_ty), mask=rmask[:, None] & (offs_v < V)[None, :])


@triton.jit
def _bases(q, k, v, gate, o, i_b, i_h, T, H, K, V, GATE: tl.constexpr):
    # Pointers to (batch i_b, head i_h, token 0) of each [B, T, H, *] tensor, and the gate's row
    # stride.
    q_base = q + i_b * T * H * K + i_h * K
    k_base = k + i_b * T * H * K + i_h * K
    v_base = v + i_b * T * H * V + i_h * V
    o_base = o + i_b * T * H * V + i_h * V
    if GATE == 2:
        gate_base = gate + i_b * T * H * K + i_h * K
        s_gate = H * K
    else:
        gate_base = gate + i_b * T * H + i_h
        s_gate = H
    return q_base, k_base, v_base, o_base, gate_base, s_gate


@kernel
def _states_kernel(k, v, gate, graw, h, s0, sT, T, H, K, V, NT, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, GATE: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr,
                   HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, cu_seqlens=None, chunk_offsets=None,
                   VARLEN: tl.constexpr = False, decay=None, STORE_H: tl.constexpr = True,
                   STORE_DECAY: tl.constexpr = False):
    # One program per (K-block, V-block, batch·head): walk the chunks, write the state before each.
    # Step 1 of a pass cut into segments (segments.py) writes no states, only the final one and, with
    # STORE_DECAY, the summed log-decay decay [N, H, K] (per dimension) or [N, H] (per head).
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_hs, NT_h = i_bh, NT                                     # h's row i_hs of NT_h chunks
    if VARLEN:
        # packed (B = 1, NT the row's chunks): i_bh = (sequence i_b, head i_h), s0 and sT [N, H, K, V];
        # h [1, H, NT, K, V] holds this sequence's chunks from chunk_offsets[i_b] on
        bos, T = _packed_seq(cu_seqlens, i_b)
        k, v = k + bos * H * K, v + bos * H * V
        gate, graw = _gate_row(gate, bos, H, K, GATE), _gate_row(graw, bos, H, K, GATE)
        h += tl.load(chunk_offsets + i_b) * K * V
        i_hs, NT = i_h, tl.cdiv(T, C)
        i_b = 0
    _, k_base, v_base, _, gate_base, s_gate = _bases(k, k, v, gate, v, i_b, i_h, T, H, K, V, GATE)
    _, _, _, _, graw_base, _ = _bases(k, k, v, graw, v, i_b, i_h, T, H, K, V, GATE)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    smask = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    s_offs = offs_k[:, None] * V + offs_v[None, :]
    if HAS_S0:
        S = tl.load(s0 + i_bh * K * V + s_offs, mask=smask, other=0.0)                      # [BK, BV]
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    if GATE == 2:
        total = tl.zeros([BK], dtype=tl.float32)
    else:
        total = 0.0
    for n in range(NT):
        if STORE_H:
            tl.store(h + (i_hs * NT_h + n) * K * V + s_offs, S.to(h.dtype.element_ty), mask=smask)
        S, b_last = _state_step(S, k_base, v_base, gate_base, graw_base, n * C, T, H * K, H * V, s_gate, offs_k,
                                offs_v, K, V, C, GATE, COMPUTE, IEEE)
        if STORE_DECAY:
            total += b_last
    if STORE_ST:
        tl.store(sT + i_bh * K * V + s_offs, S, mask=smask)
    if STORE_DECAY:
        if i_v == 0:
            if GATE == 2:
                tl.store(decay + i_bh * K + offs_k, total, mask=offs_k < K)
            else:
                if i_k == 0:
                    tl.store(decay + i_bh, total)


@kernel
def _output_kernel(q, k, v, gate, a, h, o, T, H, K, V, NT, scale, C: tl.constexpr, BR: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, COMPUTE: tl.constexpr,
                   IEEE: tl.constexpr, SPLIT: tl.constexpr = False, SDT: tl.constexpr = tl.bfloat16,
                   cu_seqlens=None, chunk_indices=None, VARLEN: tl.constexpr = False):
    # One program per (V-block, row block of a chunk, batch·head): every chunk's output in parallel.
    i_v, i_nr, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_n, r0 = i_nr // (C // BR), (i_nr % (C // BR)) * BR
    i_b, i_h = i_bh // H, i_bh % H
    i_hn = i_n                                                # h's chunk (packed: the row's, h [1, H, NT, K, V])
    if VARLEN:              # packed (B = 1): the row's chunk i_n is chunk i of its sequence
        i_n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, i_n)
        q, k, v, o, a = q + bos * H * K, k + bos * H * K, v + bos * H * V, o + bos * H * V, a + bos * H * C
        gate = _gate_row(gate, bos, H, K, GATE)
    q_base, k_base, v_base, o_base, gate_base, s_gate = _bases(q, k, v, gate, o, i_b, i_h, T, H, K, V, GATE)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    smask = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    S = tl.load(h + (i_bh * NT + i_hn) * K * V + offs_k[:, None] * V + offs_v[None, :],
                mask=smask, other=0.0).to(tl.float32)                                       # [BK, BV]
    a_base = a + i_b * T * H * C + i_h * C
    _chunk_output(S, q_base, k_base, v_base, gate_base, a_base, o_base, i_n * C, r0, T, K, V, scale,
                  H * K, H * V, s_gate, H * C, offs_v, C, BR, BK, GATE, COMPUTE, IEEE, SPLIT, SDT)


@kernel
def _fused_kernel(q, k, v, gate, graw, a, o, s0, sT, T, H, K, V, NT, scale, C: tl.constexpr,
                  BR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, COMPUTE: tl.constexpr,
                  IEEE: tl.constexpr, HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, SPLIT: tl.constexpr,
                  SDT: tl.constexpr, cu_seqlens=None, VARLEN: tl.constexpr = False):
    # One program per (V-block, batch·head): the state [K, BV] stays on chip across all chunks.
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if VARLEN:
        # packed (B = 1): i_bh = (sequence i_b, head i_h), s0 and sT [N, H, K, V]; its own chunks only
        bos, T = _packed_seq(cu_seqlens, i_b)
        q, k, v, o, a = q + bos * H * K, k + bos * H * K, v + bos * H * V, o + bos * H * V, a + bos * H * C
        gate, graw = _gate_row(gate, bos, H, K, GATE), _gate_row(graw, bos, H, K, GATE)
        NT = tl.cdiv(T, C)
        i_b = 0
    q_base, k_base, v_base, o_base, gate_base, s_gate = _bases(q, k, v, gate, o, i_b, i_h, T, H, K, V, GATE)
    _, _, _, _, graw_base, _ = _bases(q, k, v, graw, o, i_b, i_h, T, H, K, V, GATE)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    smask = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    s_offs = offs_k[:, None] * V + offs_v[None, :]
    if HAS_S0:
        S = tl.load(s0 + i_bh * K * V + s_offs, mask=smask, other=0.0)                      # [BK, BV]
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    a_base = a + i_b * T * H * C + i_h * C
    for n in range(NT):
        for r in tl.static_range(C // BR):
            _chunk_output(S, q_base, k_base, v_base, gate_base, a_base, o_base, n * C, r * BR, T, K, V, scale,
                          H * K, H * V, s_gate, H * C, offs_v, C, BR, BK, GATE, COMPUTE, IEEE, SPLIT, SDT)
        # (the log-decay is unused here; not `_`, which names an int32 above and a loop may not retype)
        S, unused = _state_step(S, k_base, v_base, gate_base, graw_base, n * C, T, H * K, H * V, s_gate, offs_k,
                                offs_v, K, V, C, GATE, COMPUTE, IEEE)
    if STORE_ST:
        tl.store(sT + i_bh * K * V + s_offs, S, mask=smask)


def packed_args(seqs, *names) -> dict:
    """The keyword arguments that make a launch index packed sequences (`Packed`'s tables by name,
    and VARLEN); none without packing."""
    return {} if seqs is None else dict({n: getattr(seqs, n) for n in names}, VARLEN=True)


def row_chunks(T: int, C: int, seqs=None) -> int:
    """Chunks of the row: ⌈T / C⌉, or those of the packed sequences (each from its own start)."""
    return triton.cdiv(T, C) if seqs is None else seqs.NT


def local_cumsum(g: torch.Tensor, chunk_size: int, seqs=None) -> torch.Tensor:
    """float32 cumulative log-gates restarting at every chunk: b in the module docstring.
    seqs (`Packed`): every packed sequence's chunks start at its own first token."""
    g = g.contiguous()          # the kernel reads [B, T, W] with plain strides (a copy only if needed)
    B, T = g.shape[:2]
    W = g[0, 0].numel()
    b = outputs.empty(g.shape, dtype=torch.float32, device=g.device)  # fully written below
    BW = min(block(W), max(16, 4096 // chunk_size))   # [C, BW] float64: as many registers as 8192 float32
    _local_cumsum_kernel[(triton.cdiv(W, BW), row_chunks(T, chunk_size, seqs), B)](
        g, b, T, W, chunk_size, BW, **packed_args(seqs, "cu_seqlens", "chunk_indices"))
    return b


def gate_sums(g, chunk_size: int, seqs=None):
    """b as the kernels read it: None without gates."""
    return None if g is None else local_cumsum(g, chunk_size, seqs)


def blocks(K: int, V: int):
    """(BK, BV) for the kernels that hold all of K: keep the [BK, BV] float32 state ≤ 8192 values."""
    BK = block(K)
    return BK, max(MIN_TILE, min(block(V), 8192 // BK, 64))


def few_programs(K: int, V: int, BH: int, sms=None) -> bool:
    """Whether a state pass of 64×64 blocks gives at most half the SMs a program (one long sequence:
    B·H = 16 at K = V = 128 on an H200), where narrower blocks pay (`state_config`)."""
    sms = num_sms() if sms is None else sms
    return BH * triton.cdiv(K, STATE_BLOCK) * triton.cdiv(V, STATE_BLOCK) <= sms // 2


def state_config(K: int, V: int, BH: int, gate: int, sms=None):
    """(BK, BV, pipeline stages) of the state pass (`chunk_states`). From sweeps on an H200 (bf16,
    K = V = 128, 16 heads, 32768 tokens, T = 1k–32k; docs/performance.md), state pass alone:
    - while 64×64 blocks give at most half the SMs a program (B·H = 16 here), a narrower block
      and 4 stages: per-head gates 32×64 (0.28 ms against 0.39 for 64×64), no gate 64×32 (0.22
      against 0.30; 32×64 took 0.53);
    - per-dimension gates hold a float32 gate tile as large as the key tile, which a program of
      all of V loads once instead of once per V-block: 32×128 took 0.24–0.34 ms at T ≤ 16k
      against 0.32–0.46 for 64×64 (with few programs 16×128 was faster still, 0.51 ms at 32k
      against 0.63 for 32×64, but no head-dimension tile is narrower than MIN_TILE: common.py);
    - otherwise 64×64, with 4 stages for per-head gates (0.405 / 0.451 ms for the whole call at
      T = 8k / 16k against 0.416 / 0.463 with 3) and 3 without gates."""
    few = few_programs(K, V, BH, sms)
    narrow = max(MIN_TILE, STATE_BLOCK // 2)
    if gate == DIM_GATE:
        BK, BV, stages = narrow, 2 * STATE_BLOCK, 3
    elif few:
        BK, BV, stages = (narrow, STATE_BLOCK, 4) if gate == HEAD_GATE else (STATE_BLOCK, narrow, 4)
    else:
        BK, BV, stages = STATE_BLOCK, STATE_BLOCK, 4 if gate == HEAD_GATE else 3
    return min(block(K), BK), min(block(V), BV), stages


def output_blocks(K: int, V: int, gate: int, ieee: bool, split: bool = False):
    """(BK, BV) of the states-mode output program. Without per-dimension gates, V up to 128 wide:
    on an H200 at T = 32768 (linear attention, bf16, K = V = 128) the output kernel takes about
    0.226 ms with 128 columns (a states call minus its state pass) against 0.259 ms with 64
    (tools/profile_ops.py): q and k are loaded once per chunk, not twice. The same holds, more
    so, for per-dimension gates with the split (the program also loads the float32 gates and
    builds A): 0.38 ms with 128 columns against 0.56 with 64 (H200, T = 1k–32k).
    The state tile stays ≤ 128×128 half-precision or 8192 float32 values (larger ones spilled
    registers when compiled for sm_90, and float32 tiles of 128×128 took 20–30 s to compile)."""
    BK = block(K)
    if gate == DIM_GATE and not split:
        return blocks(K, V)           # the A-reading output (kept for the backward)
    return BK, max(MIN_TILE, min(block(V), 128, (8192 if ieee else 16384) // BK))


def fused_config(K: int, V: int, gate: int, ieee: bool):
    """(BK, BV, warps) of the fused program. Per-head gates in half precision: the states-mode output
    program's blocks (`output_blocks`: all of V up to 128 columns) and 8 warps, so q, k and the gates
    are loaded once per chunk, not once per V-block. On an H200 (bf16, K = V = 128, 32768 tokens,
    T = 1k–4k) that fused call took 0.39 ms against 0.50 with 64 columns and 4 warps, and 0.40–0.42 ms
    in states mode. Otherwise `blocks`, 4 warps."""
    if gate == HEAD_GATE and not ieee:
        BK, BV = output_blocks(K, V, gate, ieee)
        return BK, BV, warps(8, BK, BV)
    return (*blocks(K, V), 4)


def choose_mode(mode: str, gate: int, B: int, H: int, K: int, V: int, ieee: bool = False) -> str:
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    if gate == DIM_GATE or (gate == HEAD_GATE and ieee):
        # Per-dimension gates on an H200 (bf16, K = V = 128, T = 1k–4k): fused 0.97–0.99 ms at best
        # (128 columns, 8 warps) against 0.75–0.84 for states. A fused program applies the decays
        # inside its sequential loop and, with that loop's loads pipelined, needs most of an SM's
        # shared memory, so no second program hides its latency. Per-head gates in float32 keep
        # the states mode their half-precision measurement below does not cover.
        return "states"
    # Linear attention on an H200 (bf16, K = V = 128): fused 0.27–0.29 ms up to T = 8192
    # (128 programs on 132 SMs) against states 0.35–0.41 ms there; states ahead from T = 16384
    # (64 programs: 0.39 against 0.52 ms). Per-head gates (`fused_config`): fused 0.39 ms for
    # T = 1k–4k (128 to 512 programs) against 0.40–0.42 for states, 0.76 against 0.43 at T = 8k
    # (64 programs). So fused while its grid has more programs than half the SMs: the state stays
    # on chip and no SM sits idle.
    programs = B * H * triton.cdiv(V, fused_config(K, V, gate, ieee)[1])
    return "fused" if programs > num_sms() // 2 else "states"


def forward(q, k, v, g, d, *, initial_state, output_final_state, chunk_size, sub_chunk_size, mode, keep=None,
            seqs=None):
    """Run the chunk kernels; g is None (linear attention), [B,T,H] or [B,T,H,K]. Inputs validated.
    keep: a dict that receives the per-dimension gates' cumulated gates "b" and intra matrix "A"
    (the backward reads them instead of computing them again). seqs: `Packed` for packed
    sequences (B = 1; initial and final states [N, H, K, V]), else None.

    Per-dimension gates run three kernels before the output: cumulated gates b, the intra-chunk
    matrix A for the chunks past the split's bound (a launch that returns at once for the rest),
    the states; the output kernel builds A of the other chunks with one product each. On an H200
    (bf16, K = V = 128, 32768 tokens) that output kernel takes 0.38 ms, and the whole forward
    0.78–1.17 ms, against 0.30 ms plus 0.42 for A from secondary chunking (1.08–1.48 ms).
    Building the secondary-chunking tiles inside the output kernel instead was slower: 3.24 ms
    against 1.88 ms for separate kernels (docs/performance.md).

    Per-head gates are summed by the same launch: scanning them inside the sequential chunk loop
    put 27 barriers and 21 shuffles per chunk on its critical path (sm_90) against 17 and 0. On an
    H200 (bf16, K = V = 128) the per-head states path took 0.69 / 1.07 ms at T = 16k / 32k with the
    scans in the loop, 0.60 / 0.88 ms with this launch. (The state step must also keep every load
    of its loop feeding a dot operand, or Triton stops pipelining the loop: see `_state_step`.)
    """
    check_kernel_inputs(q)
    gate = NO_GATE if g is None else (HEAD_GATE if g.dim() == 3 else DIM_GATE)
    C, c = chunk_size, min(sub_chunk_size, chunk_size)
    q, k, v, g = contiguous(q, k, v, g)
    s0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    B, T, H, K, V = d.B, d.T, d.H, d.K, d.V
    NT = row_chunks(T, C, seqs)
    N = B if seqs is None else seqs.N                                # rows, or packed sequences
    COMPUTE = compute_dtype(q.dtype)
    IEEE = COMPUTE == tl.float32
    mode = choose_mode(mode, gate, busy_rows(B, seqs), H, K, V, IEEE)
    b = gate_sums(g, C, seqs)
    gates = q if b is None else b                                    # q: an unused pointer
    # per-dimension gates, no backward to feed: chunks in the split's range build their intra matrix
    # inside the output (or fused) kernel, with operands in split_dtype; _intra_kernel writes A
    # only for the others
    split = gate == DIM_GATE and keep is None
    a = intra_attention(q, k, g, d, C, c, b=b, skip_split=split, seqs=seqs) if gate == DIM_GATE else q
    if keep is not None and gate == DIM_GATE:
        keep.update(b=b, A=a)
    o = outputs.empty((B, T, H, V), dtype=v.dtype, device=q.device)
    sT = outputs.empty((N, H, K, V), dtype=torch.float32, device=q.device) if output_final_state else None
    common = dict(C=C, GATE=gate, COMPUTE=COMPUTE, IEEE=IEEE, SPLIT=split, SDT=split_dtype())
    if mode == "fused":
        BK, BV, nw = fused_config(K, V, gate, IEEE)
        try:
            last_launch["fused"] = _fused_kernel[(triton.cdiv(V, BV), N * H)](
                q, k, v, gates, q if g is None else g, a, o, s0 if s0 is not None else q, sT if sT is not None else q, T, H, K, V,
                NT, d.scale, BR=min(C, ROW_BLOCK), BK=BK, BV=BV, HAS_S0=s0 is not None, STORE_ST=sT is not None,
                num_warps=nw, num_stages=FUSED_STAGES, **common, **packed_args(seqs, "cu_seqlens"))
            ran["mode"] = "fused"
            return o, sT
        except OutOfResources as e:
            # The fused program holds a chunk's q, k, v, A tiles and the state at once; for large
            # tiles (float32, K = 128 or C = 256) that exceeds the SM's shared memory (seen on the
            # H200). The states mode computes the same result with smaller programs.
            ran["mode"] = f"states (fused did not fit: {str(e).split('.')[0]})"
    else:
        ran["mode"] = mode
    h, _ = chunk_states(k, v, g, d, b=b, s0=s0, sT=sT, chunk_size=C, seqs=seqs)
    BK, BV = output_blocks(K, V, gate, IEEE, split=split)
    BR = min(C, ROW_BLOCK)
    last_launch["output"] = launch(              # launch: fewer stages where the GPU has less shared memory
        _output_kernel, (triton.cdiv(V, BV), NT * (C // BR), B * H),
        q, k, v, gates, a, h, o, T, H, K, V, NT, d.scale, BR=BR, BK=BK, BV=BV, num_warps=4, **common,
        **packed_args(seqs, "cu_seqlens", "chunk_indices"))
    return o, sT


def intra_attention(q, k, g, d, C, c, *, b=None, skip_split=False, seqs=None):
    """The intra-chunk matrix A [B, T, H, C] (float32) for per-dimension gates g [B, T, H, K]:
    secondary chunking. b: the chunk-local cumulated gates (`local_cumsum(g, C)`) when at hand.
    skip_split: leave the chunks that take the split (`_split_flag`) unwritten, for an output kernel
    that builds their A itself (those rows are NaN under `testing.poisoned`).

    Row t holds A[t, s] for the C positions s of t's chunk, s ≤ t (entries above the diagonal are
    not written). Computed once, in parallel over (sub-chunk, chunk, batch·head), and read by both
    modes' output step. seqs: `Packed` (chunks from each packed sequence's start), else None.
    """
    B, T, H, K = d.B, d.T, d.H, d.K
    COMPUTE = compute_dtype(q.dtype)
    q, k, g = contiguous(q, k, g)
    b = local_cumsum(g, C, seqs) if b is None else b
    A = (outputs.empty if skip_split else outputs.scratch)((B, T, H, C), dtype=torch.float32, device=q.device)
    last_launch["intra"] = launch(
        _intra_kernel, (C // c, row_chunks(T, C, seqs), B * H),
        q, k, g, b, A, T, H, K, C=C, c=c, BK=block(K), COMPUTE=COMPUTE, IEEE=COMPUTE == tl.float32,
        SKIP_SPLIT=skip_split, num_warps=2 if c <= 16 else 4, max_stages=INTRA_STAGES,
        **packed_args(seqs, "cu_seqlens", "chunk_indices"))
    return A


def chunk_states(k, v, g, d, *, b=None, s0=None, sT=None, chunk_size=64, dtype=None, seqs=None, config=None,
                 segs="auto"):
    """The state before every chunk, h [B, H, NT, K, V], from k, v and log-gates g (None, [B,T,H]
    or [B,T,H,K]). The gates are summed first (`local_cumsum`: b) unless given.

    Stored in `dtype`; by default in the dtype the output kernel multiplies it in (the input's
    natively, float32 under the interpreter or for float32 inputs). The backward asks for float32:
    its gate gradient sums h ⊙ D elementwise, where a bf16 h costs the gradient its precision.
    Also the inter-chunk half of the work, timed alone in chapter 10. Fills sT [B, H, K, V] with
    the final state when given.

    seqs (`Packed`): one program per (sequence, head, block) over that sequence's chunks; h is then
    [1, H, NT, K, V] over the row's NT chunks, s0 and sT [N, H, K, V].
    config: (BK, BV, pipeline stages, warps) of the launch; None: `state_config`'s with 4 warps (the
    backward, which writes float32 states, passes its own: `gated_backward.state_launches`).
    segs: "auto" (`segment_plan`), None (one walk per sequence) or the `segments.Segments` to cut the
    sequences into (segments.py: three launches instead of one walk).
    """
    B, T, H, K, V, C = d.B, d.T, d.H, d.K, d.V, chunk_size
    gate = NO_GATE if g is None else (HEAD_GATE if g.dim() == 3 else DIM_GATE)
    k, v, g = contiguous(k, v, g)
    if b is None:
        b = gate_sums(g, C, seqs)
    NT = row_chunks(T, C, seqs)
    N = B if seqs is None else seqs.N
    COMPUTE = compute_dtype(k.dtype)
    IEEE = COMPUTE == tl.float32
    if dtype is None:
        dtype = torch.float32 if IEEE else k.dtype
    h = outputs.empty((B, H, NT, K, V), dtype=dtype, device=k.device)   # all written below
    SK, SV, stages, nw = config or (*state_config(K, V, busy_rows(B, seqs) * H, gate), 4)
    if segs == "auto":
        segs = segment_plan(B, T, C, H, K, V, (SK, SV), k.device, seqs, gate)
        if segs is not None and config is None:     # many programs now: the launch chosen for them
            SK, SV, stages, nw = *state_config(K, V, segs.S * H, gate), 4
    args = (k, v, k if b is None else b, k if g is None else g, h)
    kw = dict(C=C, BK=SK, BV=SV, GATE=gate, COMPUTE=COMPUTE, IEEE=IEEE, num_warps=nw, max_stages=stages)
    grid = (triton.cdiv(K, SK), triton.cdiv(V, SV))
    if segs is None:
        last_launch["states"] = launch(
            _states_kernel, (*grid, N * H), *args, s0 if s0 is not None else k, sT if sT is not None else k,
            T, H, K, V, NT, HAS_S0=s0 is not None, STORE_ST=sT is not None, **kw,
            **packed_args(seqs, "cu_seqlens", "chunk_offsets"))
        return h, sT
    # in segments (segments.py): 1. each segment from zero (h's pointer unused, k in its place),
    # 2. the combine, 3. each segment from the state entering it
    rows, tables = (*grid, segs.S * H), packed_args(segs, "cu_seqlens", "chunk_offsets")
    F, decay = segments.buffers(segs, H, K, V, gate, k.device)
    launch(_states_kernel, rows, *args[:4], k, k, F, T, H, K, V, 0, HAS_S0=False, STORE_ST=True, decay=decay,
           STORE_H=False, STORE_DECAY=decay is not None, **kw, **tables)
    s_in = segments.combine(F, decay, s0, sT, segs, gate=gate)
    last_launch["states"] = launch(_states_kernel, rows, *args, s_in, k, T, H, K, V, NT, HAS_S0=True,
                                   STORE_ST=False, **kw, **tables)
    return h, sT


# The shortest walk a state pass is cut into segments for (segments.length): with per-dimension gates
# 256 chunks (GLA, H = 4, T = 16k tokens of a packed row: forward 0.58 → 0.46 ms, H200), else 1024
# (linear attention and per-head GLA at H = 4 gained GPU time at 512 chunks and lost more in launches:
# forward + backward 1.03 → 1.56 ms and 1.82 → 2.12; at 2048 chunks 3.71 → 2.42 and 7.06 → 3.55).
SEGMENT_MIN_CHUNKS = {DIM_GATE: 256, HEAD_GATE: 1024, NO_GATE: 1024}


def segment_plan(B, T, C, H, K, V, blocks, device, seqs=None, gate=NO_GATE):
    """The segments a state pass of this call is cut into (segments.py), None for one walk per
    sequence; blocks: the (BK, BV) of its launch in one walk, whose programs the rule counts."""
    return segments.plan(B, T, C, H, triton.cdiv(K, blocks[0]) * triton.cdiv(V, blocks[1]), device, seqs,
                         min_chunks=SEGMENT_MIN_CHUNKS[gate])


def gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
        sub_chunk_size=16, mode="auto", recompute=True, cu_seqlens=None):
    """Gated linear attention; g [B,T,H] or [B,T,H,K] log-decays ≤ 0. See the module doc.

    Differentiable: when an input requires grad, the Triton backward of gated_backward.py runs
    (recompute=True recomputes the chunk states there, False keeps them from the forward).

    cu_seqlens: packed sequences (docs/packed_sequences.md): q [1, T, H, K] holds N sequences,
    initial and final states are [N, H, K, V]; one launch per kernel indexes them (module doc)."""
    from .gated_backward import run        # imports this module: deferred to the call

    d = check_inputs(q, k, v, g=g, scale=scale, initial_state=None if cu_seqlens is not None else initial_state,
                     gate=True)
    check_triton("gla", q, d.K, d.V, chunk_size, sub_chunk_size)
    seqs = check_packed(cu_seqlens, d, q, initial_state, chunk_size)
    return run(q, k, v, g, d, initial_state=initial_state, output_final_state=output_final_state,
               chunk_size=chunk_size, sub_chunk_size=sub_chunk_size, mode=mode, recompute=recompute, seqs=seqs)
