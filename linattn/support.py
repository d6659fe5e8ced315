"""The supported range, in one place: what each level takes, and so what its tests must cover.

Inside the range every level computes correctly; outside it a function raises `InputError` naming
the argument before any kernel launches. For the Triton level "correctly" is a claim about compiled
kernels, so it is checked natively: the conformance suite (`linattn.conformance`,
`tools/conformance.py`) generates its matrix from the constants below, and the offline compile
(`tools/arch_check.py`, tests/test_architectures.py) covers every architecture in ARCHITECTURES.

| what | naive, chunk | triton |
|---|---|---|
| dtypes | float16, bfloat16, float32, float64 | float16, bfloat16, float32 |
| head dims K, V | any ≥ 1 | 1 … 256 |
| chunk_size (GLA, linear attention) | any ≥ 1 (chunk) | a power of two, 16 … 256 (float32: … 128) |
| chunk_size (DeltaNet, Gated DeltaNet, KDA) | any ≥ 1 (chunk) | 16, 32 or 64 |
| sub_chunk_size (GLA) | a power of two dividing chunk_size | the same, 16 … 64 |
| GPUs | — | compute capability 7.5, 8.0, 8.6, 8.9, 9.0 |

Per GPU, shared memory bounds what fits (tools/arch_check.py compiles every launch for each
architecture, book/data/architectures.json): bf16/fp16 at chunk sizes up to 64 fit all five; float32,
and larger chunks, can need more than the 99 KB per block of an RTX 30/40 or L4 (64 KB on a T4), and
such a launch raises an InputError naming the GPU and what to do (triton/common.launch).
"""
from __future__ import annotations

import torch

from .validate import InputError, check_chunk, refuse_func_transforms

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256           # one tile holds a whole key row (K) beside a state block (V)
MIN_TRITON_CHUNK = 16        # tl.dot needs every tile side ≥ 16
# GLA's sub-chunk: its diagonal tiles are [c, K] float32 walks; at c = 256, K = 256 the forward's
# intra kernel needs 256 KB of shared memory in bf16, more than any GPU has (compiled offline), and
# the backward already takes at most 64.
MAX_TRITON_SUB_CHUNK = 64
MAX_TRITON_CHUNK = {"linear_attn": 256, "gla": 256, "delta_rule": 64, "kda": 64}
# float32 tiles are twice as large: at C = 256 the state pass of linear attention and GLA needed
# 227–296 KB of shared memory with one pipeline stage on an H200 (Triton 3.6; K = 128, V = 16,
# few heads), over its 227 KB, so float32 stops at 128.
MAX_TRITON_CHUNK_FLOAT32 = {**MAX_TRITON_CHUNK, "linear_attn": 128, "gla": 128}
# GLA and linear attention: a state step holds a chunk's k, v (and float32 gates) tiles at once,
# 128 KB at C = 256 in bf16 (one pipeline stage, see triton/common.launch); C = 512 would not fit an
# H200's 227 KB of shared memory. The delta rules: above 64 their [C, C] and [C, K] tiles unroll
# into far more code than the register file holds (on an H200 DeltaNet at C = 128 in float32 and
# KDA at C = 256 in bf16 did not finish compiling within minutes).
ARCHITECTURES = {           # compute capability → the GPUs readers have with it
    (7, 5): "T4 (Colab)",
    (8, 0): "A100 (Colab)",
    (8, 6): "RTX 30xx, A10",
    (8, 9): "L4 (Colab), RTX 40xx",
    (9, 0): "H100, H200",
}


def max_triton_chunk(op: str, dtype=None) -> int:
    """The largest chunk_size the Triton level takes for op (with inputs of `dtype`, when given)."""
    return (MAX_TRITON_CHUNK_FLOAT32 if dtype == torch.float32 else MAX_TRITON_CHUNK)[op]


def triton_chunk_sizes(op: str, dtype=None) -> tuple[int, ...]:
    """Every chunk_size the Triton level takes for op (powers of two), for inputs of `dtype` when given."""
    sizes, c = [], MIN_TRITON_CHUNK
    while c <= max_triton_chunk(op, dtype):
        sizes.append(c)
        c *= 2
    return tuple(sizes)


def check_triton(op: str, q: torch.Tensor, K: int, V: int, chunk_size, sub_chunk_size=None) -> None:
    """Refuse, before any launch, what linattn.triton does not support (the table above), and
    torch.func transforms, which its hand-written autograd.Functions cannot pass."""
    refuse_func_transforms(f"linattn.triton.{op}")
    check_chunk(chunk_size, sub_chunk_size, power_of_two=True, minimum=MIN_TRITON_CHUNK,
                maximum=MAX_TRITON_CHUNK[op])
    if sub_chunk_size is not None and sub_chunk_size > MAX_TRITON_SUB_CHUNK:
        raise InputError(f"sub_chunk_size must be at most {MAX_TRITON_SUB_CHUNK} in linattn.triton, got "
                         f"{sub_chunk_size} (a larger one gives the same result and does not fit a GPU's "
                         "shared memory at large head dims)")
    for name, n in (("q", K), ("v", V)):
        if n > MAX_HEAD_DIM:
            raise InputError(f"{name} has head dimension {n}; linattn.triton supports head dimensions up "
                             f"to {MAX_HEAD_DIM} (one tile holds a whole key row beside a state block); "
                             "use linattn.chunk for larger ones")
    if q.dtype not in TRITON_DTYPES:
        raise InputError(f"q has dtype {q.dtype}; linattn.triton computes in float16, bfloat16 or float32 "
                         "(use linattn.chunk or linattn.naive for float64)")
    if isinstance(chunk_size, int) and chunk_size > max_triton_chunk(op, q.dtype):
        raise InputError(f"chunk_size must be at most {max_triton_chunk(op, q.dtype)} for {q.dtype} inputs "
                         f"in linattn.triton, got {chunk_size} (float32 tiles are twice as large and do not "
                         "fit a GPU's shared memory; use bfloat16/float16 inputs or a smaller chunk_size)")
