"""Backward of the delta rules' scores and gates: from dA, dAqk and the per-chunk gradients of the
gated keys and queries to dq, dk, dβ and the log-gates' dg. Kernel of linattn/triton/delta_backward.py.

Notation as in linattn/triton/wy.py: per chunk, G_i the log-decay summed from the chunk start (per
key dimension d for KDA, one per head for Gated DeltaNet, 0 for DeltaNet), E_ijd = e^{G_id − G_jd}
(i ≥ j), Ā_ij = Σ_d k_id k_jd E_ijd, A = diag(β) Ā (strict lower), Aqk = scale Σ_d q k E (j ≤ i).
The caller hands over, per chunk, the gradients of

    A (dA), Aqk (dAqk),  Qs = scale Q ⊙ e^G (dQs),  Kd = K ⊙ e^{G_C − G} (dKd),
    B_k = diag(β) K ⊙ e^G (dB_k, through W = 𝒯 B_k),  e^{G_C} (ddl, per key dim),

and this kernel applies the chain rule through the decays. Every term with a decay factor is of
the form a_i ⊙ e^{G_i} or b_j ⊙ e^{−G_j}, so a log-gate's gradient is read off the gradients of
the vectors it multiplies: dG_i += a_i ⊙ da_i, dG_j −= b_j ⊙ db_j. Then g_t, which enters every
G_i with i ≥ t and the chunk total G_C, gets dg_t = Σ_{i ≥ t} dG_i + dG_C.

The score terms Σ_j M_ij E_ij k_j (rows) and Σ_i M_ij E_ij q_i (columns) for a [C, C] matrix M:
- no gate or one gate per head: E is a [C, C] matrix, so they are plain dots of M ⊙ E;
- per-dimension gates: E has a third axis. Where the chunk's gates decay by less than
  e^{DIAG_DOT_RANGE} in every key dim of the program (the forward's split, `_kda_split_kernel`),
  E_ijd = e^{G_id} · e^{−G_jd} with both factors in range, so each sum is one tensor-core product:
  Σ_j M_ij E_ij k_j = e^{G_i} ⊙ (M (K ⊙ e^{−G}))_i and Σ_i M_ij E_ij q_i = e^{−G_j} ⊙ (Mᵀ (Q ⊙ e^G))_j
  (`_split_terms`; float32 operands, tf32 products for bf16/fp16 inputs: `common.split_dtype`).
  Past the bound a factor would overflow. Where each 16-row block of the chunk still decays by less
  (the gates models start from: KDA's own initialisation decays a 64-token chunk by e^−74 to
  e^−246), `_block_terms` moves the split's reference point to each block: per block four
  [C, 16] × [16, BK] tensor-core products, the factors outside them ≤ 1. Past that too (log-gates
  of −20 per token) `_columns` keeps every exponent ≤ 0: the row sums walk the columns
  j = C−1 … 0 and keep the column E_{·j} for all rows (from j + 1 to j it multiplies by
  e^{g_{j+1}} ≤ 1, no prefix sums subtracted: the forward's `_diag_walk`, for the whole chunk); the
  column sums walk the rows the same way, each row adding a rank-one tile. O(C² K) work on the FMA
  units per chunk: correct for any gates, and much slower.

One program per (K-block, chunk, head): everything is independent across key dimensions except
the sums over d in dβ (and dg of a per-head gate), which each K-block writes as a partial row that
the host adds up.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import outputs
from .common import dot, dot_input, float32_tiles, gate_floor, kernel, launch, operand, warps
from .gated import _packed_chunk
from .wy import DIAG_DOT_RANGE, split_dtype

def precise(p) -> bool:
    """float32 tiles natively: tf32x3 products (see `mm`); under the plain interpreter every tile is
    float32, its products exact."""
    return p.ieee and not float32_tiles()


@triton.jit
def mm(a, b, DT: tl.constexpr, IEEE: tl.constexpr, X3: tl.constexpr, RND: tl.constexpr = True):
    """a @ b with float32 accumulation: bf16/fp16 tiles on the tensor cores; float32 tiles natively
    as three tf32 products (X3, relative error ~2⁻²¹: compiled for sm_90, IEEE products of these
    [64, 128] tiles took minutes and spilled tens of KB, as the forward's inverse did), exactly
    under the interpreter. Computed float32 tiles of half inputs: rounded to tf32 when RND
    (`common.operand`)."""
    if X3:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    return dot(operand(a, DT, IEEE, RND), operand(b, DT, IEEE, RND), IEEE)


@triton.jit
def mm_input(a, b, DT: tl.constexpr, IEEE: tl.constexpr, X3: tl.constexpr):
    """a @ b for a computed float32 tile a (a score gradient) and b an input tile (keys, queries),
    exact in DT: half inputs as `common.dot_split`'s two products (`common.dot_input`), so a keeps
    about float32 precision where one product would round it to DT. Without it DeltaNet's dq and dk in bf16
    were up to 1.35x and 1.23x less precise than FLA's (H200, conformance case delta_rule-length-038,
    T = 2, where the intra-chunk scores make the whole gradient), which rounds the same scores once.
    Float32 inputs: `mm`."""
    if X3:
        return mm(a, b, DT, IEEE, X3)
    return dot_input(a, b, DT, IEEE)


# K-block of this kernel: the column walk keeps five [C, BK] float32 tiles live. 8 warps: compiled
# for sm_90 on a CPU (bf16, K = 128, C = 64), the spill stack is 0.1–0.7 KB against 0.7–5.4 KB
# with 4. Timed natively (H200, Triton 3.6, bf16, B = 8, T = 4096, H = 16, K = V = 128, chunk 64),
# this kernel with 8 warps against 4: DeltaNet (no gate) 0.73 against 0.49 ms, Gated DeltaNet
# 1.32 against 1.88 ms, KDA 2.37 against 3.91 ms. So 4 warps for DeltaNet in bf16/fp16, 8 otherwise
# (float32's tf32x3 products untimed).
BK_GATES = 64
BLOCK = tl.constexpr(16)   # rows per block of `_block_terms`
TUNING = dict(warps=8, warps_no_gate=4)


def gate_warps(p) -> int:
    """Warps of the gate kernel (TUNING): fewer where there is no gate to differentiate."""
    return TUNING["warps_no_gate"] if p.gate == 0 and not precise(p) else TUNING["warps"]


def split_x3(p) -> bool:
    """Whether KDA's split score products (`_split_terms`) take three tf32 products (`mm`'s X3):
    for float32 tiles natively, as every product, and for fp16 inputs. The gate's gradient is a
    suffix sum of q ⊙ dq − k ⊙ dk in which every pair of tokens of a chunk enters twice with
    opposite signs; only the pairs that straddle a token survive, so each product's rounding stays
    behind in the sum while the gradient itself is small. With one tf32 product the pairs next to
    the diagonal (the largest terms, decay near 1) left fp16's dg 1.6x less precise than FLA's,
    which sums its diagonal blocks in float32 (H200: 1.9e-3 against 1.1e-3, conformance case
    kda-extra-080, logsigmoid gates). bf16 inputs carry 2^-9 themselves, and there one product's
    rounding leaves dg below FLA's."""
    return precise(p) or (p.gate == 2 and p.work == torch.float16)


