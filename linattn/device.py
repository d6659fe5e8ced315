"""Where the book runs, and how big its examples are.

One place decides the device and the problem sizes, so chapters never branch on `cuda` themselves:
`pick(cpu=..., gpu=...)` returns the value for the machine the reader is on. The environment
variable LINATTN_SIZE=small|full overrides the choice (CI forces small; a GPU run can force full).
"""
from __future__ import annotations

import os

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def default_device() -> str:
    return "cuda" if has_cuda() else "cpu"


def size_mode() -> str:
    """'full' on a GPU, 'small' on a CPU, unless LINATTN_SIZE says otherwise."""
    mode = os.environ.get("LINATTN_SIZE", "").strip().lower()
    if mode in ("small", "full"):
        return mode
    if mode:
        raise ValueError(f"LINATTN_SIZE must be 'small' or 'full', got {mode!r}")
    return "full" if has_cuda() else "small"


def pick(cpu, gpu):
    """The CPU-sized or the GPU-sized value, e.g. `T = pick(cpu=256, gpu=8192)`."""
    return gpu if size_mode() == "full" else cpu


def triton_mode() -> str:
    """'native' when kernels compile for a GPU, 'interpreter' when Triton runs them on the CPU."""
    return "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "native"


def describe() -> str:
    """One line for the top of a chapter: device, sizes, versions."""
    parts = [f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__} ({triton_mode()})")
    except ImportError:
        parts.append("triton not installed")
    dev = torch.cuda.get_device_name() if has_cuda() else "CPU"
    return f"device: {dev} · sizes: {size_mode()} · " + " · ".join(parts)


def _choose_triton_mode() -> None:
    # Triton fixes interpreter vs native when @triton.jit runs, so this must happen before any
    # kernel module is imported. Without CUDA the interpreter is the only way kernels can run.
    if not has_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_choose_triton_mode()
