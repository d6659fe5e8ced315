"""A short causal depthwise convolution over time, with the cache that decoding needs.

Every recurrent layer of the book (and the softmax baseline) mixes each position with its few
predecessors before the attention: y_t = Σ_{i<w} W_i ⊙ x_{t−i}. It gives the layer a cheap notion of
"the previous token", which associative recall needs (bind a key to the value that follows it).
To continue a sequence it needs the last w − 1 inputs: that cache is part of the layer's state.
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

    def forward(self, x, cache=None):
        """x [B, T, C], cache [B, w−1, C] or None (zeros: the sequence starts here).
        Returns (SiLU(conv(x)) [B, T, C], the new cache [B, w−1, C])."""
        B, T, C = x.shape
        if cache is None:
            cache = x.new_zeros(B, self.width - 1, C)
        full = torch.cat([cache.to(x.dtype), x], dim=1)                # [B, w−1+T, C]
        y = F.conv1d(full.transpose(1, 2), self.conv.weight, groups=C)  # [B, C, T]: causal by the left pad
        return F.silu(y.transpose(1, 2)), full[:, -(self.width - 1):]