def gate_stage(q, k, g, beta, grads: dict, p):
    """dq, dk (input dtypes), dg (g's dtype) and the partial dβ [NK, B, T, H] float32."""
    B, T, H, K = p.B, p.T, p.H, p.K
    BK = min(p.BK, BK_GATES)
    NK = triton.cdiv(K, BK)
    dq = outputs.empty((B, T, H, K), dtype=q.dtype, device=p.device)
    dk = outputs.empty((B, T, H, K), dtype=k.dtype, device=p.device)
    db = outputs.empty((NK, B, T, H), dtype=torch.float32, device=p.device)
    if p.gate == 2:
        dg = outputs.empty((B, T, H, K), dtype=g.dtype, device=p.device)
    elif p.gate == 1:
        dg = outputs.empty((NK, B, T, H), dtype=torch.float32, device=p.device)  # summed below
    else:
        dg = db                                                                 # not written
    launch(_gate_kernel, (NK, p.NT, B * H),
        q, k, g if p.gate else q, beta, grads["dqs"], grads["dkd"], grads["dbk"],
        grads["ddl"] if p.gate else beta, grads["da"], grads["daqk"], dq, dk, dg, db,
        p.scale, T, p.NT, H, B * T * H, K=K, C=p.C, BK=BK, GATE=p.gate, DT=p.cdt, IEEE=p.ieee,
        X3=precise(p), SX3=split_x3(p), **split_dtype(p), num_warps=warps(gate_warps(p), BK),
        **p.packed("cu_seqlens", "chunk_indices"))
    if p.gate == 1:
        dg = dg.sum(0).to(g.dtype)
    return dq, dk, (dg if p.gate else None), db


