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
