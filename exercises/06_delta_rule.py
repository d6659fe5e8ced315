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
# # Workbook 06 — the delta rule, token by token
#
# Companion of `book/06_delta_rule.py`. You write DeltaNet's recurrence, then its decayed forms
# (Gated DeltaNet with one decay per head, KDA with one decay per key dimension). Both have the
# library's signature, so once they pass, `linattn.set_impl("delta_rule", "mine")` and
# `linattn.set_impl("kda", "mine")` run the library through your code.
#
# Every `check(...)` draws fresh random inputs (lengths that change every time, K ≠ V, an initial
# state, a bfloat16 case, per-head and per-dimension gates, strong decays down to $-20$ per
# token) and compares with the float64 ground truth by relative error. Outputs you never write are
# NaN in the grader. Grade the whole workbook from a shell with
# `python -m linattn.grade exercises/06_delta_rule.py`.

# %%
import torch

from linattn.grade import check

# %% [markdown]
# ## Shapes and rules
#
# | argument | shape | meaning |
# |---|---|---|
# | `q`, `k` | `[B, T, H, K]` | queries, keys (keys are L2-normalised: $\lVert k_t\rVert = 1$) |
# | `v` | `[B, T, H, V]` | values |
# | `g` | `[B, T, H]` or `[B, T, H, K]` | log-decays $\le 0$ (float32): per head, or per key dimension |
# | `beta` | `[B, T, H]` | the write strength $\beta_t \in [0, 2]$ |
# | `scale`, `initial_state`, `output_final_state` | | as in every chapter: `None` → $K^{-1/2}$; `[B, H, K, V]`; bool |
#
# Return `(o, final_state)`: `o` `[B, T, H, V]` in `v.dtype`; the final state `[B, H, K, V]` in the
# compute dtype (float32, or float64 for float64 inputs), or `None` when not asked for.

# %% [markdown]
# ## Exercise 1 — `ch06.delta_rule`: DeltaNet
#
# The state predicts the value of key $k_t$ as $k_t S_{t-1}$; the write corrects that prediction by
# a fraction $\beta_t$ of the error:
#
# $$r_t = v_t - k_t S_{t-1}, \qquad S_t = S_{t-1} + \beta_t\, k_t^\top r_t, \qquad
#   o_t = \text{scale}\cdot q_t S_t .$$
#
# Hints: `torch.einsum("bhk,bhkv->bhv", k[:, t], S)` is $k_t S$ for every batch element and head;
# `beta[:, t, :, None, None]` broadcasts $\beta_t$ over the K×V outer product.

# %% exercise="ch06.delta_rule"
def recurrent_delta_rule(q, k, v, beta, *, scale=None, initial_state=None,
                         output_final_state=False):
    raise NotImplementedError("write me")


# %%
check("ch06.delta_rule", recurrent_delta_rule);

# %% [markdown]
# ## Exercise 2 — `ch06.kda`: Gated DeltaNet and KDA
#
# Decay the state first, then correct the *decayed* state:
#
# $$\tilde S = D_t S_{t-1},\quad D_t = \operatorname{diag}(e^{g_t}),\qquad
#   S_t = \tilde S + \beta_t\, k_t^\top (v_t - k_t \tilde S), \qquad o_t = \text{scale}\cdot q_t S_t .$$
#
# For `g` of shape `[B, T, H]` the decay is the same for every key dimension (Gated DeltaNet): add a
# trailing axis, `g[..., None]`, and broadcasting does the rest. $D_t$ scales the **rows** of $S$
# (one row per key dimension): `g[:, t, :, :, None].exp() * S`.
#
# The classic mistake is to compute the residual against the undecayed $S_{t-1}$ and decay
# afterwards; the grader has a case for it.

# %% exercise="ch06.kda"
def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False):
    raise NotImplementedError("write me")


# %%
check("ch06.kda", recurrent_kda);

# %% [markdown]
# ## Using what you wrote
#
# ```python
# import linattn
# linattn.set_impl("kda", "mine")          # the library's kda now runs your recurrence
# print(linattn.which("kda"))
# linattn.set_impl("kda", "auto")
# ```
#
# Next: chapter 07 (`book/07_wy_kda.py`) turns this recurrence into chunks with matmuls; its
# workbook is `exercises/07_wy_kda.py`.

# %%
from linattn.grade import progress_text; print(progress_text())
