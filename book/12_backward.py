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
# # 12 — The backward pass
#
# **Goal.** Every chapter so far computed outputs. Training needs gradients: given the gradient
# $dO$ arriving at the outputs (and, when the final state is handed on, $dS_T$ arriving at it),
# produce $dq, dk, dv, dg$ (and $d\beta$, $dS_0$). Autograd through the token loop gets them, but
# it keeps one $K\times V$ state per token and runs $T$ tiny steps. We derive the backward by hand:
# first as a recurrence that walks time in reverse, then the **closed-form gate gradient** that
# needs no state at all (seed document 001, from the GLA paper), then the chunkwise backward the
# library runs — with the forward's precision rules — and the delta rule's backward through
# $(I + A)^{-1}$. Finally we measure the trade-off the GLA paper settles by default: recompute the
# chunk states in the backward, or keep them from the forward.

# %%
import matplotlib.pyplot as plt
import torch

import linattn
from linattn import bench, chunk, naive, testing
from linattn.device import pick
from linattn.naive import backward

print(linattn.device.describe())
torch.manual_seed(0)


def autograd(fn, args, do, dS=None, names=("q", "k", "v", "g", "beta", "initial_state")):
    """Gradients of L = <o, do> + <S_T, dS> by autograd through fn (the ground truth, in float64)."""
    leaves = {n: a.detach().clone().requires_grad_() for n, a in args.items() if n in names}
    o, S = fn(**{**args, **leaves}, output_final_state=True)
    loss = (o * do).sum() + (0 if dS is None else (S * dS).sum())
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"d" + n: g for n, g in zip(leaves, grads)}


# %% [markdown]
# ## 1. What the backward computes
#
# A layer sits inside a network; the loss $L$ depends on it only through what it hands on: the
# outputs $o_t$ and, in a model that carries the state from one segment to the next, the final
# state $S_T$. Backpropagation delivers $do_t = \partial L/\partial o_t$ and
# $dS_T = \partial L/\partial S_T$, so for the layer the loss is, to first order,
#
# $$L = \sum_t \langle o_t, do_t\rangle + \langle S_T, dS_T\rangle ,$$
#
# and its job is to return the gradient of that with respect to every input. Everything below is
# checked against autograd through the naive recurrence in float64, on this GLA problem:

# %%
B, T, H, K, V = 1, 40, 2, 16, 8
args = testing.to_float64(testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, gate="per_dim",
                                              initial_state=True, seed=1))
do = torch.randn(B, T, H, V, dtype=torch.float64)
dS_T = torch.randn(B, H, K, V, dtype=torch.float64)
truth = autograd(naive.gla, args, do, dS_T)
print({n: tuple(g.shape) for n, g in truth.items()})

# %% [markdown]
# ## 2. Walking time backwards
#
# GLA's step is $S_t = \operatorname{diag}(\alpha_t) S_{t-1} + k_t^\top v_t$ with $\alpha_t = e^{g_t}$, and
# $o_t = \text{scale}\cdot q_t S_t$. Write $dS$ for the gradient of the loss with respect to
# $S_t$ — *all* of it: from $o_t$, and through $S_{t+1}, S_{t+2}, \dots$ from every later output.
# $S_t$ feeds exactly two things, $o_t$ and $S_{t+1}$, so
#
# $$dS_t = \text{scale}\cdot q_t^\top do_t + \operatorname{diag}(\alpha_{t+1})\, dS_{t+1},\qquad dS_T
# \text{ starts from the incoming final-state gradient (or } 0).$$
#
# That is a recurrence running **backwards in time**, the mirror of the forward, with the same
# $K\times V$ shape. At step $t$, with $dS = dS_t$, the gradients of the step's inputs are read off
# $S_t = \operatorname{diag}(\alpha_t) S_{t-1} + k_t^\top v_t$ and $o_t = \text{scale}\cdot q_t S_t$:
#
# $$dq_t = \text{scale}\cdot do_t\, S_t^\top,\qquad dk_t = v_t\, dS^\top,\qquad dv_t = k_t\, dS,\qquad
#   dg_t = \alpha_t \odot \textstyle\sum_\nu \big(S_{t-1} \odot dS\big)_{:,\nu},$$
#
# with $\nu$ running over the value columns (as $\kappa$ runs over key dimensions), and after
# $t = 1$ the carried $dS_0$ is the gradient of the initial state. $dq_t$ and $dg_t$ need
# the forward's states $S_t$ — we recompute them and keep all $T+1$ (fine for a reference; the
# chunkwise version below keeps one per chunk). One head, inline:

