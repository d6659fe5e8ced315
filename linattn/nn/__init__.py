"""Layers built on the operations (chapter 14), with state carried for decoding (chapter 15).

Every layer: `forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], state)`. The recurrent
layers also take `cu_seqlens=` (x [1, T, d_model] packed, docs/packed_sequences.md): each sequence
is computed as if alone and the state is one per sequence, ready for a batched decode.
"""
from .layers import (DeltaNet, GatedDeltaNet, GatedLinearAttention, KimiDeltaAttention,  # noqa: F401
                     LinearAttention, RecurrentLayer)
from .softmax import SoftmaxAttention  # noqa: F401
from .state import LayerState  # noqa: F401
from .generate import generate, prefill_then_decode  # noqa: F401

LAYERS = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "gla": GatedLinearAttention,
    "deltanet": DeltaNet,
    "gated_deltanet": GatedDeltaNet,
    "kda": KimiDeltaAttention,
}

__all__ = ["LAYERS", "generate", "prefill_then_decode", "LayerState", "RecurrentLayer", "SoftmaxAttention", "LinearAttention",
           "GatedLinearAttention", "DeltaNet", "GatedDeltaNet", "KimiDeltaAttention"]
