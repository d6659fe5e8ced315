"""The decoding step fused into one Triton kernel: decay, delta-rule correction, write, read.

Generating one token per sequence is memory-bound: the work is reading the state S [B, H, K, V]
once and writing it once. Run as PyTorch operations (linattn.naive.step) the same step reads and
writes S several times (decay, residual, update, read-out) and launches a kernel for each. The fused
kernel loads a block of S into registers, does everything there, and stores it back:

    S ← diag(exp g) S                 (gla, kda; g per head or per key dimension)
    r = v − k S                       (delta rule: the residual against the decayed state)
    S ← S + β kᵀ r   or   S + kᵀ v
    o = scale · q S

One program per (batch·head, block of V columns): column j of S is updated from column j alone
(the residual r_j = v_j − k·S[:, j] needs only that column), so splitting V is exact and gives the
GPU B·H·V/BV independent programs even at batch 1.

Same signatures and results as linattn.naive.step (one token: q, k [B, H, K]; v [B, H, V];
g [B, H] or [B, H, K]; beta [B, H]; state [B, H, K, V] float32 or None), plus `inplace=True` to
write the new state over the one passed in (no allocation per token). Inference only: inputs that
require grad are refused (there is no backward; train through the whole-sequence path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import outputs
from ..naive.step import check_step
from ..validate import InputError, refuse_grad
from .common import check_kernel_inputs, kernel

BLOCK_V = 64  # columns per program: S block of K × 64 float32 stays in registers for K ≤ 128


def linear_attn_step(q, k, v, state=None, *, scale=None, inplace=False):
    return _step("linear_attn", q, k, v, None, None, state, scale, inplace)


def gla_step(q, k, v, g, state=None, *, scale=None, inplace=False):
    return _step("gla", q, k, v, g, None, state, scale, inplace)


def delta_rule_step(q, k, v, beta, state=None, *, scale=None, inplace=False):
    return _step("delta_rule", q, k, v, None, beta, state, scale, inplace)


def kda_step(q, k, v, g, beta, state=None, *, scale=None, inplace=False):
    return _step("kda", q, k, v, g, beta, state, scale, inplace)


def _step(op, q, k, v, g, beta, state, scale, inplace):
    d = check_step(q, k, v, state, scale, g=g, beta=beta)
    refuse_grad(f"linattn.triton.{op}_step", q=q, k=k, v=v, g=g, beta=beta, state=state)
    check_kernel_inputs(q)
    if inplace and (state is None or state.dtype != torch.float32 or not state.is_contiguous()):
        raise InputError("state: inplace=True needs a contiguous float32 state to write into")
    q, k, v = (x.contiguous() for x in (q, k, v))
    g = None if g is None else g.float().contiguous()
    beta = None if beta is None else beta.float().contiguous()
    s0 = None if state is None else state.float().contiguous()
    s1 = state if inplace else outputs.empty((d.B, d.H, d.K, d.V), dtype=torch.float32, device=q.device)
    o = outputs.empty((d.B, d.H, d.V), dtype=v.dtype, device=q.device)
    BV = min(BLOCK_V, triton.next_power_of_2(d.V))
    gate = 0 if g is None else (1 if g.dim() == 2 else 2)
    dummy = q                                                          # never read: a constexpr says so
    _step_kernel[(d.B * d.H, triton.cdiv(d.V, BV))](
        q, k, v, dummy if g is None else g, dummy if beta is None else beta,
        dummy if s0 is None else s0, s1, o, d.scale,
        K=d.K, V=d.V, BK=triton.next_power_of_2(d.K), BV=BV,
        HAS_S0=s0 is not None, GATE=gate, DELTA=beta is not None)
    return o, s1


@kernel
def _step_kernel(q, k, v, g, beta, s0, s1, o, scale, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr, GATE: tl.constexpr,
                 DELTA: tl.constexpr):
    bh = tl.program_id(0)                                              # batch · head
    rk = tl.arange(0, BK)                                              # key rows (all of them)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)                      # this program's value columns
    mk, mv = rk < K, rv < V
    m = mk[:, None] & mv[None, :]
    b_q = tl.load(q + bh * K + rk, mask=mk, other=0.0).to(tl.float32)  # [BK]
    b_k = tl.load(k + bh * K + rk, mask=mk, other=0.0).to(tl.float32)  # [BK]
    b_v = tl.load(v + bh * V + rv, mask=mv, other=0.0).to(tl.float32)  # [BV]
    p_s = bh * K * V + rk[:, None] * V + rv[None, :]                   # [BK, BV] offsets into S
    if HAS_S0:
        S = tl.load(s0 + p_s, mask=m, other=0.0)                       # [BK, BV] float32
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    if GATE == 1:                                                      # one decay per head
        S = S * tl.exp(tl.load(g + bh))
    if GATE == 2:                                                      # one decay per key row
        S = S * tl.exp(tl.load(g + bh * K + rk, mask=mk, other=0.0))[:, None]
    if DELTA:
        r = b_v - tl.sum(b_k[:, None] * S, axis=0)                     # [BV] residual v − k S
        S = S + tl.load(beta + bh) * b_k[:, None] * r[None, :]
    else:
        S = S + b_k[:, None] * b_v[None, :]
    b_o = scale * tl.sum(b_q[:, None] * S, axis=0)                     # [BV]
    tl.store(s1 + p_s, S, mask=m)
    tl.store(o + bh * V + rv, b_o.to(o.dtype.element_ty), mask=mv)
