"""Level 2, chunkwise PyTorch: the algorithms the Triton kernels implement, written with matmuls."""
from .linear import linear_attn

__all__ = ["linear_attn"]
