"""Level 2, chunkwise PyTorch: the algorithms the Triton kernels implement, written with matmuls.

The backward is hand-written (torch.autograd.Function): first-order only (a second derivative raises
DoubleBackwardError), and torch.func transforms (grad, jacrev, jvp, vmap) are refused with an
InputError; use torch.autograd.grad / .backward(), or linattn.naive for torch.func and higher order.
"""
from .linear import linear_attn

__all__ = ["linear_attn"]
from .delta import delta_rule, kda; __all__ += ["delta_rule", "kda"]  # noqa: E402,E702
from .gated import gla; __all__ += ["gla"]  # noqa: E402,E702
