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
# # Workbook 03 — decay
#
# Companion of `book/03_decay.py`. Two exercises: the causal decay mask in log space, then the
# whole chunkwise algorithm for one decay per head and step (RetNet, Mamba-2, Lightning-2).
#
# The grader draws fresh inputs at every check and compares with a float64 reference. Its gates
# include **strong** decays (log-gates down to −20 per step): a bare cumulative product of
# $e^{g_t}$ underflows to 0 within a handful of tokens there, and dividing two of them gives
# $0/0$. Everything you write must work with sums of log-gates and take `exp` only of
# differences that are ≤ 0.

# %%
import torch

from linattn.grade import check

# %% [markdown]
# ## Exercise 1 — `ch03.decay_mask`
#
# Given scalar log-gates `g` of shape `[..., L]` (all ≤ 0), return the causal decay mask
# `D` of shape `[..., L, L]`:
#
# $$b_t = \sum_{s \le t} g_s, \qquad D_{ij} = \begin{cases} e^{\,b_i - b_j} = \prod_{j < s \le i} e^{g_s} & i \ge j \\ 0 & i < j \end{cases}$$
#
# so $D_{ii} = 1$, and $D_{ij}$ is the decay a key written at step $j$ has suffered by step $i$.
# Return it in the dtype of the sums (float32 for float32 gates, float64 for float64 gates).
#
# Hints:
# * `b = g.cumsum(-1)`; `b[..., :, None] - b[..., None, :]` is the matrix of differences;
# * above the diagonal the difference is *positive* and can be large: `exp` of it is `inf`, and
#   `inf * 0` is NaN. Fill those entries with `-inf` **before** `exp` (`masked_fill`).

# %% exercise="ch03.decay_mask"
def decay_mask(g):
    raise NotImplementedError("write me")


# %%
check("ch03.decay_mask", decay_mask);

# %% [markdown]
# ## Exercise 2 — `ch03.scalar_chunkwise`
#
# The recurrence, with one log-decay $g_t$ per batch element, head and step (`g` `[B, T, H]`):
#
# $$S_t = e^{g_t} S_{t-1} + k_t^\top v_t, \qquad o_t = \text{scale}\cdot q_t S_t .$$
#
# Cut the sequence into chunks of $C$ = `chunk_size` tokens (the **last one may be shorter**).
# Inside chunk $[n]$ let $b_1, \dots, b_c$ be the cumulative log-gates *from the chunk start*
# and $b_c$ their total. Then, with $S_{[0]}$ = `initial_state` (or zeros):
#
# $$O_{[n]} = \text{scale}\cdot\Big(\underbrace{(Q_{[n]} \odot \Lambda)\, S_{[n-1]}}_{\text{earlier chunks}}
#   + \underbrace{\big(Q_{[n]} K_{[n]}^\top \odot D\big) V_{[n]}}_{\text{inside the chunk}}\Big),
#   \qquad S_{[n]} = \gamma\, S_{[n-1]} + (K_{[n]} \odot \Gamma)^\top V_{[n]},$$
#
# with $\Lambda_i = e^{b_i}$ (query side), $\Gamma_j = e^{b_c - b_j}$ (key side), total decay
# $\gamma = e^{b_c}$ and $D$ the decay mask of exercise 1 for this chunk's gates. $\Lambda$ and
# $\Gamma$ are column vectors that scale the *rows* of $Q$ and $K$.
#
# Return `(o, final_state)`: `o` `[B, T, H, V]` in `v.dtype`, the state after the last chunk
# `[B, H, K, V]` in the compute dtype (float32, or float64 for float64 inputs) or `None` when
# `output_final_state` is false. `scale=None` means $K^{-1/2}$.
#
# Hints:
# * work in `[B, H, T, *]` layout; the gates become `[B, H, T]` and need a trailing `[..., None]`
#   to scale rows;
# * read $S_{[n-1]}$ for the chunk's output *before* you update it;
# * the grader uses `chunk_size=16`, bfloat16 inputs, strong gates and an initial state.

# %% exercise="ch03.scalar_chunkwise"
def chunk_decay_attn(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                     chunk_size=64):
    raise NotImplementedError("write me")


# %%
check("ch03.scalar_chunkwise", chunk_decay_attn);

# %% [markdown]
# ## Try it on your own inputs
#
# The result must not depend on the chunk size (uncomment once your function runs):

# %%
# q, k, v = torch.randn(3, 1, 50, 2, 16).double()
# g = -torch.rand(1, 50, 2).double()
# o1, _ = chunk_decay_attn(q, k, v, g, chunk_size=4)
# o2, _ = chunk_decay_attn(q, k, v, g, chunk_size=64)
# print((o1 - o2).abs().max())   # ~1e-15

# %% [markdown]
# Next: chapter 04 gives every key dimension its own decay (GLA), and the decay no longer
# factors out of $Q K^\top$.

# %%
from linattn.grade import progress_text; print(progress_text())
