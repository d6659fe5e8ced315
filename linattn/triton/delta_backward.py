"""The backward of linattn.triton.delta_rule / kda: an autograd.Function over the three forward stages.

Notation as in linattn/triton/delta.py: per chunk n with entering state S_n, Ṽ = U − W S_n,
U = 𝒯 diag(β) V, W = 𝒯 B_k with B_k = diag(β) K ⊙ e^G, 𝒯 = (I + A)⁻¹, Qs = scale Q ⊙ e^G,
Kd = K ⊙ e^{G_C − G}, dl = e^{G_C}, and

    O = Qs S_n + Aqk Ṽ,        S_{n+1} = dl ⊙ S_n + Kdᵀ Ṽ.

Backward, given dO and the gradient of the final state (0 unless output_final_state is used):

1. Recompute (recompute=True, the default, as in the GLA paper) or reuse (recompute=False: the
   forward keeps them) stage 1 (A, Aqk, 𝒯, W, U, Kd, dl, and Qs for per-dimension gates) and stage 2 (S_n, Ṽ).
2. `_dstate_kernel`, the one sequential pass, one program per (V-block, head), chunks in reverse:
       dṼ = Aqkᵀ dO + Kd dS_{n+1},      dS_n = dl ⊙ dS_{n+1} + Qsᵀ dO − Wᵀ dṼ;
   it stores dS_{n+1} and dṼ of every chunk, and dS_0 (the initial state's gradient).
3. `_dchunk_kernel`, one program per (chunk, head), a loop over V-blocks: everything that sums
   over value dims. dQs = dO S_nᵀ, dAqk = dO Ṽᵀ, dKd = Ṽ dS_{n+1}ᵀ, d(dl) = Σ_v S_n ⊙ dS_{n+1},
   dW = −dṼ S_nᵀ, dU = dṼ; then the WY backward through 𝒯: for X = 𝒯 B, dB = 𝒯ᵀ dX and
   d𝒯 = dX Bᵀ, so dA = −𝒯ᵀ d𝒯 𝒯ᵀ = −(𝒯ᵀ dX) Xᵀ on the strict lower triangle:
       dB_v = 𝒯ᵀ dU → dv = β dB_v, dβ += Σ_v V ⊙ dB_v;   dB_k = 𝒯ᵀ dW;
       dA = −(dB_v Uᵀ + dB_k Wᵀ).
4. `linattn.triton.wy_backward`, one program per (K-block, chunk, head): the chain rule through
   the decayed scores and gates, to dq, dk, dβ and dg (see there). Without per-dimension gates
   (DeltaNet, Gated DeltaNet) and with half-precision inputs, step 3's kernel applies it itself
   (`fused_gates`), so its float32 outputs dQs, dKd, dB_k, dA and dAqk never go to memory.

Kernels: all four steps (the stage-1/2 recomputation is the forward's own kernels). The host only
allocates, launches, adds the per-K-block partial sums of dβ (and of a per-head dg) and casts.
Every exponent stays ≤ 0 as in the forward; tiles are float32 under the interpreter, and float32
inputs natively multiply as three tf32 products (`wy_backward.mm`); intermediates handed between
the backward's kernels are float32, except the state gradients, kept in the dtype the forward keeps
its states in (bf16 inputs: half the backward's largest buffer). Each intermediate is dropped once
no later step reads it.

Packed sequences: as in the forward (linattn/triton/delta.py's module doc). The reverse pass runs
one program per (V-block, sequence, head) over that sequence's chunks, the state gradients
[1, H, NT, K, V] over the row's chunks; dS_0 and the final state's gradient are [N, H, K, V], and
an empty sequence passes its final state's gradient to its initial state unchanged. The per-chunk
kernel takes (sequence, chunk within it) from chunk_indices.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import outputs
from ..validate import InputError, first_order
from .common import contiguous, dot_split_bf16, gate_floor, kernel, launch, stage, tile, warps
from .delta import factors_and_states, output_stage, plan
from .gated import _packed_chunk, _packed_seq
from .wy import first_gate
from .wy_backward import gate_stage, head_gate_grads, mm, precise

# V-blocks of the reverse state pass and of the per-chunk reductions. The reverse pass takes 64-wide
# V-blocks (V ≤ 32: all of V) whatever the number of programs: with the narrower blocks the forward's
# state pass takes for few heads (`delta.state_block`), it faulted natively with an illegal memory
# access (H200, Triton 3.6, K = V = 128, B·H = 3, bf16: DeltaNet, Gated DeltaNet and KDA, every
# length tried up to 64) or returned a wrong initial-state gradient (0.47 relative), while 64-wide
# blocks were right at every length, batch, head count and dtype tried; the interpreter was right
# with either.
# 8 warps for the reverse pass: compiled for sm_90 on a CPU (bf16, K = V = 128, C = 64), its spill
# stack falls from 0.9–1.5 KB to 0.3 KB against 4 warps; not yet timed on a GPU (the per-chunk
# kernel's warps: below). Launched through `common.launch` (the most pipeline
# stages that fit): in float32 the reverse pass's tiles at BV = 64 need 353 KB of shared memory
# with Triton's default stages, over an H200's 227 KB.
# Float32 tiles natively (tf32x3 products) take the reverse pass with 4 warps: with 8, on an H200
# (Triton 3.6, K = V = 128, C = 64, B·H = 8) it faulted or returned wrong state gradients while the
# interpreter was right. Every launch here also follows common.MIN_TILE and common.warps (no tile
# narrower than 32 columns, 8 warps only over tiles at least 64 wide), the rule that narrow tiles
# came under natively.
# The per-chunk kernel takes 64-wide V-blocks for 64- and 128-wide key tiles in bf16/fp16
# (`chunk_block`), so that it runs with 8 warps (`common.warps` allows 8 only over tiles at least 64
# wide): natively (H200, Triton 3.6, bf16, B = 8, T = 4096, H = 16, K = V = 128, chunk 64) it took
# 1.25 ms for DeltaNet and 1.32 ms for KDA, against 2.83 and 3.52 ms with 32-wide blocks and 4 warps
# and 2.56 / 3.27 ms with 64-wide blocks and 4 warps; pipeline stages (1, 2, 3) changed nothing.
# Elsewhere the 64-wide blocks failed the native conformance matrix (H200, Triton 3.6) while the
# 32-wide ones pass it: K = 16 with V ≥ 64 and chunk 64 in fp16 (4 warps: illegal memory accesses,
# dk 0.83 relative), K = 256 with V ≥ 128 and chunks ≤ 32 in bf16 and fp16 (8 warps: dk and dβ
# 7e-2 to inf), every variant; the interpreter is right at both. Float32's tf32x3 tiles keep
# 32-wide blocks (untimed). Packed rows (VARLEN) take the same blocks: natively their gradients
# equal each sequence's alone and float64's at K, V from 64 to 256, bf16/fp16, chunks 32 and 64
# (H200, Triton 3.6: 29 of the 30 cases; KDA in fp16 at chunk 64 was not reached).
TUNING = dict(bv_state=64, bv_chunk=32, bv_chunk_wide=64, warps_state=8, warps_state_f32=4, warps_chunk=8)


def needs_backward(*xs) -> bool:
    """The hand-written backward runs only when autograd will call it."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def apply(q, k, v, g, beta, d, initial_state, output_final_state, C, recompute, seqs=None):
    """(o, final state) through the autograd.Function; the final state exists only if asked for.
    seqs: `gated.Packed` for packed sequences, else None."""
    o, ht = _DeltaFunction.apply(q, k, v, g, beta, initial_state, d, C, bool(output_final_state),
                                 bool(recompute), seqs)
    return o, (ht if output_final_state else None)


