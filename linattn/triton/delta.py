"""Triton kernels for the delta rule, Gated DeltaNet and KDA: three stages, four kernels.

Notation (as in linattn.chunk.delta): a chunk of C tokens enters with state S [K, V]; G_i is the
log-decay summed from the chunk start (per key dimension for KDA, one per head for Gated DeltaNet,
0 for DeltaNet); A_ij = β_i Σ_d k_id k_jd e^{G_id − G_jd} (i > j); T = (I + A)⁻¹;
U = T diag(β) V, W = T diag(β) (K ⊙ e^G); Ṽ = U − W S; then

    O  = scale (Q ⊙ e^G) S + Aqk Ṽ,      Aqk_ij = scale Σ_d q_id k_jd e^{G_id − G_jd}  (j ≤ i)
    S' = e^{G_C} ⊙ S + (K ⊙ e^{G_C − G})ᵀ Ṽ.

Stage 1, linattn/triton/wy.py, fully parallel over (chunk, head): a factor kernel for Aqk and
    T = (I + A)⁻¹ (A kept on chip), and one for W, U plus K̃ = K ⊙ e^{G_C − G}, e^{G_C} for
    stage 2 (so its sequential loop has no exponentials) and, for per-dimension gates,
    scale · Q ⊙ e^G for stage 3 (a per-head gate's e^G is one number per token, applied by
    stage 3 itself). KDA's factor kernel gives W and the decays itself (the second kernel gives
    U only), and a third kernel redoes the chunks whose gates decay too fast for it. How the
    decays stay finite with log-gates down to −20 per token is told there, and why Gated
    DeltaNet's W and e^G are taken from each chunk's first token (W̃, with e^{G_0} applied by
    stages 2 and 3 after their products).
Stage 2, `_state_kernel`, one program per (V-block, head), a loop over chunks: the affine pass
    Ṽ = U − W S, S ← e^{G_C} S + K̃ᵀ Ṽ; it stores every chunk's entering state and Ṽ.
Stage 3, `_output_kernel`, one program per (V-block, chunk, head), fully parallel: O.
Chunks of 16, 32 or 64 tokens (`linattn.support`).

Packed sequences (`cu_seqlens`, linattn.packing: B = 1, N sequences back to back in the row) run in
the same launches, one per kernel, as linear attention and GLA do (linattn/triton/gated.py, whose
chunk tables `gated.Packed` and device helpers these kernels share): each sequence is chunked from
its own start. A chunk-parallel kernel (stage 1, the output stage, the backward's per-chunk and
gate kernels) reads (sequence n, chunk i within n) from chunk_indices [NT, 2] at its program id; a
walk over the chunks (the state pass, the reverse pass) runs one program per (V-block, sequence,
head) over that sequence's chunks. A program then moves its base pointers to the sequence's first
token bos = cu_seqlens[n], masks by the sequence's length T_n, and runs the unpacked code. What is
kept per chunk (the states [1, H, NT, K, V], the decays e^{G_C} [1, H, NT, K], KDA's flags) is
indexed by the row's chunk, a sequence's from chunk_offsets[n] on; initial and final states are
[N, H, K, V]. A chunk's first token (Gated DeltaNet's W̃ and decayed queries, wy.py) is its first
token within its own sequence. The constexpr VARLEN selects that prologue, so the unpacked kernels
compile exactly as without it. An empty sequence has no chunk: its final state is its initial state.
The backward (an autograd.Function, used only when some input requires grad) is
linattn/triton/delta_backward.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import outputs
from ..naive.delta import check_keys
from ..support import check_triton
from ..validate import InputError, check_inputs
from .common import (MIN_TILE, block, check_kernel_inputs, compute_dtype, contiguous, dot, gate_floor, kernel,
                     launch, num_sms, tile)
from .gated import _packed_chunk, _packed_seq, busy_rows, check_packed, packed_args, row_chunks
from .wy import SUB, absolute_w, factor_stage, first_gate, wu_stage, wy_stage  # noqa: F401  (stage 1)

# Launch choices (V-block widths, warps, pipeline stages), measured on an H200: docs/performance.md.
# Narrow V-blocks in the state pass give a long sequence with few heads more programs;
# bv_state=None lets `state_block` choose from the number of SMs. State pass at T = 32k, B·H = 16
# (H200, bf16): BV 16 with 4 warps was fastest for DeltaNet (0.86 ms; 8 warps 0.98, BV 32 0.94), but
# blocks narrower than common.MIN_TILE are not used (see there). Up to 3
# pipeline stages (fewer where they do not fit, `launch`): with every load of the chunk loop
# pipelined, DeltaNet's whole forward at T = 32k took 1.32 ms against 1.61 with 2 stages (Gated
# DeltaNet 1.51 / 1.78, KDA 3.43 / 3.70) and the same at T = 1k.
TUNING = dict(bv_state=None, bv_out=64, warps_state=4, warps_out=4, stages_state=3)


def state_block(V, BH, sms=None):
    """V-block of the state pass: 64 wide if that still gives every SM a program, else MIN_TILE.

    B·H·⌈V/BV⌉ programs walk the chunks in order; with one sequence of 16 heads, 64-wide blocks
    leave most of an H200's 132 SMs idle (docs/performance.md). 16-wide blocks gave a long sequence
    still more programs, but in float32 the backward's reverse pass computed wrong state gradients
    with them natively (K = 16 or V ≤ 32, one chunk; common.MIN_TILE). `sms`: this GPU's by default."""
    if TUNING["bv_state"]:
        return tile(V, TUNING["bv_state"])
    sms = num_sms() if sms is None else sms
    if BH * triton.cdiv(V, tile(V, 64)) >= sms:
        return tile(V, 64)
    return tile(V, MIN_TILE)




