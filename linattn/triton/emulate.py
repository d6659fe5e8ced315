"""The emulated mode's roundings (LINATTN_EMULATE, `linattn.device`): Triton's interpreter taught to
round and multiply as a GPU's tensor cores do, installed once when the mode is on.

Triton's interpreter keeps bf16 tiles as raw 16-bit words and gets three things unlike a GPU:
- float32 → bf16 casts drop the low bits instead of rounding to nearest even (here: torch's cast);
- `tl.dot` of bf16 tiles multiplies the raw words as integers (here: both widened to float32 first,
  exact, as the tensor cores multiply bf16 exactly and accumulate in float32);
- `tl.dot` of float32 tiles is exact, where the tensor cores read each operand as tf32, its top 19
  bits (truncated: 1 + 2⁻¹¹ + 2⁻¹² times 1 gave 1 on an H100 and an H200, `common.tf32`), and
  input_precision="tf32x3" takes three such products of the operands' high and low parts.

fp16 tiles it already rounds and multiplies as a GPU does. With these three, an emulated run gives
the native errors of bf16 and fp16 inputs to about 1 % (docs/native_correctness.md). Not modelled:
the order in which the tensor cores sum a product's terms (float32 accumulation either way).
"""
from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter


def _bf16_words(x: np.ndarray) -> np.ndarray:
    """float32 values → bf16 rounded to nearest even, as the uint16 words the interpreter keeps."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def _tf32(x: np.ndarray) -> np.ndarray:
    """float32 values as the tensor cores read them: the low 13 mantissa bits dropped."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return (bits & np.uint32(0xFFFFE000)).view(np.float32)


def install() -> None:
    """Patch the interpreter's builder (once): bf16 casts, bf16 and tf32 products."""
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_linattn_emulated", False):
        return
    cast, dot = builder.cast_impl, builder.create_dot

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if d == tl.bfloat16 and s in (tl.float32, tl.float16):
            return interpreter.TensorHandle(_bf16_words(src.data.astype(np.float32)), d)
        if s == tl.bfloat16 and d == tl.float16:
            return interpreter.TensorHandle(cast(self, src, tl.float32).data.astype(np.float16), d)
        return cast(self, src, dst_type)

    def create_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = cast(self, a, tl.float32)          # widening bf16 is exact
        if b.dtype.scalar == tl.bfloat16:
            b = cast(self, b, tl.float32)
        mode = str(input_precision).rsplit(".", 1)[-1].upper()
        if a.dtype.scalar == tl.float32 and b.dtype.scalar == tl.float32 and mode in ("TF32", "TF32X3"):
            x, y = a.data.astype(np.float32), b.data.astype(np.float32)
            xh, yh = _tf32(x), _tf32(y)
            out = np.matmul(xh, yh, dtype=np.float32)
            if mode == "TF32X3":
                out = out + np.matmul(xh, _tf32(y - yh), dtype=np.float32) + np.matmul(_tf32(x - xh), yh, dtype=np.float32)
            return interpreter.TensorHandle(out.astype(acc.data.dtype) + acc.data, acc.dtype.scalar)
        return dot(self, a, b, acc, input_precision, max_num_imprecise_acc)

    builder.cast_impl = cast_impl
    builder.create_fp_ext = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder.create_dot = create_dot
    builder._linattn_emulated = True