class _DeltaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0_in, d, C, output_final_state, recompute, seqs):
        p = plan(q, g, d, C, seqs)
        q, k, v, g, beta = contiguous(q, k, v, g, beta)
        h0 = None if h0_in is None else h0_in.to(torch.float32).contiguous()
        # recompute: the forward frees its intermediates as the plain forward does; keep: the
        # backward reads 𝒯, W, U, the decays, Aqk, (Qs), the states and Ṽ
        wy, hs, vnew, ht = factors_and_states(q, k, v, g, beta, h0, p, output_final_state,
                                              keep=not recompute)
        o = output_stage(q, wy, hs, vnew, p, v.dtype, g)
        ctx.p, ctx.recompute, ctx.has_h0 = p, recompute, h0 is not None
        ctx.dtypes = (None if h0_in is None else h0_in.dtype,)
        ctx.keep = None if recompute else dict(wy, hs=hs, vnew=vnew)
        del wy, hs, vnew
        ctx.save_for_backward(q, k, v, g, beta, h0)
        if ht is None:
            ht = torch.zeros((), dtype=torch.float32, device=q.device)  # a placeholder output
        return o, ht

    @staticmethod
    @first_order("linattn.triton.delta_rule / kda")   # kernels: no graph, a double backward raises
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        keep, ctx.keep = ctx.keep, None                   # kept tensors freed as soon as the backward ends
        dht = dht if dht is not None and dht.dim() == 4 else None
        dq, dk, dv, dg, dbeta, dh0 = backward(q, k, v, g, beta, h0, do, dht, ctx.p, keep=keep)
        dh0 = dh0.to(ctx.dtypes[0]) if ctx.has_h0 else None
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None


