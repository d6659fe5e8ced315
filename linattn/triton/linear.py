"""Chunkwise linear attention in Triton: the gated kernels of gated.py with no gate.

Per chunk of C tokens with S the state before it (chapter 09 builds this kernel up):
    O_[n] = scale · (Q_[n] S + (Q_[n] K_[n]ᵀ ⊙ M) V_[n]),   S ← S + K_[n]ᵀ V_[n].
`mode` chooses between one fused pass over the chunks and materialised chunk states (gated.py).
"""
from __future__ import annotations

from ..support import check_triton
from ..validate import check_inputs
from .gated import check_packed
from .gated_backward import run


def linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
                mode="auto", recompute=True, cu_seqlens=None):
    """Differentiable: the Triton backward of gated_backward.py with no gate (`recompute` as in gla).
    cu_seqlens: packed sequences, as in gla."""
    d = check_inputs(q, k, v, scale=scale, initial_state=None if cu_seqlens is not None else initial_state)
    check_triton("linear_attn", q, d.K, d.V, chunk_size)
    seqs = check_packed(cu_seqlens, d, q, initial_state, chunk_size)
    return run(q, k, v, None, d, initial_state=initial_state, output_final_state=output_final_state,
               chunk_size=chunk_size, sub_chunk_size=chunk_size, mode=mode, recompute=recompute, seqs=seqs)