def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               chunk_size=64, recompute=True, cu_seqlens=None):
    """DeltaNet on the GPU: S_t = S_{t-1} + β_t k_tᵀ (v_t − k_t S_{t-1}), o_t = scale · q_t S_t.

    Differentiable (linattn/triton/delta_backward.py); recompute=False keeps the forward's chunk
    factors and states for the backward instead of recomputing them (more memory, less work).

    cu_seqlens: packed sequences (docs/packed_sequences.md): q [1, T, H, K] holds N sequences,
    initial and final states are [N, H, K, V]; one launch per kernel indexes them (module doc)."""
    d = check_inputs(q, k, v, beta=beta, scale=scale,
                     initial_state=None if cu_seqlens is not None else initial_state, delta=True)
    check_triton("delta_rule", q, d.K, d.V, chunk_size)
    check_keys(k, beta)
    seqs = check_packed(cu_seqlens, d, q, initial_state, chunk_size)
    return _run(q, k, v, None, beta, d, initial_state, output_final_state, chunk_size, recompute, seqs)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        chunk_size=64, recompute=True, cu_seqlens=None):
    """KDA (g [B,T,H,K]) or Gated DeltaNet (g [B,T,H]) on the GPU:
    S_t = D_t S_{t-1} + β_t k_tᵀ (v_t − k_t D_t S_{t-1}), D_t = diag(exp g_t).
    Differentiable; `recompute` and `cu_seqlens` as in `delta_rule`."""
    d = check_inputs(q, k, v, g=g, beta=beta, scale=scale,
                     initial_state=None if cu_seqlens is not None else initial_state, gate=True, delta=True)
    check_triton("kda", q, d.K, d.V, chunk_size)
    check_keys(k, beta)
    seqs = check_packed(cu_seqlens, d, q, initial_state, chunk_size)
    return _run(q, k, v, g, beta, d, initial_state, output_final_state, chunk_size, recompute, seqs)


def _run(q, k, v, g, beta, d, initial_state, output_final_state, C, recompute, seqs=None):
    """The plain forward, or the autograd.Function when autograd will ask for gradients."""
    from . import delta_backward  # it builds on this module's stages
    if delta_backward.needs_backward(q, k, v, g, beta, initial_state):
        return delta_backward.apply(q, k, v, g, beta, d, initial_state, output_final_state, C,
                                    recompute, seqs)
    return _forward(q, k, v, g, beta, d, initial_state, output_final_state, C, seqs)


