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
# # Workbook 14 — build the GLA layer, train it, decode with it
#
# Companion of `book/14_training.py`. You build the GLA layer of the chapter from its weights, one
# piece at a time, then put the pieces together, train a small model with your layer, and write
# the decoding loop that runs it one token at a time:
#
# 1. `ch14.heads` — split the projected channels into $q, k, v$ heads;
# 2. `ch14.gate` — the low-rank forget gate, in log space;
# 3. `ch14.short_conv` — the short causal convolution and its cache;
# 4. `ch14.head_norm` — the LayerNorm of each head's output;
# 5. `ch14.output_gate` — the Swish output gate and the output projection;
# 6. `ch14.gla_layer` — the whole layer; then a few training steps on MQAR with it;
# 7. `ch14.decode` — one token per step, the state carried from step to step.
#
# Each check compares your function with the same piece of `linattn.nn.GatedLinearAttention`, in
# float64 with the same weights, on fresh random inputs; a wrong answer that matches a known
# mistake is told which. The weights come as the layer's `state_dict` (a dict `params`; the
# `nn.Linear` weights are stored out × in, so a projection is `x @ W.T`):
#
# | name | shape | role |
# |---|---|---|
# | `qkv.weight` | $[H(2K+V),\ d]$ | $W_Q, W_K, W_V$ stacked: one matrix product gives $[q \mid k \mid v]$ |
# | `conv.conv.weight` | $[H(2K+V),\ 1,\ w]$ | the short convolution's taps, one row per channel |
# | `gate.proj.0.weight`, `gate.proj.1.weight`, `gate.proj.1.bias` | $[r, d]$, $[HK, r]$, $[HK]$ | the gate's $W_\alpha^1$, $W_\alpha^2$, $c_\alpha$ |
# | `norm.weight`, `norm.bias` | $[V]$, $[V]$ | the per-head LayerNorm, shared by the heads |
# | `out_gate.weight`, `out_gate.bias` | $[HV, d]$, $[HV]$ | the output gate's $W_r$, $c_r$ |
# | `out.weight` | $[d, HV]$ | the output projection $W_O$ |
#
# Grade the whole workbook from a shell with `python -m linattn.grade exercises/14_layers.py`.

# %%
import torch
import torch.nn.functional as F

import linattn
from linattn.grade import check

# %% [markdown]
# ## Exercise 1 — `ch14.heads`: from one projection to $q, k, v$ heads
#
# The GLA paper (§3.1) projects the input three times, $Q = XW_Q$, $K = XW_K$, $V = XW_V$, and
# §3.4 splits each into $H$ heads of $d_k/H$ and $d_v/H$ features. The layer does the three
# products as one, `u = x @ params["qkv.weight"].T`, whose last axis holds the channels of $q$,
# then of $k$, then of $v$ — $HK$, $HK$ and $HV$ of them — and within each, head after head.
# Split `u` `[B, T, H(2K+V)]` into `q`, `k` `[B, T, H, K]` and `v` `[B, T, H, V]`.

# %% exercise="ch14.heads"
def split_heads(qkv, n_heads, head_k, head_v):
    raise NotImplementedError("not written yet")


# %%
check("ch14.heads", split_heads);

# %% [markdown]
# ## Exercise 2 — `ch14.gate`: the low-rank gate, in log space
#
# The forget gate of GLA is one number per key dimension and token, $\alpha_t \in (0, 1)^{d_k}$
# (§3.1, with the low-rank $W_\alpha = W_\alpha^1 W_\alpha^2$ of rank 16 from §3.4):
#
# $$z_t = x_t W_\alpha^1 W_\alpha^2 + c_\alpha, \qquad \alpha_t = \sigma(z_t)^{1/\tau}, \qquad \tau = 16 .$$
#
# The kernels take the log-decay $g_t = \log\alpha_t \le 0$, and the paper applies the
# temperature in log space too (its footnote to §3.1): $g_t = \log\sigma(z_t)/\tau$. Write
# `low_rank_gate(x, w1, w2, bias, n_heads, tau)`, returning $g$ `[B, T, H, K]`. `w1` `[r, d]` and
# `w2` `[HK, r]` are stored out × in like every `nn.Linear` weight.
#
# Two cases to think about: a gate the layer wants to close completely has $z \ll 0$ — the grader
# includes float32 biases down to $-200$, where $\sigma(z)$ rounds to $0$ — and a gate that keeps
# everything has $z \gg 0$, where $\alpha$ must come out close to 1, not close to 0.