# %%
def reverse_gla(q, k, v, g, do, S0, dS_T, scale):
    """One head: q, k, g [T, K], v, do [T, V], S0, dS_T [K, V]."""
    a = g.exp()
    S = [S0]
    for t in range(len(q)):                                   # forward, keeping every state
        S.append(a[t, :, None] * S[-1] + k[t, :, None] * v[t])
    dq, dk, dv, dg = (torch.empty_like(x) for x in (q, k, v, g))
    dS = dS_T.clone()
    for t in reversed(range(len(q))):
        dS += scale * q[t, :, None] * do[t]                   # the read o_t = scale · q_t S_t
        dq[t] = scale * S[t + 1] @ do[t]
        dk[t], dv[t] = dS @ v[t], k[t] @ dS
        dg[t] = a[t] * (S[t] * dS).sum(-1)                    # S_{t−1} is S[t]
        dS = a[t, :, None] * dS                               # dS_{t−1}
    return dq, dk, dv, dg, dS


h, scale = 1, K ** -0.5
one = [args[n][0, :, h] for n in ("q", "k", "v", "g")]
mine = reverse_gla(*one, do[0, :, h], args["initial_state"][0, h], dS_T[0, h], scale)
for name, x in zip(("dq", "dk", "dv", "dg", "dinitial_state"), mine):
    ref = truth[name][0, h] if name == "dinitial_state" else truth[name][0, :, h]
    print(f"{name:>15}: reverse recurrence vs autograd {testing.rel_err(x, ref):.1e}")
    assert testing.rel_err(x, ref) < testing.tolerance(torch.float64)

# %% [markdown]
# The library's `linattn.naive.backward` has this walk for all four operations — linear attention
# ($\alpha_t = 1$), GLA with either gate shape, the delta rule and KDA (section 6) — each equal to
# autograd to float64 rounding:

# %%
for op, gate in [("linear_attn", None), ("gla", "per_head"), ("delta_rule", None), ("kda", "per_dim")]:
    a = testing.to_float64(testing.make_inputs(op, B=1, T=25, H=2, K=8, V=8, gate=gate or "per_dim",
                                               initial_state=True, seed=2))
    fn, bwd = getattr(naive, op), getattr(backward, op + "_backward")
    want = autograd(fn, a, do[:, :25], dS_T[..., :8, :8])
    got = bwd(**a, do=do[:, :25], dfinal_state=dS_T[..., :8, :8])
    worst = max(testing.rel_err(got[n], want[n]) for n in want)
    print(f"{op:>11} {gate or '':>8}: worst gradient vs autograd {worst:.1e}  ({', '.join(want)})")
    assert worst < testing.tolerance(torch.float64)

# %% [markdown]
# ## 3. The gate gradient needs no state
#
# $dg_t$ above reads $S_{t-1}$: a $K\times V$ state per token, the one thing the chunkwise form
# never materialises. Mao (2022) claimed that gate gradients require it; the GLA paper showed
# they do not. Absorb the decay into the inputs, as chapter 03 did in the forward: with
# $b_t = g_1 + \dots + g_t$ (per key dimension),
#
# $$\hat q_t = q_t \odot e^{b_t},\qquad \tilde k_t = k_t \odot e^{-b_t},\qquad
#   \tilde S_t = \operatorname{diag}(e^{-b_t})\, S_t \;\Rightarrow\;
#   \tilde S_t = \tilde S_{t-1} + \tilde k_t^\top v_t,\quad o_t = \text{scale}\cdot\hat q_t \tilde S_t .$$
#
# In this form the gates appear **only** in $\hat q_t$ and $\tilde k_t$ (and in
# $S_T = \operatorname{diag}(e^{b_T}) \tilde S_T$). For $x = y \odot e^{\pm b}$ the chain rule gives
# $\partial L/\partial b = \pm\, x \odot \partial L/\partial x = \pm\, y \odot \partial L/\partial y$ —
# the rescaling cancels — so
#
# $$\boxed{\frac{\partial L}{\partial b_t} = q_t \odot dq_t - k_t \odot dk_t
#   + [t = T]\,\textstyle\sum_\nu (S_T \odot dS_T)_{:,\nu},\qquad
#   dg_t = \sum_{s \ge t} \frac{\partial L}{\partial b_s}}$$
#
# **Sign convention.** $g \le 0$ is the log-decay, $b$ its running sum, and the decay from key $j$ to
# query $i$ is $e^{b_i - b_j}$: $b$ enters with $+$ on the query side and $-$ on the key side.
# (Seed 001's display equation reads $d\log b_t = k_t \odot dk_t - q_t \odot dq_t$ — the gradient
# with respect to $-b$; the comment in its own code has our sign. The check below decides.) The
# sum runs from $t$ to the **end**: $g_t$ is inside every $b_s$ with $s \ge t$. It is an
# $O(TK)$ reverse cumulative sum of numbers the backward computes anyway, $dq$ and $dk$.

