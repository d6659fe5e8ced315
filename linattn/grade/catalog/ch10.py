"""Chapter 10 — GLA in Triton: the absorbed off-diagonal sub-chunk tiles, the float32 diagonal
tiles, and the whole GLA forward with secondary chunking.

Per-chunk exercises take one chunk's q, k [N, C, K] and its cumulative log-gates b [N, C, K]
(b_t = g_1 + … + g_t inside the chunk, float32), with sub-chunks of SUB = 16 tokens, and return
their part of the chunk's float32 matrix A[t, s] = Σ_k q_tk k_sk e^{b_tk − b_sk}: the off-diagonal
tiles (sub-chunk of t after that of s) or the diagonal ones (same sub-chunk, t ≥ s), zeros
elsewhere. The references are the kernels below; the truth is float64 with the mask applied
before exp. The whole kernel's reference is linattn.triton.gla.
"""
from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from ... import chunk, naive, outputs, testing
from ... import triton as lt
from ..cases import op_cases
from ..exercise import Case, Exercise

SUB = 16  # tokens per sub-chunk (tl.dot's smallest tile side)


def _block(n):
    return max(16, triton.next_power_of_2(n))


def gated_scores(q, k, b, keep):
    """A[.., t, s] = Σ_k q_tk k_sk e^{b_tk − b_sk} where keep[t, s], else 0 (exponent masked first)."""
    diff = b[..., :, None, :] - b[..., None, :, :]                         # [N, C, C, K]
    diff = diff.masked_fill(~keep[..., None], float("-inf"))               # e^{-inf} = 0: no overflow
    return torch.einsum("...tk,...sk,...tsk->...ts", q, k, diff.exp())


def _sub(C):
    return torch.arange(C) // SUB                                          # sub-chunk of each row


def offdiag_truth(q, k, b):
    s = _sub(q.shape[-2])
    return gated_scores(q, k, b, s[:, None] > s[None, :])


def diag_truth(q, k, b):
    C = q.shape[-2]
    s, t = _sub(C), torch.arange(C)
    return gated_scores(q, k, b, (s[:, None] == s[None, :]) & (t[:, None] >= t[None, :]))


@triton.jit
def _load(ptr, row0, K, BK: tl.constexpr):
    """Rows row0 … row0 + 15 of a [C, K] row-major matrix as a float32 [16, BK] tile."""
    t, c = row0 + tl.arange(0, 16), tl.arange(0, BK)
    return tl.load(ptr + t[:, None] * K + c[None, :], mask=c[None, :] < K, other=0.0).to(tl.float32)


@triton.jit
def _offdiag_kernel(q, k, b, a, C, K, BK: tl.constexpr):
    i, j, n = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    q, k, b, a = q + n * C * K, k + n * C * K, b + n * C * K, a + n * C * C
    A = tl.zeros([16, 16], dtype=tl.float32)
    if j < i:
        c = tl.arange(0, BK)
        r = tl.load(b + (i * 16 - 1) * K + c, mask=c < K, other=0.0)    # b just before sub-chunk i
        Qa = _load(q, i * 16, K, BK) * tl.exp(_load(b, i * 16, K, BK) - r[None, :])   # e^{b_t − r} ≤ 1
        Ka = _load(k, j * 16, K, BK) * tl.exp(r[None, :] - _load(b, j * 16, K, BK))   # e^{r − b_s} ≤ 1
        A = tl.dot(Qa, tl.trans(Ka), input_precision="ieee")
    t = tl.arange(0, 16)
    tl.store(a + (i * 16 + t[:, None]) * C + j * 16 + t[None, :], A)


