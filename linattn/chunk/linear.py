"""Chunkwise linear attention: exact, with matmuls only.

Split T into chunks of C tokens. Inside a chunk the output is a small masked attention; everything
before the chunk reaches it through the state S carried from chunk to chunk:
    O_[n] = scale · (Q_[n] S_[n-1] + (Q_[n] K_[n]ᵀ ⊙ M) V_[n]),   S_[n] = S_[n-1] + K_[n]ᵀ V_[n].
The last chunk may be shorter than C (any T works).

With grad enabled and an input that requires it, the chunkwise forward and hand-written backward
of `linattn.chunk.gla_backward` run with no gate (the same algebra with every decay equal to 1);
recompute=True recomputes the chunk states in the backward, False keeps them from the forward.
"""
from __future__ import annotations

import torch

from .. import outputs
from ..naive.linear import initial
from ..validate import check_chunk, check_inputs
from .gated import ChunkwiseGated, Plan, needs_grad


def linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
                recompute=True):
    d = check_inputs(q, k, v, scale=scale, initial_state=initial_state)
    check_chunk(chunk_size)
    if needs_grad(q, k, v, initial_state):
        C = min(chunk_size, d.T)                                       # no padding past a short T
        # operands are not rounded to the input dtype here, as in the loop below
        o, S = ChunkwiseGated.apply(q, k, v, None, initial_state, Plan(d, C, C, d.acc, bool(recompute)))
        return o, (S if output_final_state else None)
    q, k, v_ = (x.to(d.acc).transpose(1, 2) for x in (q, k, v))       # [B, H, T, *]
    S = initial(initial_state, d, q.device)                           # [B, H, K, V]
    o = outputs.empty((d.B, d.H, d.T, d.V), dtype=d.acc, device=q.device)
    mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    for s in range(0, d.T, chunk_size):
        e = min(s + chunk_size, d.T)                                   # last chunk may be short
        qc, kc, vc = q[:, :, s:e], k[:, :, s:e], v_[:, :, s:e]          # [B, H, c, *]
        P = (qc @ kc.transpose(-1, -2)).masked_fill(~mask[: e - s, : e - s], 0)  # [B, H, c, c]
        o[:, :, s:e] = d.scale * (qc @ S + P @ vc)                     # inter + intra
        S = S + kc.transpose(-1, -2) @ vc                              # state after this chunk
    return o.transpose(1, 2).to(v.dtype), (S if output_final_state else None)
