# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %%
# Colab: install the book's library (elsewhere this cell does nothing). The source is set in one
# place, [tool.linattn] in pyproject.toml; "" means the wheel you upload (`make wheel` builds it).
LINATTN_SOURCE = ""
import glob, importlib.util, subprocess, sys
if "google.colab" in sys.modules and importlib.util.find_spec("linattn") is None:
    wheels = sorted(glob.glob("linattn-*.whl") + glob.glob("/content/linattn-*.whl"))
    if not (LINATTN_SOURCE or wheels):
        print("Upload the linattn wheel: run `make wheel` in a clone of the repository, "
              "then choose dist/linattn-*.whl below.")
        from google.colab import files
        wheels = sorted(n for n in files.upload() if n.startswith("linattn") and n.endswith(".whl"))
    if LINATTN_SOURCE or wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", LINATTN_SOURCE or wheels[-1]],
                       check=True)
    else:
        print("No wheel uploaded, so linattn is not installed: run this cell again and upload "
              "dist/linattn-*.whl, or read the book locally (README: `make book`).")

# %% [markdown]
# # Workbook 09 — your first Triton kernels
#
# Companion of `book/09_triton.py`. You write `@triton.jit` kernels and the small Python
# launchers that allocate the outputs and start them. Four steps, each graded on its own: a masked
# tile, one chunk's masked product $(QK^\top \odot M)V$, one chunk's state update $S + K^\top V$,
# and the whole chunkwise linear-attention forward kernel with the library's signature. The last
# one unlocks `linattn.set_impl("linear_attn", "mine")` **at the Triton level**: the library then
# runs your kernel.
#
# How your kernels are graded. Without a GPU they run in Triton's interpreter (slow: the graded
# sizes are small), on a GPU they are compiled. Every check uses fresh random cases, and while it
# runs:
#
# * `torch.empty` / `torch.empty_like` return NaN-filled tensors, so an output element your kernel
#   never stores shows up as NaN (with the index range where they are);
# * under the interpreter every `tl.load` and `tl.store` is bounds-checked: touching memory past
#   the end of a tensor (an unmasked tail) is reported with the line of that load or store;
# * each case has a time limit (60 s by default), and an input your code changes in place fails.
#
# `spec(name)` prints the PyTorch code each exercise must match. The `hint` of a failed check
# says what usually goes wrong, and a `diagnosis` line appears when your result is exactly that
# of a known mistake.

# %%
import linattn  # first: on a machine without a GPU it switches Triton's interpreter on
import torch
import triton
import triton.language as tl

from linattn.grade import check, spec

# %% [markdown]
# ## Exercise 1 — `ch09.scale_rows`: a masked tile
#
# `x` is `[T, D]` float32 (row-major, contiguous), `w` is `[T]`. Return `y` with
# $y_{t,:} = w_t\, x_{t,:}$. One program handles `BT = 16` rows: its rows are
# `rows = tl.program_id(0) * BT + tl.arange(0, BT)` and its columns `cols = tl.arange(0, BD)`,
# with `BD` the next power of two $\ge D$ (`tl.arange` needs a power of two). The tile's addresses
# are `x + rows[:, None] * D + cols[None, :]`.
#
# `T` is rarely a multiple of 16 and `D` rarely a power of two: the last program's tile sticks out
# below the matrix, and every tile sticks out to the right. Both the load and the store need
# `mask=(rows[:, None] < T) & (cols[None, :] < D)`. The launcher:
# `y = torch.empty_like(x)`, then `kernel[(triton.cdiv(T, 16),)](x, w, y, T, D, BT=16, BD=...)`.

# %%
spec("ch09.scale_rows");

# %% exercise="ch09.scale_rows"
@triton.jit
def scale_rows_kernel(x, w, y, T, D, BT: tl.constexpr, BD: tl.constexpr):
    pass  # your kernel here


def scale_rows(x, w):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch09.scale_rows", scale_rows);