# ---------------------------------------------------------------- host side

@dataclass(frozen=True)
class Plan:
    """What every launch of one call shares: sizes, gate kind, dtypes, tile widths."""
    B: int
    T: int
    H: int
    K: int
    V: int
    C: int
    NT: int          # chunks per sequence, the last one possibly partial (packed: of the row)
    gate: int        # 0 DeltaNet, 1 one log-decay per head (Gated DeltaNet), 2 per key dim (KDA)
    scale: float
    cdt: object      # tile dtype for tl.dot (tl.float32 under the interpreter)
    ieee: bool       # float32 tiles: exact IEEE products, not tf32
    work: torch.dtype  # dtype of the tensors handed from stage to stage
    BK: int
    device: torch.device
    seqs: object = None  # gated.Packed for packed sequences (B = 1), else None

    @property
    def N(self) -> int:
        """Rows, or packed sequences: the first axis of initial and final states."""
        return self.B if self.seqs is None else self.seqs.N

    def packed(self, *names) -> dict:
        """Keyword arguments of a launch indexing packed sequences (`gated.packed_args`)."""
        return packed_args(self.seqs, *names)


def plan(q, g, d, C, seqs=None) -> Plan:
    """seqs: `gated.Packed` of packed sequences (`gated.check_packed`), else None."""
    check_kernel_inputs(q)
    cdt = compute_dtype(q.dtype)
    ieee = cdt == tl.float32
    return Plan(d.B, d.T, d.H, d.K, d.V, C, row_chunks(d.T, C, seqs),
                0 if g is None else (1 if g.dim() == 3 else 2), d.scale, cdt, ieee,
                torch.float32 if ieee else q.dtype, block(d.K), q.device, seqs)


def state_stage(wy: dict, h0, p: Plan, output_final_state: bool, over_u: bool = False, g=None):
    """Stage 2, one program per (V-block, head) walking the chunks in order: Ṽ = U − W S,
    S ← e^{G_C} S + (K ⊙ e^{G_C − G})ᵀ Ṽ (Gated DeltaNet: W S = e^{G_0} W̃ S, g its per-head
    log-gates [B,T,H], see linattn/triton/wy.py). Returns (states [B,H,NT,K,V] entering each chunk,
    Ṽ [B,T,H,V], final state [B,H,K,V] float32 or None; packed: one program per (V-block, sequence,
    head), h0 and the final state [N,H,K,V], the states [1,H,NT,K,V] over the row's chunks). over_u: Ṽ is written over U (each
    program reads a block of U once, then writes Ṽ to the same place), saving a [B,T,H,V] buffer
    when nothing reads U afterwards."""
    B, T, H, K, V = p.B, p.T, p.H, p.K, p.V
    hs = outputs.empty((B, H, p.NT, K, V), dtype=p.work, device=p.device)
    vnew = wy["u"] if over_u else outputs.empty((B, T, H, V), dtype=p.work, device=p.device)
    ht = outputs.empty((p.N, H, K, V), dtype=torch.float32, device=p.device) if output_final_state else None
    BV = state_block(V, busy_rows(p.B, p.seqs) * H)
    launch(
        _state_kernel, (triton.cdiv(V, BV), p.N * H),
        wy["kd"], wy["dl"] if p.gate else hs, g if p.gate == 1 else hs, wy["w"], wy["u"],
        hs if h0 is None else h0, hs, vnew, hs if ht is None else ht, T, p.NT,
        H=H, K=K, V=V, C=p.C, BK=p.BK, BV=BV, GATE=p.gate, DT=p.cdt, IEEE=p.ieee,
        HAS_H0=h0 is not None, STORE_HT=output_final_state, num_warps=TUNING["warps_state"],
        max_stages=state_stages(p), **p.packed("cu_seqlens", "chunk_offsets"))
    return hs, vnew, ht


