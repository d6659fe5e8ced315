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
# # Workbook 07 — the WY representation and chunkwise KDA
#
# Companion of `book/07_wy_kda.py`. Four steps, each graded on its own: the inverse of a unit
# lower-triangular matrix, the WY factors $U$ and $W$ of one chunk, the chunk as an affine map
# $S' = MS + B$, and finally chunkwise KDA with the library's signature (it unlocks
# `linattn.set_impl("kda", "mine")` at the chunk level).
#
# The per-chunk exercises take tensors of one chunk with any leading dimensions (`[B, H, C, …]`),
# and are graded against float64 truths computed *another way*: `torch.linalg.solve_triangular`
# for the inverse, and the token-by-token recurrence of chapter 06 run on chosen entering states
# for $U, W, M, B$.

# %%
import torch

from linattn.grade import check

# %% [markdown]
# ## Exercise 1 — `ch07.unit_lower_inverse`
#
# `A` has shape `[..., C, C]` and is **strictly** lower triangular ($A_{ij} = 0$ for $j \ge i$).
# Return $X = (I + A)^{-1}$. Forward substitution builds $X$ row by row from $(I + A)X = I$:
#
# $$X_i = e_i - \sum_{j < i} A_{ij}\, X_j ,$$
#
# where $X_i$ is row $i$ and $e_i$ the unit row. $X$ is unit lower triangular too, so row $i$ only
# has entries in columns $\le i$: `X[..., i, :i] = -(A[..., i:i+1, :i] @ X[..., :i, :i])`.
# Do not call `torch.linalg.solve_triangular` or `torch.linalg.inv` here: that is what you are
# being checked against.

# %% exercise="ch07.unit_lower_inverse"
def unit_lower_inverse(A):
    raise NotImplementedError("write me")


# %%
check("ch07.unit_lower_inverse", unit_lower_inverse);

# %% [markdown]
# ## Exercise 2 — `ch07.wy_factors`: $U$ and $W$ of one chunk
#
# Inputs for one chunk of $C$ tokens: `k` `[..., C, K]` (unit rows), `v` `[..., C, V]`, `g`
# `[..., C, K]` raw log-gates, `beta` `[..., C]`. With $b_i = g_1 + \dots + g_i$ (cumulative within
# the chunk; $G$ stacks the rows $b_i$) and the β-weighted residuals $\tilde v_i = \beta_i (v_i - k_i D_i s_{i-1})$:
#
# $$A_{ij} = \beta_i \sum_d k_{id}\, k_{jd}\, e^{b_{id} - b_{jd}} \quad (i > j,\ \text{else } 0), \qquad
#   U = (I + A)^{-1} \operatorname{diag}(\beta)\, V, \qquad
#   W = (I + A)^{-1} \operatorname{diag}(\beta)\, (K \odot e^{G}),$$
#
# so that $\tilde V = U - W S$ for every state $S$ entering the chunk. Return `(U, W)` in float32
# (float64 for float64 inputs).
#
# Two details the grader checks: $A$ is **strictly** lower triangular (the diagonal would count
# a token's own write before it happens), and $\beta_i$ multiplies **row** $i$ (the token being
# written), not column $j$. Form $e^{b_i - b_j}$ only where $i > j$ (mask *before* `exp`: above the
# diagonal the exponent is positive and can overflow).

# %% exercise="ch07.wy_factors"
def wy_factors(k, v, g, beta):
    raise NotImplementedError("write me")


# %%
check("ch07.wy_factors", wy_factors);

# %% [markdown]
# ## Exercise 3 — `ch07.chunk_map`: the chunk as $S' = M S + B$
#
# Same inputs. Let $K_{\text{dec}}$ have rows $k_i \odot e^{b_C - b_i}$ (each key decayed to the end
# of the chunk) and $\gamma = e^{b_C}$ (the decay over the whole chunk). Then
#
# $$M = \operatorname{diag}(\gamma) - K_{\text{dec}}^\top W \quad[K\times K], \qquad
#   B = K_{\text{dec}}^\top U \quad[K\times V].$$
#
# Return `(M, B)`. Reuse your `wy_factors`. Compute $b_C - b_i$ as the sum of the gates *after*
# $i$ (e.g. a reversed cumulative sum), not as a difference of two large numbers.

# %% exercise="ch07.chunk_map"
def kda_chunk_map(k, v, g, beta):
    raise NotImplementedError("write me")


# %%
check("ch07.chunk_map", kda_chunk_map);

# %% [markdown]
# ## Exercise 4 — `ch07.chunk_kda`: chunkwise KDA
#
# The library's signature, with `chunk_size`. For each chunk $n$ (the last may be shorter: pad it
# with zeros, which are identity tokens, or slice it), with $S$ the state entering it:
#
# $$\tilde V = U - W S,\qquad
#   O = \text{scale}\cdot\big((Q \odot e^{G}) S + \operatorname{tril}(A_{qk})\, \tilde V\big),\qquad
#   S \leftarrow \operatorname{diag}(e^{b_C}) S + K_{\text{dec}}^\top \tilde V,$$
#
# with $(A_{qk})_{ij} = \sum_d q_{id} k_{jd} e^{b_{id} - b_{jd}}$ for $j \le i$ (diagonal included).
# `g` may be `[B, T, H]` (one decay per head): give it a trailing axis of size 1. Inputs arrive as
# `[B, T, H, …]`; `x.transpose(1, 2)` gives `[B, H, T, …]`, then slice chunks along axis 2.

# %% exercise="ch07.chunk_kda"
def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              chunk_size=64):
    raise NotImplementedError("write me")


# %%
check("ch07.chunk_kda", chunk_kda);

# %% [markdown]
# Next: chapter 08 (`book/08_affine_scan.py`) composes these chunk maps, scans them in parallel and
# splits a sequence across processes; its workbook is `exercises/08_affine_scan.py`.

# %%
from linattn.grade import progress_text; print(progress_text())