# %%
q, k = args["q"], args["k"]
final = naive.gla(**args, output_final_state=True)[1]
db = q * truth["dq"] - k * truth["dk"]                       # ∂L/∂b_t, [B, T, H, K]
db[:, -1] += (final * dS_T).sum(-1)                          # S_T = diag(e^{b_T}) S̃_T
dg_closed = db.flip(1).cumsum(1).flip(1)                     # Σ_{s ≥ t}
e_ours = testing.rel_err(dg_closed, truth["dg"])
e_seed = testing.rel_err(-dg_closed, truth["dg"])           # the display equation's sign
e_lib = testing.rel_err(backward.gate_grad_closed_form(q, k, truth["dq"], truth["dk"], args["g"],
                                                       final_state=final, dfinal_state=dS_T), truth["dg"])
print(f"closed form vs autograd: {e_ours:.1e} (library {e_lib:.1e}); with the opposite sign: {e_seed:.2f}")
assert max(e_ours, e_lib) < testing.tolerance(torch.float64) and e_seed > 1.9

# %% [markdown]
# The opposite sign gives exactly $-dg$ (relative error 2). For per-head gates ($g$ of shape
# `[B, T, H]`) the same $\partial L/\partial b_t$ is summed over $K$. For the delta rule (section 6)
# the key has a second role: the read $k_t S'$ of the decayed state, which in absorbed form is
# $(k_t \odot e^{b_t})\tilde S_{t-1}$ and enters with $+$, so its part of $dk$ flips sign:
# $\partial L/\partial b_t = q_t\odot dq_t + k_t\odot dk_t^{\text{read}} - k_t\odot dk_t^{\text{write}}$
# (`gate_grad_closed_form(..., dk_read=)`; tested for KDA and Gated DeltaNet in
# `tests/test_naive_backward.py`).
#
# ## 4. The chunkwise backward
#
# Chapter 04's chunk forward, with $b$ the log-gates summed from the chunk start,
# $\Lambda_i = e^{b_i}$, $\Gamma_j = e^{b_C - b_j}$, $\gamma = e^{b_C}$, and `scale` on the outputs only:
#
# $$O = \text{scale}\cdot\big(P V + (Q\odot\Lambda) S_{[n-1]}\big),\quad P_{ij} = \textstyle\sum_\kappa q_{i\kappa}k_{j\kappa}e^{b_{i\kappa}-b_{j\kappa}}\ (i\ge j),\quad
#   S_{[n]} = \operatorname{diag}(\gamma) S_{[n-1]} + (K\odot\Gamma)^\top V .$$
#
# Differentiate each line. The state gradient obeys the reverse recurrence of section 2 taken a
# chunk at a time — the only sequential part, $N = T/C$ steps:
#
# $$dS_{[n-1]} = \operatorname{diag}(\gamma)\, dS_{[n]} + \text{scale}\cdot(Q\odot\Lambda)^\top dO_{[n]} .$$
#
# Given $dS_{[n]}$ (the gradient of the state *after* chunk $n$) every chunk is independent:
#
# $$dP = \text{scale}\cdot\operatorname{tril}(dO\,V^\top),\qquad dV = \text{scale}\cdot P^\top dO + (K\odot\Gamma)\,dS_{[n]},$$
# $$dq_i = \textstyle\sum_{j\le i} dP_{ij}\, k_j\odot e^{b_i-b_j} + \text{scale}\cdot\Lambda_i\odot(dO_i\,S_{[n-1]}^\top),\qquad
#   dk_j = \textstyle\sum_{i\ge j} dP_{ij}\,q_i\odot e^{b_i-b_j} + \Gamma_j\odot(V_j\,dS_{[n]}^\top),$$
#
# and the gate gradient by the closed form **inside the chunk**: $\partial L/\partial b_t =
# q_t\odot dq_t - k_t\odot dk_t$ plus $\sum_\nu(S_{[n]}\odot dS_{[n]})_{:,\nu}$ at the chunk's
# last token (the chunk-level $S_T$ term: a chunk hands its state on), then a suffix sum over the
# chunk. The two sums over $j$ and $i$ are the forward's $P$ tiles again, read along rows and along
# columns: the same log-space tiles, the same secondary chunking. The code below multiplies the
# queries by `scale` once, `qh` $= \text{scale}\cdot q$, so its `P` is the scaled copy
# $\text{scale}\cdot P$ and its `dP` is $\operatorname{tril}(dO\,V^\top)$; it computes the gradient
# with respect to $\text{scale}\cdot q$ and multiplies by `scale` once at the end. One head, inline:

# %%
def chunk_gla_backward(q, k, v, g, do, S0, dS_T, scale, C):
    """One head: q, k, g [T, K], v, do [T, V], S0, dS_T [K, V]; chunks of C (the last may be shorter)."""
    qh, spans = q * scale, [(s, min(s + C, len(q))) for s in range(0, len(q), C)]
    Sin, S = [], S0
    for s, e in spans:                                            # the states entering each chunk
        b = g[s:e].cumsum(0)
        Sin.append(S)
        S = b[-1, :, None].exp() * S + (k[s:e] * (b[-1] - b).exp()).T @ v[s:e]
    Sin.append(S)
    dq, dk, dv, dg = (torch.empty_like(x) for x in (q, k, v, g))
    dS = dS_T.clone()
    for n in reversed(range(len(spans))):
        s, e = spans[n]
        qc, kc, vc, doc, b = qh[s:e], k[s:e], v[s:e], do[s:e], g[s:e].cumsum(0)
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        W = (b[:, None] - b[None]).masked_fill(~causal[..., None], float("-inf")).exp()  # [c, c, K]
        P = torch.einsum("ik,jk,ijk->ij", qc, kc, W)
        dP = (doc @ vc.T) * causal
        lam, gam = b.exp(), (b[-1] - b).exp()                     # Λ, Γ: exponents ≤ 0
        dv[s:e] = P.T @ doc + (kc * gam) @ dS
        dqc = torch.einsum("ij,jk,ijk->ik", dP, kc, W) + lam * (doc @ Sin[n].T)
        dk[s:e] = torch.einsum("ij,ik,ijk->jk", dP, qc, W) + gam * (vc @ dS.T)
        db = qc * dqc - kc * dk[s:e]
        db[-1] += (Sin[n + 1] * dS).sum(-1)
        dg[s:e] = db.flip(0).cumsum(0).flip(0)                    # suffix sum inside the chunk
        dq[s:e] = dqc * scale
        dS = b[-1, :, None].exp() * dS + (qc * lam).T @ doc       # dS_[n−1]
    return dq, dk, dv, dg, dS


for C in (16, 64):
    got = chunk_gla_backward(*one, do[0, :, h], args["initial_state"][0, h], dS_T[0, h], scale, C)
    worst = max(testing.rel_err(x, (truth[n][0, h] if n == "dinitial_state" else truth[n][0, :, h]))
                for n, x in zip(("dq", "dk", "dv", "dg", "dinitial_state"), got))
    print(f"C = {C}: chunkwise backward vs autograd, worst of dq, dk, dv, dg, dS_0: {worst:.1e}")
    assert worst < testing.tolerance(torch.float64)

# %% [markdown]
# Exact for a chunk size that divides $T$ and one that does not ($T = 40$, $C = 16$: the last chunk
# has 8 tokens). `linattn.chunk.gla` runs this backward for `[B, T, H, K]` tensors as a
# `torch.autograd.Function`, all chunks' intra-chunk parts at once, with the forward's secondary
# chunking for the $P$-like sums — used only when an input requires grad. In float32, strong gates,
# against float64 autograd at the library's gradient tolerance $10^{-4}$, in both of its modes
# (`recompute`, section 7):

# %%
a32 = testing.make_inputs("gla", B=2, T=pick(cpu=150, gpu=1000), H=2, K=32, V=16, strength="strong",
                          initial_state=True, seed=5)
