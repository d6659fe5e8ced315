"""linattn: linear attention kernels, from token-by-token recurrences to Triton tensor cores.

Levels (same signatures): linattn.naive (ground truth), linattn.chunk (chunkwise PyTorch),
linattn.triton (Triton kernels). The functions here dispatch between them: see `dispatch`.
"""
from . import device  # noqa: F401  (first: fixes Triton's interpreter/native mode before any kernel import)
from . import testing  # noqa: F401
from .dispatch import KeywordError, delta_rule, gla, kda, linear_attn, set_impl, which
from .validate import DoubleBackwardError, InputError

__all__ = ["linear_attn", "gla", "delta_rule", "kda", "set_impl", "which", "InputError",
           "KeywordError", "DoubleBackwardError"]
__version__ = "0.1.0"

# The levels, the layers and the helper modules load on first use (`linattn.chunk` after a bare
# `import linattn`), so `import linattn` stays fast: no level, no Triton. Triton's mode is fixed
# by `device` above, before any kernel module can be imported.
_LAZY = {"naive", "chunk", "triton", "nn", "affine", "bench", "context", "decay", "mqar", "grade",
         "outputs"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _LAZY)
