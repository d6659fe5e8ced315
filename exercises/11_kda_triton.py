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
# # Workbook 11 — KDA in Triton
#
# Companion of `book/11_kda_triton.py`. The delta rule couples the tokens of a chunk through the
# triangular system $(I + A)\tilde V = \dots$; chapter 07 solved it in PyTorch with the WY
# representation. Here it goes into kernels, in three graded steps: the inverse $(I + A)^{-1}$ of
# one chunk's matrix, the chunk's WY factors $U$ and $W$, and the whole KDA forward kernel with the
# library's signature (it unlocks `linattn.set_impl("kda", "mine")` at the Triton level).
#
# Grading as in workbooks 09 and 10: NaN-filled `torch.empty`, bounds-checked loads and stores
# under the interpreter, fresh random cases, a time limit per case. `spec(name)` prints the
# PyTorch code to match (chapter 07's chunk-level functions).

# %%
import linattn  # first: on a machine without a GPU it switches Triton's interpreter on
import torch
import triton
import triton.language as tl

from linattn.grade import check, spec

# %% [markdown]
# ## Exercise 1 — `ch11.unit_lower_inverse`
#
# `A` is `[N, C, C]` float32, strictly lower triangular. Return $X = (I + A)^{-1}$, float32, one
# program per matrix. Forward substitution gives $X$ row by row from $(I + A)X = I$:
#
# $$X_i = e_i - \sum_{j < i} A_{ij}\, X_j .$$
#
# A kernel cannot assign one row of a register tile, but it can rebuild the tile:
# start from `X = (r[:, None] == r[None, :]).to(tl.float32)` (the identity, `r = tl.arange(0,
# BC)`), and for `i in range(1, C)` compute the new row `x_i` from row $i$ of $A$ (a `[BC]` load)
# and `tl.sum(a_i[:, None] * X, axis=0)`, then `X = tl.where(r[:, None] == i, x_i[None, :], X)`.
# Rows $j < i$ of `X` are final when row $i$ needs them. Mind which index is the row: $X$ is lower
# triangular, and its transpose is a classic wrong answer.

# %%
spec("ch11.unit_lower_inverse");

# %% exercise="ch11.unit_lower_inverse"
@triton.jit
def inverse_kernel(a, x, C, BC: tl.constexpr):
    pass  # your kernel here


def unit_lower_inverse(A):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch11.unit_lower_inverse", unit_lower_inverse);

# %% [markdown]
# ## Exercise 2 — `ch11.wy_factors`: $U$ and $W$ of one chunk
#
# `k` `[N, C, K]` (unit rows), `v` `[N, C, V]`, `g` `[N, C, K]` raw log-gates (float32), `beta`
# `[N, C]`; `k`, `v`, `beta` may be bf16. With $b_i$ the cumulative gates inside the chunk
# (`tl.cumsum(g, axis=0)`; $G$ stacks the rows $b_i$):
#
# $$A_{ij} = \beta_i \sum_\kappa k_{i\kappa} k_{j\kappa}\, e^{b_{i\kappa} - b_{j\kappa}} \ (i > j,\ \text{else } 0),\qquad
#   U = (I + A)^{-1} \operatorname{diag}(\beta) V, \qquad
#   W = (I + A)^{-1} \operatorname{diag}(\beta) (K \odot e^{G}).$$
#
# Return `(U, W)` in float32. $A$ is **strictly** lower triangular, $\beta_i$ multiplies **row**
# $i$, and the exponent is masked with `-inf` before `tl.exp` (above the diagonal it is positive).
# Your substitution from exercise 1 can work on the register tile $A$: read its row $i$ as
# `tl.sum(tl.where(t[:, None] == i, A, 0.0), axis=0)`.

# %%
spec("ch11.wy_factors");

# %% exercise="ch11.wy_factors"
@triton.jit
def wy_kernel(k, v, g, beta, u, w, C, K, V, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    pass  # your kernel here


def wy_factors(k, v, g, beta):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch11.wy_factors", wy_factors);

# %% [markdown]
# ## Exercise 3 — `ch11.kda`: the KDA forward kernel
#
# `kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
# chunk_size=16)`, inputs `[B, T, H, …]`, `g` `[B, T, H, K]` or `[B, T, H]` (expand it in the
# launcher), `beta` `[B, T, H]`. One program per (batch, head) walks the chunks with $S$ (K×V,
# float32) on chip; per chunk, with $U, W$ as in exercise 2:
#
# $$\tilde V = U - W S,\qquad
#   O = \text{scale}\cdot\big((Q \odot e^{G}) S + \operatorname{tril}(A_{qk})\, \tilde V\big),\qquad
#   S \leftarrow \operatorname{diag}(e^{b_C}) S + \big(K \odot e^{b_C - G}\big)^\top \tilde V,$$
#
# with $(A_{qk})_{ij} = \sum_\kappa q_{i\kappa} k_{j\kappa} e^{b_{i\kappa} - b_{j\kappa}}$ for
# $j \le i$ (diagonal included, unlike $A$). Rows past $T$ in the last chunk load as
# $k = v = \beta = g = 0$: such a token changes nothing (an identity token), so the padded chunk
# computes the right state. Return `o` in `v.dtype` and the state in float32 (or `None`).

# %%
spec("ch11.kda");

# %% exercise="ch11.kda"
@triton.jit
def kda_kernel(q, k, v, g, beta, h0, o, ht, scale, T, H, K, V, C: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr):
    pass  # your kernel here


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        chunk_size=16):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch11.kda", kda);

# %% [markdown]
# Passed? `linattn.set_impl("kda", "mine")` runs your kernel inside `linattn.kda`, and
# `linattn.which("kda")` says so.

# %%
from linattn.grade import progress_text; print(progress_text())
