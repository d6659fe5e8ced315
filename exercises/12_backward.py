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
# Companion of `book/12_backward.py`. You write five pieces of the backward pass:
#
# 1. GLA's gate gradient in closed form, from $dq$ and $dk$ alone;
# 2. GLA's whole backward token by token, walking time in reverse;
# 3. the chunkwise GLA backward, the algorithm the library's `linattn.chunk.gla` runs;
# 4. your own `torch.autograd.Function` around it — gradchecked, then trained through;
# 5. the delta rule's chunkwise backward through the WY/UT transform (`linattn.chunk.delta_rule`).
#
# The GLA forward is chapter 04's: $S_t = \operatorname{diag}(e^{g_t}) S_{t-1} + k_t^\top v_t$,
# $o_t = \text{scale}\cdot q_t S_t$, with $S$ of shape K×V, $g$ log-decays ≤ 0 of shape
# `[B, T, H, K]` or `[B, T, H]`. The loss is $L = \sum_t \langle o_t, do_t\rangle +
# \langle S_T, dS_{\mathrm{fin}}\rangle$: `do` `[B, T, H, V]` is the gradient arriving at the output,
# and `dfinal_state` `[B, H, K, V]` (or `None`) is $dS_{\mathrm{fin}}$, the gradient arriving at
# the final state (a model that hands the state on to the next segment sends one back).
#
# Each backward returns its gradients in a tuple, every gradient in its input's shape and dtype;
# `dinitial_state` is `None` when no `initial_state` was given. The grader compares with float64
# autograd through the naive recurrence, at relative error 1e-4 for float32 inputs. Its cases
# include strong gates (down to −20 per step), both gate shapes, K ≠ V, an initial state, a
# final-state gradient, float64, and lengths that are not a multiple of the chunk size. When your
# answer is wrong in a known way — the sign, the direction of a sum, a state off by one step, an
# overflow — the verdict says which.

# %%
import torch

import linattn
from linattn.grade import check
from linattn.grade.catalog.ch12 import gradients_through

# %% [markdown]
# ## Exercise 1 — `ch12.gate_grad`
#
# With $b_t = g_1 + \dots + g_t$ (per key dimension), the forward depends on the gates only
# through $q_t \odot e^{b_t}$ and $k_t \odot e^{-b_t}$ (and $S_T = \operatorname{diag}(e^{b_T})\tilde S_T$).
# Hence, with $dq$, $dk$ the full gradients of $q$ and $k$:
#
# $$\frac{\partial L}{\partial b_t} = q_t \odot dq_t - k_t \odot dk_t
#   \;+\; [t = T]\,\textstyle\sum_\nu (S_T \odot dS_{\mathrm{fin}})_{:,\nu},
# \qquad dg_t = \sum_{s \ge t} \frac{\partial L}{\partial b_s}.$$
#
# Mind the sign (+ on the query side; seed 001's display equation has the opposite one) and the
# direction of the sum (from the **end**: $g_t$ is inside every $b_s$ with $s \ge t$). $\nu$ runs
# over the value columns (`.sum(-1)` of a `[..., K, V]` product). For gates of shape `[B, T, H]`
# sum the result over K. `final_state` and `dfinal_state` are `[B, H, K, V]` or both `None`.
# Return `dg` in `g`'s dtype.
#
# Hint: `x.flip(1).cumsum(1).flip(1)` is the suffix sum along time.

# %% exercise="ch12.gate_grad"
def gate_grad(q, k, dq, dk, g, *, final_state=None, dfinal_state=None):
    raise NotImplementedError("not written yet")


# %%
check("ch12.gate_grad", gate_grad);

