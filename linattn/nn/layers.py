"""The attention layers of chapter 14: one skeleton, five memories.

    x [B, T, d] ─ proj ─ short conv ─ q, k, v [B, T, H, ·] ─ op(q, k, v, g, β; S₀) ─ norm per head
                                                                ─ ⊙ swish(x W_r) ─ W_o ─ y [B, T, d]

The layers differ only in the operation and in what they compute from x besides q, k, v:

    LinearAttention        S ← S + kᵀv
    GatedLinearAttention   S ← diag(α) S + kᵀv,  log α from the GLA paper's low-rank gate (gates.py)
    DeltaNet               S ← S + β kᵀ(v − kS),          β = σ(x W_β), q and k L2-normalised
    GatedDeltaNet          the same after S ← α S, one α per head
    KimiDeltaAttention     the same after S ← diag(α) S, one α per key dimension (KDA)

`forward(x, state=None) -> (y, state)`: a whole sequence goes through the chunkwise operation via the
dispatcher (impl="auto": Triton on CUDA, chunk on the CPU; `impl=` overrides); a single token goes
through the one-token step (linattn.naive.step; the fused Triton step on CUDA at inference). Both
start from the state passed in and return the state after the last token, so a prompt (prefill) and
the tokens generated after it (decode) are the same computation cut at different places.

`forward(x, state=None, cu_seqlens=None)`: with cu_seqlens (linattn.packing) x [1, T, d] holds N
sequences back to back. The projections are per token; the short convolution and the operation
take the boundaries, so each sequence is computed as if alone, and the state returned is one per
sequence ([N, H, K, V] and [N, w−1, C]): the state a batched decode step of N rows continues from.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import dispatch, naive, ops
from ..validate import InputError
from .conv import ShortConv
from .gates import TAU, LogGate
from .state import LayerState, check_packed, check_state, check_x, new_owner


class RecurrentLayer(nn.Module):
    """The shared skeleton. Subclasses set `op` and `extras(x, q, k) -> (q, k, args)`."""

    op = "linear_attn"
    norm_cls = nn.RMSNorm

    def __init__(self, d_model: int, n_heads: int, *, head_k: int | None = None,
                 head_v: int | None = None, conv_width: int = 4, impl: str = "auto"):
        super().__init__()
        if d_model % n_heads:
            raise InputError(f"n_heads = {n_heads} must divide d_model = {d_model}")
        dispatch._check(self.op, impl)
        self.d_model, self.n_heads, self.impl = d_model, n_heads, impl
        self.head_k = head_k or d_model // n_heads
        self.head_v = head_v or d_model // n_heads
        K, V = n_heads * self.head_k, n_heads * self.head_v
        self.qkv = nn.Linear(d_model, 2 * K + V, bias=False)
        self.conv = ShortConv(2 * K + V, conv_width) if conv_width > 1 else None
        self.norm = self.norm_cls(self.head_v)                       # per head, shared weights
        self.out_gate = nn.Linear(d_model, V)                         # R_t = swish(x W_r + b_r)
        self.out = nn.Linear(V, d_model, bias=False)
        self.owner = new_owner()

    def state_size(self) -> int:
        """Numbers in the recurrent state per sequence: H · K · V (the short-conv cache aside)."""
        return self.n_heads * self.head_k * self.head_v

    def extras(self, x, q, k):
        return q, k, ()

    def forward(self, x, state: LayerState | None = None, cu_seqlens=None):
        check_x(x, self.d_model)
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_k, self.head_v
        check_packed(cu_seqlens, x, (H, K, V))
        check_state(state, self.owner, x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1,
                    packed=cu_seqlens is not None)
        qkv = self.qkv(x)                                             # [B, T, 2HK + HV]
        conv_cache = None
        if self.conv is not None:
            qkv, conv_cache = self.conv(qkv, state.conv if state else None, cu_seqlens)
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        q, k, v = q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), v.unflatten(-1, (H, V))
        q, k, args = self.extras(x, q, k)
        S0 = state.memory if state else None
        o, S = self.run(q, k, v, args, S0) if cu_seqlens is None else \
            self.run_packed(q, k, v, args, S0, cu_seqlens)               # o [B, T, H, V]
        o = self.norm(o).flatten(-2) * F.silu(self.out_gate(x))
        seen = (state.seen if state else 0) + T
        return self.out(o.to(x.dtype)), LayerState(S, conv_cache, self.owner, seen)

    def run(self, q, k, v, args, S0):
        """o [B, T, H, V], S [B, H, K, V]: one token by the step, a sequence by the chunked op."""
        if q.shape[1] == 1:
            o, S = self.step(q[:, 0], k[:, 0], v[:, 0], [a[:, 0] for a in args], S0)
            return o[:, None], S
        return dispatch.call(self.op, self.impl, (q, k, v, *args),
                             {"initial_state": S0, "output_final_state": True})

    def run_packed(self, q, k, v, args, S0, cu_seqlens):
        """o [1, T, H, V], S [N, H, K, V]: always by the chunked op, even for T = 1 (one packed
        token may be a whole sequence, with empty ones beside it)."""
        return dispatch.call(self.op, self.impl, (q, k, v, *args), {
            "initial_state": S0, "output_final_state": True, "cu_seqlens": cu_seqlens})

    def step(self, q, k, v, args, S0):
        if torch.compiler.is_compiling():
            # one node of the compiled graph (dynamo cannot trace the step's value checks); the
            # custom op runs the same step as below
            level = "triton" if self.fused_step(q, k, v, S0, *args) else "naive"
            return ops.call(self.op + "_step", (q, k, v, *args), state=S0, level=level)
        if self.fused_step(q, k, v, S0, *args):
            from ..triton import step as fused

            return getattr(fused, self.op + "_step")(q, k, v, *args, S0)
        return getattr(naive, self.op + "_step")(q, k, v, *args, S0)

    def fused_step(self, q, *tensors) -> bool:
        """Whether a token goes through the fused Triton step: on CUDA, when nothing needs a
        gradient (it has no backward: decoding is inference). Otherwise the naive step, which is
        plain torch and trains like the rest."""
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, *tensors))
        return q.is_cuda and not needs_grad and self.impl in ("auto", "triton")


class LinearAttention(RecurrentLayer):
    op = "linear_attn"


class GatedLinearAttention(RecurrentLayer):
    """The GLA paper's layer: per-dimension gate α = σ(x W₁ W₂ + b)^{1/τ} (log space, τ = 16),
    LayerNorm per head, swish output gate. The paper uses d_k = d/2 (`head_k`), d_v = d."""

    op = "gla"
    norm_cls = nn.LayerNorm

    def __init__(self, d_model, n_heads, *, tau: float = TAU, gate_rank: int = 16, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.gate = LogGate(d_model, n_heads, self.head_k, per_dim=True, rank=gate_rank, tau=tau)

    def extras(self, x, q, k):
        return q, k, (self.gate(x).to(q.dtype),)


class DeltaNet(RecurrentLayer):
    """DeltaNet: β = σ(x W_β) per head; q and k L2-normalised (the delta rule needs ‖k‖ = 1)."""

    op = "delta_rule"

    def __init__(self, d_model, n_heads, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.beta = nn.Linear(d_model, n_heads)

    def extras(self, x, q, k):
        beta = torch.sigmoid(self.beta(x)).to(q.dtype)                # [B, T, H] in (0, 1)
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), self.gates(x, q) + (beta,)

    def gates(self, x, q):
        return ()


class KimiDeltaAttention(DeltaNet):
    """KDA: the delta rule after a per-key-dimension decay diag(α_t) (the GLA gate, log space).
    `per_head_gate=True` gives Gated DeltaNet: one decay per head."""

    op = "kda"

    def __init__(self, d_model, n_heads, *, per_head_gate: bool = False, tau: float = TAU,
                 gate_rank: int = 16, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.gate = LogGate(d_model, n_heads, self.head_k, per_dim=not per_head_gate,
                            rank=gate_rank, tau=tau)

    def gates(self, x, q):
        return (self.gate(x).to(q.dtype),)


class GatedDeltaNet(KimiDeltaAttention):
    """Gated DeltaNet: KimiDeltaAttention with one decay per head."""

    def __init__(self, d_model, n_heads, **kw):
        super().__init__(d_model, n_heads, per_head_gate=True, **kw)