def backward(q, k, v, g, beta, h0, do, dht, p, *, keep=None, timer=None):
    """(dq, dk, dv, dg, dβ, dh0 in float32) of the forward planned by p (`delta.plan`); steps 1–4 above.

    keep: what factors_and_states(..., keep=True) returned in the forward (recomputed when None);
    dht: the final state's gradient or None. timer: a dict that receives the milliseconds of each
    stage (chapter 13, tools/bench.py)."""
    with stage(timer, "recompute WY, states"):
        if keep is None:
            wy, hs, vnew, _ = factors_and_states(q, k, v, g, beta, h0, p, False, keep=True)
        else:
            wy, hs, vnew = keep, keep["hs"], keep["vnew"]
    del keep
    do = do.contiguous()
    dht = None if dht is None else dht.to(torch.float32).contiguous()
    with stage(timer, "reverse pass dS"):
        dhs, dvnew, dh0 = dstate_stage(q, g, wy, do, dht, p)
    for name in ("kd", "dl", "aqk", "qg"):                # read by the reverse pass only
        wy.pop(name, None)
    if fused_gates(p, q.dtype):
        with stage(timer, "per-chunk grads, WY, dq, dk, dg, dβ"):
            grads, dv, db_v = dchunk_stage(v, beta, wy, hs, vnew, dhs, dvnew, do, p, g, q=q, k=k)
        return grads["dq"], grads["dk"], dv, grads.get("dg"), db_v.to(beta.dtype), dh0
    with stage(timer, "per-chunk grads, WY"):
        grads, dv, db_v = dchunk_stage(v, beta, wy, hs, vnew, dhs, dvnew, do, p, g)
    del wy, hs, vnew, dhs, dvnew                          # step 4 reads none of them
    with stage(timer, "dq, dk, dg, dβ"):
        dq, dk, dg, db_k = gate_stage(q, k, g, beta, grads, p)
        dbeta = (db_v + db_k.sum(0)).to(beta.dtype)
    return dq, dk, dv, dg, dbeta, dh0