@kernel
def _gate_kernel(q, k, g, beta, dqs, dkd, dbk, ddl, da, daqk, dq, dk, dg, db, scale, T, NT, H, BTH,
                 K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr,
                 DT: tl.constexpr, IEEE: tl.constexpr, X3: tl.constexpr, SX3: tl.constexpr,
                 SDT: tl.constexpr, RND: tl.constexpr, cu_seqlens=None, chunk_indices=None, VARLEN: tl.constexpr = False):
    ik, n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    nc = n                  # ddl's chunk (packed: the row's)
    if VARLEN:              # packed (B = 1): the row's chunk n is chunk n of its sequence
        n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, n)
        rk, rc = bos * H * K, bos * H * C
        q, k, beta, dqs, dkd, dbk, da, daqk = q + rk, k + rk, beta + bos * H, dqs + rk, dkd + rk, dbk + rk, da + rc, daqk + rc
        dq, dk, db = dq + rk, dk + rk, db + bos * H
        if GATE == 2:       # per-dimension gates and their gradient [1, T, H, K]
            g, dg = g + rk, dg + rk
        else:               # per-head: [1, T, H] and the partial sums [NK, 1, T, H]
            g, dg = g + bos * H, dg + bos * H
    jc = tl.arange(0, C)
    t = n * C + jc
    tm = t < T
    r0 = (b * T + n * C).to(tl.int64) * H + h                                    # the chunk's row 0
    row = jc * H                                                                  # [C]
    dk_ = ik * BK + tl.arange(0, BK)
    mk = tm[:, None] & (dk_[None, :] < K)
    offk = r0 * K + (row[:, None] * K + dk_[None, :])                             # [C, BK]
    qt = tl.load(q + offk, mask=mk, other=0.0).to(tl.float32)
    kt = tl.load(k + offk, mask=mk, other=0.0).to(tl.float32)
    bt = tl.load(beta + r0 + row, mask=tm, other=0.0).to(tl.float32)              # [C]
    dQs = tl.load(dqs + offk, mask=mk, other=0.0)                                 # [C, BK] float32
    dKd = tl.load(dkd + offk, mask=mk, other=0.0)
    dBk = tl.load(dbk + offk, mask=mk, other=0.0)
    nxt = ((t + 1) < T) & (jc < C - 1)                                            # token i + 1 in the chunk
    offc = r0 * C + row[:, None] * C + jc[None, :]                                # [C, C]
    part = ik.to(tl.int64) * BTH                                                  # this K-block's partial
    dDl = tl.zeros((BK,), dtype=tl.float32)
    if GATE > 0:
        dDl = tl.load(ddl + (bh.to(tl.int64) * NT + nc) * K + dk_, mask=dk_ < K, other=0.0)
    if GATE == 2:
        # the decays: e^G (≤ 1, from the chunk start), e^{G_C − G} summed from the chunk end over the
        # gates shifted up one row (the forward's `_w_part` takes the sum from the chunk end minus
        # g_i: the same tail, never a difference of two long prefix sums), and e^{G_C}
        gt = gate_floor(tl.load(g + offk, mask=mk, other=0.0))                 # [C, BK]
        gsh = gate_floor(tl.load(g + offk + H * K, mask=nxt[:, None] & (dk_[None, :] < K), other=0.0))
        G = tl.cumsum(gt, axis=0)                                                 # [C, BK] ≤ 0
        eG = tl.exp(G)
        tail = tl.exp(tl.cumsum(gsh, axis=0, reverse=True))
        GC = tl.sum(gt, axis=0)                                                   # [BK]
        # score terms: Z = Σ_j Mq_ij E_ij k_j (→ dq), Zt_j = Σ_i Mq_ij E_ij q_i (→ dk),
        # X = Σ_j dA_ij E_ij k_j (→ β dk_i, dβ_i), Y_j = Σ_i β_i dA_ij E_ij k_i (→ dk_j); Mq = scale dAqk
        if tl.max(-GC, axis=0) < DIAG_DOT_RANGE:                                  # the split: in range
            Mq, Ma = _score_grads(da, daqk, offc, tm, jc, scale)
            Z, Zt, X, Y = _split_terms(qt, kt, bt, G, Mq, Ma, SDT, IEEE, SX3, RND)
        elif _block_decay(gt, C, BK) < DIAG_DOT_RANGE:                             # split per 16 rows
            Z, Zt, X, Y = _block_terms(q + r0 * K, k + r0 * K, g + r0 * K, beta + r0, da + r0 * C,
                                       daqk + r0 * C, gt, gsh, scale, n, T, H, K, C, BK, dk_, SDT, IEEE, SX3, RND)
        else:
            Z, Zt, X, Y = _columns(q + r0 * K, k + r0 * K, g + r0 * K, beta + r0, da + r0 * C,
                                   daqk + r0 * C, scale, n, T, H, K, C, BK, dk_)
        dqt, dkt, dbt, dG = _combine(qt, kt, bt, eG, tail, Z, Zt, X, Y, dQs, dKd, dBk, scale)
        tl.store(dg + offk, _gate_grad(kt, tail, dKd, GC, dDl, dG).to(dg.dtype.element_ty), mask=mk)
        tl.store(dq + offk, dqt.to(dq.dtype.element_ty), mask=mk)
        tl.store(dk + offk, dkt.to(dk.dtype.element_ty), mask=mk)
    else:
        Mq, Ma = _score_grads(da, daqk, offc, tm, jc, scale)
        dbt, dg1 = head_gate_grads(qt, kt, bt, g + r0, row, tm, nxt, mk, Mq, Ma, dQs, dKd, dBk, dDl, scale,
                                   H, dq + offk, dk + offk, GATE, DT, IEEE, X3)
        if GATE == 1:
            tl.store(dg + part + r0 + row, dg1, mask=tm)
    tl.store(db + part + r0 + row, dbt, mask=tm)