def state_stages(p: Plan) -> int:
    """Pipeline stages of the state pass: one for a 256-wide key tile with chunks of 32 or fewer.
    Natively (H200, Triton 3.6, bf16 and fp16, K = 256, V = 32, chunk 32, no initial state) the
    pipelined loop (2 or 3 stages) left the states and Ṽ of whole chunks unwritten: a silently
    wrong output, every length tried, where one stage and the interpreter were right. Measured
    against a float64 reference of this pass over K, V in 16…256, chunks 16/32/64, three dtypes,
    with and without an initial state (docs/native_correctness.md); every other shape was right
    pipelined, and one stage costs a long sequence 1.7× in this pass, so the rule stays narrow."""
    return 1 if p.BK >= 256 and p.C <= 32 else TUNING["stages_state"]


def output_stage(q, wy: dict, hs, vnew, p: Plan, out_dtype, g=None):
    """Stage 3, one program per (V-block, chunk, head): O = scale (Q ⊙ e^G) S + Aqk Ṽ.
    g: the per-head log-gates [B,T,H] (Gated DeltaNet; read here, see `wu_stage`)."""
    if p.gate == 1 and g is None:
        raise InputError("g: output_stage of Gated DeltaNet needs the per-head log-gates")
    o = outputs.empty((p.B, p.T, p.H, p.V), dtype=out_dtype, device=p.device)
    BV = tile(p.V, TUNING["bv_out"])
    launch(                                 # launch: fewer stages where the GPU has less shared memory
        _output_kernel, (triton.cdiv(p.V, BV), p.NT, p.B * p.H),
        wy["qg"] if p.gate == 2 else q, g if p.gate == 1 else q, hs, wy["aqk"], vnew, o, p.scale, p.T, p.NT,
        H=p.H, K=p.K, V=p.V, C=p.C, BK=p.BK, BV=BV, GATE=p.gate, DT=p.cdt, IEEE=p.ieee,
        num_warps=TUNING["warps_out"], **p.packed("cu_seqlens", "chunk_indices"))
    return o


def _forward(q, k, v, g, beta, d, initial_state, output_final_state, C, seqs=None):
    p = plan(q, g, d, C, seqs)
    q, k, v, g, beta = contiguous(q, k, v, g, beta)
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    wy, hs, vnew, ht = factors_and_states(q, k, v, g, beta, h0, p, output_final_state, keep=False)
    return output_stage(q, wy, hs, vnew, p, v.dtype, g), ht


def factors_and_states(q, k, v, g, beta, h0, p: Plan, output_final_state: bool, keep: bool):
    """Stages 1 and 2: (wy dict, states, Ṽ, final state). Peak memory: each intermediate is
    dropped as soon as no later stage reads it — 𝒯 once W and U are known, and
    W, U, K ⊙ e^{G_C − G}, e^{G_C} after the state pass, with Ṽ written over U — so the output
    stage adds O to Aqk, (scale · Q ⊙ e^G), the states and Ṽ only. keep=True (the backward reads
    them) keeps 𝒯, W, U and the decays, and Ṽ in a buffer of its own."""
    wy = factor_stage(q, k, g, beta, p)
    wy.pop("exact", None)   # KDA's per-chunk flags: read by its exact kernel only
    wy.update(wu_stage(q, k, v, g, beta, wy["ai"], p))
    if not keep:
        del wy["ai"]
    hs, vnew, ht = state_stage(wy, h0, p, output_final_state, over_u=not keep, g=g)
    if not keep:
        for name in ("w", "u", "kd", "dl"):
            del wy[name]
    return wy, hs, vnew, ht


# ---------------------------------------------------------------- stages 2 and 3

@triton.jit
def _mm(a, b, DT: tl.constexpr, IEEE: tl.constexpr):
    """a @ b on the tensor cores: operands in the compute dtype, float32 accumulation."""
    return dot(a.to(DT), b.to(DT), IEEE)