do32 = torch.randn(2, a32["q"].shape[1], 2, 16)
dS32 = torch.randn(2, 2, 32, 16)
want = autograd(naive.gla, testing.to_float64(a32), do32.double(), dS32.double())
for recompute in (True, False):
    got = autograd(lambda **kw: chunk.gla(**kw, recompute=recompute), a32, do32, dS32)
    errs = {n: testing.rel_err(got[n], want[n]) for n in want}
    print(f"recompute={recompute!s:5}:", "  ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) < 1e-4
print("gradients come back in each input's dtype, e.g. dq", got["dq"].dtype, "and dg", got["dg"].dtype)

# %% [markdown]
# ## 5. Precision: the forward's rules, again
#
# The backward multiplies the same decays as the forward, so the forward's rules carry over:
#
# * **Exponents ≤ 0.** Every factor is $e^{b_i - b_j}$ with $i \ge j$, $\Lambda$, $\Gamma$ or $\gamma$ —
#   never $e^{-b}$ on its own. Off-diagonal sub-chunk tiles split the decay at a sub-chunk
#   boundary (chapter 05), for $dq$ at the query sub-chunk's start and for $dk$ at the key
#   sub-chunk's end, so both factors stay ≤ 1.
# * **Diagonal tiles in float32**, as in the forward: built from single-token decays $e^{g} \le 1$
#   (the library's chunk level halves the diagonal tiles again and again, `linattn.chunk.gla_tiles`,
#   so every factor is a product of such decays and nothing is divided).
# * **Short sums for the gate gradient.** The suffix sum of $\partial L/\partial b$ over a whole
#   sequence adds up $T$ terms that largely cancel (each $q\odot dq$ is nearly offset by a later
#   $k\odot dk$); summing inside each chunk adds at most $C$ of them, and the chunk's $S$ term carries
#   the rest exactly (restarting the sum at each chunk *without* that term is wrong: the gate of a
#   token decays everything after it, across chunk borders). In float32, strong per-head gates:

# %%
print(f"{'T':>5} {'whole-sequence suffix sum':>26} {'per-chunk (chunk.gla)':>22}")
rows = []
for Tn in (64, pick(cpu=256, gpu=1024), pick(cpu=512, gpu=4096)):
    a = testing.make_inputs("gla", B=1, T=Tn, H=1, K=16, V=16, gate="per_head", strength="strong", seed=Tn)
    d_o = torch.randn(1, Tn, 1, 16)
    ref = backward.gla_backward(**testing.to_float64(a), do=d_o.double())["dg"]
    r32 = backward.gla_backward(**a, do=d_o)                       # float32 dq, dk
    whole = backward.gate_grad_closed_form(a["q"], a["k"], r32["dq"], r32["dk"], a["g"])
    lib = autograd(chunk.gla, a, d_o)["dg"]
    rows.append((testing.rel_err(whole, ref), testing.rel_err(lib, ref)))
    print(f"{Tn:>5} {rows[-1][0]:>26.1e} {rows[-1][1]:>22.1e}")
assert all(lib < 1e-4 for _, lib in rows) and rows[-1][0] > 3 * rows[-1][1]

# %% [markdown]
# Both stay within $10^{-4}$ here, but the whole-sequence sum is the less accurate and, like
# chapter 04's whole-sequence prefix sums, it has no bound as $T$ grows; the per-chunk sum's error
# does not depend on $T$.
#
# ### What breaks if the gradient goes through $e^{-b}$
#
# The forward's absorption trick has a backward twin: the intra-chunk part of $dq_i$ is $e^{b_i}\odot\sum_j dP_{ij}\,(k_j\odot
# e^{-b_j})$, two matmul-friendly factors. Under strong gates ($g$ down to −20 per token),
# $e^{-b_j}$ over a 64-token chunk reaches $e^{640}$: float32 overflows, and $\infty\cdot 0$ turns
# the gradient into NaN.

# %%
a = testing.make_inputs("gla", B=1, T=64, H=1, K=16, V=16, strength="strong", seed=9)
qc, kc, vc, gc = (a[n][0, :, 0] for n in ("q", "k", "v", "g"))
doc = torch.randn(64, 16)
b = gc.cumsum(0)                                                   # [C, K], down to about −640
dP = (doc @ vc.T).tril()
absorbed = b.exp() * (dP @ (kc * (-b).exp()))                     # e^{b_i} Σ_j dP_ij k_j e^{−b_j}
W = (b[:, None] - b[None]).masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril()[..., None],
                                       float("-inf")).exp()
log_space = torch.einsum("ij,jk,ijk->ik", dP, kc, W)
bad = (~torch.isfinite(absorbed)).sum().item()
print(f"min b = {b.min():.0f}; absorbed: {bad} of {absorbed.numel()} entries not finite; "
      f"log space: {(~torch.isfinite(log_space)).sum().item()} not finite")