# %% exercise="ch14.gate"
def low_rank_gate(x, w1, w2, bias, n_heads, tau=16.0):
    raise NotImplementedError("not written yet")


# %%
check("ch14.gate", low_rank_gate);

# %% [markdown]
# ## Exercise 3 — `ch14.short_conv`: the short causal convolution
#
# Before the split into heads, the layer mixes each channel with its $w - 1$ predecessors
# (depthwise: channel $c$ has its own taps `weight[c, 0, :]`) and applies SiLU:
#
# $$u'_{t,c} = \mathrm{SiLU}\Big(\sum_{i=0}^{w-1} W_{c,i}\; u_{t-(w-1)+i,\,c}\Big).$$
#
# This is `F.conv1d(..., groups=C)` with the taps in the order `F.conv1d` uses (it does not flip
# them). Output $t$ must read inputs up to $t$ only — the layer may not see the future. At the
# start of a sequence the inputs before it are zeros; to continue a sequence, `cache`
# `[B, w−1, C]` holds the last $w-1$ inputs of the previous call. Return the output `[B, T, C]`
# and the cache for the next call, the last $w - 1$ inputs seen (the grader also calls it with
# fewer new tokens than the cache holds).

# %% exercise="ch14.short_conv"
def short_conv(u, weight, cache=None):
    raise NotImplementedError("not written yet")


# %%
check("ch14.short_conv", short_conv);

# %% [markdown]
# ## Exercise 4 — `ch14.head_norm`: the LayerNorm of each head
#
# The operation's output $o$ `[B, T, H, V]` is normalised head by head (§3.4: "LayerNorm is
# applied after the output of each head individually"), with one learned scale and shift `[V]`
# shared by the heads:
#
# $$\mathrm{LN}(o)_{t,h} = \frac{o_{t,h} - \mu_{t,h}}{\sqrt{\sigma^2_{t,h} + \varepsilon}} \odot \gamma + \beta_{\text{ln}},$$
#
# where $\mu_{t,h}$ and $\sigma^2_{t,h}$ are the mean and the (biased) variance of the $V$
# features of head $h$ at token $t$.

# %% exercise="ch14.head_norm"
def head_norm(o, weight, bias, eps=1e-5):
    raise NotImplementedError("not written yet")


# %%
check("ch14.head_norm", head_norm);

# %% [markdown]
# ## Exercise 5 — `ch14.output_gate`: the output gate and the output projection
#
# The normalised heads are concatenated, gated and projected back to the model width — the
# paper's eqs. (10)–(11), multi-head in §3.4:
#
# $$R_t = \mathrm{Swish}(x_t W_r + c_r), \qquad y_t = \big(R_t \odot \mathrm{concat}_h\, \mathrm{LN}(o_{t,h})\big)\, W_O .$$
#
# `o` is the output of `head_norm`, `[B, T, H, V]`; `x` `[B, T, d]` the layer's input; `w_r`
# `[HV, d]`, `b_r` `[HV]`, `w_o` `[d, HV]`. Return `y` `[B, T, d]`.

# %% exercise="ch14.output_gate"
def output_gate(o, x, w_r, b_r, w_o):
    raise NotImplementedError("not written yet")


# %%
check("ch14.output_gate", output_gate);