def fused_gates(p, dtype: torch.dtype) -> bool:
    """Whether the per-chunk kernel applies step 4 itself (FUSE): without per-dimension gates
    (DeltaNet, Gated DeltaNet) step 4 needs no K-blocks and no secondary chunking
    (`wy_backward.head_gate_grads`: four products per chunk), and the per-chunk kernel already holds
    every key dim of dQs, dKd, dB_k, dA and dAqk, which then never go to memory ([B, T, H, K] float32
    three times and [B, T, H, C] twice). Half-precision inputs with key tiles up to 128 wide (where
    its V-blocks are wide, `chunk_block`), decided by the dtype so the interpreter takes the native
    path; float32 tiles (tf32x3 products) and 256-wide key tiles keep the separate gate kernel. ptxas
    for sm_90 (offline, K = V = 128, C = 64, spill bytes per thread, separate → fused): bf16 DeltaNet
    256 → 456, Gated DeltaNet 320 → 876; float32 3,332 → 5,012 and 4,140 → 6,972. Timed natively in
    bf16 (H200, H = 16, 32k tokens, forward + backward): DeltaNet 4.01 → 3.54 ms at T = 1k, 6.31 →
    5.83 at 32k; Gated DeltaNet 5.42 → 4.78 and 7.88 → 7.18."""
    return p.gate < 2 and dtype in (torch.bfloat16, torch.float16) and p.BK <= 128


# ---------------------------------------------------------------- host side of steps 2 and 3

def dstate_stage(q, g, wy, do, dht, p):
    """Step 2: dS entering the next chunk for every chunk [B,H,NT,K,V] (in the dtype the forward
    keeps its states in: the largest buffer of the backward), dṼ [B,T,H,V] and dS_0 [B,H,K,V]
    float32 (packed: [N,H,K,V], as dht)."""
    B, T, H, K, V = p.B, p.T, p.H, p.K, p.V
    dhs = outputs.empty((B, H, p.NT, K, V), dtype=p.work, device=p.device)
    dvnew = outputs.empty((B, T, H, V), dtype=torch.float32, device=p.device)
    dh0 = outputs.empty((p.N, H, K, V), dtype=torch.float32, device=p.device)
    BV = tile(V, TUNING["bv_state"])

    def run(two):
        launch(_dstate_kernel, (triton.cdiv(V, BV), p.N * H),
            wy["qg"] if p.gate == 2 else q, g if p.gate == 1 else q, wy["kd"],
            wy["dl"] if p.gate else dh0, wy["w"], wy["aqk"], do,
            dh0 if dht is None else dht, dhs, dvnew, dh0, p.scale, T, p.NT,
            H=H, K=K, V=V, C=p.C, BK=p.BK, BV=BV, GATE=p.gate, DT=p.cdt, IEEE=p.ieee,
            X3=precise(p), TWO=two, HAS_DHT=dht is not None,
            num_warps=warps(TUNING["warps_state_f32" if precise(p) else "warps_state"], BV),
            max_stages=dstate_stages(p), **p.packed("cu_seqlens", "chunk_offsets"))

    two = two_part_state_grads(p)
    try:
        run(two)
    except InputError:
        if not two:
            raise
        # the two parts do not fit this GPU even with one stage (a T4: 96 KB at K = 256, chunk 64,
        # against 64 KB per block); one product each fits, as before they were taken
        run(False)
    return dhs, dvnew, dh0


def two_part_state_grads(p) -> bool:
    """Whether the reverse pass takes the state gradients dS (against Kd) and dṼ (against Wᵀ) as
    two bf16 parts each (`common.dot_split_bf16`): KDA with bf16 inputs. Those two products round
    the gradients that the pass carries from chunk to chunk; one bf16 product each left KDA's
    initial-state gradient 1.07× FLA's worst on the same inputs (H200, conformance case
    kda-strength-067, weak gates, T = 300), two parts bring it to 0.92× (the emulated mode:
    2.53e-3 against FLA's 2.76e-3) and dv, dβ 5–15 % lower too. They cost KDA's pass 0.94 → 1.01 ms
    (H200, bf16, B = 8, T = 4096, H = 16, K = V = 128); DeltaNet's took 0.72 → 1.02 ms, for gradients
    already at 0.85–0.93× FLA's, so DeltaNet and Gated DeltaNet keep one product. fp16 inputs keep
    one product too: KDA's fp16 gradients are at or below 0.81× FLA's, and a two-part fp16 pass
    (tf32 parts) returned wrong gradients natively at K = 64, V = 128, chunk 16. On a GPU whose
    shared memory does not hold the two parts (a T4 at K = 256, tools/arch_check.py),
    `dstate_stage` launches one product each instead."""
    return p.gate == 2 and p.cdt == tl.bfloat16