# %% [markdown]
# ## Exercise 2 — `ch12.recurrent_backward`
#
# Recompute the forward and keep every state in a list `S[0], …, S[T]`: `S[0]` is the initial
# state (zeros without one) and `S[t]` the state **after** step $t$. Python's rows count from 0,
# so row `t` of `q`, `k`, `v`, `g`, `do` is step $t+1$: its output reads `S[t + 1]`, and its gate
# multiplies `S[t]`. Walk the rows `t = T−1, …, 0` carrying `dS`, the gradient of `S[t + 1]`,
# which starts as `dfinal_state` (or zeros):
#
# ```
# dS    += scale · q[t]ᵀ do[t]               (the read o = scale · q[t] S[t + 1])
# dq[t]  = scale · do[t] S[t + 1]ᵀ           (the state AFTER this step's write)
# dk[t]  = v[t] dSᵀ,   dv[t] = k[t] dS
# dg[t]  = e^{g[t]} ⊙ rowsum(S[t] ⊙ dS)      (the state BEFORE it, which the gate multiplies)
# dS     = diag(e^{g[t]}) dS                 (now the gradient of S[t])
# ```
#
# After the walk `dS` is the gradient of the initial state. Compute in float32 (float64 for
# float64 inputs). Check your `dg` against Exercise 1 if you like: they must agree.

# %% exercise="ch12.recurrent_backward"
def recurrent_gla_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None):
    raise NotImplementedError("not written yet")


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
#    last position, then a suffix sum within the chunk. (Chapter 12, section 5.1, sums the same
#    terms without the ones that cancel; either passes here.)
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
    raise NotImplementedError("not written yet")


# %%
check("ch12.chunk_backward", chunk_gla_backward);

# %% [markdown]
# ## Exercise 4 — `ch12.autograd_function`
#
# A backward is useful once autograd calls it. Write `GLAFunction`, a `torch.autograd.Function`:
#
# * `forward(ctx, q, k, v, g, initial_state, scale)` computes `o, S = linattn.chunk.gla(q, k, v, g,
#   scale=scale, initial_state=initial_state, output_final_state=True)` (inside `forward` autograd
#   is off, so the library's own backward is not recorded), saves what your backward needs with
#   `ctx.save_for_backward(...)` (tensors; `None` is allowed) and `ctx.scale = scale`, and returns
#   `o, S`;
# * `backward(ctx, do, dS)` gets one gradient per output — `dS` is the gradient arriving at the
#   final state — and returns one per input of `forward`: your `chunk_gla_backward(...,
#   dfinal_state=dS)` from Exercise 3 for q, k, v, g and the initial state, and `None` for `scale`.
#
# `gla_function` (given) applies it. The grader runs autograd through `gla_function` —
# `gradients_through(gla_function)` returns $o$, $S_T$ and every gradient for an incoming `do`
# and `dfinal_state` — and compares all of them with float64 autograd through the naive
# recurrence.

# %% exercise="ch12.autograd_function"
class GLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale):
        raise NotImplementedError("not written yet")

    @staticmethod
    def backward(ctx, do, dS):
        raise NotImplementedError("not written yet")


def gla_function(q, k, v, g, *, scale=None, initial_state=None):
    """(o, final_state), differentiable through your GLAFunction."""
    return GLAFunction.apply(q, k, v, g, initial_state, scale)


# %%
passed_function = check("ch12.autograd_function", gradients_through(gla_function)).passed

# %% [markdown]
# ### Use it: gradcheck, then train
#
# `torch.autograd.gradcheck` compares your backward with finite differences of the forward, in
# float64 (in float32 the differences would be noise), on a small problem — every input that
# requires grad, both outputs. Then the real use: a tiny model whose queries, keys, values and
# gates are linear maps of an input $x$, trained by gradient descent through your backward to
# reproduce a fixed target. Its loss must fall. (These cells run once Exercise 4 has passed.)

# %%
if passed_function:
    gen = torch.Generator().manual_seed(0)
    small = linattn.testing.to_float64(linattn.testing.make_inputs("gla", B=1, T=10, H=1, K=4, V=3,
                                                                   initial_state=True, seed=0))
    inputs = tuple(small[n].requires_grad_() for n in ("q", "k", "v", "g", "initial_state"))
    ok = torch.autograd.gradcheck(lambda q, k, v, g, S0: gla_function(q, k, v, g, initial_state=S0),
                                  inputs, eps=1e-6, atol=1e-5)
    print("gradcheck (float64, every input, both outputs):", ok)
    assert ok
else:
    print("Exercise 4 has not passed yet: write GLAFunction, then run this cell again.")