@kernel
def _state_kernel(kd, dl, g, w, u, h0, hs, vnew, ht, T, NT, H, K: tl.constexpr,
                  V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
                  HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, cu_seqlens=None, chunk_offsets=None,
                  VARLEN: tl.constexpr = False):
    iv, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    NT_n = NT                                       # this program's chunks
    if VARLEN:
        # packed (B = 1, NT the row's chunks): program bh = (sequence b, head h), h0 and ht
        # [N, H, K, V]; hs [1, H, NT, K, V] and dl [1, H, NT, K] hold this sequence's NT_n chunks
        # from chunk_offsets[b] on. Then bh = h indexes the row's head h in each.
        bos, T = _packed_seq(cu_seqlens, b)
        kd, g, w, u, vnew = kd + bos * H * K, g + bos * H, w + bos * H * K, u + bos * H * V, vnew + bos * H * V
        c0 = tl.load(chunk_offsets + b)
        hs, dl = hs + c0 * K * V, dl + c0 * K
        h0, ht = h0 + b.to(tl.int64) * H * K * V, ht + b.to(tl.int64) * H * K * V
        NT_n = tl.cdiv(T, C)
        bh, b = h, 0
    dk = tl.arange(0, BK)
    dv = iv * BV + tl.arange(0, BV)
    ms = (dk[:, None] < K) & (dv[None, :] < V)
    S = tl.zeros((BK, BV), dtype=tl.float32)                                     # [BK, BV]
    if HAS_H0:
        S = tl.load(h0 + bh.to(tl.int64) * K * V + dk[:, None] * V + dv[None, :], mask=ms, other=0.0)
    # The decay e^{G_C} of chunk n is loaded one chunk ahead: a load waited on in the same
    # iteration (it feeds no dot operand, so the pipeliner leaves it alone) stalls every step.
    # Gated DeltaNet's e^{G_0} (W = e^{G_0} W̃, linattn/triton/wy.py) likewise.
    dl_n = tl.zeros((BK,), dtype=tl.float32)                                     # [BK]
    f_n = 1.0
    if VARLEN:              # an empty sequence has no chunk to read these from
        if GATE > 0:
            dl_n = tl.load(dl + bh.to(tl.int64) * NT * K + dk, mask=(dk < K) & (NT_n > 0), other=0.0)
        if GATE == 1:
            f_n = tl.exp(gate_floor(tl.load(g + h, mask=NT_n > 0, other=0.0)))
    else:
        if GATE > 0:
            dl_n = tl.load(dl + bh.to(tl.int64) * NT * K + dk, mask=dk < K, other=0.0)
        if GATE == 1:
            f_n = first_gate(g, (b * T).to(tl.int64) * H + h)
    for n in range(NT_n):
        # the state entering chunk n, for the output stage
        hn = hs + (bh.to(tl.int64) * NT + n) * K * V
        tl.store(hn + dk[:, None] * V + dv[None, :], S.to(hs.dtype.element_ty), mask=ms)
        t = n * C + tl.arange(0, C)
        tm = t < T
        # 64-bit offset of the chunk's first row, 32-bit offsets inside it (64-bit address
        # tiles cost twice the registers)
        r0 = (b * T + n * C).to(tl.int64) * H + h
        row = tl.arange(0, C) * H
        mk = tm[:, None] & (dk[None, :] < K)
        mv = tm[:, None] & (dv[None, :] < V)
        Wt = tl.load(w + r0 * K + (row[:, None] * K + dk[None, :]), mask=mk, other=0.0)  # [C, BK]
        Ut = tl.load(u + r0 * V + (row[:, None] * V + dv[None, :]), mask=mv, other=0.0).to(tl.float32)
        WS = _mm(Wt, S, DT, IEEE)                                                 # [C, BV] W̃ S
        if GATE == 1:
            WS = WS * f_n                                                         # W = e^{G_0} W̃
            f_n = tl.exp(gate_floor(tl.load(g + r0 + C * H, mask=n + 1 < NT_n, other=0.0)))
        Vt = Ut - WS                                                              # [C, BV] Ṽ
        tl.store(vnew + r0 * V + (row[:, None] * V + dv[None, :]), Vt.to(vnew.dtype.element_ty), mask=mv)
        # K ⊙ e^{G_C − G} (just K for DeltaNet) and the decay e^{G_C} across the chunk, from stage 1
        # kept in the stored dtype: a float32 copy would go through registers, not the pipeline
        kt = tl.load(kd + r0 * K + (row[:, None] * K + dk[None, :]), mask=mk, other=0.0)
        if GATE > 0:
            S = S * dl_n[:, None]
            dl_n = tl.load(dl + (bh.to(tl.int64) * NT + n + 1) * K + dk, mask=(dk < K) & (n + 1 < NT_n), other=0.0)
        S += _mm(tl.trans(kt), Vt, DT, IEEE)                                      # [BK, BV]
    if STORE_HT:
        tl.store(ht + bh.to(tl.int64) * K * V + dk[:, None] * V + dv[None, :], S, mask=ms)