@triton.jit
def head_gate_grads(qt, kt, bt, g, row, tm, nxt, mk, Mq, Ma, dQs, dKd, dBk, dDl, scale, H, dq, dk,
                    GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, X3: tl.constexpr):
    """Stores dq and dk (dq, dk: [C, BK] pointers, masked by mk) of one chunk without per-dimension
    gates and returns (the β gradient through the keys [C], the per-head gate's dg [C], 0 without a
    gate), from q, k [C, BK] and β [C] as loaded, Mq = scale dAqk and Ma = dA ([C, C], masked as
    `_score_grads` does), dQs, dKd, dB_k [C, BK] and d(e^{G_C}) [BK], float32. g points at the
    chunk's first per-head log-gate, row = token · H, nxt: whether token i + 1 is in the chunk.

    One gate per head makes E one [C, C] tile, so each score term is one product (`mm_input`), and
    the terms are taken one at a time into `_combine`'s sums (dq stored first), so that no more than
    one product and two accumulators are live: the per-chunk kernel that fuses this step
    (`delta_backward.fused_gates`) holds its own tiles too. The sums over key dims (dβ, dg) cover the
    program's keys: in `_gate_kernel` one K-block's part, in the fused per-chunk kernel all of them."""
    C: tl.constexpr = Mq.shape[0]
    if GATE == 1:
        # the decays e^G (≤ 1, from the chunk start) and e^{G_C − G} summed from the chunk end over
        # the gates shifted up one row (the forward's `_w_part` takes the sum from the chunk end
        # minus g_i: the same tail, never a difference of two long prefix sums); E_ij = e^{G_i − G_j}
        g1 = gate_floor(tl.load(g + row, mask=tm, other=0.0))                     # [C]
        G1 = tl.cumsum(g1, axis=0)
        eG = tl.exp(G1)[:, None]                                                  # [C, 1]
        gsh1 = gate_floor(tl.load(g + row + H, mask=nxt, other=0.0))
        tail = tl.exp(tl.cumsum(gsh1, axis=0, reverse=True))[:, None]             # [C, 1]
        E = tl.exp(tl.minimum(G1[:, None] - G1[None, :], 0.0))                    # [C, C] ≤ 1
        Mq, Ma = Mq * E, Ma * E
    else:
        eG = tl.full((C, 1), 1.0, tl.float32)
        tail = eG
    # score terms (`_combine`): Z = Σ_j Mq_ij E_ij k_j, Zt_j = Σ_i Mq_ij E_ij q_i,
    # X = Σ_j dA_ij E_ij k_j, Y_j = Σ_i β_i dA_ij E_ij k_i
    dqt = mm_input(Mq, kt, DT, IEEE, X3) + scale * eG * dQs                      # Z + ... [C, BK]
    tl.store(dq, dqt.to(dq.dtype.element_ty), mask=mk)
    q32, k32 = qt.to(tl.float32), kt.to(tl.float32)
    dG = q32 * dqt
    R = mm_input(Ma, kt, DT, IEEE, X3) + eG * dBk                                 # X + ...
    dbt = tl.sum(k32 * R, axis=1)                                                 # [C]
    P = bt[:, None] * R
    dKt = k32 * tail * dKd
    N = mm_input(tl.trans(Mq), qt, DT, IEEE, X3) + tail * dKd                     # Zt + ...
    N += mm_input(tl.trans(Ma * bt[:, None]), kt, DT, IEEE, X3)                   # + Y
    tl.store(dk, (N + P).to(dk.dtype.element_ty), mask=mk)
    dg1 = tl.zeros_like(dbt)
    if GATE == 1:
        dG += k32 * (P - N)
        dGC = tl.sum(dKt, axis=0) + tl.exp(tl.sum(g1, axis=0)) * dDl              # [BK]
        dg1 = tl.sum(tl.where(mk, tl.cumsum(dG, axis=0, reverse=True) + dGC[None, :], 0.0), axis=1)
    return dbt, dg1