# %%
if passed_function:
    torch.manual_seed(0)
    Tn, D, H, K, V = 48, 16, 2, 8, 8
    x, target = torch.randn(1, Tn, D), torch.randn(1, Tn, H, V)
    proj = {n: (0.3 * torch.randn(D, H * d)).requires_grad_()
            for n, d in (("q", K), ("k", K), ("v", V), ("g", K))}
    opt = torch.optim.Adam(proj.values(), lr=3e-2)
    losses = []
    for step in range(40):
        q, k, v, a = ((x @ proj[n]).view(1, Tn, H, -1) for n in ("q", "k", "v", "g"))
        g = torch.nn.functional.logsigmoid(a) / 16                    # log-decays ≤ 0, as GLA's
        o, _ = gla_function(q, k, v, g)
        loss = ((o - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()                                               # your backward
        opt.step()
        losses.append(loss.item())
    print(f"loss: {losses[0]:.3f} at the start, {losses[-1]:.3f} after {len(losses)} steps")
    assert losses[-1] < 0.8 * losses[0]

# %% [markdown]
# ## Exercise 5 — `ch12.delta_backward`
#
# The delta rule, $S_t = S_{t-1} + \beta_t k_t^\top (v_t - k_t S_{t-1})$, $o_t = \text{scale}\cdot q_t S_t$
# (keys L2-normalised, no gates), chunk by chunk as in chapter 07. Per chunk of $C$ = `chunk_size`
# tokens (16 in the grader; the last may be shorter), with $S$ the entering state:
#
# $$A = \operatorname{diag}(\beta)\operatorname{tril}_{-1}(K K^\top),\quad \mathcal T = (I + A)^{-1},\quad
#   U = \mathcal T\operatorname{diag}(\beta) V,\quad W = \mathcal T\operatorname{diag}(\beta) K,\quad \tilde V = U - W S,$$
# $$O = \text{scale}\,\big(Q S + \operatorname{tril}(Q K^\top)\,\tilde V\big),\qquad S' = S + K^\top \tilde V .$$
#
# Write the backward (chapter 12, section 6, derives every line; here without gates, so every
# $\Lambda$, $\Gamma$, $\gamma$ is 1). With $dO$ meaning $\text{scale}\cdot dO$ and $dS'$ the gradient of
# the state leaving the chunk (`dfinal_state`, or zeros, for the last):
#
# 1. forward over the chunks, keeping $S$ (entering), $\mathcal T$, $U$, $W$, $\tilde V$;
# 2. backward over the chunks: $d\tilde V = A_{qk}^\top dO + K\,dS'$ with $A_{qk} = \operatorname{tril}(QK^\top)$;
#    $dS = Q^\top dO - W^\top d\tilde V + dS'$ (the next $dS'$);
# 3. $dA_{qk} = \operatorname{tril}(dO\,\tilde V^\top)$, $dU = d\tilde V$, $dW = -\,d\tilde V S^\top$;
# 4. through the inverse: $dY_U = \mathcal T^\top dU$, $dY_W = \mathcal T^\top dW$,
#    $dA = -\operatorname{tril}_{-1}(dY_U U^\top + dY_W W^\top)$;
# 5. $dv = \beta\,dY_U$; $d\beta_i = dY_{U,i}\cdot v_i + dY_{W,i}\cdot k_i + \sum_j dA_{ij}(k_i\cdot k_j)$;
# 6. $dq = dO\,S^\top + dA_{qk} K$; and $k$ from all five of its places:
#    $dk = dA_{qk}^\top Q + dA^{kk} K + dA^{kk\top} K + \beta\,dY_W + \tilde V\,dS'^\top$, where $dA^{kk} = \operatorname{diag}(\beta)\,dA$.
#
# Return `(dq, dk, dv, dbeta, dinitial_state)`.

# %% exercise="ch12.delta_backward"
def chunk_delta_backward(q, k, v, beta, do, *, scale=None, initial_state=None, dfinal_state=None,
                         chunk_size=64):
    raise NotImplementedError("not written yet")


# %%
check("ch12.delta_backward", chunk_delta_backward);

# %%
from linattn.grade import progress_text; print(progress_text())
