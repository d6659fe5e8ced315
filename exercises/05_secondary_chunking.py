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
# # Workbook 05 — secondary chunking
#
# Companion of `book/05_secondary_chunking.py`. You build the intra-chunk matrix $P$ of GLA
# for one chunk from $c \times c$ tiles: tiles below the diagonal as matrix products after
# absorbing the decay, diagonal tiles in log space.

# %%
import torch

from linattn.grade import check

# %% [markdown]
# ## Exercise — `ch05.intra_matrix`
#
# **Input.** One chunk per batch element and head: `q`, `k` `[B, H, C, K]` and per-dimension
# log-gates `g` `[B, H, C, K]` (all ≤ 0, float32) of *this chunk*; `sub_chunk_size` $c$ divides $C$.
#
# **Output.** `P` `[B, H, C, C]` in the compute dtype (float32, float64 for float64 inputs), no scale:
#
# $$b_m = \sum_{s \le m} g_s \in \mathbb{R}^K,\qquad P_{mn} = \sum_{\kappa} q_{m\kappa}\, k_{n\kappa}\, e^{\,b_{m\kappa} - b_{n\kappa}}\quad (m \ge n),\qquad P_{mn} = 0\ (m < n).$$
#
# **Tiles.** Split rows and columns into sub-chunks of $c$ tokens; tile $(i, j)$ covers query
# sub-chunk $i$ and key sub-chunk $j$.
#
# * Tiles **above** the diagonal ($j > i$) are 0.
# * A tile **below** the diagonal ($j < i$) is one matrix product. Count positions in the chunk
#   from 1 (so $b_0 = 0$) and sub-chunks from 0, as the code does; sub-chunk $i$ holds positions
#   $ic+1, \dots, (i+1)c$, and $r = ic$ is the last position before it. Every key $n$ of the tile
#   is at or before $r$ and every query $m$ after it, so
#   $$e^{\,b_m - b_n} = \underbrace{e^{\,b_m - b_r}}_{\le 1\text{, query side}} \cdot \underbrace{e^{\,b_r - b_n}}_{\le 1\text{, key side}}$$
#   and $P_{[i][j]} = \big(Q_{[i]} \odot e^{G_{[i]} - b_r}\big)\big(K_{[j]} \odot e^{\,b_r - G_{[j]}}\big)^\top$
#   ($G_{[i]}$ stacks the rows $b_m$ of sub-chunk $i$; in 0-based code, $b_r$ is `b[i*c - 1]`, and 0 for $i = 0$). Both exponents are ≤ 0, so nothing can overflow. (In a kernel this
#   product runs on tensor cores in bf16; you may write it in float32.)
# * A **diagonal** tile ($j = i$) cannot be split like that: for $n \le m$ inside one sub-chunk
#   one side would need $e^{+(\dots)}$. Compute it in log space:
#   $e^{b_m - b_n}$ per dimension, masked to 0 for $m < n$ **before** `exp`, summed over $\kappa$.
#
# The grader uses strong gates (down to −20 per step, so $b$ reaches −1000 within a chunk):
# absorbing relative to the *chunk* start ($e^{-b_n}$ on the key side), or doing the diagonal
# tiles by absorption, produces `inf` and NaN there.

# %% exercise="ch05.intra_matrix"
def intra_chunk_matrix(q, k, g, *, sub_chunk_size=16):
    raise NotImplementedError("write me")


# %%
check("ch05.intra_matrix", intra_chunk_matrix);

# %% [markdown]
# ## Try it on your own inputs
#
# Compare with the quadratic formula on a small chunk (uncomment once your function runs):

# %%
# from linattn.naive.gated import attention_matrix
# q, k = torch.randn(2, 1, 1, 32, 8).double()
# g = -3 * torch.rand(1, 1, 32, 8).double()
# print((intra_chunk_matrix(q, k, g, sub_chunk_size=8) - attention_matrix(q, k, g)).abs().max())

# %%
from linattn.grade import progress_text; print(progress_text())