@triton.jit
def _combine(qt, kt, bt, eG, tail, Z, Zt, X, Y, dQs, dKd, dBk, scale):
    """dq, dk [C, BK], the β gradient through the keys [C] and the log-decays' dG [C, BK] before the
    suffix sum, from the score terms and the per-chunk gradients of Qs = scale Q ⊙ e^G,
    Kd = K ⊙ tail (tail = e^{G_C − G}) and B_k = diag(β) K ⊙ e^G:
        dq = Z + scale e^G ⊙ dQs,   dk = N + P with R = X + e^G ⊙ dB_k, P = β R, N = Zt + Y + tail ⊙ dKd,
        dβ_i = Σ_d k_id R_id  (from A = diag(β) Ā, row i: Σ_j dA_ij Ā_ij = Σ_d k_id X_id, and from B_k),
        dG = q ⊙ dq + k ⊙ (P − N): a_i ⊙ da_i for every factor e^{G_i}, −b_j ⊙ db_j for every e^{−G_j}."""
    dqt = Z + scale * eG * dQs
    R = X + eG * dBk
    P = bt[:, None] * R
    N = Zt + Y + tail * dKd
    return dqt, N + P, tl.sum(kt * R, axis=1), qt * dqt + kt * (P - N)


@triton.jit
def _gate_grad(kt, tail, dKd, GC, dDl, dG):
    """dg [C, BK] per key dim: g_t enters every G_i with i ≥ t and the chunk total G_C (through
    Kd's e^{G_C − G} and e^{G_C}), so dg_t = Σ_{i ≥ t} dG_i + dG_C."""
    dGC = tl.sum(kt * tail * dKd, axis=0) + tl.exp(GC) * dDl                      # [BK]
    return tl.cumsum(dG, axis=0, reverse=True) + dGC[None, :]


