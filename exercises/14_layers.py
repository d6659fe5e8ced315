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
# # Workbook 14 — layers: the log-space gate and the decode loop
#
# Companion of `book/14_training.py` (and of `book/15_inference.py` for the second exercise). You
# write the GLA layer's forget gate in log space, then the loop that generation runs: a prompt in
# one call, then one token per call with the state carried — which must give exactly what the
# layer computes for the whole sequence at once.
#
# Every `check(...)` draws fresh random inputs and compares with the ground truth by relative
# error. Grade the whole workbook from a shell with `python -m linattn.grade exercises/14_layers.py`.

# %%
import torch
import torch.nn.functional as F

from linattn.grade import check

# %% [markdown]
# ## Exercise 1 — `ch14.log_gate`: the GLA gate, in log space
#
# The GLA paper's forget gate is $\alpha_t = \sigma(z_t)^{1/\tau}$ with the low-rank pre-activation
# $z_t = x_t W_\alpha^1 W_\alpha^2 + c_\alpha$ (the bias $c_\alpha$; $b$ is the cumulative log-gate) and the temperature $\tau = 16$. The kernels take the log-decay
# $g_t = \log\alpha_t \le 0$, so write the gate in log space:
#
# $$g = \frac{\log \sigma(z)}{\tau}.$$
#
# | argument | shape | meaning |
# |---|---|---|
# | `z` | any, e.g. `[B, T, H, K]` | gate pre-activations (float32, bfloat16 or float64) |
# | `tau` | number | the temperature ($16$ in the paper) |
#
# Return `g` of `z`'s shape in float32 (float64 when `z` is float64). The grader includes gates
# deep in the saturated range ($z \approx -200$), where $\sigma(z)$ rounds to $0$ in float32 and
# its log to $-\infty$ — a gate the kernels cannot use. `F.logsigmoid` computes
# $\log\sigma(z) = -\mathrm{softplus}(-z)$ without forming $\sigma(z)$.

# %% exercise="ch14.log_gate"
def log_gate(z, tau=16.0):
    raise NotImplementedError("write me")


# %%
check("ch14.log_gate", log_gate);

# %% [markdown]
# ## Exercise 2 — `ch14.decode`: prefill, then one token at a time
#
# A layer of `linattn.nn` is called as `y, state = layer(x, state)` with `x` `[B, T, d]`; `state`
# is `None` at the start of a sequence, and the returned state continues it. Write the loop of
# generation for a given input sequence: the first `prefill` tokens in one call, then every later
# token in a call of its own, each starting from the state the previous call returned. Return all
# outputs concatenated along time, `[B, T, d]`.
#
# The grader compares with `layer(x)[0]` — the whole sequence at once — for GLA, DeltaNet, Gated
# DeltaNet, KDA and softmax attention (whose "state" is its KV cache), with prefills of one token,
# a few, and all but one.

# %% exercise="ch14.decode"
def prefill_then_decode(layer, x, prefill):
    raise NotImplementedError("write me")


# %%
check("ch14.decode", prefill_then_decode);

# %% [markdown]
# ## Using what you wrote
#
# Your `prefill_then_decode` is what `linattn.nn.generate` does, with the next token chosen by
# the model instead of read from `x`. Chapter 15 (`book/15_inference.py`) measures what each
# generated token costs.

# %%
from linattn.grade import progress_text; print(progress_text())