assert bad > 0 and torch.isfinite(log_space).all()

# %% [markdown]
# ### What breaks if the gate gradient sums from the start
#
# A prefix sum $\sum_{s\le t}$ instead of the suffix sum is the natural slip ($b_t$ *is* a prefix
# sum of $g$, so its gradient flows the other way). It is not a small error:

# %%
dg_prefix = db.cumsum(1)
e_prefix = testing.rel_err(dg_prefix, truth["dg"])
print(f"prefix sum instead of suffix sum: relative error {e_prefix:.2f}")
assert e_prefix > 0.5

# %% [markdown]
# ## 6. The delta rule's backward through $(I + A)^{-1}$
#
# Chapter 07's chunk forward of the delta rule (and KDA) goes through the WY/UT transform. With
# $b$ the chunk's cumulative log-gates, $\Lambda$, $\Gamma$, $\gamma$ as before and $S$ the entering state:
#
# $$A_{ij} = \beta_i \textstyle\sum_\kappa k_{i\kappa}k_{j\kappa}e^{b_{i\kappa}-b_{j\kappa}}\ (i > j),\quad
#   \mathcal T = (I + A)^{-1},\quad U = \mathcal T\operatorname{diag}(\beta)V,\quad W = \mathcal T\operatorname{diag}(\beta)(K\odot\Lambda),$$
# $$\tilde V = U - W S,\qquad O = \text{scale}\,\big((Q\odot\Lambda) S + A_{qk}\tilde V\big),\qquad
#   S' = \operatorname{diag}(\gamma) S + (K\odot\Gamma)^\top\tilde V,$$
#
# $A_{qk}$ the decayed query-key scores ($i \ge j$). The reverse pass over chunks is as in GLA,
# with the state now entering $\tilde V$ as well: $d\tilde V = \text{scale}\,A_{qk}^\top dO +
# (K\odot\Gamma)\,dS'$ and $dS = \text{scale}\,(Q\odot\Lambda)^\top dO - W^\top d\tilde V +
# \operatorname{diag}(\gamma)\,dS'$; then $dU = d\tilde V$ and $dW = -d\tilde V S^\top$.
# The new piece is the inverse. For $X = \mathcal T Y$ with $\mathcal T = (I + A)^{-1}$, $d\mathcal T = -\mathcal T\,dA\,\mathcal T$ gives
#
# $$dY = \mathcal T^\top dX,\qquad dA = -\operatorname{tril}_{-1}\big(\mathcal T^\top dX\, X^\top\big) = -\operatorname{tril}_{-1}\big(dY\, X^\top\big),$$
#
# one more product with $\mathcal T^\top$ (or a triangular solve with $(I + A)^\top$) and one matmul.
# Applied to $U$ and $W$ (both $\mathcal T\cdot$something), with
# $dY_U = \mathcal T^\top dU$, $dY_W = \mathcal T^\top dW$:
#
# $$dA = -\operatorname{tril}_{-1}(dY_U U^\top + dY_W W^\top),\quad dv_i = \beta_i\, dY_{U,i},\quad
#   d\beta_i = dY_{U,i}\cdot v_i + dY_{W,i}\cdot(k_i\odot\Lambda_i) + \textstyle\sum_{j<i} dA_{ij}\, A^{kk}_{ij},$$
#
# with $A^{kk}_{ij} = A_{ij}/\beta_i$ the scores without $\beta$ ($\beta$ enters three times: in $U$,
# in $W$ and in $A$), and $dA$ flows on into $dk$ and $dg$ through the decayed scores like $dP$ in GLA. First the
# inverse's rule on its own, against autograd:

# %%
n = 16
A = (0.3 * torch.randn(n, n, dtype=torch.float64)).tril(-1).requires_grad_()
Y, dX = torch.randn(n, 8, dtype=torch.float64), torch.randn(n, 8, dtype=torch.float64)
I = torch.eye(n, dtype=torch.float64)
X = torch.linalg.solve_triangular(I + A, Y, upper=False, unitriangular=True)   # X = (I + A)⁻¹ Y
(X * dX).sum().backward()
dY = torch.linalg.solve_triangular((I + A).T.detach(), dX, upper=True, unitriangular=True)  # 𝒯ᵀ dX
dA = -(dY @ X.detach().T).tril(-1)
print(f"dA = −tril(𝒯ᵀ dX Xᵀ) vs autograd: {testing.rel_err(dA, A.grad):.1e}")
assert testing.rel_err(dA, A.grad) < testing.tolerance(torch.float64)

