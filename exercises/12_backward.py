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
# # Workbook 12 — the backward pass
#
# Companion of `book/12_backward.py`. You write three pieces of GLA's backward pass:
#
# 1. the gate gradient in closed form, from $dq$ and $dk$ alone;
# 2. the whole backward token by token, walking time in reverse;
# 3. the chunkwise backward, the algorithm the library's `linattn.chunk.gla` runs.
#
# The forward is GLA as in chapter 04: $S_t = \operatorname{diag}(e^{g_t}) S_{t-1} + k_t^\top v_t$,
# $o_t = \text{scale}\cdot q_t S_t$, with $S$ of shape K×V, $g$ log-decays ≤ 0 of shape
# `[B, T, H, K]` or `[B, T, H]`. The loss is $L = \sum_t \langle o_t, do_t\rangle +
# \langle S_T, dS_T\rangle$: `do` `[B, T, H, V]` is the gradient arriving at the output, and
# `dfinal_state` `[B, H, K, V]` (or `None`) the gradient arriving at the final state (a model that
# hands the state on to the next segment sends one back).
#
# Each backward returns `(dq, dk, dv, dg, dinitial_state)`, every gradient in its input's shape
# and dtype; `dinitial_state` is `None` when no `initial_state` was given. The grader compares
# with float64 autograd through the naive recurrence, at relative error 1e-4 for float32 inputs.
# Its cases include strong gates (down to −20 per step), both gate shapes, K ≠ V, an initial
# state, a final-state gradient, float64, and lengths that are not a multiple of the chunk size.

# %%
import torch

from linattn.grade import check

# %% [markdown]
# ## Exercise 1 — `ch12.gate_grad`
#
# With $b_t = g_1 + \dots + g_t$ (per key dimension), the forward depends on the gates only
# through $q_t \odot e^{b_t}$ and $k_t \odot e^{-b_t}$ (and $S_T = \operatorname{diag}(e^{b_T})\tilde S_T$).
# Hence, with $dq$, $dk$ the full gradients of $q$ and $k$:
#
# $$\frac{\partial L}{\partial b_t} = q_t \odot dq_t - k_t \odot dk_t
#   \;+\; [t = T]\,\textstyle\sum_\nu (S_T \odot dS_T)_{:,\nu},
# \qquad dg_t = \sum_{s \ge t} \frac{\partial L}{\partial b_s}.$$
#
# Mind the sign (+ on the query side) and the direction of the sum (from the **end**: $g_t$ is
# inside every $b_s$ with $s \ge t$). $\nu$ runs over the value columns (`.sum(-1)` of a
# `[..., K, V]` product). For gates of shape `[B, T, H]` sum the result over K.
# `final_state` and `dfinal_state` are `[B, H, K, V]` or both `None`. Return `dg` in `g`'s dtype.
#
# Hint: `x.flip(1).cumsum(1).flip(1)` is the suffix sum along time.

# %% exercise="ch12.gate_grad"
def gate_grad(q, k, dq, dk, g, *, final_state=None, dfinal_state=None):
    raise NotImplementedError("write me")


# %%
check("ch12.gate_grad", gate_grad);

# %% [markdown]
# ## Exercise 2 — `ch12.recurrent_backward`
#
# Recompute the forward and keep every state $S_0, \dots, S_T$. Then walk $t = T, \dots, 1$
# (row $t-1$ of the tensors, Python counting from 0) carrying $dS$, the gradient of the state
# after step $t$, $S_t$, which starts as `dfinal_state` (or zeros):
#
# $$dS \mathrel{+}= \text{scale}\cdot q_t^\top do_t,\quad dq_t = \text{scale}\cdot do_t S_t^\top,\quad
#   dk_t = v_t\, dS^\top,\quad dv_t = k_t\, dS,$$
# $$dg_t = e^{g_t} \odot \textstyle\sum_\nu (S_{t-1} \odot dS)_{:,\nu},\qquad
#   dS \leftarrow \operatorname{diag}(e^{g_t})\, dS .$$
#
# After the walk $dS$ is the gradient of the initial state. Compute in float32 (float64 for
# float64 inputs). Check your `dg` against Exercise 1 if you like: they must agree.

