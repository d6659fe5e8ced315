"""Softmax attention with a KV cache: the baseline of chapters 14 and 15.

The same skeleton as the recurrent layers (projection, short convolution, per-head norm, swish
output gate), with `torch.nn.functional.scaled_dot_product_attention` as the memory. Its state is
the cache of every key and value seen so far, [B, H, L, K] and [B, H, L, V]: it grows by one row per
generated token, where a recurrent layer's state stays H·K·V numbers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..validate import InputError
from .conv import ShortConv
from .state import LayerState, check_state, check_x, new_owner


class SoftmaxAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, *, conv_width: int = 4, **_ignored):
        super().__init__()
        if d_model % n_heads:
            raise InputError(f"n_heads = {n_heads} must divide d_model = {d_model}")
        self.d_model, self.n_heads, self.head = d_model, n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.conv = ShortConv(3 * d_model, conv_width) if conv_width > 1 else None
        self.norm = nn.RMSNorm(self.head)
        self.out_gate = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.owner = new_owner()

    def state_size(self, length: int) -> int:
        """Numbers in the KV cache per sequence after `length` tokens: 2 · L · d."""
        return 2 * length * self.d_model

    def forward(self, x, state: LayerState | None = None, cu_seqlens=None):
        if cu_seqlens is not None:
            # a packed row would need a block-diagonal causal mask, and its KV caches (of unequal
            # lengths) a padded layout for decoding; refused rather than attending across documents
            raise InputError("cu_seqlens: SoftmaxAttention does not take packed sequences; pad the "
                             "batch to [B, T, d] instead (the recurrent layers of linattn.nn take it)")
        check_x(x, self.d_model)
        check_state(state, self.owner, x.shape[0])
        B, T, _ = x.shape
        qkv = self.qkv(x)
        conv_cache = None
        if self.conv is not None:
            qkv, conv_cache = self.conv(qkv, state.conv if state else None)
            # The convolution's output is a transposed view (time has unit stride): SDPA's flash
            # kernel on the CPU needs unit stride in the head dimension, else it falls back to the
            # math kernel, which materialises all B·H·T² scores. One copy of qkv fixes it.
            qkv = qkv.contiguous()
        q, k, v = (t.unflatten(-1, (self.n_heads, self.head)).transpose(1, 2)  # [B, H, T, D]
                   for t in qkv.chunk(3, dim=-1))
        past = state.seen if state else 0
        if state is not None:
            k = torch.cat([state.memory, k], dim=2)                   # [B, H, past + T, D]
            v = torch.cat([state.values, v], dim=2)
        # No cache: SDPA's own causal flag (the flash kernels, O(T) memory); an explicit [T, T] mask
        # would send a long prefill to the math kernel, which materialises B·H·T² scores.
        mask = _causal(T, past, x.device) if past else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not past and T > 1)
        o = self.norm(o.transpose(1, 2)).flatten(-2) * F.silu(self.out_gate(x))
        return self.out(o), LayerState(k, conv_cache, self.owner, past + T, values=v)


def _causal(T, past, device):
    # Query i (at absolute position past + i) sees keys 0 … past + i. SDPA's is_causal aligns the
    # mask top-left, which is wrong once a cache precedes the queries; None: no mask for one token.
    if T == 1:
        return None
    i = torch.arange(T, device=device)[:, None] + past
    return torch.arange(past + T, device=device)[None, :] <= i       # [T, past + T]
