"""Level 2, chunkwise PyTorch: the algorithms the Triton kernels implement, written with matmuls."""
from .linear import linear_attn

__all__ = ["linear_attn"]
from .delta import delta_rule, kda; __all__ += ["delta_rule", "kda"]  # noqa: E402,E702
from .gated import gla; __all__ += ["gla"]  # noqa: E402,E702
