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
# # Workbook 08 — composing affine maps, and scanning them
#
# Companion of `book/08_affine_scan.py`. A chunk (or a whole slice of a sequence) acts on the
# state entering it as $S' = MS + B$, with $M$ `[..., K, K]` and $B$ `[..., K, V]`. You write the
# composition of two such maps, the parallel prefix scan that gives every state entering a
# chunk in $\lceil\log_2 N\rceil$ rounds, and the per-token maps of RWKV-7, whose transition is
# diagonal plus low rank.

# %%
import torch

from linattn.grade import check

# %% [markdown]
# ## Exercise 1 — `ch08.compose`
#
# Apply $(M_1, B_1)$ first, then $(M_2, B_2)$:
#
# $$M_2 (M_1 S + B_1) + B_2 = \underbrace{M_2 M_1}_{M}\, S + \underbrace{M_2 B_1 + B_2}_{B}.$$
#
# Return `(M, B)`. The arguments come in the order `M2, B2, M1, B1` (the later map first, as in
# $f_2 \circ f_1$); matrix products do not commute, and the grader knows it.

# %% exercise="ch08.compose"
def compose(M2, B2, M1, B1):
    raise NotImplementedError("write me")


# %%
check("ch08.compose", compose);

# %% [markdown]
# ## Exercise 2 — `ch08.prefix_scan`
#
# `M` `[B, H, N, K, K]`, `B` `[B, H, N, K, V]`: $N$ maps along axis 2. Return `(M_pre, B_pre)` of the
# same shapes where position $n$ holds maps $0, 1, \dots, n$ composed ("0 first, $n$ last"):
# an **inclusive** scan. Hillis–Steele: for $s = 1, 2, 4, \dots < N$, replace every position
# $n \ge s$ by (its map) $\circ$ (the map at $n - s$), all positions at once, with one batched
# `compose` on slices `[:, :, s:]` and `[:, :, :-s]`. After the round with step $s$, position $n$
# covers maps $\max(0, n - 2s + 1) \dots n$.

# %% exercise="ch08.prefix_scan"
def prefix_scan(M, B):
    raise NotImplementedError("write me")


# %%
check("ch08.prefix_scan", prefix_scan);

# %% [markdown]
# ## Exercise 3 — `ch08.rwkv7_maps`
#
# RWKV-7's transition is diagonal plus low rank. `seeds/004` writes it for a $V\times K$ state
# updated on the right, $S_t = S_{t-1}A_t + v_t^\top k_t$ with
# $A_t = \operatorname{diag}(w_t) - \hat\kappa_t^\top (a_t \odot \hat\kappa_t)$ (row vectors). Our state is
# its transpose ($K\times V$, transitions on the left), and the same token step reads
#
# $$S_t = \operatorname{diag}(w_t)\,S_{t-1} - (a_t\odot\hat\kappa_t)^\top\big(\hat\kappa_t S_{t-1}\big) + k_t^\top v_t :$$
#
# $\hat\kappa_t S_{t-1}$ reads the state at $\hat\kappa_t$, and what was read is
# removed along $a_t\odot\hat\kappa_t$. Write `rwkv7_maps(w, kappa_hat, a, k, v)`: `w`, `kappa_hat`,
# `a`, `k` are `[B, H, T, K]`, `v` is `[B, H, T, V]`; return `M` `[B, H, T, K, K]` and `B`
# `[B, H, T, K, V]`, one map per token, with $S_t = M_t S_{t-1} + B_t$. The grader compares them with maps it reads off a token
# loop of the recurrence (it runs one step on probe states), so the transpose of the right
# answer — `seeds/004`'s $A_t$ taken over as it stands — fails.
#
# Then feed your maps to your `prefix_scan` (axis 2 holds the tokens): position $t$ applied to
# $S_0$ is the state after token $t$. Which part of chapter 07's WY derivation changes when the
# "key" that is removed ($a_t \odot \hat\kappa_t$) differs from the one that is read ($\hat\kappa_t$)?

# %% exercise="ch08.rwkv7_maps"
def rwkv7_maps(w, kappa_hat, a, k, v):
    raise NotImplementedError("write me")


# %%
check("ch08.rwkv7_maps", rwkv7_maps);

# %%
from linattn.grade import progress_text; print(progress_text())
