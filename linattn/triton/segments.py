"""State passes cut into segments along the sequence: one long sequence no longer walks its
chunks alone.

A state pass (the forward's states before every chunk, the backward's recomputed states and its
reverse pass) walks a sequence's chunks in order, one program per (sequence, head, block). With one
long sequence and few heads (B = 1, H = 4, T = 32k: 16 to 32 programs for 132 SMs) that walk is the
call's critical path while most SMs idle. Chapter 08's observation removes it: every chunk's step
is an affine map of the state,

    S ← diag(a_c) S + U_c          (a_c = e^{b_last} of the chunk, per key dimension, per head or 1),

so a stretch of chunks is one such map too: a = Π a_c and U = the stretch's state from zero. With
the sequence cut into segments of L chunks (chunk-aligned, so every chunk-local gate sum b is
unchanged) a pass runs as three launches:

    1. every segment from a zero state, in parallel: its final state F_j and its log-decay
       Σ_c log a_c (the state kernel with STORE_H off and STORE_DECAY on);
    2. `_combine_kernel`, one program per (sequence, head, block), walks the sequence's segments:
       the state entering segment j is S_j = a_{j−1} ⊙ S_{j−1} + F_{j−1}, S_0 the initial state;
       the state after the last is the final state;
    3. every segment again, in parallel, from S_j: the states before its chunks (the state kernel
       as for packed sequences, each segment a "sequence" with its own initial state).

The critical path goes from NT chunk steps to about 2L + NT/L, for twice the chunk steps in all.
The backward's reverse pass is the same map walked from the last chunk: in step 1 each segment
yields the gradient at its start from a zero gradient at its end, step 2 walks the segments from
the last, step 3 writes dh. Every factor is a decay ≤ 1, so nothing grows; the results differ from
one walk by float32 rounding order only.

Segments reuse the packed-sequence indexing (gated.py, "Packed sequences"): their token boundaries
play cu_seqlens and their first chunks chunk_offsets, so h keeps the row's layout [1, H, NT, K, V].
A row of B = 1 is one sequence; rows of B > 1 keep one walk per row. `length` decides from the
pass's launch whether segments pay (measured: they pay where the walks leave SMs idle and are long
enough to repay two extra launches; docs/performance.md, "The sequential state pass").
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import outputs, packing
from .common import kernel, launch, num_sms

# Segments are never shorter than this many chunks: below it the second walk and the combine cost
# more than the shorter walk saves.
MIN_CHUNKS = 16
_fixed: list = []          # `fixed`'s override of the rule, innermost last


@dataclass(frozen=True)
class Segments:
    """A row's sequences cut into segments of at most L chunks, as the state kernels index them."""
    cu_seqlens: torch.Tensor      # [S + 1] int64: token boundaries of the segments
    chunk_offsets: torch.Tensor   # [S + 1] int64: the row's first chunk of each segment
    first: torch.Tensor           # [N + 1] int64: sequence n's segments are first[n] … first[n+1] − 1
    N: int                        # sequences
    S: int                        # segments
    L: int                        # chunks per segment (the last of a sequence may have fewer)


@contextlib.contextmanager
def fixed(chunks: int):
    """Within the block every state pass cuts its sequences into segments of `chunks` chunks (0:
    never), whatever `length` would choose: for tests and for the benchmark behind the rule."""
    _fixed.append(chunks)
    try:
        yield
    finally:
        _fixed.pop()


