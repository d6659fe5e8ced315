"""Level 3, Triton: tensor-core kernels, native on CUDA, through the Triton interpreter on a CPU.

Same signatures as linattn.chunk, plus `mode="auto"|"fused"|"states"` (see gated.py).
"""
from .linear import linear_attn
from .gated import gla

__all__ = ["linear_attn", "gla"]

try:  # the delta-rule kernels are optional: the package works without delta.py
    from .delta import delta_rule, kda  # noqa: F401
except ImportError as exc:
    if getattr(exc, "name", None) != f"{__name__}.delta":
        raise  # delta.py exists but is broken: say so instead of hiding it
else:
    __all__ += ["delta_rule", "kda"]
