"""Chunkwise linear attention in Triton: the gated kernels of gated.py with no gate.

Per chunk of C tokens with S the state before it (chapter 09 builds this kernel up):
    O_[n] = scale · (Q_[n] S + (Q_[n] K_[n]ᵀ ⊙ M) V_[n]),   S ← S + K_[n]ᵀ V_[n].
`mode` chooses between one fused pass over the chunks and materialised chunk states (gated.py).
"""
from __future__ import annotations

from ..validate import check_chunk, check_inputs
from .gated import MAX_CHUNK
from .gated_backward import run


def linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
                mode="auto", recompute=True):
    """Differentiable: the Triton backward of gated_backward.py with no gate (`recompute` as in gla)."""
    d = check_inputs(q, k, v, scale=scale, initial_state=initial_state)
    check_chunk(chunk_size, power_of_two=True, minimum=16, maximum=MAX_CHUNK)
    return run(q, k, v, None, d, initial_state=initial_state, output_final_state=output_final_state,
               chunk_size=chunk_size, sub_chunk_size=chunk_size, mode=mode, recompute=recompute)
