"""Stage 1 of the delta-rule kernels: the WY/UT factors of every chunk.

Notation as in linattn.chunk.delta: a chunk of C tokens, G_i the log-decay summed from the chunk
start (per key dimension for KDA, one per head for Gated DeltaNet, 0 for DeltaNet),
A_ij = β_i Σ_d k_id k_jd e^{G_id − G_jd} (i > j), Aqk_ij = scale Σ_d q_id k_jd e^{G_id − G_jd}
(j ≤ i), 𝒯 = (I + A)⁻¹, W = 𝒯 diag(β)(K ⊙ e^G), U = 𝒯 diag(β) V.

1. The factor kernels, one program per (chunk, head), compute A as its ten 16×16 blocks (the
   keys loaded as four row blocks, one dot per block) and invert it in registers: A never goes
   to memory. They write Aqk (tile dtype) and 𝒯.
   - DeltaNet / Gated DeltaNet: `_factor_kernel`; a per-head decay e^{G_i − G_j} is a C×C
     matrix, applied to each block's product.
   - KDA: the decay has a third axis (key dims), so it goes into the operands.
     `_kda_split_kernel` takes the common case, a chunk whose gates decay by less than e^{−60}:
     e^{G_i − G_j} = e^{G_i} · e^{−G_j}, each block one product of K ⊙ e^G with K ⊙ e^{−G}; the
     same kernel also gives W and what stages 2 and 3 need from the keys and gates
     (K ⊙ e^{G_C − G}, e^{G_C}, scale · Q ⊙ e^G). Chunks that decay more are flagged, and
     `_kda_exact_kernel` redoes them with every exponent ≤ 0 (`_kda_blocks`); the others return
     at once.
   The inversion (`_invert`): each diagonal block by doubling the inverted block side
   (X ← X − X L X, `_diag_inverse`), then 𝒯_ij = −𝒯_ii Σ_{j≤m<i} A_im 𝒯_mj for the six blocks
   below, all 16×16 tiles held as separate variables (no tile is cut out of a larger one), every
   product on the tensor cores.
2. `_wu_kernel`: U = 𝒯 diag(β) V; for DeltaNet and Gated DeltaNet in a second program per chunk
   also W, K ⊙ e^{G_C − G} and e^{G_C}, K and the gates read once.

𝒯 is stored in float32: U = (𝒯 diag(β)) V and W = (𝒯 diag(β e^G)) K are each computed as
a float32 matrix times an input exact in its dtype (`common.dot_input`), so neither 𝒯 nor β V
is rounded into a half-precision operand (W for key tiles up to 128 wide, `split_w`; KDA's W,
whose keys carry computed decays, rounds them).

Decays. With log-gates down to −20 per token, e^{±G} over a chunk under- and overflows float32.
Every exponent here is ≤ 0 — a difference G_i − G_j with i ≥ j, or a tail G_C − G_i summed from
the chunk end — except in KDA's split products (e^{−G} ≤ e^{60}, checked per chunk) and
`_kda_diag` (the same bound per 16-row block).

Gated DeltaNet's decays from the chunk start, e^{G_i} in W = 𝒯 (β K ⊙ e^G) and in the queries
scale · Q ⊙ e^G, are taken from the chunk's first token instead: W̃ = e^{−G_0} W (stored) and
e^{G_i − G_0}, and the factor e^{G_0} multiplies the products they enter (W S, Wᵀ dṼ, Qs S,
Qsᵀ dO) in float32, after the dot (`first_gate`). The first token's factor is the chunk's largest
(the G_i fall), so the stored and multiplied tiles keep their bits: with strong gates e^{G_0}
alone (e^{−15} = 3e-7) is below fp16's normal range (6e-5), and rounded into an fp16 operand it
kept a few bits of the initial state's gradient, which it alone makes (natively, an H200: relative
error 0.62 in fp16, Gated DeltaNet with log-gates near −15). A per-head gate makes e^{G_0} one
number per chunk; KDA's per-dimension factors would need one per key dimension and stay in the
operands.

Packed sequences (linattn/triton/delta.py's module doc): every kernel here is chunk-parallel and
takes (sequence, chunk within it) from chunk_indices at its program id (VARLEN), so a chunk's first
token is its first token within its own sequence; the per-chunk outputs (e^{G_C}, KDA's flags)
are indexed by the row's chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import outputs
from .gated import _packed_chunk
from .common import (GATE_FLOOR, SPLIT_RANGE, block, dot, dot_input, float32_tiles, gate_floor, kernel, launch,
                     operand, rounds_tf32)
from .common import split_dtype as operand_dtype

SUB = 16          # sub-chunk: the side of the diagonal blocks done element by element
BS = tl.constexpr(SUB)  # the same, as kernels see it
# KDA's split products use a factor e^{+x}, x ≤ this bound (e^60 ≈ 1e26, far from float32's
# 3e38 and its underflow, and bf16 has float32's range): per chunk in `_kda_split_kernel`, per
# 16-row block in `_kda_diag`. Past it: `_kda_exact_kernel`, and in there `_diag_walk`.
DIAG_DOT_RANGE = SPLIT_RANGE
# Warps per program, measured on an H200 (bf16, H = 16, K = V = 128, C = 64, T = 1k and 32k):
# KDA split kernel 2 / 4 / 8 warps 1.02 / 0.80 / 1.43 ms; W/U 4 warps;
# factor kernel (Gated DeltaNet, tf32x3 products) 2 / 4 / 8 warps 0.38 / 0.62 / 1.17 ms, with tf32
# products 1 and 2 warps alike (0.22). The exact KDA kernel runs only for strongly decaying
# chunks; 4 warps (8 spill less when compiled for sm_90 on a CPU,
# yet ran slower.)
TUNING = dict(warps_split=4, warps_exact=4, warps_factor=2, warps_wu=4)


def inverse_precision(p) -> str:
    """input_precision of the inversion's 16×16 float32 products: exact under the plain interpreter;
    natively tf32x3 (about float32) for float32 and fp16 inputs, one tf32 pass for bf16 inputs, whose
    𝒯 then carries about tf32's 10 bits, past the 8 of a bf16 input, into U and W (`dot_input`).
    fp16's 𝒯 keeps 11 bits, more than the tensor cores' truncated tf32 products leave
    (`common.tf32`; tf32x3 rounds its parts)."""
    if float32_tiles():
        return "ieee"
    return "tf32x3" if p.ieee or rounds_tf32(p.work) else "tf32"


def split_dtype(p) -> dict:
    """SDT, the operand dtype of KDA's split products (`common.split_dtype`), and RND, whether
    they are rounded to tf32 (`common.rounds_tf32`), as kernel keywords."""
    return dict(SDT=operand_dtype(), RND=rounds_tf32(p.work))


def factor_stage(q, k, g, beta, p) -> dict:
    """aqk [B,T,H,C] = scale · Aqk in the tile dtype (diagonal included) and ai = 𝒯 [B,T,H,C]
    (unit lower triangular) in float32 (module doc); row t
    holds its chunk's row, zeros right of the diagonal. A is computed and inverted in registers.
    KDA's kernel also gives what `wu_stage` gives the others from the keys and gates: w, kd, dl
    and qg; and exact [B,H,NT] int32, 1 where a chunk's gates decay too fast for the split
    products and the exact kernel computed it."""
    aqk = outputs.empty((p.B, p.T, p.H, p.C), dtype=p.work, device=p.device)
    ai = outputs.empty((p.B, p.T, p.H, p.C), dtype=torch.float32, device=p.device)
    if p.gate == 2:
        s = _key_outputs(k, p)
        exact = outputs.empty((p.B * p.H * p.NT,), dtype=torch.int32, device=p.device)
        args = (q, k, g, beta, aqk, ai, s["w"], s["qg"], s["kd"], s["dl"], exact, p.scale, p.T,
                p.NT, p.H)
        # launch: fewer pipeline stages where the GPU has less shared memory (common.launch)
        launch(
            _kda_split_kernel, (p.NT, p.B * p.H), *args, K=p.K, C=p.C, BK=p.BK, **split_dtype(p), DT=p.cdt,
            IEEE=p.ieee, PREC=inverse_precision(p), num_warps=TUNING["warps_split"], **_packed(p))
        launch(
            _kda_exact_kernel, (p.NT, p.B * p.H), *args, K=p.K, C=p.C, BK=p.BK, DT=p.cdt, IEEE=p.ieee, PREC=inverse_precision(p),
            num_warps=TUNING["warps_exact"], **_packed(p))
        return dict(s, aqk=aqk, ai=ai, exact=exact.view(p.B, p.H, p.NT))
    launch(
        _factor_kernel, (p.NT, p.B * p.H), q, k, g if p.gate else q, beta, aqk, ai, p.scale, p.T, p.H,
        K=p.K, C=p.C, BK=p.BK, GATE=p.gate, DT=p.cdt, IEEE=p.ieee, PREC=inverse_precision(p),
        num_warps=TUNING["warps_factor"], **_packed(p))
    return dict(aqk=aqk, ai=ai)


def _packed(p) -> dict:
    """Launch keywords of a chunk-parallel kernel for packed sequences (none without)."""
    return p.packed("cu_seqlens", "chunk_indices")


def _key_outputs(k, p) -> dict:
    """Empty W [B,T,H,K]; with gates kd = K ⊙ e^{G_C − G} [B,T,H,K] and dl = e^{G_C}
    [B,H,NT,K] float32 (else None and kd is k); with per-dimension gates qg = scale · Q ⊙ e^G
    [B,T,H,K]. A per-head gate's e^G is one number per token: the output stage multiplies by it
    itself rather than read a [B,T,H,K] copy of Q."""
    shape = (p.B, p.T, p.H, p.K)
    return dict(w=outputs.empty(shape, dtype=p.work, device=p.device),
                qg=outputs.empty(shape, dtype=p.work, device=p.device) if p.gate == 2 else None,
                kd=outputs.empty(shape, dtype=p.work, device=p.device) if p.gate else k,
                dl=(outputs.empty((p.B, p.H, p.NT, p.K), dtype=torch.float32, device=p.device)
                    if p.gate else None))


def split_w(p) -> bool:
    """Whether W = 𝒯 diag(β e^G) K takes 𝒯's float32 tile against the keys as given in two parts
    (`common.dot_input`): for key tiles up to 128 wide. At 256 the parts need more shared memory
    than a T4's 64 KB per block even with one stage (tools/arch_check.py, chunk 64: 96 KB for fp16,
    whose tf32 products widen the keys to float32; 80 KB for Gated DeltaNet in bf16), and W is one
    product of operands in the input dtype, as before the rule."""
    return p.BK <= 128


def wu_stage(q, k, v, g, beta, ai, p) -> dict:
    """U [B,T,H,V] = 𝒯 diag(β) V; for DeltaNet and Gated DeltaNet also W and the decays of
    `_key_outputs` (KDA's factor kernel has given those)."""
    u = outputs.empty((p.B, p.T, p.H, p.V), dtype=p.work, device=p.device)
    s = {} if p.gate == 2 else _key_outputs(k, p)
    w, kd, dl = s.get("w", u), s.get("kd", u), s.get("dl")   # u: placeholders never written
    launch(
        _wu_kernel, (p.NT, p.B * p.H, 1 if p.gate == 2 else 2), k, v, g if p.gate == 1 else k, beta, ai, w, u, kd, u if dl is None else dl, p.T, p.NT, p.H,
        K=p.K, V=p.V, C=p.C, BK=p.BK, BV=min(block(p.V), 64), GATE=p.gate, DT=p.cdt,
        IEEE=p.ieee, U_ONLY=p.gate == 2, SPLIT_W=split_w(p), num_warps=TUNING["warps_wu"], **_packed(p))
    return dict(s, u=u)


def wy_stage(q, k, v, g, beta, p) -> dict:
    """Stage 1 whole, every tensor kept for inspection, 𝒯 in float32: aqk, ai and the W/U
    outputs (for Gated DeltaNet w holds W̃, W from the chunk's first token: `absolute_w`)."""
    s = factor_stage(q, k, g, beta, p)
    return dict(s, **wu_stage(q, k, v, g, beta, s["ai"], p))


def absolute_w(w, g, C: int, cu_seqlens=None):
    """W from the stored W̃ of Gated DeltaNet (per-head g [B,T,H]): e^{G_0} W̃ per chunk, in float32
    or float64 (w's own if wider); w itself for the other variants (see the module doc).
    cu_seqlens: packed sequences, each chunked from its own start."""
    if g is None or g.dim() != 3:
        return w
    w = w.to(torch.promote_types(w.dtype, torch.float32))
    if cu_seqlens is not None:
        t = torch.arange(g.shape[1], device=g.device)
        bos = cu_seqlens[torch.searchsorted(cu_seqlens, t, right=True) - 1]  # each token's sequence start
        first = g[:, bos + (t - bos) // C * C].to(w.dtype).clamp(min=GATE_FLOOR.value)  # [1, T, H] its G_0
        return w * first.exp()[..., None]
    first = g[:, ::C].to(w.dtype).clamp(min=GATE_FLOOR.value)                 # [B, NT, H] G_0
    return w * first.exp().repeat_interleave(C, dim=1)[:, :w.shape[1], :, None]


# ---------------------------------------------------------------- device helpers

@triton.jit
def first_gate(g, r0):
    """e^{G_0} of a chunk with per-head log-gates: its first token's gate (g + r0 points at it),
    floored as every kernel reads gates (see the module doc)."""
    return tl.exp(gate_floor(tl.load(g + r0)))


@triton.jit
def _mm32(a, b, PREC: tl.constexpr):
    """a @ b of float32 16×16 blocks (the inversion, KDA's diagonal scores), at the precision
    `inverse_precision` chose."""
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _row_block(i: tl.constexpr, n, T, H, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """Offsets [16, BK] of rows 16 i … 16 i + 15 of a chunk's [C, K] tile stored row t at t·H·K,
    their mask (inside the sequence, the chunk and K), the row mask and the row offsets t·H [16]."""
    r = tl.arange(0, BS)
    dk = tl.arange(0, BK)
    rows = i * BS + r
    rm = (n * C + rows < T) & (rows < C)
    return (rows * H)[:, None] * K + dk[None, :], rm[:, None] & (dk[None, :] < K), rm, rows * H


@triton.jit
def _kda_rows(q, k, g, beta, i: tl.constexpr, n, T, H, K: tl.constexpr, C: tl.constexpr,
              BK: tl.constexpr):
    """Rows 16 i … 16 i + 15 of the chunk (zeros past T or C): keys and queries [16, BK] float32,
    β [16], Gl [16, BK] = G − G_b summed from the block start (b: the token before the block)
    and the block's gate total s [BK] = Gl of its last row (≤ 0)."""
    at, m, rm, rh = _row_block(i, n, T, H, K, C, BK)
    kb = tl.load(k + at, mask=m, other=0.0).to(tl.float32)
    qb = tl.load(q + at, mask=m, other=0.0).to(tl.float32)
    gb = gate_floor(tl.load(g + at, mask=m, other=0.0))
    bb = tl.load(beta + rh, mask=rm, other=0.0).to(tl.float32)
    return kb, qb, bb, tl.cumsum(gb, axis=0), tl.sum(gb, axis=0)


@triton.jit
def _diag_walk(Ks, Qs, k, g, i: tl.constexpr, n, T, H, K: tl.constexpr, C: tl.constexpr,
               BK: tl.constexpr):
    """The 16×16 diagonal block for any gates, columns j = 15 … 0: E_i = e^{G_i − G_j} for i ≥ j,
    0 above. Moving from column j + 1 to j multiplies by e^{g_{j+1}} (≤ 1): one exponential per
    key dim per column, and no exponent is ever positive. A loop, not unrolled: only gates that
    decay by more than e^{DIAG_DOT_RANGE} within 16 tokens come here."""
    r = tl.arange(0, BS)
    dk = tl.arange(0, BK)
    E = tl.zeros((BS, BK), dtype=tl.float32)
    Da = tl.zeros((BS, BS), dtype=tl.float32)
    Dq = tl.zeros((BS, BS), dtype=tl.float32)
    for c in range(BS):
        jj = BS - 1 - c
        tj = n * C + i * BS + jj
        rj = (i * BS + jj) * H
        gn = gate_floor(tl.load(g + (rj + H) * K + dk, mask=(dk < K) & (tj + 1 < T) & (jj + 1 < BS),
                                other=0.0))
        E = tl.where(r[:, None] == jj, 1.0, E * tl.exp(gn)[None, :])              # [16, BK]
        kj = tl.load(k + rj * K + dk, mask=(dk < K) & (tj < T), other=0.0).to(tl.float32)  # [BK]
        wj = E * kj[None, :]
        Da = tl.where(r[None, :] == jj, tl.sum(Ks * wj, axis=1)[:, None], Da)    # column j
        Dq = tl.where(r[None, :] == jj, tl.sum(Qs * wj, axis=1)[:, None], Dq)
    return Da, Dq


@triton.jit
def _kda_diag(kb, qb, dn, Gl, s, bb, scale, k, g, i: tl.constexpr, n, T, H, K: tl.constexpr,
              C: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """A_ii (β on its rows, strictly lower) and scale · Aqk_ii (lower) of block i.

    Split at the token b before the block: e^{G_i − G_j} = e^{Gl_i} · e^{−Gl_j}. The second factor
    is ≥ 1 but at most e^{−s} (Gl only falls within the block); where that stays below
    e^{DIAG_DOT_RANGE} in every key dim (always, for the gates of trained models), one float32
    product per matrix gives the block, else `_diag_walk`. Float32 operands (tf32 on the GPU):
    a factor near e^{60} does not fit fp16."""
    r = tl.arange(0, BS)
    if tl.max(-s, axis=0) < DIAG_DOT_RANGE:
        up = tl.trans(kb * tl.exp(-Gl))                                           # [BK, 16]
        Da = _mm32(kb * dn, up, PREC)                                            # [16, 16]
        Dq = _mm32(qb * dn, up, PREC)
    else:
        Da, Dq = _diag_walk(kb, qb, k, g, i, n, T, H, K, C, BK)
    Da = tl.where(r[:, None] > r[None, :], Da, 0.0) * bb[:, None]
    Dq = tl.where(r[:, None] >= r[None, :], Dq, 0.0) * scale
    return Da, Dq


@triton.jit
def _kda_off(kdn, qdn, dec, bb, ut, scale, DT: tl.constexpr, IEEE: tl.constexpr):
    """A_ij and scale · Aqk_ij, i > j: the rows of block i decayed to its start b_i (kdn, qdn),
    times dec = e^{G_{b_i} − G_{e_j}} [BK] (e_j: block j's last token), against the keys of
    block j decayed to e_j (ut = (K_j ⊙ e^{G_{e_j} − G_j})ᵀ [BK, 16], tile dtype): every factor
    ≤ 1, each operand rounded once."""
    return (dot((kdn * dec[None, :]).to(DT), ut, IEEE) * bb[:, None],
            dot((qdn * dec[None, :]).to(DT), ut, IEEE) * scale)


@triton.jit
def _kda_key_rows(q, k, g, beta, kd, qg, pre, suf, scale, i: tl.constexpr, n, T, H,
                  K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """Block i's rows once more (L2 holds them): stores K ⊙ e^{G_C − G} and scale · Q ⊙ e^G,
    returns β K ⊙ e^G (tile dtype) for W. pre = e^{G_{b_i}}, suf = e^{G_C − G_{e_i}} [BK]."""
    kb, qb, bb, Gl, s = _kda_rows(q, k, g, beta, i, n, T, H, K, C, BK)
    d = tl.exp(Gl) * pre[None, :]                                                 # e^G ≤ 1
    _store_rows(qg, qb * d * scale, i, n, T, H, K, C, BK)
    _store_rows(kd, kb * tl.exp(s[None, :] - Gl) * suf[None, :], i, n, T, H, K, C, BK)
    return (kb * d * bb[:, None]).to(DT)


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
def _store_block(ai, X, i: tl.constexpr, j: tl.constexpr, n, T, H, C: tl.constexpr):
    ptrs, m = _block_ptrs(ai, i, j, n, T, H, C)
    tl.store(ptrs, X.to(ai.dtype.element_ty), mask=m)


@triton.jit
def _store_lower(ai, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, n, T, H,
                   C: tl.constexpr):
    """All sixteen blocks of a block-lower C×C matrix (𝒯, Aqk), zeros right of the diagonal
    (the kernels that read it load whole rows)."""
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
        Gb = tl.cumsum(gate_floor(tl.load(g + rows * H, mask=rm, other=0.0)), axis=0) + gsum
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


@kernel
def _factor_kernel(q, k, g, beta, aqk, ai, scale, T, H, K: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
                   PREC: tl.constexpr, cu_seqlens=None, chunk_indices=None, VARLEN: tl.constexpr = False):
    """DeltaNet / Gated DeltaNet: Aqk and 𝒯 of one (chunk, head); A stays in registers."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    if VARLEN:              # packed (B = 1): the row's chunk n is chunk n of its sequence
        n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, n)
        q, k, g, beta = q + bos * H * K, k + bos * H * K, g + bos * H, beta + bos * H
        aqk, ai = aqk + bos * H * C, ai + bos * H * C
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
        gc = gate_floor(tl.load(g + row, mask=tm, other=0.0))                  # [C]
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
    _store_lower(ai, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, n, T, H, C)


@triton.jit
def _store_rows(x, X, i: tl.constexpr, n, T, H, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """Rows 16 i … 16 i + 15 of a [C, K] chunk tile stored row t at x + t·H·K (x: row 0)."""
    r = tl.arange(0, BS)
    dk = tl.arange(0, BK)
    rows = i * BS + r
    m = ((n * C + rows < T) & (rows < C))[:, None] & (dk[None, :] < K)
    tl.store(x + (rows * H)[:, None] * K + dk[None, :], X.to(x.dtype.element_ty), mask=m)


@triton.jit
def _split_rows(q, k, g, beta, qg, P, scale, i: tl.constexpr, n, T, H, K: tl.constexpr,
                C: tl.constexpr, BK: tl.constexpr, SDT: tl.constexpr, IEEE: tl.constexpr,
                RND: tl.constexpr, PREC: tl.constexpr, DX3: tl.constexpr):
    """Rows 16 i … 16 i + 15 of the chunk (zeros past T or C), G = P + their own prefix sums
    (P [BK]: the gates of the rows before). Stores scale · Q ⊙ e^G; returns K ⊙ e^G, K ⊙ e^{−G},
    Q ⊙ e^G (dot operands in SDT, `common.operand`, [16, BK]), β [16], P for the next block and,
    with DX3 (fp16), the diagonal block (A_ii, scale · Aqk_ii) from the unrounded rows
    (`_split_diag`; zeros without). With DX3 K ⊙ e^{−G} stays float32 (made an operand where
    `_split_block` reads it: it also gives the stored K ⊙ e^{G_C − G}, which a tf32 rounding
    before the store to fp16 would round twice). The operations stay in the order each variant was
    compiled and measured in."""
    at, m, rm, rh = _row_block(i, n, T, H, K, C, BK)
    gb = gate_floor(tl.load(g + at, mask=m, other=0.0))
    G = tl.cumsum(gb, axis=0) + P[None, :]                                        # [16, BK]
    kb = tl.load(k + at, mask=m, other=0.0).to(tl.float32)
    qb = tl.load(q + at, mask=m, other=0.0).to(tl.float32)
    eg = tl.exp(G)                                                                # ≤ 1
    qe = qb * eg
    tl.store(qg + at, (qe * scale).to(qg.dtype.element_ty), mask=m)
    bb = tl.load(beta + rh, mask=rm, other=0.0).to(tl.float32)
    # e^{−G} capped at the bound: a chunk past it is flagged and redone, but stays finite here
    kl, kr = kb * eg, kb * tl.exp(tl.minimum(-G, DIAG_DOT_RANGE))
    if DX3:
        Ad, Qd = _split_diag(kl, qe, kr, bb, scale, IEEE, PREC)
    else:
        Ad = tl.zeros((BS, BS), dtype=tl.float32)
        Qd = Ad
        kr = operand(kr, SDT, IEEE, RND)
    return operand(kl, SDT, IEEE, RND), kr, operand(qe, SDT, IEEE, RND), bb, P + tl.sum(gb, axis=0), Ad, Qd


@triton.jit
def _split_block(kl, ql, kr, bb, scale, DIAG: tl.constexpr, IEEE: tl.constexpr):
    """A_ij (β on the rows) and scale · Aqk_ij from row block i (kl, ql: K, Q ⊙ e^G) and
    column block j (kr = K ⊙ e^{−G}); on the diagonal A strictly lower, Aqk lower."""
    krt = tl.trans(kr)                                                            # [BK, 16]
    A = dot(kl, krt, IEEE) * bb[:, None]
    Q = dot(ql, krt, IEEE) * scale
    if DIAG:
        r = tl.arange(0, BS)
        A = tl.where(r[:, None] > r[None, :], A, 0.0)
        Q = tl.where(r[:, None] >= r[None, :], Q, 0.0)
    return A, Q


@triton.jit
def _split_diag(kl, ql, kr, bb, scale, IEEE: tl.constexpr, PREC: tl.constexpr):
    """The diagonal block of A and scale · Aqk from float32 rows not yet rounded for the tensor
    cores, at the inversion's precision (`inverse_precision`: about float32 for fp16 inputs). Its
    pairs of tokens decay least, so they are the largest scores: with one tf32 product from rounded
    operands KDA's fp16 output was up to 1.8x less precise than FLA's (H200, conformance case
    kda-length-050, T = 2), which sums its diagonal blocks in float32. Natively for bf16 (one tf32
    pass of the same operands) and exactly for float32 inputs, the products are as the other blocks'."""
    krt = tl.trans(kr)                                                            # [BK, 16]
    if IEEE:
        A, Q = dot(kl, krt, IEEE), dot(ql, krt, IEEE)
    else:
        A, Q = _mm32(kl, krt, PREC), _mm32(ql, krt, PREC)
    r = tl.arange(0, BS)
    return (tl.where(r[:, None] > r[None, :], A * bb[:, None], 0.0),
            tl.where(r[:, None] >= r[None, :], Q * scale, 0.0))


@kernel
def _kda_split_kernel(q, k, g, beta, aqk, ai, w, qg, kd, dl, exact, scale, T, NT, H,
                      K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, SDT: tl.constexpr,
                      RND: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, PREC: tl.constexpr,
                      cu_seqlens=None, chunk_indices=None, VARLEN: tl.constexpr = False):
    """KDA, the common case: one (chunk, head) whose gates decay by less than e^{−DIAG_DOT_RANGE}
    over the chunk in every key dim. Then e^{G_i − G_j} = e^{G_i} · e^{−G_j} with both factors
    in range, so each 16×16 block of A and Aqk is one product of K ⊙ e^G (or Q ⊙ e^G) with
    K ⊙ e^{−G}, as for Gated DeltaNet; A is inverted in registers, W is ten products more,
    and K ⊙ e^{G_C − G} = (K ⊙ e^{−G}) e^{G_C}. A chunk whose gates decay more is flagged in
    `exact` (its outputs are garbage until `_kda_exact_kernel` redoes it).

    The products with the factor e^{−G} (≤ e^{60}) take float32 operands (`split_dtype`): tf32
    products for bf16 and fp16 inputs, exact ones for float32."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    nc = n                  # dl's and exact's chunk (packed: the row's)
    if VARLEN:              # packed (B = 1): the row's chunk n is chunk n of its sequence
        n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, n)
        q, k, g, beta, w, qg, kd = _packed_rows(q, k, g, beta, w, qg, kd, bos, H, K)
        aqk, ai = aqk + bos * H * C, ai + bos * H * C
    r0 = (b * T + n * C).to(tl.int64) * H + h                                    # the chunk's row 0
    q, k, g, beta = q + r0 * K, k + r0 * K, g + r0 * K, beta + r0
    aqk, ai, w, qg, kd = aqk + r0 * C, ai + r0 * C, w + r0 * K, qg + r0 * K, kd + r0 * K
    # fp16 (DX3): the diagonal blocks at the inversion's precision from the unrounded rows
    # (`_split_diag`), K ⊙ e^{−G} rounded where a product reads it (`_split_rows`). bf16 and
    # float32 keep the blocks as one product of the operands each, in the order the kernel was
    # tuned in (bf16's products are as precise either way; restructured, it spilled more: 948
    # against 864 bytes per thread for sm_90, and took 3.27 against 2.92 ms on an H200 at B = 8,
    # T = 4096, H = 16, K = V = 128).
    DX3: tl.constexpr = PREC == "tf32x3" and not IEEE
    P = tl.zeros((BK,), dtype=tl.float32)
    if DX3:
        kl0, kr0, ql0, b0, P, A00, Q00 = _split_rows(q, k, g, beta, qg, P, scale, 0, n, T, H, K, C, BK,
                                                        SDT, IEEE, RND, PREC, DX3)
        kl1, kr1, ql1, b1, P, A11, Q11 = _split_rows(q, k, g, beta, qg, P, scale, 1, n, T, H, K, C, BK,
                                                        SDT, IEEE, RND, PREC, DX3)
        A10, Q10 = _split_block(kl1, ql1, operand(kr0, SDT, IEEE, RND), b1, scale, False, IEEE)
        kl2, kr2, ql2, b2, P, A22, Q22 = _split_rows(q, k, g, beta, qg, P, scale, 2, n, T, H, K, C, BK,
                                                        SDT, IEEE, RND, PREC, DX3)
        A20, Q20 = _split_block(kl2, ql2, operand(kr0, SDT, IEEE, RND), b2, scale, False, IEEE)
        A21, Q21 = _split_block(kl2, ql2, operand(kr1, SDT, IEEE, RND), b2, scale, False, IEEE)
        kl3, kr3, ql3, b3, P, A33, Q33 = _split_rows(q, k, g, beta, qg, P, scale, 3, n, T, H, K, C, BK,
                                                        SDT, IEEE, RND, PREC, DX3)
        A30, Q30 = _split_block(kl3, ql3, operand(kr0, SDT, IEEE, RND), b3, scale, False, IEEE)
        A31, Q31 = _split_block(kl3, ql3, operand(kr1, SDT, IEEE, RND), b3, scale, False, IEEE)
        A32, Q32 = _split_block(kl3, ql3, operand(kr2, SDT, IEEE, RND), b3, scale, False, IEEE)
    else:
        kl0, kr0, ql0, b0, P, _, _ = _split_rows(q, k, g, beta, qg, P, scale, 0, n, T, H, K, C, BK, SDT,
                                                     IEEE, RND, PREC, DX3)
        A00, Q00 = _split_block(kl0, ql0, kr0, b0, scale, True, IEEE)
        kl1, kr1, ql1, b1, P, _, _ = _split_rows(q, k, g, beta, qg, P, scale, 1, n, T, H, K, C, BK, SDT,
                                                     IEEE, RND, PREC, DX3)
        A10, Q10 = _split_block(kl1, ql1, kr0, b1, scale, False, IEEE)
        A11, Q11 = _split_block(kl1, ql1, kr1, b1, scale, True, IEEE)
        kl2, kr2, ql2, b2, P, _, _ = _split_rows(q, k, g, beta, qg, P, scale, 2, n, T, H, K, C, BK, SDT,
                                                     IEEE, RND, PREC, DX3)
        A20, Q20 = _split_block(kl2, ql2, kr0, b2, scale, False, IEEE)
        A21, Q21 = _split_block(kl2, ql2, kr1, b2, scale, False, IEEE)
        A22, Q22 = _split_block(kl2, ql2, kr2, b2, scale, True, IEEE)
        kl3, kr3, ql3, b3, P, _, _ = _split_rows(q, k, g, beta, qg, P, scale, 3, n, T, H, K, C, BK, SDT,
                                                     IEEE, RND, PREC, DX3)
        A30, Q30 = _split_block(kl3, ql3, kr0, b3, scale, False, IEEE)
        A31, Q31 = _split_block(kl3, ql3, kr1, b3, scale, False, IEEE)
        A32, Q32 = _split_block(kl3, ql3, kr2, b3, scale, False, IEEE)
        A33, Q33 = _split_block(kl3, ql3, kr3, b3, scale, True, IEEE)
    _store_lower(aqk, Q00, Q10, Q11, Q20, Q21, Q22, Q30, Q31, Q32, Q33, n, T, H, C)
    T00, T10, T11, T20, T21, T22, T30, T31, T32, T33 = _invert(
        A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, PREC)
    _store_lower(ai, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, n, T, H, C)
    # W = 𝒯 (β K ⊙ e^G), block row by block row
    y0 = (kl0.to(tl.float32) * b0[:, None]).to(DT)
    y1 = (kl1.to(tl.float32) * b1[:, None]).to(DT)
    y2 = (kl2.to(tl.float32) * b2[:, None]).to(DT)
    y3 = (kl3.to(tl.float32) * b3[:, None]).to(DT)
    _store_rows(w, dot(T00.to(DT), y0, IEEE), 0, n, T, H, K, C, BK)
    _store_rows(w, dot(T10.to(DT), y0, IEEE) + dot(T11.to(DT), y1, IEEE), 1, n, T, H, K, C, BK)
    _store_rows(w, dot(T20.to(DT), y0, IEEE) + dot(T21.to(DT), y1, IEEE)
                + dot(T22.to(DT), y2, IEEE), 2, n, T, H, K, C, BK)
    _store_rows(w, dot(T30.to(DT), y0, IEEE) + dot(T31.to(DT), y1, IEEE)
                + dot(T32.to(DT), y2, IEEE) + dot(T33.to(DT), y3, IEEE), 3, n, T, H, K, C, BK)
    # for the state pass: K ⊙ e^{G_C − G} and e^{G_C} (P is now G_C)
    eC = tl.exp(P)
    _store_rows(kd, kr0.to(tl.float32) * eC[None, :], 0, n, T, H, K, C, BK)
    _store_rows(kd, kr1.to(tl.float32) * eC[None, :], 1, n, T, H, K, C, BK)
    _store_rows(kd, kr2.to(tl.float32) * eC[None, :], 2, n, T, H, K, C, BK)
    _store_rows(kd, kr3.to(tl.float32) * eC[None, :], 3, n, T, H, K, C, BK)
    dk = tl.arange(0, BK)
    tl.store(dl + (bh.to(tl.int64) * NT + nc) * K + dk, eC, mask=dk < K)
    tl.store(exact + bh.to(tl.int64) * NT + nc, (tl.max(-P, axis=0) >= DIAG_DOT_RANGE).to(tl.int32))


@kernel
def _kda_exact_kernel(q, k, g, beta, aqk, ai, w, qg, kd, dl, exact, scale, T, NT, H,
                      K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                      IEEE: tl.constexpr, PREC: tl.constexpr, cu_seqlens=None, chunk_indices=None,
                      VARLEN: tl.constexpr = False):
    """KDA, any gates: redoes the chunks `_kda_split_kernel` flagged (the others return at once)."""
    n, bh = tl.program_id(0), tl.program_id(1)
    if tl.load(exact + bh.to(tl.int64) * NT + n) != 0:
        nc = n              # dl's chunk (packed: the row's)
        if VARLEN:          # packed (B = 1): the row's chunk n is chunk n of its sequence
            n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, n)
            q, k, g, beta, w, qg, kd = _packed_rows(q, k, g, beta, w, qg, kd, bos, H, K)
            aqk, ai = aqk + bos * H * C, ai + bos * H * C
        _kda_blocks(q, k, g, beta, aqk, ai, w, qg, kd, dl, scale, n, nc, bh, T, NT, H, K, C, BK, DT,
                    IEEE, PREC)


@triton.jit
def _packed_rows(q, k, g, beta, w, qg, kd, bos, H, K: tl.constexpr):
    """KDA's per-token inputs and outputs moved to token bos of their packed row."""
    return (q + bos * H * K, k + bos * H * K, g + bos * H * K, beta + bos * H, w + bos * H * K,
            qg + bos * H * K, kd + bos * H * K)


@triton.jit
def _kda_blocks(q, k, g, beta, aqk, ai, w, qg, kd, dl, scale, n, nc, bh, T, NT, H, K: tl.constexpr,
                C: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
                PREC: tl.constexpr):
    """What `_kda_split_kernel` gives, for one (chunk, head) with gates of any strength.

    Decays by 16-row blocks, every exponent ≤ 0: a block's rows to its start (e^{Gl}), its keys
    to its end (u = K ⊙ e^{s − Gl}), and between blocks the block totals s_m. Two passes over
    the four blocks: the scores, then (after the inversion) the key-side outputs, which reload
    the rows rather than hold them: holding them spilled registers. n: the chunk within its
    sequence, nc: dl's chunk (the same unless packed)."""
    b, h = bh // H, bh % H
    r0 = (b * T + n * C).to(tl.int64) * H + h                                    # the chunk's row 0
    q, k, g, beta = q + r0 * K, k + r0 * K, g + r0 * K, beta + r0
    aqk, ai, w, qg, kd = aqk + r0 * C, ai + r0 * C, w + r0 * K, qg + r0 * K, kd + r0 * K
    # pass 1: A and Aqk, block row by block row
    k0, q0, b0, G0, s0 = _kda_rows(q, k, g, beta, 0, n, T, H, K, C, BK)
    A00, Q00 = _kda_diag(k0, q0, tl.exp(G0), G0, s0, b0, scale, k, g, 0, n, T, H, K, C, BK, PREC)
    u0 = tl.trans((k0 * tl.exp(s0[None, :] - G0)).to(DT))                         # [BK, 16]
    k1, q1, b1, G1, s1 = _kda_rows(q, k, g, beta, 1, n, T, H, K, C, BK)
    d1 = tl.exp(G1)
    A11, Q11 = _kda_diag(k1, q1, d1, G1, s1, b1, scale, k, g, 1, n, T, H, K, C, BK, PREC)
    one = tl.full((BK,), 1.0, tl.float32)
    A10, Q10 = _kda_off(k1 * d1, q1 * d1, one, b1, u0, scale, DT, IEEE)
    u1 = tl.trans((k1 * tl.exp(s1[None, :] - G1)).to(DT))
    k2, q2, b2, G2, s2 = _kda_rows(q, k, g, beta, 2, n, T, H, K, C, BK)
    d2 = tl.exp(G2)
    A22, Q22 = _kda_diag(k2, q2, d2, G2, s2, b2, scale, k, g, 2, n, T, H, K, C, BK, PREC)
    A21, Q21 = _kda_off(k2 * d2, q2 * d2, one, b2, u1, scale, DT, IEEE)
    A20, Q20 = _kda_off(k2 * d2, q2 * d2, tl.exp(s1), b2, u0, scale, DT, IEEE)
    u2 = tl.trans((k2 * tl.exp(s2[None, :] - G2)).to(DT))
    k3, q3, b3, G3, s3 = _kda_rows(q, k, g, beta, 3, n, T, H, K, C, BK)
    d3 = tl.exp(G3)
    A33, Q33 = _kda_diag(k3, q3, d3, G3, s3, b3, scale, k, g, 3, n, T, H, K, C, BK, PREC)
    A32, Q32 = _kda_off(k3 * d3, q3 * d3, one, b3, u2, scale, DT, IEEE)
    A31, Q31 = _kda_off(k3 * d3, q3 * d3, tl.exp(s2), b3, u1, scale, DT, IEEE)
    A30, Q30 = _kda_off(k3 * d3, q3 * d3, tl.exp(s1 + s2), b3, u0, scale, DT, IEEE)
    _store_lower(aqk, Q00, Q10, Q11, Q20, Q21, Q22, Q30, Q31, Q32, Q33, n, T, H, C)
    T00, T10, T11, T20, T21, T22, T30, T31, T32, T33 = _invert(
        A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, PREC)
    _store_lower(ai, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, n, T, H, C)
    # pass 2: K ⊙ e^{G_C − G}, scale · Q ⊙ e^G, and W = 𝒯 (β K ⊙ e^G) block row by block row
    dk = tl.arange(0, BK)
    tl.store(dl + (bh.to(tl.int64) * NT + nc) * K + dk, tl.exp(s0 + s1 + s2 + s3), mask=dk < K)
    y0 = _kda_key_rows(q, k, g, beta, kd, qg, one, tl.exp(s1 + s2 + s3), scale, 0, n, T, H, K, C,
                       BK, DT)
    _store_rows(w, dot(T00.to(DT), y0, IEEE), 0, n, T, H, K, C, BK)
    y1 = _kda_key_rows(q, k, g, beta, kd, qg, tl.exp(s0), tl.exp(s2 + s3), scale, 1, n, T, H, K,
                       C, BK, DT)
    _store_rows(w, dot(T10.to(DT), y0, IEEE) + dot(T11.to(DT), y1, IEEE), 1, n, T, H, K, C, BK)
    y2 = _kda_key_rows(q, k, g, beta, kd, qg, tl.exp(s0 + s1), tl.exp(s3), scale, 2, n, T, H, K,
                       C, BK, DT)
    _store_rows(w, dot(T20.to(DT), y0, IEEE) + dot(T21.to(DT), y1, IEEE)
                + dot(T22.to(DT), y2, IEEE), 2, n, T, H, K, C, BK)
    y3 = _kda_key_rows(q, k, g, beta, kd, qg, tl.exp(s0 + s1 + s2), one, scale, 3, n, T, H, K,
                       C, BK, DT)
    _store_rows(w, dot(T30.to(DT), y0, IEEE) + dot(T31.to(DT), y1, IEEE)
                + dot(T32.to(DT), y2, IEEE) + dot(T33.to(DT), y3, IEEE), 3, n, T, H, K, C, BK)


@kernel
def _wu_kernel(k, v, g, beta, ai, w, u, kd, dl, T, NT, H, K: tl.constexpr,
               V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, U_ONLY: tl.constexpr,
               SPLIT_W: tl.constexpr,
               cu_seqlens=None, chunk_indices=None, VARLEN: tl.constexpr = False):
    # grid axis 2 splits the work in two programs of similar size: part 0 everything that reads
    # K and the gates (W and the state pass's decays), part 1 all of U, V-block by V-block,
    # reading 𝒯 once. KDA's factor kernel does part 0 itself (U_ONLY: one program, part 1).
    # (Computing W in the U program too gave wrong W for bf16 at K ≤ 32 when compiled for an
    # H200, though right under the interpreter.)
    n, bh = tl.program_id(0), tl.program_id(1)
    part = 1 if U_ONLY else tl.program_id(2)
    b, h = bh // H, bh % H
    nc = n                  # dl's chunk (packed: the row's)
    if VARLEN:              # packed (B = 1): the row's chunk n is chunk n of its sequence
        n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, n)
        k, v, g, beta, ai = k + bos * H * K, v + bos * H * V, g + bos * H, beta + bos * H, ai + bos * H * C
        w, u, kd = w + bos * H * K, u + bos * H * V, kd + bos * H * K
    t = n * C + tl.arange(0, C)
    tm = t < T
    r0 = (b * T + n * C).to(tl.int64) * H + h                                    # the chunk's row 0
    k, v, g, beta, ai = k + r0 * K, v + r0 * V, g + r0, beta + r0, ai + r0 * C
    w, u, kd = w + r0 * K, u + r0 * V, kd + r0 * K
    jc = tl.arange(0, C)
    row = jc * H                                                                  # [C]
    bt = tl.load(beta + row, mask=tm, other=0.0).to(tl.float32)                   # [C]
    if part == 1:
        # 𝒯 diag(β) (float32) times V as given (`dot_input`): one rounding fewer than rounding
        # 𝒯 and β V each into an operand
        Tb = tl.load(ai + row[:, None] * C + jc[None, :], mask=tm[:, None], other=0.0).to(tl.float32) * bt[None, :]
        for iv in tl.static_range(0, V, BV):
            dv = iv + tl.arange(0, BV)
            mv = tm[:, None] & (dv[None, :] < V)
            vt = tl.load(v + row[:, None] * V + dv[None, :], mask=mv, other=0.0)  # [C, BV]
            Ut = dot_input(Tb, vt, DT, IEEE)                                      # [C, BV]
            tl.store(u + row[:, None] * V + dv[None, :], Ut.to(u.dtype.element_ty), mask=mv)
    else:
        _w_part(k, g, ai, bt, w, kd, dl, row, t, nc, bh, T, NT, H, K, C, BK, GATE, DT, IEEE, SPLIT_W)


@triton.jit
def _w_part(k, g, ai, bt, w, kd, dl, row, t, n, bh, T, NT, H, K: tl.constexpr, C: tl.constexpr,
            BK: tl.constexpr, GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, SPLIT_W: tl.constexpr):
    """DeltaNet / Gated DeltaNet, from one load of K (and the per-head gates): W = 𝒯 (β K ⊙ e^G),
    for Gated DeltaNet taken from the chunk's first token, W̃ = e^{−G_0} W (`first_gate`);
    with gates, for the state pass, K ⊙ e^{G_C − G} and e^{G_C}. G_C − G_i = g_{i+1} + … + g_C
    comes from the sum taken from the chunk end minus g_i (never a difference of two long prefix
    sums); padded rows have g = 0."""
    tm = t < T
    dk = tl.arange(0, BK)
    jc = tl.arange(0, C)
    mk = tm[:, None] & (dk[None, :] < K)
    kin = tl.load(k + row[:, None] * K + dk[None, :], mask=mk, other=0.0)       # [C, BK] as given
    cb = bt                                                                       # β e^G [C], columns of 𝒯
    if GATE == 1:
        gt = gate_floor(tl.load(g + row, mask=tm, other=0.0))                  # [C]
        # e^{G − G_0}: decays from the chunk's first token (see `first_gate`); the sum of the gates
        # after it, not a difference of prefix sums
        cb = bt * tl.exp(tl.cumsum(tl.where(jc == 0, 0.0, gt), axis=0))
        tail = tl.exp(tl.cumsum(gt, axis=0, reverse=True) - gt)[:, None]          # e^{G_C − G}
        tl.store(kd + row[:, None] * K + dk[None, :], (kin.to(tl.float32) * tail).to(kd.dtype.element_ty), mask=mk)
        tl.store(dl + (bh.to(tl.int64) * NT + n) * K + dk,
                 tl.zeros((BK,), dtype=tl.float32) + tl.exp(tl.sum(gt, axis=0)), mask=dk < K)
    # 𝒯 diag(β e^G) (float32) times K as given (`dot_input`), as U; else (`split_w`) 𝒯 and the
    # decayed keys each rounded into an operand
    Ti = tl.load(ai + row[:, None] * C + jc[None, :], mask=tm[:, None], other=0.0)  # [C, C] float32
    if SPLIT_W:
        Wt = dot_input(Ti * cb[None, :], kin, DT, IEEE)                           # [C, BK]
    else:
        Wt = dot(Ti.to(DT), (kin.to(tl.float32) * cb[:, None]).to(DT), IEEE)
    tl.store(w + row[:, None] * K + dk[None, :], Wt.to(w.dtype.element_ty), mask=mk)
