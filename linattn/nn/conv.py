"""A short causal depthwise convolution over time, with the cache that decoding needs.

Every recurrent layer of the book (and the softmax baseline) mixes each position with its few
predecessors before the attention: y_t = Σ_{i<w} W_i ⊙ x_{t−i}. It gives the layer a cheap notion of
"the previous token", which associative recall needs (bind a key to the value that follows it).
To continue a sequence it needs the last w − 1 inputs: that cache is part of the layer's state.

Packed sequences (`cu_seqlens`, linattn.packing): the window must not reach back across a boundary.
Each sequence's window starts in its own cache (zeros for a fresh sequence), so every output equals
that of the sequence convolved alone, and each sequence gets its own cache back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..validate import InputError


class ShortConv(nn.Module):
    def __init__(self, channels: int, width: int = 4):
        super().__init__()
        if not (isinstance(width, int) and width >= 2):
            raise InputError(f"conv_width must be an int ≥ 2 (or ≤ 1 for no convolution), got {width!r}")
        self.width = width
        self.conv = nn.Conv1d(channels, channels, width, groups=channels, bias=False)

    def forward(self, x, cache=None, cu_seqlens=None):
        """x [B, T, C], cache [B, w−1, C] or None (zeros: the sequence starts here).
        Returns (SiLU(conv(x)) [B, T, C], the new cache [B, w−1, C]).
        With cu_seqlens (x [1, T, C] packed, N sequences) the cache is one per sequence, [N, w−1, C]."""
        if cu_seqlens is not None:
            return self.packed(x, cu_seqlens, cache)
        B, T, C = x.shape
        if cache is None:
            cache = x.new_zeros(B, self.width - 1, C)
        full = torch.cat([cache.to(x.dtype), x], dim=1)                # [B, w−1+T, C]
        y = F.conv1d(full.transpose(1, 2), self.conv.weight, groups=C)  # [B, C, T]: causal by the left pad
        return F.silu(y.transpose(1, 2)), full[:, -(self.width - 1):]

    def packed(self, x, cu_seqlens, cache=None):
        """The convolution of each packed sequence alone, as one gather (no loop over sequences, no
        read of cu_seqlens to the host: it compiles into one graph).

        Every tap reads from `src`, the N caches followed by the row: a position inside its own
        sequence reads the row, one before the sequence's start reads that sequence's cache."""
        _, T, C = x.shape
        P, N = self.width - 1, cu_seqlens.shape[0] - 1
        if cache is None:
            cache = x.new_zeros(N, P, C)
        src = torch.cat([cache.to(x.dtype).reshape(N * P, C), x[0]])   # [N·P + T, C]
        t = torch.arange(T, device=x.device)
        seq = torch.searchsorted(cu_seqlens, t, right=True) - 1         # the sequence of each token
        taps = torch.arange(-P, 1, device=x.device)                     # w taps, oldest first
        window = _gather(src, seq, cu_seqlens, t[:, None] + taps, P)  # [T, w, C]
        y = (window * self.conv.weight[:, 0].T).sum(1)                  # weight [C, 1, w] → [w, C]
        # new cache: each sequence's last w − 1 positions (its old cache shows through when shorter)
        n = torch.arange(N, device=x.device)
        last = cu_seqlens[1:, None] + torch.arange(-P, 0, device=x.device)  # [N, w−1]
        return F.silu(y)[None], _gather(src, n, cu_seqlens, last, P)


def _gather(src, seq, cu_seqlens, pos, P):
    """src rows for positions `pos` [M, j] of sequences `seq` [M] (caches of P rows each): the row
    itself inside the sequence, else the cache row of that sequence that sits start − p before
    the cache's end."""
    N = cu_seqlens.shape[0] - 1
    seq = seq.clamp(0, N - 1)
    start = cu_seqlens[seq][:, None]
    index = torch.where(pos >= start, N * P + pos, seq[:, None] * P + P - (start - pos))
    # clamped: a malformed cu_seqlens under torch.compile (where the layer's host-side check is
    # skipped) must reach the operation's own check rather than fail here on an index
    return src[index.clamp(0, src.shape[0] - 1)]
