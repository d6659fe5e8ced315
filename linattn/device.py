"""Where the book runs, and how big its examples are.

One place decides the device and the problem sizes, so chapters never branch on `cuda` themselves:
`pick(cpu=..., gpu=...)` returns the value for the machine the reader is on. The environment
variable LINATTN_SIZE=small|full overrides the choice (CI forces small; a GPU run can force full).

Triton runs in one of three modes (`triton_mode()`), set by the environment before linattn is
imported (Triton fixes interpreter or compiler when a kernel is defined):
- 'native': kernels compile for the GPU.
- 'interpreter' (TRITON_INTERPRET=1, set here when there is no CUDA): Triton's interpreter runs the
  kernels on the CPU, every tile in float32 with exact products (its bf16 arithmetic is broken), so
  the CPU checks the algorithms and none of the half-precision roundings a GPU takes.
- 'emulated' (LINATTN_EMULATE=fp16 or bf16, which sets TRITON_INTERPRET=1 on any machine): the
  interpreter runs the kernels, but the library takes its native dtype decisions (half tiles and
  operands, tf32 rounding of computed operands, each product's precision), and the interpreter is
  taught to round bf16 and to read float32 product operands as tf32 as a GPU does
  (`linattn.triton.emulate`). Errors then come out as they do natively (docs/native_correctness.md:
  KDA's fp16 gate gradient 1.852e-3 emulated and 1.853e-3 on an H200, DeltaNet's bf16 dq 4.655e-3
  both, on the same inputs), and a precision defect can be found and fixed on a CPU. Only inputs of
  the named dtype are taken (others raise an InputError). Not modelled: the order in which the
  tensor cores sum a product's terms, and a GPU's launch choices that depend on its SM count (the
  interpreter counts one).
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


# LINATTN_EMULATE's values → the input dtype whose native roundings the interpreter reproduces
EMULATED = {"fp16": torch.float16, "bf16": torch.bfloat16}


def emulated_dtype():
    """The input dtype the 'emulated' mode takes (LINATTN_EMULATE, see the module doc), else None."""
    name = os.environ.get("LINATTN_EMULATE", "").strip().lower()
    if not name:
        return None
    if name not in EMULATED:
        raise ValueError(f"LINATTN_EMULATE must be one of {sorted(EMULATED)} (or unset), got {name!r}")
    return EMULATED[name]


def triton_mode() -> str:
    """'native' when kernels compile for a GPU, 'interpreter' when Triton runs them on the CPU with
    float32 tiles, 'emulated' when it runs them with the native dtype decisions (module doc)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if emulated_dtype() is None:
        return "interpreter" if interpreted else "native"
    if not interpreted:
        raise ValueError("LINATTN_EMULATE runs the kernels in Triton's interpreter, but TRITON_INTERPRET is "
                         f"{os.environ.get('TRITON_INTERPRET')!r}: unset one of them")
    return "emulated"


def describe() -> str:
    """One line for the top of a chapter: device, sizes, versions."""
    parts = [f"torch {torch.__version__}"]
    try:
        import triton

        mode = triton_mode()
        if mode == "emulated":
            mode = f"emulated {os.environ['LINATTN_EMULATE'].strip().lower()}"
        parts.append(f"triton {triton.__version__} ({mode})")
    except ImportError:
        parts.append("triton not installed")
    dev = torch.cuda.get_device_name() if has_cuda() else "CPU"
    return f"device: {dev} · sizes: {size_mode()} · " + " · ".join(parts)


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run linattn's kernels in this environment, or None when it can.
    Triton before 3.7 turns a loop bound (a one-element array in the interpreter) into a Python int
    with int(), which NumPy 2 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"), so every kernel with a chunk loop stops there: seen with Triton 3.6, the GPU machines'
    toolchain, where only the emulated mode uses the interpreter. Triton 3.7 squeezes the array first."""
    try:
        import numpy as np
        import triton
    except ImportError:
        return None
    try:
        int(np.zeros(1))
        return None
    except TypeError:
        pass
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return None
    if (major, minor) >= (3, 7):
        return None
    return (f"Triton {triton.__version__}'s interpreter cannot run these kernels with NumPy {np.__version__} "
            "(it converts a one-element array to int, which NumPy 2 refuses; Triton 3.7 does not): "
            "install triton==3.7.1 (requirements.txt) to run linattn.triton in the interpreter "
            "(no GPU, or LINATTN_EMULATE)")


def _choose_triton_mode() -> None:
    # Triton fixes interpreter vs native when @triton.jit runs, so this must happen before any
    # kernel module is imported. Without CUDA the interpreter is the only way kernels can run; the
    # emulated mode runs in it on any machine. A contradiction (a bad LINATTN_EMULATE, or it with
    # TRITON_INTERPRET=0) is raised here, on import, rather than at the first kernel launch.
    if not has_cuda() or emulated_dtype() is not None:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton_mode()


_choose_triton_mode()