@triton.jit
def _score_grads(da, daqk, offc, tm, jc, scale):
    """scale · dAqk on and below the diagonal and dA below it, [C, C] each, 0 elsewhere."""
    Mq = tl.load(daqk + offc, mask=tm[:, None], other=0.0)
    Ma = tl.load(da + offc, mask=tm[:, None], other=0.0)
    return tl.where(jc[:, None] >= jc[None, :], Mq, 0.0) * scale, tl.where(jc[:, None] > jc[None, :], Ma, 0.0)


@triton.jit
def _split_terms(qt, kt, bt, G, Mq, Ma, SDT: tl.constexpr, IEEE: tl.constexpr, X3: tl.constexpr,
                 RND: tl.constexpr):
    """The four score terms of a chunk whose gates decay by less than e^{DIAG_DOT_RANGE}:
    E_ij = e^{G_i} e^{−G_j}, so Z = e^G ⊙ Mq (K ⊙ e^{−G}), X = e^G ⊙ Ma (K ⊙ e^{−G}),
    Zt = e^{−G} ⊙ Mqᵀ (Q ⊙ e^G), Y = e^{−G} ⊙ (diag(β) Ma)ᵀ (K ⊙ e^G): [C, BK] each, four products
    with operands in SDT. e^{−G} is capped at e^{DIAG_DOT_RANGE}, which the bound never reaches."""
    eG = tl.exp(G)
    einv = tl.exp(tl.minimum(-G, DIAG_DOT_RANGE))                                 # ≤ e^60
    Ki = kt * einv
    Z = eG * mm(Mq, Ki, SDT, IEEE, X3, RND)
    X = eG * mm(Ma, Ki, SDT, IEEE, X3, RND)
    Zt = einv * mm(tl.trans(Mq), qt * eG, SDT, IEEE, X3, RND)
    Y = einv * mm(tl.trans(Ma * bt[:, None]), kt * eG, SDT, IEEE, X3, RND)
    return Z, Zt, X, Y


