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
# # Workbook 10 — GLA in Triton, with secondary chunking
#
# Companion of `book/10_gla_triton.py`. With per-dimension gates the decay sits *inside* the sum
# over key dimensions,
#
# $$P_{ts} = \sum_\kappa q_{t\kappa}\, k_{s\kappa}\, e^{b_{t\kappa} - b_{s\kappa}} \quad (s \le t),$$
#
# with $b$ the cumulative log-gate inside the chunk, so the chunk's $P$ (chapter 04's intra-chunk
# matrix; the graders and kernels below call the tensor `A`) is not one matrix product.
# Secondary chunking splits the chunk into sub-chunks of 16 tokens: an **off-diagonal** tile
# (query sub-chunk $i$, key sub-chunk $j < i$) factors through a reference point $r$ between them
# and becomes a `tl.dot`; a **diagonal** tile ($i = j$) has no such point and is built in float32.
# Three steps, graded on their own: the off-diagonal tiles, the diagonal tiles, then the whole GLA
# forward kernel with the library's signature — it unlocks `linattn.set_impl("gla", "mine")` at
# the Triton level.
#
# The grading works as in workbook 09: NaN-filled `torch.empty`, bounds-checked loads and stores
# under the interpreter, fresh random cases with **strong gates** (down to −20 per token: a
# chunk's $b$ reaches −300 and below, and $e^{300}$ is far beyond float32's $3.4\cdot10^{38}$).

# %%
import linattn  # first: on a machine without a GPU it switches Triton's interpreter on
import torch
import triton
import triton.language as tl

from linattn.grade import check, spec

# %% [markdown]
# ## Exercise 1 — `ch10.offdiag_tiles`: the absorbed tiles
#
# Inputs for N chunks of C tokens (C a multiple of 16): `q`, `k` `[N, C, K]` (float32 or bf16)
# and `b` `[N, C, K]` float32, the cumulative log-gates of each chunk (non-increasing in $t$, all
# $\le 0$). Return `A` `[N, C, C]` float32 holding the tiles $(i, j)$ with $j < i$ of
# $P_{ts} = \sum_\kappa q_{t\kappa} k_{s\kappa} e^{b_{t\kappa} - b_{s\kappa}}$ and **zeros** in
# every other tile (store those too: `torch.empty` is NaN while graded).
#
# For $t$ in sub-chunk $i$ and $s$ in sub-chunk $j < i$ (sub-chunks numbered from 0), with
# $r = 16i$ the last position before sub-chunk $i$ (positions from 1, $b_0 = 0$; in the 0-based
# tensor, $b_r$ is row `16*i - 1`):
#
# $$e^{b_t - b_s} = e^{b_t - b_r}\cdot e^{b_r - b_s}, \qquad
#   P_{[i][j]} = \big(Q_{[i]} \odot e^{G_{[i]} - b_r}\big)\big(K_{[j]} \odot e^{b_r - G_{[j]}}\big)^\top ,$$
#
# with $G_{[i]}$ the rows $b_t$ of sub-chunk $i$; both exponents are $\le 0$ because $b$ does not increase: nothing overflows, a tiny factor
# just underflows to 0. Any other reference point (the chunk start, the end of sub-chunk $i$)
# makes one of the two exponents positive and large. A grid `(C // 16, C // 16, N)` with one
# 16×16 tile per program is the simplest.

# %%
spec("ch10.offdiag_tiles");

# %% exercise="ch10.offdiag_tiles"
@triton.jit
def offdiag_kernel(q, k, b, a, C, K, BK: tl.constexpr):
    pass  # your kernel here


def offdiag_tiles(q, k, b):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch10.offdiag_tiles", offdiag_tiles);

# %% [markdown]
# ## Exercise 2 — `ch10.diag_tiles`: the diagonal tiles in float32
#
# Same inputs; return the tiles $(i, i)$ with $P_{ts}$ for $t \ge s$ (diagonal included) and zeros
# above the diagonal and in every other tile. Inside a diagonal tile there is no point between a
# query and its keys to split at. Build the decays as a `[16, 16, BK]` float32 block,
# `Bt[:, None, :] - Bt[None, :, :]`, **mask the exponent** with `-inf` above the diagonal
# (`tl.where(causal[:, :, None], diff, float("-inf"))`) *before* `tl.exp` — after `tl.exp` it is
# too late: $e^{+300}$ is `inf`, and `inf · 0` is NaN — then `tl.sum(Q[:, None, :] * K[None, :, :]
# * decay, axis=2)`. Keep it all in float32: the graded tolerance is float32's, also for bf16
# inputs.

# %%
spec("ch10.diag_tiles");

# %% exercise="ch10.diag_tiles"
@triton.jit
def diag_kernel(q, k, b, a, C, K, BK: tl.constexpr):
    pass  # your kernel here


def diag_tiles(q, k, b):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch10.diag_tiles", diag_tiles);

# %% [markdown]
# ## Exercise 3 — `ch10.gla`: the GLA forward kernel
#
# `gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, chunk_size=32,
# sub_chunk_size=16)`, `g` `[B, T, H, K]` (or `[B, T, H]`, one decay per head: expand it to
# `[B, T, H, K]` in the launcher). For each chunk, with $b$ the cumulative sum of its gates
# (`tl.cumsum(g, axis=0)` on the loaded gates; load the rows past $T$ as $g = 0$, which decays
# nothing), $G$ its rows stacked, and $S$ the state entering it:
#
# $$O = \text{scale}\cdot\big((Q \odot e^{G}) S + P V\big), \qquad
#   S \leftarrow \operatorname{diag}(e^{b_C})\, S + \big(K \odot e^{b_C - G}\big)^\top V,$$
#
# with $P$ the chunk's matrix from exercises 1 and 2 (your two tile kernels can be reused as
# `@triton.jit` helpers, or write the chunk's $P$ to a float32 buffer in a first kernel and read
# it in a second). Every exponent here is $\le 0$. As in workbook 09: the last chunk may be
# partial, `o` in `v.dtype`, the state float32.

# %%
spec("ch10.gla");

# %% exercise="ch10.gla"
@triton.jit
def gla_kernel(q, k, v, g, h0, o, ht, scale, T, H, K, V, C: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr):
    pass  # your kernel here


def gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, chunk_size=32,
        sub_chunk_size=16):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch10.gla", gla);

# %% [markdown]
# Passed? `linattn.set_impl("gla", "mine")` now runs your kernel inside `linattn.gla`, and
# `linattn.which("gla")` says so. Next: chapter 11 (`book/11_kda_triton.py`), the delta rule in
# Triton; its workbook is `exercises/11_kda_triton.py`.

# %%
from linattn.grade import progress_text; print(progress_text())