# %% [markdown]
# The library's chunkwise delta-rule backward (`linattn.chunk.delta_rule` / `kda`, module
# `chunk/delta_backward.py`) chains exactly these steps. Its gradients — $d\beta$ included — against
# float64 autograd through the token loop, float32 inputs, both gate shapes:

# %%
for op, gate in [("delta_rule", None), ("kda", "per_head"), ("kda", "per_dim")]:
    a = testing.make_inputs(op, B=1, T=pick(cpu=70, gpu=500), H=2, K=16, V=16, gate=gate or "per_dim",
                            initial_state=True, seed=11)
    d_o, d_S = torch.randn(1, a["q"].shape[1], 2, 16), torch.randn(1, 2, 16, 16)
    want = autograd(getattr(naive, op), testing.to_float64(a), d_o.double(), d_S.double())
    got = autograd(getattr(chunk, op), a, d_o, d_S)
    errs = {n: testing.rel_err(got[n], want[n]) for n in want}
    print(f"{op:>10} {gate or '':>8}:", "  ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) < 1e-4

# %% [markdown]
# ## 7. Recompute or materialise
#
# The chunkwise backward needs the state entering every chunk, $S_{[n-1]}$. Two ways to have them:
# **materialise** — the forward keeps all $N$ states ($N K V$ numbers per head) for the backward —
# or **recompute** — the backward runs the state pass again (one matmul per chunk and a short
# loop). The GLA paper recomputes by default: the states cost memory for as long as the network
# waits between the layer's forward and its backward (all later layers' forwards and backwards),
# while recomputing them costs a small part of the backward's time. The library takes
# `recompute=True` (default) or `False`.
#
# We measure on this machine, per-dimension GLA, forward + backward: the time (fastest of a few
# runs, one thread), the **peak** memory during forward + backward, and the memory **held** after
# the forward — what waits for the backward. `bench.memory_use` counts, on a GPU, the allocator's
# bytes; on a CPU every tensor storage created during the call until it is freed (an operation's
# internal scratch space is not seen).

# %%
Hm, Km = 2, 64
Ts = pick(cpu=[128, 256, 512], gpu=[2048, 8192, 32768])
dev = linattn.device.default_device()
res = {m: {"ms": [], "peak": [], "held": []} for m in ("recompute", "materialise")}
base = []                                                          # inputs + outputs + one state per head
for Tn in Ts:
    a = testing.make_inputs("gla", B=1, T=Tn, H=Hm, K=Km, V=Km, device=dev, seed=Tn)
    a = {n: x.requires_grad_() for n, x in a.items()}
    d_o = torch.randn(1, Tn, Hm, Km, device=dev)
    base.append(sum(x.numel() * x.element_size() for x in a.values()) + d_o.numel() * 4 + Hm * Km * Km * 4)
    for mode, rc in (("recompute", True), ("materialise", False)):
        def fwd_bwd():
            o, _ = chunk.gla(**a, recompute=rc)
            o.backward(d_o)
        res[mode]["ms"].append(bench.fastest_ms(fwd_bwd, runs=3))
        res[mode]["peak"].append(bench.memory_use(fwd_bwd)[0])
        res[mode]["held"].append(bench.memory_use(lambda: chunk.gla(**a, recompute=rc))[1])

print(f"{'T':>6} {'mode':>12} {'fwd+bwd ms':>11} {'peak MB':>8} {'held MB':>8}  (inputs+outputs+state MB)")
for i, Tn in enumerate(Ts):
    for mode in res:
        r = res[mode]
        print(f"{Tn:>6} {mode:>12} {r['ms'][i]:>11.1f} {r['peak'][i] / 1e6:>8.2f} {r['held'][i] / 1e6:>8.2f}"
              f"  ({base[i] / 1e6:.2f})")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
for mode, color, marker in (("recompute", "C0", "o"), ("materialise", "C1", "s")):
    ax1.plot(Ts, res[mode]["ms"], marker=marker, color=color, label=mode)
    ax2.plot(Ts, [p / 1e6 for p in res[mode]["peak"]], marker=marker, color=color,
             label=f"{mode}: peak during forward + backward")
    ax2.plot(Ts, [p / 1e6 for p in res[mode]["held"]], marker=marker, color=color, ls="--",
             label=f"{mode}: held from forward to backward")
ax2.plot(Ts, [x / 1e6 for x in base], "k:", label="inputs + outputs + one state per head")
for ax in (ax1, ax2):
    ax.set(xscale="log", yscale="log", xlabel="sequence length T (tokens)")
    ax.set_xticks(Ts, [str(t) for t in Ts])
    ax.xaxis.set_minor_locator(plt.NullLocator())
ax1.set(ylabel="forward + backward (ms, fastest run)", title=f"GLA per-dim gates, H={Hm}, K=V={Km}: time")
ax2.set(ylabel="memory (MB)", title="memory")
ax1.legend()
ax2.legend(fontsize=7)
plt.show()
held_extra = [m - r for m, r in zip(res["materialise"]["held"], res["recompute"]["held"])]
states = [Hm * (-(-Tn // 64)) * Km * Km * 4 for Tn in Ts]          # N states of K × V float32 per head
print("held by materialise beyond recompute (MB):", [f"{x / 1e6:.2f}" for x in held_extra],
      "| N chunk states (MB):", [f"{x / 1e6:.2f}" for x in states])
assert all(x >= 0.9 * s for x, s in zip(held_extra, states))

# %% [markdown]
# What the measurement says (the numbers above are this machine's):
#
# * **Held between forward and backward**, the memory that piles up across the layers of a network,
#   grows with $T$ in both modes — the outputs — and materialise holds the $N$ chunk states on
#   top (the assertion: at least their size). With $C = 64$ and $K = V = 64$ the states are
#   $NKV = TKV/C$ numbers per head, as much as the outputs; at $K = V = 128$ they are twice the
#   outputs.
# * **Peak during one layer's forward + backward** is about the same for both modes: it is set by
#   the backward's working set — here the intra-chunk tiles of all chunks at once, several times
#   the inputs — and recomputed states are alive during the backward either way. On a CPU this
#   chunk level's peak is far above "inputs + outputs + one state"; a fused GPU kernel keeps such
#   tiles on chip.
# * **Time:** recomputing adds one state pass, small next to the intra-chunk work. Compare the two
#   curves on the left: on a CPU the gap between the modes is small either way, and the
#   materialise path is not necessarily the faster one (keeping the states is not free either: the
#   forward writes them out and autograd holds them); on a GPU the paper reports about 2 %.
#
# That is the GLA paper's argument: recomputation costs little time and saves the memory that
# matters, the memory held while the rest of the network runs.
#
# ## Summary
#
# * The backward of a linear recurrence is a linear recurrence **in reverse time**:
#   $dS_{t-1} = \operatorname{diag}(\alpha_t)\,dS_t + \text{scale}\cdot q_{t-1}^\top do_{t-1}$, started from
#   the incoming final-state gradient and ending at the initial state's. `linattn.naive.backward`
#   has it for all four operations, equal to autograd to float64 rounding.
# * **Closed-form gate gradient**: $\partial L/\partial b_t = q_t\odot dq_t - k_t\odot dk_t$ (plus
#   $\sum_\nu S_T\odot dS_T$ at the end), $dg_t = \sum_{s\ge t}\partial L/\partial b_s$ — no state per token.
#   Sign: $+$ on the query side; the sum runs to the end. For the delta rule the read key adds
#   $+k\odot dk^{\text{read}}$.
# * **Chunkwise**: a reverse pass over chunk states ($dS_{[n-1]} = \operatorname{diag}(\gamma)dS_{[n]} +
#   \text{scale}\cdot(Q\odot\Lambda)^\top dO$), then independent chunks whose $dq$, $dk$ are the forward's
#   decayed tiles read by rows and by columns, and the gate gradient summed inside each chunk.
# * **Precision** as in the forward: exponents ≤ 0 (a gradient through $e^{-b}$ overflows under
#   strong gates), diagonal tiles in float32, short suffix sums.
# * **Delta rule**: through $X = (I + A)^{-1}Y$, $dY = \mathcal T^\top dX$ and $dA = -\operatorname{tril}_{-1}(dY X^\top)$;
#   $d\beta$ collects from $U$, $W$ and $A$.
# * **Recompute vs materialise**: same peak within one layer, less memory held between forward and
#   backward for recompute, at the cost of one more state pass.
#
# **Workbook:** `exercises/12_backward.py` — the closed-form gate gradient, the reverse-time
# recurrence, then the chunkwise GLA backward, graded against float64 autograd.
#
# **Next:** chapter 13 (`book/13_backward_triton.py`) writes this backward as Triton kernels.