@kernel
def _output_kernel(q, g, hs, aqk, vnew, o, scale, T, NT, H, K: tl.constexpr,
                   V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, cu_seqlens=None,
                   chunk_indices=None, VARLEN: tl.constexpr = False):
    iv, n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    nc = n                  # hs's chunk (packed: the row's, hs [1, H, NT, K, V])
    if VARLEN:              # packed (B = 1): the row's chunk n is chunk n of its sequence
        n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, n)
        q, g, aqk, vnew, o = q + bos * H * K, g + bos * H, aqk + bos * H * C, vnew + bos * H * V, o + bos * H * V
    t = n * C + tl.arange(0, C)
    tm = t < T
    r0 = (b * T + n * C).to(tl.int64) * H + h                                    # the chunk's row 0
    q, aqk, vnew, o = q + r0 * K, aqk + r0 * C, vnew + r0 * V, o + r0 * V
    row = tl.arange(0, C) * H
    dk = tl.arange(0, BK)
    dv = iv * BV + tl.arange(0, BV)
    mk = tm[:, None] & (dk[None, :] < K)
    mv = tm[:, None] & (dv[None, :] < V)
    # q is scale · Q ⊙ e^G from stage 1 with per-dimension gates, the plain queries else: their
    # scale and per-token decay multiply the rows of Q S after the product, so the product reads
    # the queries exactly as given (rounding scale · q into a bf16 operand first made the output
    # up to 1.07x less precise than FLA's, which scales after its product too)
    qt = tl.load(q + row[:, None] * K + dk[None, :], mask=mk, other=0.0)         # [C, BK]
    hn = hs + (bh.to(tl.int64) * NT + nc) * K * V
    S = tl.load(hn + dk[:, None] * V + dv[None, :], mask=(dk[:, None] < K) & (dv[None, :] < V),
                other=0.0)                                                        # [BK, BV]
    jc = tl.arange(0, C)
    Aqk = tl.load(aqk + row[:, None] * C + jc[None, :], mask=tm[:, None], other=0.0)  # [C, C]
    Vt = tl.load(vnew + row[:, None] * V + dv[None, :], mask=mv, other=0.0)      # [C, BV]
    QS = _mm(qt, S, DT, IEEE)                                                     # [C, BV]
    if GATE == 0:
        QS = QS * scale
    if GATE == 1:   # one decay per token: e^{G_i − G_0} ≤ 1, the gates after the first summed,
        # times e^{G_0} (`first_gate`), float32
        G1 = tl.cumsum(tl.where(jc == 0, 0.0, gate_floor(tl.load(g + r0 + row, mask=tm, other=0.0))),
                       axis=0)                                                    # [C]
        QS = QS * (tl.exp(G1) * scale)[:, None] * first_gate(g, r0)
    out = QS + _mm(Aqk, Vt, DT, IEEE)                                            # [C, BV]
    tl.store(o + row[:, None] * V + dv[None, :], out.to(o.dtype.element_ty), mask=mv)