def offdiag_tiles(q, k, b):
    N, C, K = q.shape
    a = outputs.empty((N, C, C), dtype=torch.float32, device=q.device)
    _offdiag_kernel[(C // SUB, C // SUB, N)](q, k, b, a, C, K, BK=_block(K))
    return a


@triton.jit
def _diag_kernel(q, k, b, a, C, K, BK: tl.constexpr):
    i, j, n = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    q, k, b, a = q + n * C * K, k + n * C * K, b + n * C * K, a + n * C * C
    t = tl.arange(0, 16)
    A = tl.zeros([16, 16], dtype=tl.float32)
    if i == j:
        Q, Kt, Bt = _load(q, i * 16, K, BK), _load(k, i * 16, K, BK), _load(b, i * 16, K, BK)
        causal = t[:, None] >= t[None, :]                                  # [16, 16]
        # no point inside the tile to split e^{b_t − b_s} at: the whole [16, 16, BK] decay, in
        # float32, masked before exp (above the diagonal the exponent is positive)
        diff = tl.where(causal[:, :, None], Bt[:, None, :] - Bt[None, :, :], float("-inf"))
        A = tl.sum(Q[:, None, :] * Kt[None, :, :] * tl.exp(diff), axis=2)
    tl.store(a + (i * 16 + t[:, None]) * C + j * 16 + t[None, :], A)


def diag_tiles(q, k, b):
    N, C, K = q.shape
    a = outputs.empty((N, C, C), dtype=torch.float32, device=q.device)
    _diag_kernel[(C // SUB, C // SUB, N)](q, k, b, a, C, K, BK=_block(K))
    return a


# ---- known mistakes, in PyTorch (float32, as a kernel computes them) --------------------------
def _absorbed_from_chunk_start(q, k, b):
    q, k, b = q.float(), k.float(), b.float()
    s = _sub(q.shape[-2])
    A = (q * b.exp()) @ (k * (-b).exp()).transpose(-1, -2)               # e^{−b} overflows
    return torch.where(s[:, None] > s[None, :], A, 0.0)


def _diag_variant(strict=False, bf16=False, mask_after=False):
    def mistake(q, k, b):
        q, k, b = q.float(), k.float(), b.float()
        C = q.shape[-2]
        s, t = _sub(C), torch.arange(C)
        tri = t[:, None] > t[None, :] if strict else t[:, None] >= t[None, :]
        keep = (s[:, None] == s[None, :]) & tri
        diff = b[..., :, None, :] - b[..., None, :, :]
        if mask_after:  # inside the diagonal tiles: inf · 0 = NaN above the diagonal
            same = (s[:, None] == s[None, :])[..., None]
            dec = torch.where(same, diff.exp() * keep[..., None], 0.0)
        else:
            dec = diff.masked_fill(~keep[..., None], float("-inf")).exp()
        if bf16:
            dec = dec.bfloat16().float()
        return torch.einsum("...tk,...sk,...tsk->...ts", q, k, dec)
    return mistake


OFFDIAG_MISTAKES = (
    ("absorb the decay relative to the chunk start (q ⊙ e^{b}, k ⊙ e^{−b}): e^{−b} overflows "
     "float32 once the gates sum below −88; use r = b just before the query sub-chunk",
     _absorbed_from_chunk_start),
)
DIAG_MISTAKES = (
    ("mask with a strict triangle (t > s): each token misses its own key", _diag_variant(strict=True)),
    ("apply the mask after exp (e^{b_t − b_s} overflows above the diagonal, and inf · 0 = NaN): "
     "mask the exponent with -inf first", _diag_variant(mask_after=True)),
    ("round the decay to bfloat16: build the diagonal tile in float32", _diag_variant(bf16=True), 5e-3),
)


# (N, C, K, dtype, strength): C a multiple of SUB, strong gates where absorption can overflow
_CHUNKS = [(2, 32, 16, torch.float32, "strong"), (1, 48, 24, torch.float32, "normal"),
           (2, 32, 32, torch.bfloat16, "strong"), (1, 16, 16, torch.float32, "weak"),
           (1, 64, 16, torch.float32, "strong")]


def tile_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (N, C, K, dtype, strength) in enumerate(_CHUNKS):
        gen = torch.Generator().manual_seed(seed * 19 + i)
        N += rng.randint(0, 1)
        q, k = (torch.randn(N, C, K, generator=gen) / K ** 0.25 for _ in range(2))
        b = testing.log_gates((N, C, K), strength, generator=gen).cumsum(-2)  # float32
        note = f"N={N} C={C} K={K} {str(dtype).replace('torch.', '')}, {strength} gates"
        cases.append(Case(args=(q.to(dtype), k.to(dtype), b), note=note, dtype=torch.float32))
    return cases


# ---------------------------------------------------------------- ch10.gla
# (B, T, H, K, V, dtype, gate, strength, initial_state): mostly per-dimension gates
KERNEL_SHAPES = [
    (1, 45, 2, 16, 16, torch.float32, "per_dim", "normal", False),
    (2, 40, 1, 32, 24, torch.float32, "per_dim", "strong", True),
    (1, 37, 2, 16, 32, torch.bfloat16, "per_dim", "normal", True),
    (1, 9, 1, 16, 16, torch.float32, "per_head", "strong", True),
]


def gla_kernel_cases(seed):
    cases = op_cases("gla", seed, chunk_size=32, extra={"sub_chunk_size": 16}, shapes=KERNEL_SHAPES)
    cases[0].kwargs["output_final_state"] = False
    cases[0].note += ", output_final_state=False"
    cases[1].kwargs["scale"] = 1.0
    cases[1].note += ", scale=1.0"
    return cases


def _gla_dropped_tail(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                      chunk_size=32, **_):
    T = q.shape[1]
    full = T - T % chunk_size
    o = torch.full(v.shape, float("nan"), dtype=v.dtype)
    B, _, H, K = q.shape
    S = initial_state.float() if initial_state is not None else torch.zeros(B, H, K, v.shape[3])
    if full:
        o[:, :full], S = naive.gla(q[:, :full].float(), k[:, :full].float(), v[:, :full].float(),
                                   g[:, :full].float(), scale=scale, initial_state=S,
                                   output_final_state=True)
    return o, (S if output_final_state else None)


GLA_MISTAKES = (
    ("drop the last partial chunk (loop over T // C chunks instead of cdiv(T, C))", _gla_dropped_tail),
)

EXERCISES = [
    Exercise(
        name="ch10.offdiag_tiles",
        chapter=10,
        on_gpu=True,
        title="The absorbed off-diagonal sub-chunk tiles of A",
        signature="offdiag_tiles(q, k, b) -> A   # q, k [N, C, K], b [N, C, K] cumulative log-gates; "
                  "A [N, C, C] float32",
        reference=offdiag_tiles,
        truth=offdiag_truth,
        spec=offdiag_truth,
        cases=tile_cases,
        outputs=("A",),
        hint="tile (i, j), j < i: with r = b[16 i − 1] (just before sub-chunk i), "
             "A_ij = (Q_i ⊙ e^{B_i − r}) (K_j ⊙ e^{r − B_j})ᵀ — both exponents ≤ 0; tiles j ≥ i "
             "are zeros (store them too).",
        diagnoses=OFFDIAG_MISTAKES,
    ),
    Exercise(
        name="ch10.diag_tiles",
        chapter=10,
        on_gpu=True,
        title="The float32 diagonal sub-chunk tiles of A",
        signature="diag_tiles(q, k, b) -> A   # q, k [N, C, K], b [N, C, K]; A [N, C, C] float32",
        reference=diag_tiles,
        truth=diag_truth,
        spec=diag_truth,
        cases=tile_cases,
        outputs=("A",),
        hint="tile (i, i): A[t, s] = Σ_k q_tk k_sk e^{b_tk − b_sk} for t ≥ s (diagonal included), "
             "exponent masked with -inf before tl.exp, everything float32; other tiles zeros.",
        diagnoses=DIAG_MISTAKES,
    ),
    Exercise(
        name="ch10.gla",
        chapter=10,
        on_gpu=True,
        title="The GLA forward kernel with secondary chunking",
        signature="gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, "
                  "chunk_size=32, sub_chunk_size=16) -> (o, final_state)   # g [B,T,H,K] or [B,T,H]",
        reference=lt.gla,
        truth=naive.gla,
        spec=chunk.gla,
        cases=gla_kernel_cases,
        unlocks=("gla", "triton"),
        outputs=("o", "final_state"),
        hint="per chunk: b = cumsum of g inside it (rows past T: g = 0); "
             "O = scale·((Q ⊙ e^{b}) S + A V) with A from your two tile kernels; "
             "S ← diag(e^{b_last}) S + (K ⊙ e^{b_last − b})ᵀ V; keep the last partial chunk; "
             "per-head g [B,T,H]: expand it to [B,T,H,K] in the launcher. NaN/inf under strong "
             "gates means some exponent is > 0: absorb relative to the sub-chunk boundary.",
        diagnoses=GLA_MISTAKES,
    ),
]
