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
# # Workbook 15 — serving: padded prompts and the sampling distribution
#
# Companion of `book/15_inference.py`. Two pieces of a server that decodes many sequences at once:
#
# 1. `ch15.padded_prefill` — prefill a batch of prompts of different lengths, padded on the right
#    to one length, in one call, and return for every row the state its own prompt leads to;
# 2. `ch15.next_token_probs` — the distribution temperature and top-k sampling draw the next token
#    from, with temperature 0 as greedy decoding.
#
# Each check runs your function on fresh random inputs and compares it with the truth in float64
# (for the prefill: every prompt run on its own, its padding never seen); a wrong answer that
# matches a known mistake is told which. Grade the whole workbook from a shell with
# `python -m linattn.grade exercises/15_inference.py`.

# %%
import torch

import linattn
from linattn.grade import check

# %% [markdown]
# ## Exercise 1 — `ch15.padded_prefill`: a padded batch, each row's own state
#
# The inputs are those of `linattn.kda` — `q`, `k` `[B, T, H, K]`, `v` `[B, T, H, V]`, `g`
# `[B, T, H, K]` (log-decays), `beta` `[B, T, H]` — for $B$ prompts padded on the right to $T$
# tokens; `lengths` is a list of $B$ ints, row $b$'s prompt being its first `lengths[b]` tokens.
# Return the final states `[B, H, K, V]` — row $b$ must hold exactly the state that running prompt
# $b$ alone gives — from **one** call of `linattn.kda` on the whole batch (`output_final_state=True`).
#
# Chapter 15, section 4, shows why the plain call is wrong: the recurrence
# $S \leftarrow \mathrm{diag}(e^{g_t})S + \beta_t k_t^\top(v_t - k_t\,\mathrm{diag}(e^{g_t})S)$ runs on
# over the padding. Change the inputs so that a padded token leaves $S$ exactly as it was.

# %% exercise="ch15.padded_prefill"
def padded_prefill(q, k, v, g, beta, lengths):
    raise NotImplementedError("not written yet")


# %%
check("ch15.padded_prefill", padded_prefill);

# %% [markdown]
# ## Exercise 2 — `ch15.next_token_probs`: temperature and top-k
#
# From the logits $z$ `[B, vocab]` of the last position, sampling draws token $i$ with probability
#
# $$p_i = \frac{e^{z_i/\theta}}{\sum_{j \in \text{top-}k} e^{z_j/\theta}} \ \text{ for } i \text{ among the } k
#   \text{ largest logits of its row}, \qquad p_i = 0 \text{ otherwise},$$
#
# with temperature $\theta$ (`temperature`) and all logits kept when `top_k` is `None`. At
# `temperature == 0` return the limit $\theta \to 0$: probability 1 on the largest logit of each row
# (greedy decoding), 0 elsewhere. Return `p` `[B, vocab]` in the logits' dtype. (The logits have no
# ties.)

# %% exercise="ch15.next_token_probs"
def next_token_probs(logits, temperature=1.0, top_k=None):
    raise NotImplementedError("not written yet")


# %%
check("ch15.next_token_probs", next_token_probs);

# %% [markdown]
# ## Using what you wrote
#
# A sampler is one line on top of your distribution: `torch.multinomial(next_token_probs(z, θ, k),
# 1, generator=gen)` with a seeded `torch.Generator`. Drawn many times, the tokens' frequencies
# approach `p`; chapter 15 checks its own sampler that way, and that temperature 0 and top-1 give
# the greedy tokens of `linattn.nn.generate`.

# %%
from linattn.grade import progress_text; print(progress_text())