# %% [markdown]
# ## Exercise 6 — `ch14.gla_layer`: the whole layer
#
# Put the pieces together in the layer's order:
#
# 1. `u = x @ params["qkv.weight"].T`, then `short_conv` from `conv_cache`, then `split_heads`;
# 2. `g = low_rank_gate(x, ...)` from the `gate.*` weights ($\tau = 16$);
# 3. `o, S = linattn.gla(q, k, v, g, initial_state=initial_state, output_final_state=True)` — the
#    operation of chapters 04–05, which trains through the backward of chapter 12;
# 4. `head_norm`, then `output_gate`.
#
# Read $H$ from `n_heads`, $V$ from `params["norm.weight"]` and $K$ from the gate's output size.
# Return `(y, S, new_conv_cache)`: what a caller needs to continue the sequence. The grader runs
# float64 layers from the start of a sequence and continuing after a prefix, and one float32 layer.

# %% exercise="ch14.gla_layer"
def gla_layer(x, params, n_heads, *, initial_state=None, conv_cache=None):
    raise NotImplementedError("not written yet")


# %%
layer_verdict = check("ch14.gla_layer", gla_layer)

# %% [markdown]
# ### Train it
#
# A layer that computes the right outputs must also pass the right gradients back to its
# weights. The cell below builds the one-block MQAR model of chapter 14 twice on the same weights
# — once with the library's GLA layer, once with yours — and compares the gradients of one loss
# with respect to every weight; then it trains the model with your layer for a few steps. In
# that time the loss falls from about $\log(\text{vocab})$ to about $\log(\text{vocab}/2)$: the
# model has learned that an answer is always one of the values (recalling *which* one takes the
# longer runs of the chapter).

# %%
from linattn.grade.catalog import ch14

if layer_verdict.passed:
    err = ch14.gradient_error(gla_layer)
    print(f"gradients of every weight, your layer against the library's: relative error ≤ {err:.1e}")
    assert err < 1e-4, "your layer's outputs are right but its gradients are not: is something detached?"
    run = ch14.train(gla_layer)
    first, last = (sum(run.losses[s]) / 10 for s in (slice(0, 10), slice(-10, None)))
    print(f"{len(run.losses)} steps: loss {first:.2f} → {last:.2f} nats (mean of the first and last 10)")
    assert last < 0.9 * first, "the loss did not fall"
else:
    print("Pass ch14.gla_layer first; then this cell trains a model with your layer.")

# %% [markdown]
# ## Exercise 7 — `ch14.decode`: one token at a time
#
# Generation runs the layer one token per call. Write `gla_step(x_t, params, n_heads, S, cache)`
# for one token `x_t` `[B, 1, d]`: the same pieces as `gla_layer`, but the operation is one step
# of the recurrence (chapter 04) instead of `linattn.gla`:
#
# $$S \leftarrow \mathrm{diag}(e^{g_t})\, S + k_t^\top v_t, \qquad o_t = K^{-1/2}\, q_t S,$$
#
# returning `(y_t, S, cache)`. Then `gla_decode` runs it over `x` `[B, T, d]`, one step per token,
# starting from `initial_state` and `conv_cache` (zeros when they are `None`: S is `[B, H, K, V]`,
# the cache `[B, w−1, H(2K+V)]`), and returns all outputs concatenated along time with the state
# after the last token. The grader compares with the whole-sequence layer — your decode must
# compute exactly what one call on the whole sequence computes.

# %% exercise="ch14.decode"
def gla_step(x_t, params, n_heads, S, cache):
    raise NotImplementedError("not written yet")


def gla_decode(x, params, n_heads, *, initial_state=None, conv_cache=None):
    raise NotImplementedError("not written yet")


# %%
check("ch14.decode", gla_decode);

# %% [markdown]
# ## Using what you wrote
#
# Your `gla_decode` is the loop `linattn.nn.generate` runs, with the next token chosen by the model
# instead of read from `x`. Chapter 15 (`book/15_inference.py`) measures what each generated
# token costs.

# %%
from linattn.grade import progress_text; print(progress_text())