def length(counts, programs_per_head: int, H: int, min_chunks: int = 4 * MIN_CHUNKS, sms=None) -> int:
    """Chunks per segment for a state pass over sequences of `counts` chunks each, whose launch has
    programs_per_head programs per (sequence, head); 0 for one walk per sequence.

    Measured on an H200 (bf16, K = V = 128, B = 1; docs/performance.md has the tables):
    - a pass whose walks give the GPU more than half its SMs' worth of programs moves its bytes
      about as fast as it can, and segments, which read k and v twice, gain nothing (linear
      attention at H = 16, 128 programs: the same GPU time either way); with at most half (GLA's
      forward pass at H = 16, 64 programs; every pass at H = 4) the walk's latency is what costs
      and segments cut it (GPU time at T = 32k: GLA 1.46 → 1.32 ms at H = 16, 0.96 → 0.42 at H = 4);
    - every segmented pass launches three kernels for one, about 0.1 ms of host time each way on the
      machine measured, so a short walk loses in wall time what its GPU time gains: the walk must
      be at least `min_chunks` long (the caller's: a per-dimension gate's chunk step costs about
      three times another's).
    So segments where the rows of the longest sequence (Σ counts / max counts: a packed row's short
    documents finish early) give at most half the SMs a program and the longest walk has at least
    min_chunks chunks. L = √(max/2), rounded up to a power of two and at least MIN_CHUNKS, minimises
    the critical path 2L + max/L."""
    if _fixed:
        return _fixed[-1]
    longest = max(counts, default=0)
    if longest < max(min_chunks, 4 * MIN_CHUNKS):
        return 0
    rows = max(1, sum(counts) // longest)
    if rows * H * programs_per_head > (num_sms() if sms is None else sms) // 2:
        return 0
    return max(MIN_CHUNKS, triton.next_power_of_2(math.ceil(math.sqrt(longest / 2))))


def _tables(lengths, C: int, L: int, device) -> Segments:
    bounds, offsets, first = [0], [0], [0]
    start = 0
    for n in lengths:
        chunks = triton.cdiv(n, C)
        for j in range(triton.cdiv(chunks, L)):
            bounds.append(start + min(n, (j + 1) * L * C))
            offsets.append(offsets[-1] + min(L, chunks - j * L))
        start += n
        if chunks == 0:           # an empty sequence: one empty segment carries its initial state
            bounds.append(start)
            offsets.append(offsets[-1])
        first.append(len(bounds) - 1)
    as_t = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return Segments(as_t(bounds), as_t(offsets), as_t(first), len(lengths), len(bounds) - 1, L)


@functools.lru_cache(maxsize=64)
def _row_tables(T: int, C: int, L: int, device: str) -> Segments:
    return _tables([T], C, L, device)


def plan(B: int, T: int, C: int, H: int, programs_per_head: int, device, seqs=None, min_chunks=4 * MIN_CHUNKS,
         sms=None):
    """The segments of a state pass of this call (`length`), or None for one walk per sequence.
    seqs: `gated.Packed` for a packed row (the tables are remembered with its cu_seqlens)."""
    if seqs is None and B > 1:
        return None
    lengths = [T] if seqs is None else list(seqs.lengths)
    L = length([triton.cdiv(n, C) for n in lengths], programs_per_head, H, min_chunks, sms)
    if L <= 0:
        return None
    if seqs is None:
        return _row_tables(T, C, L, str(device))
    return packing.remembered(seqs.cu_seqlens, ("segments", C, L),
                              lambda: _tables(lengths, C, L, seqs.cu_seqlens.device))


@kernel
def _combine_kernel(F, decay, s_in, s0, sT, first, H, K, V, BK: tl.constexpr, BV: tl.constexpr,
                    GATE: tl.constexpr, HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, REVERSE: tl.constexpr):
    # One program per (K-block, V-block, sequence·head) walks the sequence's segments (from the last
    # when REVERSE): s_in[j] = S, then S ← e^{decay_j} ⊙ S + F_j (decay per key row). F, s_in
    # [S, H, K, V] and s0, sT [N, H, K, V] float32; decay [S, H, K] (GATE 2) or [S, H] (GATE 1).
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n, i_h = i_nh // H, i_nh % H
    j0 = tl.load(first + n)
    count = (tl.load(first + n + 1) - j0).to(tl.int32)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    kmask = offs_k < K
    smask = kmask[:, None] & (offs_v < V)[None, :]
    s_offs = offs_k[:, None] * V + offs_v[None, :]
    if HAS_S0:
        S = tl.load(s0 + i_nh * K * V + s_offs, mask=smask, other=0.0)                  # [BK, BV]
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for u in range(count):
        if REVERSE:
            j = j0 + count - 1 - u
        else:
            j = j0 + u
        at = (j * H + i_h) * K * V + s_offs
        tl.store(s_in + at, S, mask=smask)
        if GATE == 2:
            S = S * tl.exp(tl.load(decay + (j * H + i_h) * K + offs_k, mask=kmask, other=0.0))[:, None]
        elif GATE == 1:
            S = S * tl.exp(tl.load(decay + j * H + i_h))
        S += tl.load(F + at, mask=smask, other=0.0)
    if STORE_ST:
        tl.store(sT + i_nh * K * V + s_offs, S, mask=smask)


def buffers(segs: Segments, H: int, K: int, V: int, gate: int, device):
    """What step 1 fills, float32: every segment's final state F [S, H, K, V] and its log-decay
    ([S, H, K] per dimension, [S, H] per head, None ungated)."""
    F = outputs.empty((segs.S, H, K, V), dtype=torch.float32, device=device)
    if gate == 0:
        return F, None
    shape = (segs.S, H, K) if gate == 2 else (segs.S, H)
    return F, outputs.empty(shape, dtype=torch.float32, device=device)


def combine(F, decay, s0, sT, segs: Segments, *, gate: int, reverse: bool = False, block=(64, 64)):
    """Step 2: the state entering each segment (from its end when reverse), [S, H, K, V] float32,
    from the segments' own F and log-decays; fills sT (the state past the sequence's last segment,
    [N, H, K, V]) when given. s0: the sequence's initial state (reverse: the final state's gradient),
    None for zero."""
    _, H, K, V = F.shape
    BK, BV = min(block[0], triton.next_power_of_2(K)), min(block[1], triton.next_power_of_2(V))
    s_in = outputs.empty(F.shape, dtype=torch.float32, device=F.device)            # every segment written
    launch(_combine_kernel, (triton.cdiv(K, BK), triton.cdiv(V, BV), segs.N * H), F,
           F if decay is None else decay, s_in, F if s0 is None else s0, F if sT is None else sT, segs.first,
           H, K, V, BK=BK, BV=BV, GATE=gate, HAS_S0=s0 is not None, STORE_ST=sT is not None, REVERSE=reverse,
           num_warps=4, max_stages=3)   # (Triton pipelines none of these loads: no dot; 0 bytes of shared memory)
    return s_in