# %% exercise="ch12.recurrent_backward"
def recurrent_gla_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None):
    raise NotImplementedError("write me")


# %%
check("ch12.recurrent_backward", recurrent_gla_backward);

# %% [markdown]
# ## Exercise 3 — `ch12.chunk_backward`
#
# Chunks of $C$ = `chunk_size` tokens (the grader uses 16; the **last chunk may be shorter** —
# its gradients count too). Inside a chunk, $b$ is the cumulative log-gate from the chunk start,
# $\Lambda_i = e^{b_i}$, $\Gamma_j = e^{b_C - b_j}$, $\gamma = e^{b_C}$,
# and the forward is $O = \text{scale}\cdot\big(P V + (Q \odot \Lambda) S_{[n-1]}\big)$,
# $P_{ij} = \sum_\kappa q_{i\kappa} k_{j\kappa} e^{b_{i\kappa} - b_{j\kappa}}$ ($i \ge j$),
# $S_{[n]} = \operatorname{diag}(\gamma) S_{[n-1]} + (K \odot \Gamma)^\top V$.
#
# 1. Forward over chunks, keeping the state *entering* each chunk, $S_{[n-1]}$.
# 2. Backward over chunks from $dS_{[N]}$ = `dfinal_state` (or zeros); with $dS_{[n]}$ the
#    gradient of the state after chunk $n$:
#
# $$dP = \text{scale}\cdot\operatorname{tril}(dO\, V^\top),\quad dV = \text{scale}\cdot P^\top dO + (K \odot \Gamma)\, dS_{[n]},$$
# $$dq_i = \textstyle\sum_{j \le i} dP_{ij}\, k_j \odot e^{b_i - b_j} + \text{scale}\cdot\Lambda_i \odot (dO_i\, S_{[n-1]}^\top),\qquad
#   dk_j = \textstyle\sum_{i \ge j} dP_{ij}\, q_i \odot e^{b_i - b_j} + \Gamma_j \odot (V_j\, dS_{[n]}^\top),$$
# $$dS_{[n-1]} = \operatorname{diag}(\gamma)\, dS_{[n]} + \text{scale}\cdot(Q \odot \Lambda)^\top dO .$$
#
# 3. The gate gradient by the closed form **inside each chunk**: $\partial L/\partial b_t = q_t
#    \odot dq_t - k_t \odot dk_t$, plus $\sum_\nu (S_{[n]} \odot dS_{[n]})_{:,\nu}$ at the chunk's
#    last position, then a suffix sum within the chunk.
#
# (Or multiply the queries by `scale` once, as the chapter's code does: with $\text{scale}\cdot q$
# in place of $q$, $dP = \operatorname{tril}(dO\,V^\top)$ and every other `scale` above drops out;
# that gives the gradient with respect to $\text{scale}\cdot q$, so multiply it by `scale` for $dq$.)
#
# Keep $e^{b_i - b_j}$ in log space (masked to $-\infty$ above the diagonal before `exp`), as in
# chapter 04: strong gates make $e^{-b}$ overflow.

# %% exercise="ch12.chunk_backward"
def chunk_gla_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None,
                       chunk_size=64):
    raise NotImplementedError("write me")


# %%
check("ch12.chunk_backward", chunk_gla_backward);

# %% [markdown]
# ## Use it
#
# Your `chunk_gla_backward` can train: wrap it in a `torch.autograd.Function` whose forward is
# `linattn.chunk.gla(..., output_final_state=True)` and whose backward returns your gradients.
# Compare its time with autograd through `linattn.naive.gla` (uncomment):

# %%
# import linattn
# args = linattn.testing.make_inputs("gla", T=256)
# do = torch.randn_like(args["v"])
# print(linattn.bench.timeit(lambda: chunk_gla_backward(**args, do=do)), "ms")

# %%
from linattn.grade import progress_text; print(progress_text())
