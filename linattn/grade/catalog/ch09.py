"""Chapter 09 — Triton: a masked tile, one chunk's masked product, one chunk's state update, and
the whole chunkwise linear-attention kernel.

The reader writes @triton.jit kernels and the small launchers that call them. Under the Triton
interpreter (no GPU) every load and store is bounds-checked while grading (grade/bounds.py), and
torch.empty is NaN-filled, so an unmasked tail read is reported at its line and an unwritten
output element shows as NaN. The per-chunk references are the kernels below (the library has no
kernel of that shape); the whole kernel's reference is linattn.triton.linear_attn itself.
"""
from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from ... import chunk, naive, outputs
from ... import triton as lt
from ..cases import op_cases
from ..exercise import Case, Exercise
from .ch02 import CHUNK_MISTAKES


def _block(n):
    return max(16, triton.next_power_of_2(n))  # tl.dot wants tile sides ≥ 16


# ---------------------------------------------------------------- ch09.scale_rows
@triton.jit
def _scale_rows_kernel(x, w, y, T, D, BT: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)                      # [BT]
    cols = tl.arange(0, BD)                                              # [BD]
    inside = (rows[:, None] < T) & (cols[None, :] < D)                   # [BT, BD]
    tile = tl.load(x + rows[:, None] * D + cols[None, :], mask=inside, other=0.0)
    wt = tl.load(w + rows, mask=rows < T, other=0.0)                     # [BT]
    tl.store(y + rows[:, None] * D + cols[None, :], tile * wt[:, None], mask=inside)


def scale_rows(x, w):
    """y[t, :] = w[t] · x[t, :] for x [T, D] and w [T], by tiles of 16 rows."""
    T, D = x.shape
    y = outputs.empty((T, D), dtype=x.dtype, device=x.device)
    _scale_rows_kernel[(triton.cdiv(T, 16),)](x, w, y, T, D, BT=16, BD=_block(D))
    return y


def scale_rows_truth(x, w):
    return x * w[:, None]


def row_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (T, D) in enumerate([(37, 24), (16, 16), (5, 40), (50, 8)]):
        T = max(1, T + rng.randint(-2, 2))
        gen = torch.Generator().manual_seed(seed * 7 + i)
        cases.append(Case(args=(torch.randn(T, D, generator=gen), torch.randn(T, generator=gen)),
                          note=f"T={T} D={D} float32"))
    return cases


