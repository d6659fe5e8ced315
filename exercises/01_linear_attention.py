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
# # Workbook 01 — linear attention, two ways
#
# Companion of `book/01_linear_attention.py`. You write the two forms of linear attention the
# chapter builds: the **recurrent** form (one token at a time, a K×V state) and the **parallel**
# form (one masked matrix product). Each function has the library's signature, so once
# `ch01.recurrent` passes you can run the whole library through it:
# `linattn.set_impl("linear_attn", "mine")`.
#
# How grading works: every `check(...)` call draws fresh random inputs (several shapes, a length
# that changes every time, K ≠ V, an initial state, a bfloat16 case, an explicit `scale`, a case
# without the final state) and compares your result with the float64 ground truth by relative
# error ‖yours − truth‖ / ‖truth‖. Outputs you never write are NaN in the grader, so they are
# found. When something is wrong, the verdict names the case, the output, the worst position and
# a hint — and, if your result reproduces one of the usual mistakes, a diagnosis naming it. Run the whole workbook from a shell with
# `python -m linattn.grade exercises/01_linear_attention.py` to get a score table.

# %%
import torch

from linattn.grade import check

# %% [markdown]
# ## The shapes and the rules, for both exercises
#
# | argument | shape | meaning |
# |---|---|---|
# | `q`, `k` | `[B, T, H, K]` | queries and keys: batch, time, heads, key dimension |
# | `v` | `[B, T, H, V]` | values (V may differ from K) |
# | `scale` | float or `None` | multiplies every output; `None` means $K^{-1/2}$ |
# | `initial_state` | `[B, H, K, V]` float32, or `None` | the state before the first token (`None` = zeros); convert it to the compute dtype, and never change the caller's tensor in place |
# | `output_final_state` | bool | return the state after the last token, else `None` |
#
# Return a pair `(o, final_state)`:
#
# * `o` of shape `[B, T, H, V]` **in `v.dtype`** (a bfloat16 input gives a bfloat16 output);
# * `final_state` of shape `[B, H, K, V]` in the compute dtype — float32, or float64 for float64
#   inputs — or `None` when `output_final_state` is false.
#
# Compute in float32 (float64 when the inputs are float64): upcast with `.to(acc)` first, since
# sums of many bfloat16 products lose too many bits. The tolerance is 1e-5 for float32 inputs,
# 1e-2 for bfloat16, 1e-10 for float64.

# %% [markdown]
# ## Exercise 1 — `ch01.recurrent`: token by token
#
# Keep a state $S \in \mathbb{R}^{K\times V}$ per batch element and head, starting from
# $S_0$ (`initial_state`, or zeros). For $t = 1, \dots, T$:
#
# $$S_t = S_{t-1} + k_t^\top v_t, \qquad o_t = \text{scale}\cdot q_t\, S_t .$$
#
# $k_t^\top v_t$ is an outer product (K×V), and $q_t S_t$ a row vector times a matrix (a length-V
# row). The order matters: token $t$ sees its own key and value, so add before you read.
#
# Hints: index one token with `q[:, t]` (shape `[B, H, K]`); an outer product for every batch
# element and head at once is `k[:, t, :, :, None] * v[:, t, :, None, :]`; a batched
# vector–matrix product is `torch.einsum("bhk,bhkv->bhv", ...)`. Collect the rows $o_t$ in a list
# and `torch.stack(rows, dim=1)` them, or allocate `o` once and write every position.

# %% exercise="ch01.recurrent"
def recurrent_linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
    raise NotImplementedError("write me")


# %%
check("ch01.recurrent", recurrent_linear_attn);

# %% [markdown]
# ## Exercise 2 — `ch01.parallel`: one masked matrix product
#
# Unroll the recurrence: $S_t = S_0 + \sum_{i \le t} k_i^\top v_i$, so
# $o_t = \text{scale}\cdot\big(\sum_{i\le t} (q_t\cdot k_i)\, v_i + q_t S_0\big)$. For all $t$ at once
# (per batch element and head, with $Q, K \in \mathbb{R}^{T\times K}$, $V \in \mathbb{R}^{T\times V}$):
#
# $$O = \text{scale}\cdot\Big( \big(Q K^\top \odot M\big) V + Q S_0 \Big), \qquad
#   M_{ti} = \begin{cases} 1 & i \le t \\ 0 & i > t \end{cases}, \qquad
#   S_T = S_0 + K^\top V .$$
#
# $M$ is the causal mask: the lower triangle **including** the diagonal (`torch.tril`). A
# strict triangle drops each token's own contribution; the upper one lets tokens see the future —
# both are classic mistakes, and the grader has cases for them.
#
# Hints: `x.transpose(1, 2)` turns `[B, T, H, *]` into `[B, H, T, *]`, where `@` multiplies the
# last two dimensions for every batch element and head; transpose the result back.

# %% exercise="ch01.parallel"
def parallel_linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
    raise NotImplementedError("write me")


# %%
check("ch01.parallel", parallel_linear_attn);

# %% [markdown]
# ## Using what you wrote
#
# Once `ch01.recurrent` has passed, the library can run through your function. Try it:
#
# ```python
# import linattn
# linattn.set_impl("linear_attn", "mine")
# o, _ = linattn.linear_attn(q, k, v)
# print(linattn.which("linear_attn"))     # your ch01.recurrent (...)
# linattn.set_impl("linear_attn", "auto")  # back to the library's own
# ```
#
# Next: chapter 02 (`book/02_chunkwise.py`) splits the sequence into chunks and gets the best of both
# forms; its workbook is `exercises/02_chunkwise.py`.

# %%
from linattn.grade import progress_text; print(progress_text())