def dstate_stages(p) -> int:
    """Pipeline stages of the reverse pass: one where the float32 (tf32x3) pass has a padded key tile
    (K < BK) and chunks of 16. Natively (H200, Triton 3.6, float32, K = 16 in a 32-wide tile, chunk
    16, V ≥ 64) the pipelined loop returned state gradients off by 0.1 to 1e18 at every length,
    DeltaNet and KDA, where one stage and the interpreter were right (float64 reference of this pass
    on the same inputs); K = 32, and K = 16 with chunks 32/64, were right pipelined. Not wider: with
    chunk 64 one float32 stage needs 320 KB of shared memory at a 128-wide key tile, more than any GPU
    has, where the pipelined launch fits with 2."""
    return 1 if precise(p) and p.K < p.BK and p.C <= 16 else 3


def dchunk_stage(v, beta, wy, hs, vnew, dhs, dvnew, do, p, g=None, q=None, k=None):
    """Step 3: dict of float32 gradients for step 4 (dqs, dkd, dbk [B,T,H,K]; da, daqk [B,T,H,C];
    ddl [B,H,NT,K]), dv (v's dtype) and the β gradient through U, [B,T,H] float32. Given q and k
    (`fused_gates`), step 4 too: the dict holds dq, dk (their dtypes) and, for a per-head gate, dg
    (g's dtype), and the β gradient is the whole of it."""
    B, T, H, K, V = p.B, p.T, p.H, p.K, p.V
    f32 = dict(dtype=torch.float32, device=p.device)
    fuse = q is not None
    if fuse:
        grads = dict(dq=outputs.empty((B, T, H, K), dtype=q.dtype, device=p.device),
                     dk=outputs.empty((B, T, H, K), dtype=k.dtype, device=p.device))
        if p.gate == 1:
            grads["dg"] = outputs.empty((B, T, H), dtype=g.dtype, device=p.device)
    else:
        grads = {name: outputs.empty((B, T, H, K), **f32) for name in ("dqs", "dkd", "dbk")}
        grads.update(da=outputs.empty((B, T, H, p.C), **f32), daqk=outputs.empty((B, T, H, p.C), **f32),
                     ddl=outputs.empty((B, H, p.NT, K), **f32))
    dv = outputs.empty((B, T, H, V), dtype=v.dtype, device=p.device)
    db_v = outputs.empty((B, T, H), **f32)

    def out(name):                  # the outputs of the other form: a pointer no program touches
        return grads.get(name, db_v)

    def run(BV):
        launch(_dchunk_kernel, (p.NT, B * H),
            q if fuse else v, k if fuse else v, v, g if p.gate == 1 else beta, beta, wy["ai"], wy["u"], wy["w"],
            hs, vnew, dhs, dvnew, do, *map(out, ("dq", "dk", "dg", "dqs", "dkd", "dbk", "ddl", "da", "daqk")),
            dv, db_v, p.scale, T, p.NT, H=H, K=K, V=V, C=p.C, BK=p.BK, BV=BV, GATE=p.gate, DT=p.cdt,
            IEEE=p.ieee, X3=precise(p), FUSE=fuse, num_warps=warps(TUNING["warps_chunk"], p.BK, BV),
            **p.packed("cu_seqlens", "chunk_indices"))

    BV, narrow = chunk_block(p), chunk_block(p, narrow=True)
    try:
        run(BV)
    except InputError:
        if BV == narrow:
            raise
        # the wide blocks do not fit this GPU even with one stage (a T4: 80 KB at K = V = 128,
        # chunk 64, against 64 KB per block); the narrow ones did before this launch was widened
        run(narrow)
    return grads, dv, db_v


def chunk_block(p, narrow: bool = False) -> int:
    """V-block of the per-chunk kernel: 64 wide only where natively verified (TUNING's comment),
    for packed rows (their compiled variant, VARLEN) as for unpacked ones
    (tests/test_triton_packing.py's native cases at model head dims); where those do not fit the
    GPU, `dchunk_stage` launches the 32-wide ones (narrow=True) instead."""
    wide = not narrow and not precise(p) and 64 <= p.BK <= 128
    return tile(p.V, TUNING["bv_chunk_wide" if wide else "bv_chunk"])