# %% [markdown]
# ## Exercise 2 — `ch09.intra_chunk`: $(QK^\top \odot M)V$ of one chunk with `tl.dot`
#
# `q`, `k` are `[N, C, K]` and `v` `[N, C, V]`: N independent chunks of C tokens; launch one
# program per chunk (`grid = (N,)`). Return `o` `[N, C, V]` in `v.dtype` with
#
# $$O = (QK^\top \odot M)\, V, \qquad M_{ij} = 1 \text{ if } i \ge j \text{ (diagonal included) else } 0 .$$
#
# `tl.dot` needs tiles of at least 16×16 with power-of-two sides: use `BC = max(16,
# next_power_of_2(C))` (likewise `BK`, `BV`) and load with `other=0.0` past `C`, `K`, `V`, so the
# padding adds nothing. Inputs may be bf16: upcast each tile to float32 right after its load
# (`.to(tl.float32)`; the interpreter's bf16 arithmetic is not reliable), and for float32 tiles
# ask for exact products, `tl.dot(a, b, input_precision="ieee")` (the GPU default, tf32, keeps 10
# mantissa bits of float32's 23). The mask is `tl.where(t[:, None] >= t[None, :], A, 0.0)` with
# `t = tl.arange(0, BC)`. Store `O.to(o.dtype.element_ty)`.

# %%
spec("ch09.intra_chunk");

# %% exercise="ch09.intra_chunk"
@triton.jit
def intra_chunk_kernel(q, k, v, o, C, K, V, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    pass  # your kernel here


def intra_chunk(q, k, v):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch09.intra_chunk", intra_chunk);

# %% [markdown]
# ## Exercise 3 — `ch09.chunk_state`: $S + K^\top V$
#
# `k` `[N, C, K]`, `v` `[N, C, V]` (float32 or bf16) and `S` `[N, K, V]` float32, the state
# entering each chunk. Return the state after it, float32:
#
# $$S' = S + K^\top V .$$
#
# `tl.trans(K_tile)` gives $K^\top$. Accumulate in float32 — the state is summed over every chunk
# of a sequence, and rounding it to bf16 at each step keeps fewer than three significant decimal
# digits (8 mantissa bits against float32's 24). The grader
# compares with float32's tolerance even for bf16 inputs.

# %%
spec("ch09.chunk_state");

# %% exercise="ch09.chunk_state"
@triton.jit
def chunk_state_kernel(k, v, s, out, C, K, V, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    pass  # your kernel here


def chunk_state(k, v, S):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch09.chunk_state", chunk_state);

# %% [markdown]
# ## Exercise 4 — `ch09.linear_attn`: the whole forward kernel
#
# The library's signature, `linear_attn(q, k, v, *, scale=None, initial_state=None,
# output_final_state=False, chunk_size=16)`, with `q`, `k` `[B, T, H, K]`, `v` `[B, T, H, V]`
# (float32 or bf16) and the state `[B, H, K, V]`. Exercises 2 and 3 are its two halves. One
# program per (batch, head) walks the chunks in order, holding $S$ (float32) on chip:
#
# $$O_{[n]} = \text{scale}\cdot\big(Q_{[n]} S + (Q_{[n]}K_{[n]}^\top \odot M) V_{[n]}\big), \qquad
#   S \leftarrow S + K_{[n]}^\top V_{[n]} .$$
#
# Row $t$ of head $h$ in batch $b$ starts at element `((b * T + t) * H + h) * K` of `q` (call
# `.contiguous()` first). Loop with `for s in range(0, T, C):` — the last chunk is partial when
# `T % C != 0`, so every load and store masks its rows with `s + t < T`. `scale` defaults to
# $K^{-1/2}$; start from `initial_state` (or zeros); return `o` in `v.dtype` and the final state in
# float32 (or `None`). A `None` tensor argument may be passed to a kernel; guard its use with a
# `tl.constexpr` flag such as `HAS_H0`.

# %%
spec("ch09.linear_attn");

# %% exercise="ch09.linear_attn"
@triton.jit
def linear_attn_kernel(q, k, v, h0, o, ht, scale, T, H, K, V, C: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr):
    pass  # your kernel here


def linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False, chunk_size=16):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch09.linear_attn", linear_attn);

# %% [markdown]
# Passed? Then the library can run your kernel:
#
# ```python
# linattn.set_impl("linear_attn", "mine")
# o, S = linattn.linear_attn(q, k, v, output_final_state=True)
# print(linattn.which("linear_attn"))      # your ch09.linear_attn (…/mine/ch09.linear_attn.py)
# ```
#
# Next: chapter 10 (`book/10_gla_triton.py`) adds gates and secondary chunking; its workbook is
# `exercises/10_gla_triton.py`.

# %%
from linattn.grade import progress_text; print(progress_text())
