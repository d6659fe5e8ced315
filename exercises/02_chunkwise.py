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
# On Colab, install the book's library first (does nothing elsewhere).
import subprocess, sys
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "linattn @ git+https://github.com/linattn/linattn"], check=True)

# %% [markdown]
# # Workbook 02 — chunkwise linear attention
#
# Companion of `book/02_chunkwise.py`. You write the chunkwise form: a short loop over chunks that
# carries the K×V state from chunk to chunk, with a small masked attention inside each chunk.
# Same signature as the library's `linattn.chunk.linear_attn`; once it passes,
# `linattn.set_impl("linear_attn", "mine")` runs the library through it (it takes precedence over
# your chapter-01 recurrence, being the more advanced level).
#
# The grader draws fresh inputs at every check and compares with the float64 recurrence. It
# calls your function with `chunk_size=16` on lengths that are rarely a multiple of 16 (and one
# shorter than a single chunk), with an initial state, bfloat16 inputs, an explicit `scale`, and
# a case without the final state. Note that it checks values only: a token-by-token loop would
# pass too, but it would not teach you anything you did not already write in workbook 01.

# %%
import torch

from linattn.grade import check

# %% [markdown]
# ## Exercise — `ch02.chunkwise`
#
# Per batch element and head, cut the sequence into chunks of $C$ = `chunk_size` tokens:
# $Q_{[n]}, K_{[n]} \in \mathbb{R}^{c\times K}$ and $V_{[n]} \in \mathbb{R}^{c\times V}$ with
# $c = C$, except that the **last chunk may be shorter** ($T$ need not be a multiple of $C$).
# With $S_{[0]}$ = `initial_state` (or zeros), for $n = 1, 2, \dots$:
#
# $$O_{[n]} = \text{scale}\cdot\Big( \underbrace{Q_{[n]} S_{[n-1]}}_{\text{earlier chunks}}
#    + \underbrace{\big(Q_{[n]} K_{[n]}^\top \odot M\big) V_{[n]}}_{\text{inside the chunk}} \Big),
#    \qquad S_{[n]} = S_{[n-1]} + K_{[n]}^\top V_{[n]},$$
#
# with $M$ the c×c lower triangle **including** the diagonal. Return `(o, final_state)` exactly as
# in workbook 01: `o` `[B, T, H, V]` in `v.dtype`, the state after the last chunk
# `[B, H, K, V]` in the compute dtype (float32, or float64 for float64 inputs) or `None`.
#
# Hints:
# * work in `[B, H, T, *]` layout (`x.transpose(1, 2)`), so that `@` multiplies per batch and head;
# * loop `for s in range(0, T, C)` with `e = min(s + C, T)`; slice the mask to the chunk's length;
# * read $S_{[n-1]}$ for the chunk's output *before* you add $K_{[n]}^\top V_{[n]}$ — reading it
#   afterwards counts the chunk twice;
# * compute in float32/float64 (`.to(acc)`) and cast `o` back at the end.

# %% exercise="ch02.chunkwise"
def chunk_linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                      chunk_size=64):
    raise NotImplementedError("write me")


# %%
check("ch02.chunkwise", chunk_linear_attn);

# %% [markdown]
# ## Try it on your own inputs
#
# Your function must give the same result for every chunk size — a quick self-test before the
# grader (uncomment once your function runs):

# %%
# q, k, v = torch.randn(3, 1, 50, 2, 16).double()
# o1, _ = chunk_linear_attn(q, k, v, chunk_size=4)
# o2, _ = chunk_linear_attn(q, k, v, chunk_size=64)
# print((o1 - o2).abs().max())   # ~1e-15

# %% [markdown]
# Next: chapter 03 adds a decay to the state, and the chunkwise form has to carry it across chunk
# boundaries.

# %%
from linattn.grade import progress_text; print(progress_text())