# ---------------------------------------------------------------- kernels

@triton.jit
def _carried(a, b, DT: tl.constexpr, IEEE: tl.constexpr, X3: tl.constexpr, TWO: tl.constexpr):
    """a @ b in the reverse pass for b a state gradient it carries from chunk to chunk (dS, dṼ):
    b in two bf16 parts where TWO (`two_part_state_grads`), else `mm`."""
    if TWO:
        return dot_split_bf16(a, b)
    return mm(a, b, DT, IEEE, X3)


@kernel
def _dstate_kernel(qs, g, kd, dl, w, aqk, do, dht, dhs, dvnew, dh0, scale, T, NT, H,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, GATE: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
                   X3: tl.constexpr, TWO: tl.constexpr, HAS_DHT: tl.constexpr, cu_seqlens=None, chunk_offsets=None,
                   VARLEN: tl.constexpr = False):
    iv, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    NT_n = NT                                       # this program's chunks
    if VARLEN:
        # packed (B = 1, NT the row's chunks): program bh = (sequence b, head h), dht and dh0
        # [N, H, K, V]; dhs [1, H, NT, K, V] and dl [1, H, NT, K] hold this sequence's NT_n chunks
        # from chunk_offsets[b] on. Then bh = h indexes the row's head h in each.
        bos, T = _packed_seq(cu_seqlens, b)
        qs, g, kd, w, aqk = qs + bos * H * K, g + bos * H, kd + bos * H * K, w + bos * H * K, aqk + bos * H * C
        do, dvnew = do + bos * H * V, dvnew + bos * H * V
        c0 = tl.load(chunk_offsets + b)
        dhs, dl = dhs + c0 * K * V, dl + c0 * K
        dht, dh0 = dht + b.to(tl.int64) * H * K * V, dh0 + b.to(tl.int64) * H * K * V
        NT_n = tl.cdiv(T, C)
        bh, b = h, 0
    dk = tl.arange(0, BK)
    dv = iv * BV + tl.arange(0, BV)
    ms = (dk[:, None] < K) & (dv[None, :] < V)
    offs = dk[:, None] * V + dv[None, :]                                          # [BK, BV]
    dS = tl.zeros((BK, BV), dtype=tl.float32)                                     # dS_{n+1}
    if HAS_DHT:
        dS = tl.load(dht + bh.to(tl.int64) * K * V + offs, mask=ms, other=0.0)
    jc = tl.arange(0, C)
    row = jc * H
    for i in range(NT_n):
        n = NT_n - 1 - i
        # the gradient of the state leaving chunk n, for step 3
        tl.store(dhs + (bh.to(tl.int64) * NT + n) * K * V + offs, dS.to(dhs.dtype.element_ty), mask=ms)
        tm = n * C + jc < T
        r0 = (b * T + n * C).to(tl.int64) * H + h
        mk = tm[:, None] & (dk[None, :] < K)
        mv = tm[:, None] & (dv[None, :] < V)
        offv = r0 * V + (row[:, None] * V + dv[None, :])                          # [C, BV]
        offk = r0 * K + (row[:, None] * K + dk[None, :])                          # [C, BK]
        dOt = tl.load(do + offv, mask=mv, other=0.0).to(tl.float32)               # [C, BV]
        Aqk = tl.load(aqk + r0 * C + (row[:, None] * C + jc[None, :]), mask=tm[:, None],
                      other=0.0).to(tl.float32)                                   # [C, C]
        kt = tl.load(kd + offk, mask=mk, other=0.0).to(tl.float32)                # [C, BK] Kd
        qt = tl.load(qs + offk, mask=mk, other=0.0).to(tl.float32)                # [C, BK] Qs
        if GATE == 1:   # as the output stage: e^{G − G_0} of a per-head gate, the gates after the first
            G1 = tl.cumsum(tl.where(jc == 0, 0.0, gate_floor(tl.load(g + r0 + row, mask=tm, other=0.0))),
                           axis=0)
            qt = qt * tl.exp(G1)[:, None]
        Wt = tl.load(w + offk, mask=mk, other=0.0).to(tl.float32)                 # [C, BK]
        dVt = mm(tl.trans(Aqk), dOt, DT, IEEE, X3) + _carried(kt, dS, DT, IEEE, X3, TWO)   # [C, BV] dṼ
        tl.store(dvnew + offv, dVt, mask=mv)
        if GATE > 0:
            dS = dS * tl.load(dl + (bh.to(tl.int64) * NT + n) * K + dk, mask=dk < K, other=0.0)[:, None]
        # Qsᵀ dO: the scale after the product (as the output stage), so that without a gate the
        # product reads the queries as given; rounding scale · q into the operand made the initial
        # state's gradient up to 1.2x less precise than FLA's
        QdO = mm(tl.trans(qt), dOt, DT, IEEE, X3)                                 # [BK, BV]
        if GATE < 2:
            QdO = QdO * scale
        dSn = QdO - _carried(tl.trans(Wt), dVt, DT, IEEE, X3, TWO)                # [BK, BV]
        if GATE == 1:
            dSn = dSn * first_gate(g, r0)        # Qs and W from the chunk's first token (wy.py)
        dS += dSn                                                                 # dS_n
    tl.store(dh0 + bh.to(tl.int64) * K * V + offs, dS, mask=ms)


