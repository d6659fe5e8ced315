"""Chunkwise linear attention: exact, with matmuls only.

Split T into chunks of C tokens. Inside a chunk the output is a small masked attention; everything
before the chunk reaches it through the state S carried from chunk to chunk:
    O_[n] = scale · (Q_[n] S_[n-1] + (Q_[n] K_[n]ᵀ ⊙ M) V_[n]),   S_[n] = S_[n-1] + K_[n]ᵀ V_[n].
The last chunk may be shorter than C (any T works).

This is GLA with every decay equal to 1, so it runs `linattn.chunk.gated.forward` with no gate:
the intra-chunk matmuls of a group of chunks in one batch, the state carried chunk by chunk.
With grad enabled and an input that requires it, the hand-written backward of
`linattn.chunk.gla_backward` runs too; recompute=True recomputes the chunk states in the backward,
False keeps them from the forward.

A NaN or inf input is refused when the value checks run (CPU tensors, by default); unchecked it
makes the outputs of its whole chunk non-finite, earlier tokens included (linattn.validate).
"""
from __future__ import annotations

from .. import packing
from ..validate import autocast_off, check_chunk, check_inputs, refuse_func_transforms
from .gated import ChunkwiseGated, Plan, forward, needs_grad


@autocast_off
def linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
                recompute=True, cu_seqlens=None):
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence(linear_attn, dict(q=q, k=k, v=v), cu_seqlens, scale=scale,
                                    initial_state=initial_state, output_final_state=output_final_state,
                                    chunk_size=chunk_size, recompute=recompute)
    d = check_inputs(q, k, v, scale=scale, initial_state=initial_state)
    check_chunk(chunk_size)
    refuse_func_transforms("linattn.chunk.linear_attn")
    C = min(chunk_size, d.T)                                           # no padding past a short T
    # matmul operands are not rounded to the input dtype: accumulation dtype throughout
    plan = Plan(d, C, C, d.acc, bool(recompute))
    if needs_grad(q, k, v, initial_state):
        o, S = ChunkwiseGated.apply(q, k, v, None, initial_state, plan)
    else:
        o, S, _ = forward(q, k, v, None, initial_state, plan, keep_states=False)
    return o, (S if output_final_state else None)