# ---------------------------------------------------------- ch09.intra_chunk, ch09.chunk_state
@triton.jit
def _tile(ptr, C, W, BC: tl.constexpr, BW: tl.constexpr):
    """The [BC, BW] float32 tile of a [C, W] row-major matrix at ptr, zeros outside."""
    t, c = tl.arange(0, BC), tl.arange(0, BW)
    m = (t[:, None] < C) & (c[None, :] < W)
    return tl.load(ptr + t[:, None] * W + c[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _intra_chunk_kernel(q, k, v, o, C, K, V, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    Q = _tile(q + n * C * K, C, K, BC, BK)                               # [BC, BK]
    Kc = _tile(k + n * C * K, C, K, BC, BK)                              # [BC, BK]
    Vc = _tile(v + n * C * V, C, V, BC, BV)                              # [BC, BV]
    t = tl.arange(0, BC)
    A = tl.dot(Q, tl.trans(Kc), input_precision="ieee")                  # [BC, BC]
    A = tl.where(t[:, None] >= t[None, :], A, 0.0)                       # causal, diagonal kept
    O = tl.dot(A, Vc, input_precision="ieee")                            # [BC, BV]
    c = tl.arange(0, BV)
    tl.store(o + n * C * V + t[:, None] * V + c[None, :], O.to(o.dtype.element_ty),
             mask=(t[:, None] < C) & (c[None, :] < V))


def intra_chunk(q, k, v):
    """(Q Kᵀ ⊙ M) V for each of N chunks: q, k [N, C, K], v [N, C, V]; M lower triangle with diagonal."""
    N, C, K = q.shape
    V = v.shape[-1]
    o = outputs.empty((N, C, V), dtype=v.dtype, device=v.device)
    _intra_chunk_kernel[(N,)](q, k, v, o, C, K, V, BC=_block(C), BK=_block(K), BV=_block(V))
    return o


def intra_chunk_truth(q, k, v):
    C = q.shape[-2]
    M = torch.ones(C, C, dtype=q.dtype).tril()                          # t_i >= t_j
    return ((q @ k.transpose(-1, -2)) * M) @ v                          # [N, C, V]


def _intra_mistake(mask):
    def mistake(q, k, v):
        C = q.shape[-2]
        M = {"strict": torch.ones(C, C).tril(-1), "future": torch.ones(C, C).triu(),
             "none": torch.ones(C, C)}[mask]
        return (((q.float() @ k.float().transpose(-1, -2)) * M) @ v.float()).to(v.dtype)
    return mistake


INTRA_MISTAKES = (
    ("mask with a strict triangle (tl.where(t_i > t_j, …)): each token misses its own k_tᵀ v_t",
     _intra_mistake("strict")),
    ("mask with the upper triangle (t_i <= t_j): tokens see the later ones", _intra_mistake("future")),
    ("leave the mask out: every token sees the whole chunk", _intra_mistake("none")),
)


@triton.jit
def _chunk_state_kernel(k, v, s, out, C, K, V, BC: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    Kc = _tile(k + n * C * K, C, K, BC, BK)                              # [BC, BK]
    Vc = _tile(v + n * C * V, C, V, BC, BV)                              # [BC, BV]
    S = _tile(s + n * K * V, K, V, BK, BV)                               # [BK, BV]
    S += tl.dot(tl.trans(Kc), Vc, input_precision="ieee")               # float32 accumulation
    r, c = tl.arange(0, BK), tl.arange(0, BV)
    tl.store(out + n * K * V + r[:, None] * V + c[None, :], S, mask=(r[:, None] < K) & (c[None, :] < V))


def chunk_state(k, v, S):
    """S + Kᵀ V for each of N chunks: k [N, C, K], v [N, C, V], S [N, K, V] float32 -> float32."""
    N, C, K = k.shape
    V = v.shape[-1]
    out = outputs.empty((N, K, V), dtype=torch.float32, device=k.device)
    _chunk_state_kernel[(N,)](k, v, S, out, C, K, V, BC=_block(C), BK=_block(K), BV=_block(V))
    return out


def chunk_state_truth(k, v, S):
    return S + k.transpose(-1, -2) @ v


STATE_MISTAKES = (
    ("return Kᵀ V alone, without the state S entering the chunk",
     lambda k, v, S: k.float().transpose(-1, -2) @ v.float()),
    # matched loosely: the interpreter rounds float32 -> bf16 by truncation, a GPU to nearest
    ("accumulate in bfloat16 (Kᵀ V rounded to bf16 before it is added), or let float32 dots run "
     "in tf32: keep the tl.dot result in float32, input_precision='ieee' for float32 tiles",
     lambda k, v, S: S + (k.float().transpose(-1, -2) @ v.float()).bfloat16().float(), 5e-3),
    ("multiply K Vᵀ-wise (S + V K...): the state is K×V, its rows indexed by key dimensions",
     lambda k, v, S: S + (v.float().transpose(-1, -2) @ k.float()).transpose(-1, -2)),
)


# (N, C, K, V, dtype): C not a power of two in most (masks!), one bf16 case
_CHUNKS = [(3, 16, 16, 16, torch.float32), (2, 13, 24, 16, torch.float32),
           (2, 32, 16, 40, torch.bfloat16), (1, 5, 16, 16, torch.float32)]


def chunk_cases(seed, state=False):
    rng = random.Random(seed)
    cases = []
    for i, (N, C, K, V, dtype) in enumerate(_CHUNKS):
        C = max(1, C + rng.choice((-1, 0, 0)))
        gen = torch.Generator().manual_seed(seed * 13 + i)
        q, k = (torch.randn(N, C, K, generator=gen) / K ** 0.25 for _ in range(2))
        v = torch.randn(N, C, V, generator=gen)
        note = f"N={N} C={C} K={K} V={V} {str(dtype).replace('torch.', '')}"
        if state:
            S = torch.randn(N, K, V, generator=gen)
            # float32 output: the tolerance is float32's even for bf16 inputs (exact in float32)
            cases.append(Case(args=(k.to(dtype), v.to(dtype), S), note=note, dtype=torch.float32))
        else:
            cases.append(Case(args=(q.to(dtype), k.to(dtype), v.to(dtype)), note=note, dtype=dtype))
    return cases


# ---------------------------------------------------------------- ch09.linear_attn
# (B, T, H, K, V, dtype, gate, strength, initial_state): float32 and bf16 only (what the kernels
# take); T rarely a multiple of 16, one T shorter than a chunk, K ≠ V.
KERNEL_SHAPES = [
    (1, 37, 2, 16, 16, torch.float32, "per_dim", "normal", False),
    (2, 50, 1, 32, 24, torch.float32, "per_head", "strong", True),
    (1, 40, 2, 16, 32, torch.bfloat16, "per_dim", "normal", True),
    (1, 7, 1, 16, 16, torch.float32, "per_head", "normal", True),
]


def linear_kernel_cases(seed):
    cases = op_cases("linear_attn", seed, chunk_size=16, shapes=KERNEL_SHAPES)
    cases[0].kwargs["output_final_state"] = False
    cases[0].note += ", output_final_state=False"
    cases[1].kwargs["scale"] = 1.0
    cases[1].note += ", scale=1.0"
    return cases


def _dropped_tail(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                  chunk_size=16):
    """The chunks that fit whole, and nothing of the last partial one (its rows left unwritten)."""
    T = q.shape[1]
    full = T - T % chunk_size
    o = torch.full(v.shape, float("nan"), dtype=v.dtype)
    S = initial_state.float() if initial_state is not None else \
        torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    if full:
        o[:, :full], S = naive.linear_attn(q[:, :full].float(), k[:, :full].float(),
                                           v[:, :full].float(), scale=scale,
                                           initial_state=S, output_final_state=True)
    return o, (S if output_final_state else None)


KERNEL_MISTAKES = CHUNK_MISTAKES + (
    ("drop the last partial chunk (loop over T // C chunks instead of cdiv(T, C))", _dropped_tail),
)

EXERCISES = [
    Exercise(
        name="ch09.scale_rows",
        chapter=9,
        on_gpu=True,
        title="A masked tile: load, compute, store 16 rows at a time",
        signature="scale_rows(x, w) -> y   # x [T, D] float32, w [T]; y[t] = w[t] · x[t]",
        reference=scale_rows,
        truth=scale_rows_truth,
        cases=row_cases,
        outputs=("y",),
        spec=scale_rows_truth,
        hint="offsets rows[:, None] * D + cols[None, :], mask (rows[:, None] < T) & "
             "(cols[None, :] < D) on the load AND the store; BD = next power of two ≥ D; "
             "grid = (cdiv(T, BT),).",
    ),
    Exercise(
        name="ch09.intra_chunk",
        chapter=9,
        on_gpu=True,
        title="One chunk's (Q Kᵀ ⊙ M) V with tl.dot",
        signature="intra_chunk(q, k, v) -> o   # q, k [N, C, K], v [N, C, V]; one program per chunk",
        reference=intra_chunk,
        truth=intra_chunk_truth,
        cases=chunk_cases,
        outputs=("o",),
        spec=intra_chunk_truth,
        hint="tiles of BC = max(16, next_pow2(C)) rows, zeros past C (mask + other=0); "
             "A = tl.dot(Q, tl.trans(K)); keep t_i >= t_j (diagonal included) with tl.where; "
             "O = tl.dot(A, V); upcast bf16 tiles to float32 after the load.",
        diagnoses=INTRA_MISTAKES,
    ),
    Exercise(
        name="ch09.chunk_state",
        chapter=9,
        on_gpu=True,
        title="One chunk's state update S + Kᵀ V",
        signature="chunk_state(k, v, S) -> S_new   # k [N,C,K], v [N,C,V], S [N,K,V] float32",
        reference=chunk_state,
        truth=chunk_state_truth,
        cases=lambda seed: chunk_cases(seed, state=True),
        outputs=("S_new",),
        spec=chunk_state_truth,
        hint="S_new = S + tl.dot(tl.trans(K), V) with K, V tiles upcast to float32 and the rows past "
             "C masked to 0 (a padded row must add nothing); store float32.",
        diagnoses=STATE_MISTAKES,
    ),
    Exercise(
        name="ch09.linear_attn",
        chapter=9,
        on_gpu=True,
        title="The chunkwise linear-attention forward kernel",
        signature="linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False, "
                  "chunk_size=16) -> (o, final_state)   # q, k [B,T,H,K], v [B,T,H,V]",
        reference=lt.linear_attn,
        truth=naive.linear_attn,
        cases=linear_kernel_cases,
        unlocks=("linear_attn", "triton"),
        outputs=("o", "final_state"),
        spec=chunk.linear_attn,
        hint="one program per (batch·head): S (float32, from initial_state or 0); for each chunk "
             "o = scale·(Q S + (Q Kᵀ ⊙ M) V), then S += Kᵀ V; rows t < T masked in every load "
             "and store; range(0, T, C) keeps the last partial chunk; o in v's dtype, S float32.",
        diagnoses=KERNEL_MISTAKES,
    ),
]