@kernel
def _dchunk_kernel(q, k, v, g, beta, ai, u, w, hs, vnew, dhs, dvnew, do, dq_out, dk_out, dg_out, dqs, dkd, dbk, ddl,
                   da, daqk, dv_out, db_v, scale, T, NT, H, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                   DT: tl.constexpr, IEEE: tl.constexpr, X3: tl.constexpr, FUSE: tl.constexpr,
                   cu_seqlens=None, chunk_indices=None, VARLEN: tl.constexpr = False):
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    nc = n                  # hs's, dhs's and ddl's chunk (packed: the row's)
    if VARLEN:              # packed (B = 1): the row's chunk n is chunk n of its sequence
        n, bos, T = _packed_chunk(cu_seqlens, chunk_indices, n)
        rk, rv, rc = bos * H * K, bos * H * V, bos * H * C
        v, g, beta, ai, u, w, vnew = v + rv, g + bos * H, beta + bos * H, ai + rc, u + rv, w + rk, vnew + rv
        dvnew, do, dqs, dkd, dbk, da, daqk = dvnew + rv, do + rv, dqs + rk, dkd + rk, dbk + rk, da + rc, daqk + rc
        dv_out, db_v = dv_out + rv, db_v + bos * H
        q, k, dq_out, dk_out, dg_out = q + rk, k + rk, dq_out + rk, dk_out + rk, dg_out + bos * H
    jc = tl.arange(0, C)
    tm = n * C + jc < T
    r0 = (b * T + n * C).to(tl.int64) * H + h
    row = jc * H
    dk = tl.arange(0, BK)
    mk = tm[:, None] & (dk[None, :] < K)
    offk = r0 * K + (row[:, None] * K + dk[None, :])                              # [C, BK]
    offc = r0 * C + (row[:, None] * C + jc[None, :])                              # [C, C]
    Ti = tl.load(ai + offc, mask=tm[:, None], other=0.0)                          # [C, C] 𝒯, float32
    bt = tl.load(beta + r0 + row, mask=tm, other=0.0).to(tl.float32)              # [C]
    st = (bh.to(tl.int64) * NT + nc) * K * V                                      # S_n, dS_{n+1}
    dQs = tl.zeros((C, BK), dtype=tl.float32)
    dKd = tl.zeros((C, BK), dtype=tl.float32)
    dW = tl.zeros((C, BK), dtype=tl.float32)
    dDl = tl.zeros((BK,), dtype=tl.float32)
    dAqk = tl.zeros((C, C), dtype=tl.float32)
    dA = tl.zeros((C, C), dtype=tl.float32)                                       # Σ_v dB_v Uᵀ so far
    dbv = tl.zeros((C,), dtype=tl.float32)
    for iv in range((V + BV - 1) // BV):
        dv = iv * BV + tl.arange(0, BV)
        mv = tm[:, None] & (dv[None, :] < V)
        ms = (dk[:, None] < K) & (dv[None, :] < V)
        offv = r0 * V + (row[:, None] * V + dv[None, :])                          # [C, BV]
        offs = st + dk[:, None] * V + dv[None, :]                                 # [BK, BV]
        dOt = tl.load(do + offv, mask=mv, other=0.0).to(tl.float32)
        Vt = tl.load(vnew + offv, mask=mv, other=0.0).to(tl.float32)              # Ṽ
        dVt = tl.load(dvnew + offv, mask=mv, other=0.0)                           # dṼ
        Ut = tl.load(u + offv, mask=mv, other=0.0).to(tl.float32)
        vt = tl.load(v + offv, mask=mv, other=0.0).to(tl.float32)
        S = tl.load(hs + offs, mask=ms, other=0.0).to(tl.float32)                 # [BK, BV]
        dS = tl.load(dhs + offs, mask=ms, other=0.0).to(tl.float32)
        dQs += mm(dOt, tl.trans(S), DT, IEEE, X3)                                    # [C, BK]
        dKd += mm(Vt, tl.trans(dS), DT, IEEE, X3)
        dW -= mm(dVt, tl.trans(S), DT, IEEE, X3)
        dDl += tl.sum(S * dS, axis=1)
        dAqk += mm(dOt, tl.trans(Vt), DT, IEEE, X3)                                  # [C, C]
        dBv = mm(tl.trans(Ti), dVt, DT, IEEE, X3)                                    # [C, BV] 𝒯ᵀ dU
        tl.store(dv_out + offv, (dBv * bt[:, None]).to(dv_out.dtype.element_ty), mask=mv)
        dbv += tl.sum(dBv * vt, axis=1)
        dA += mm(dBv, tl.trans(Ut), DT, IEEE, X3)
    dBk = mm(tl.trans(Ti), dW, DT, IEEE, X3)                                         # [C, BK] 𝒯ᵀ dW
    Wt = tl.load(w + offk, mask=mk, other=0.0).to(tl.float32)
    dBW = mm(dBk, tl.trans(Wt), DT, IEEE, X3)                                        # [C, C]
    if GATE == 1:
        dBW = dBW * first_gate(g, r0)            # W = e^{G_0} W̃ (wy.py)
    dA = -(dA + dBW)
    dA = tl.where(jc[:, None] > jc[None, :], dA, 0.0)
    dAqk = tl.where(jc[:, None] >= jc[None, :], dAqk, 0.0)
    if FUSE:        # step 4 here (`fused_gates`): the chain rule through the scores and the per-head gate
        qt = tl.load(q + offk, mask=mk, other=0.0)                                # [C, BK] as given
        kt = tl.load(k + offk, mask=mk, other=0.0)
        nxt = (n * C + jc + 1 < T) & (jc < C - 1)
        dbt, dg1 = head_gate_grads(qt, kt, bt, g + r0, row, tm, nxt, mk, dAqk * scale, dA, dQs, dKd, dBk,
                                   dDl, scale, H, dq_out + offk, dk_out + offk, GATE, DT, IEEE, X3)
        tl.store(db_v + r0 + row, dbv + dbt, mask=tm)
        if GATE == 1:
            tl.store(dg_out + r0 + row, dg1.to(dg_out.dtype.element_ty), mask=tm)
    else:
        tl.store(dqs + offk, dQs, mask=mk)
        tl.store(dkd + offk, dKd, mask=mk)
        tl.store(dbk + offk, dBk, mask=mk)
        tl.store(da + offc, dA, mask=tm[:, None])
        tl.store(daqk + offc, dAqk, mask=tm[:, None])
        tl.store(db_v + r0 + row, dbv, mask=tm)
        if GATE > 0:
            tl.store(ddl + (bh.to(tl.int64) * NT + nc) * K + dk, dDl, mask=dk < K)