@triton.jit
def _in_blocks(x, C: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr = False):
    """x's running sum within each 16-row block of the chunk (from the block's first row, or its
    last when REVERSE), [C, BK]: one scan of [C/16, 16, BK]."""
    return tl.reshape(tl.cumsum(tl.reshape(x, (C // BLOCK, BLOCK, BK)), axis=1, reverse=REVERSE), (C, BK))


@triton.jit
def _block_decay(gt, C: tl.constexpr, BK: tl.constexpr):
    """The largest decay exponent −Σ g over one 16-row block of the chunk, in any key dim of the program."""
    worst = tl.max(-tl.sum(tl.reshape(gt, (C // BLOCK, BLOCK, BK)), axis=1), axis=1)   # [C/16]
    return tl.max(worst, axis=0)


@triton.jit
def _block_terms(q, k, g, beta, da, daqk, gt, gsh, scale, n, T, H, K: tl.constexpr, C: tl.constexpr,
                 BK: tl.constexpr, dk_, SDT: tl.constexpr, IEEE: tl.constexpr, X3: tl.constexpr,
                 RND: tl.constexpr):
    """The four score terms of a chunk that decays past the split's bound while each of its 16-row
    blocks decays by less (the gates models start from: KDA's own initialisation decays a chunk by
    e^−74 to e^−246). The split's reference point moves from the chunk start to the block: for the
    column block J (tokens b+1 … e, b the token before it, e its last),
        Z_i  += e^{G_i − G_b} ⊙ Σ_{j∈J} Mq_ij (k_j ⊙ e^{G_b − G_j}),   i ≥ j: the first factor ≤ 1,
        Zt_j += e^{G_e − G_j} ⊙ Σ_{i∈J} Mq_ij (q_i ⊙ e^{G_i − G_e}),   j ≤ i: the first factor ≤ 1,
    and X, Y alike from dA (β on Y's rows). The operands' factors are ≥ 1 but at most e^{−Σ_J g},
    below e^{DIAG_DOT_RANGE}. Per block, four [C, 16] × [16, BK] products with operands in SDT, as
    `_split_terms`. q, k, g, beta, da, daqk point at the chunk's row 0; gt, gsh: [C, BK].

    Every exponent is a sum of the gates between its two tokens, never a difference of two sums
    from the chunk start: those reach −250 here, and their float32 rounding costs the gate gradient
    two digits. So each is a running sum within its row's block (`_in_blocks`, once per chunk) plus
    the totals of the whole blocks between that block and J, added to a carry as the walk passes
    each block: Z and X walk the blocks from the last (rows below J gain J's total), Zt and Y from
    the first (rows above J gain it). Rows (columns) a block's scores do not reach are zero in M;
    their factors stay ≤ 1."""
    jc = tl.arange(0, C)
    c16 = tl.arange(0, BLOCK)
    tm = n * C + jc < T
    blk = (jc // BLOCK)[:, None]                                                  # [C, 1] each row's block
    W = _in_blocks(gt, C, BK)                                                     # G_i − G_{block start − 1}
    last = (jc % BLOCK == BLOCK - 1)[:, None]
    Rx = _in_blocks(tl.where(last, 0.0, gsh), C, BK, True)                        # G_{block end} − G_i
    Z = tl.zeros((C, BK), dtype=tl.float32)
    X = tl.zeros((C, BK), dtype=tl.float32)
    carry = tl.zeros((C, BK), dtype=tl.float32)
    for Jr in tl.static_range(C // BLOCK):                                        # Z, X: the last block first
        J = C // BLOCK - 1 - Jr
        rj = J * BLOCK + c16                                                      # the block's rows [16]
        live = (n * C + rj < T)
        mb = live[:, None] & (dk_[None, :] < K)
        at = (rj * H)[:, None] * K + dk_[None, :]
        kb = tl.load(k + at, mask=mb, other=0.0).to(tl.float32)                    # [16, BK]
        gb = gate_floor(tl.load(g + at, mask=mb, other=0.0))
        carry = tl.where(blk > J, carry + tl.sum(gb, axis=0)[None, :], carry)    # rows below J: + J's total
        col = (jc * H * C)[:, None] + rj[None, :]                                 # the scores' columns in J
        Mq_c = tl.load(daqk + col, mask=tm[:, None] & (jc[:, None] >= rj[None, :]), other=0.0) * scale
        Ma_c = tl.load(da + col, mask=tm[:, None] & (jc[:, None] > rj[None, :]), other=0.0)
        up = tl.exp(W + carry)                                                    # e^{G_i − G_b}
        kin = kb * tl.exp(-tl.cumsum(gb, axis=0))                                 # k_j e^{G_b − G_j}
        Z += up * mm(Mq_c, kin, SDT, IEEE, X3, RND)
        X += up * mm(Ma_c, kin, SDT, IEEE, X3, RND)
    Zt = tl.zeros((C, BK), dtype=tl.float32)
    Y = tl.zeros((C, BK), dtype=tl.float32)
    carry = tl.zeros((C, BK), dtype=tl.float32)
    for J in tl.static_range(C // BLOCK):                                         # Zt, Y: the first block first
        rj = J * BLOCK + c16
        live = (n * C + rj < T)
        mb = live[:, None] & (dk_[None, :] < K)
        at = (rj * H)[:, None] * K + dk_[None, :]
        kb = tl.load(k + at, mask=mb, other=0.0).to(tl.float32)
        qb = tl.load(q + at, mask=mb, other=0.0).to(tl.float32)
        bb = tl.load(beta + rj * H, mask=live, other=0.0).to(tl.float32)           # [16]
        gb = gate_floor(tl.load(g + at, mask=mb, other=0.0))
        carry = tl.where(blk < J, carry + tl.sum(gb, axis=0)[None, :], carry)    # rows above J: + J's total
        nx = live & (n * C + rj + 1 < T) & (c16 < BLOCK - 1)
        gs = gate_floor(tl.load(g + at + H * K, mask=nx[:, None] & (dk_[None, :] < K), other=0.0))
        row = (rj * H * C)[None, :] + jc[:, None]                                 # the scores' rows in J, transposed
        Mq_r = tl.load(daqk + row, mask=live[None, :] & (jc[:, None] <= rj[None, :]), other=0.0) * scale
        Ma_r = tl.load(da + row, mask=live[None, :] & (jc[:, None] < rj[None, :]), other=0.0) * bb[None, :]
        down = tl.exp(Rx + carry)                                                 # e^{G_e − G_j}
        out = tl.exp(-tl.cumsum(gs, axis=0, reverse=True))                        # e^{G_i − G_e} ≥ 1
        Zt += down * mm(Mq_r, qb * out, SDT, IEEE, X3, RND)
        Y += down * mm(Ma_r, kb * out, SDT, IEEE, X3, RND)
    return Z, Zt, X, Y


@triton.jit
def _columns(q, k, g, beta, da, daqk, scale, n, T, H, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
             dk_):
    """The score terms for per-dimension gates with decay tiles built one gate factor (≤ 1) at a
    time, so every exponent is ≤ 0. q, k, g, beta, da, daqk point at the chunk's row 0.

    Z and X (sums over columns j for each row i) walk the columns j = C−1 … 0 keeping
    E[i, d] = e^{G_id − G_jd} for rows i ≥ j (0 above); column j of dA and dAqk is read from memory.
    Zt and Y (sums over rows i for each column j) walk the rows i = 0 … C−1 keeping
    F[j, d] = e^{G_id − G_jd} for columns j ≤ i (0 beyond): each row adds a rank-one tile, where a
    column walk would need a sum across rows and a scatter into row j for every column."""
    jc = tl.arange(0, C)
    mkk = dk_ < K
    E = tl.zeros((C, BK), dtype=tl.float32)
    Z = tl.zeros((C, BK), dtype=tl.float32)
    X = tl.zeros((C, BK), dtype=tl.float32)
    for c in range(C):
        j = C - 1 - c
        tj = n * C + j
        gn = gate_floor(tl.load(g + (j + 1) * H * K + dk_, mask=mkk & (tj + 1 < T) & (j + 1 < C),
                                other=0.0))                         # [BK] g_{j+1}
        E = E * tl.exp(gn)[None, :]
        E = tl.where(jc[:, None] == j, 1.0, E)
        kj = tl.load(k + j * H * K + dk_, mask=mkk & (tj < T), other=0.0).to(tl.float32)  # [BK]
        mq = tl.load(daqk + jc * H * C + j, mask=(jc >= j) & (n * C + jc < T), other=0.0) * scale
        ma = tl.load(da + jc * H * C + j, mask=(jc > j) & (n * C + jc < T), other=0.0)  # [C]
        Ek = E * kj[None, :]
        Z += mq[:, None] * Ek
        X += ma[:, None] * Ek
    F = tl.zeros((C, BK), dtype=tl.float32)
    Zt = tl.zeros((C, BK), dtype=tl.float32)
    Y = tl.zeros((C, BK), dtype=tl.float32)
    for i in range(C):
        live = n * C + i < T
        gi = gate_floor(tl.load(g + i * H * K + dk_, mask=mkk & live, other=0.0))   # [BK] g_i
        F = tl.where(jc[:, None] == i, 1.0, F * tl.exp(gi)[None, :])              # F_i, rows j ≤ i
        qi = tl.load(q + i * H * K + dk_, mask=mkk & live, other=0.0).to(tl.float32)   # [BK]
        ki = tl.load(k + i * H * K + dk_, mask=mkk & live, other=0.0).to(tl.float32)
        bi = tl.load(beta + i * H, mask=live, other=0.0).to(tl.float32)
        mq = tl.load(daqk + i * H * C + jc, mask=(jc <= i) & live, other=0.0) * scale     # [C] row i
        ma = tl.load(da + i * H * C + jc, mask=(jc < i) & live, other=0.0)
        Zt += mq[:, None] * qi[None, :] * F
        Y += (bi * ma)[:, None] * ki[None, :] * F
    return Z, Zt, X, Y
