"""linattn: linear attention kernels, from token-by-token recurrences to Triton tensor cores.

Levels (same signatures): linattn.naive (ground truth), linattn.chunk (chunkwise PyTorch),
linattn.triton (Triton kernels). The functions here dispatch between them: see `dispatch`.
"""
from . import device  # noqa: F401  (first: fixes Triton's interpreter/native mode before any kernel import)
from . import testing  # noqa: F401
from .dispatch import delta_rule, gla, kda, linear_attn, set_impl, which
from .validate import InputError

__all__ = ["linear_attn", "gla", "delta_rule", "kda", "set_impl", "which", "InputError"]
__version__ = "0.1.0"
