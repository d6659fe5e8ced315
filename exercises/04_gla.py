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
# # Workbook 04 — gated linear attention
#
# Companion of `book/04_gla.py`. You write GLA twice, with the library's signature
# `gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False)`: first token by
# token, then chunkwise. Once they pass, `linattn.set_impl("gla", "mine")` runs the library's
# `linattn.gla` through your most advanced passed version.
#
# `g` holds log-decays ≤ 0, either `[B, T, H, K]` (GLA: one decay per key dimension) or
# `[B, T, H]` (one per head); your functions must take both. The grader's cases include strong
# gates (down to −20 per step), lengths that are not a multiple of the chunk size, an initial
# state, K ≠ V, bfloat16 and float64 inputs.

# %%
import torch

from linattn.grade import check

# %% [markdown]
# ## Exercise 1 — `ch04.recurrent`
#
# $$S_t = \operatorname{diag}(e^{g_t})\, S_{t-1} + k_t^\top v_t, \qquad o_t = \text{scale}\cdot q_t S_t,$$
#
# with $S$ of shape K×V: $e^{g_t}$ scales **row** $\kappa$ of $S$ by $e^{g_{t\kappa}}$. Start from
# `initial_state` (or zeros), compute in float32 (float64 for float64 inputs), return `o` in
# `v.dtype` and the final state in the compute dtype (or `None`).
#
# Hint: `a = g.exp()`; if `g.dim() == 3` use `g[..., None]` so that one decay covers every row.

# %% exercise="ch04.recurrent"
def recurrent_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False):
    raise NotImplementedError("write me")


# %%
check("ch04.recurrent", recurrent_gla);

# %% [markdown]
# ## Exercise 2 — `ch04.chunkwise`
#
# Chunks of $C$ = `chunk_size` tokens (the last may be shorter). Inside chunk $[n]$, with
# $b_i \in \mathbb{R}^K$ the cumulative log-gates from the chunk start and $b_c$ the last one:
#
# $$\Lambda_i = e^{b_i},\quad \Gamma_j = e^{b_c - b_j},\quad \gamma = e^{b_c}\qquad(\text{each in } \mathbb{R}^K)$$
#
# $$O_{[n]} = \text{scale}\cdot\big((Q_{[n]} \odot \Lambda) S_{[n-1]} + P V_{[n]}\big),\qquad
#   P_{ij} = \sum_\kappa q_{i\kappa} k_{j\kappa}\, e^{\,b_{i\kappa} - b_{j\kappa}}\ (i \ge j),\ 0 \text{ above},$$
#
# $$S_{[n]} = \operatorname{diag}(\gamma)\, S_{[n-1]} + (K_{[n]} \odot \Gamma)^\top V_{[n]} .$$
#
# Compute $P$ in log space as written: the difference $b_i - b_j$ per dimension, masked to
# $-\infty$ above the diagonal **before** `exp`, then a sum over $\kappa$ (`torch.einsum`). Do
# **not** split it as $(Q \odot e^{b})(K \odot e^{-b})^\top$: with strong gates $e^{-b}$ is
# $e^{+320}$ and overflows float32. (Chapter 05 shows how to make most of $P$ a matmul safely.)
#
# Hints: the `[B, H, T, *]` layout; `g[..., None]` for `[B, T, H]` gates (it broadcasts over K);
# read $S_{[n-1]}$ before updating it; the grader uses `chunk_size=16`.

# %% exercise="ch04.chunkwise"
def chunk_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
              chunk_size=64):
    raise NotImplementedError("write me")


# %%
check("ch04.chunkwise", chunk_gla);

# %% [markdown]
# ## Use it
#
# Once `ch04.chunkwise` has passed, the library can run through your code (uncomment):

# %%
# import linattn
# linattn.set_impl("gla", "mine")
# args = linattn.testing.make_inputs("gla", T=50)
# o, _ = linattn.gla(**args)
# print(linattn.which("gla"))
# linattn.set_impl("gla", "auto")

# %%
from linattn.grade import progress_text; print(progress_text())
