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
# $do_t$ arriving at each output (and, when the final state is handed on, a gradient
# $dS_{\mathrm{fin}}$ arriving at it), produce $dq, dk, dv, dg$ (and $d\beta$, $dS_0$). Autograd
# through the token loop gets them, but it keeps one $K\times V$ state per token and runs $T$ tiny
# steps. We derive the backward by hand, each idea the book's way — derivation, token loop,
# chunked form, checked against the level before: first a recurrence that walks time in reverse,
# then the **closed-form gate gradient** that needs no state (seed 001, summarising the GLA paper),
# then the chunkwise backward the library runs — with the forward's precision rules, and with the
# gate gradient summed where it does not cancel — and the complete delta-rule / KDA backward
# through the WY/UT transform. Finally we measure the trade-off the GLA paper settles by default:
# recompute the chunk states in the backward, or keep them from the forward.

# %%
import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import FuncFormatter

import linattn
from linattn import bench, chunk, naive, testing
from linattn.device import pick
from linattn.naive import backward

print(linattn.device.describe())
torch.manual_seed(0)
NEG_INF = float("-inf")


def autograd(fn, args, do, dS=None, names=("q", "k", "v", "g", "beta", "initial_state")):
    """Gradients of L = <o, do> + <S_T, dS> by autograd through fn (the ground truth, in float64)."""
    leaves = {n: a.detach().clone().requires_grad_() for n, a in args.items() if n in names}
    o, S = fn(**{**args, **leaves}, output_final_state=True)
    loss = (o * do).sum() + (0 if dS is None else (S * dS).sum())
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"d" + n: g for n, g in zip(leaves, grads)}


def suffix_sum(x, dim=0):
    """Σ_{s ≥ t} x_s along dim: the direction in which a gate's gradient collects."""
    return x.flip(dim).cumsum(dim).flip(dim)


# %% [markdown]
# ## 1. What the backward computes
#
# A layer sits inside a network; the loss $L$ depends on it only through what it hands on: the
# outputs $o_t$ and, in a model that carries the state from one segment to the next, the final
# state $S_T$. Backpropagation delivers $do_t = \partial L/\partial o_t$ and, from the next
# segment, $dS_{\mathrm{fin}}$ — the part of $\partial L/\partial S_T$ that arrives from outside
# the layer (zero when the state is not handed on). For the layer the loss is, to first order,
#
# $$L = \sum_t \langle o_t, do_t\rangle + \langle S_T, dS_{\mathrm{fin}}\rangle ,$$
#
# and its job is to return the gradient of that with respect to every input. Everything below is
# checked against autograd through the naive recurrence in float64, on this GLA problem (`dfinal`
# is $dS_{\mathrm{fin}}$, the library's `dfinal_state`):

# %%
B, T, H, K, V = 1, 40, 2, 16, 8
args = testing.to_float64(testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, gate="per_dim",
                                              initial_state=True, seed=1))
do = torch.randn(B, T, H, V, dtype=torch.float64)
dfinal = torch.randn(B, H, K, V, dtype=torch.float64)
truth = autograd(naive.gla, args, do, dfinal)
print({n: tuple(g.shape) for n, g in truth.items()})

# %% [markdown]
# ## 2. Walking time backwards
#
# GLA's step is $S_t = \operatorname{diag}(\alpha_t) S_{t-1} + k_t^\top v_t$ with $\alpha_t = e^{g_t}$, and
# $o_t = \text{scale}\cdot q_t S_t$. Write $dS_t$ for the gradient of the loss with respect to
# $S_t$ — *all* of it: from $o_t$, and through $S_{t+1}, S_{t+2}, \dots$ from every later output.
# $S_t$ feeds exactly two things, $o_t$ and $S_{t+1}$ (for $t = T$: $o_T$ and the outside), so
#
# $$dS_t = \text{scale}\cdot q_t^\top do_t + \operatorname{diag}(\alpha_{t+1})\, dS_{t+1}\quad (t < T),\qquad
#   dS_T = \text{scale}\cdot q_T^\top do_T + dS_{\mathrm{fin}} .$$
#
# That is a recurrence running **backwards in time**, the mirror of the forward, with the same
# $K\times V$ shape. At step $t$ the gradients of the step's inputs are read off
# $S_t = \operatorname{diag}(\alpha_t) S_{t-1} + k_t^\top v_t$ and $o_t = \text{scale}\cdot q_t S_t$:
#
# $$dq_t = \text{scale}\cdot do_t\, S_t^\top,\qquad dk_t = v_t\, dS_t^\top,\qquad dv_t = k_t\, dS_t,\qquad
#   dg_t = \alpha_t \odot \textstyle\sum_\nu \big(S_{t-1} \odot dS_t\big)_{:,\nu},$$
#
# with $\nu$ running over the value columns (as $\kappa$ runs over key dimensions). Mind the two
# states: the read $o_t$ sees $S_t$, the state *after* step $t$'s write, while the gate multiplies
# $S_{t-1}$, the state *before* it. In a list `S[0], …, S[T]` (`S[t]` the state after step $t$,
# `S[0]` the initial state) step $t$ reads `S[t]` for $dq_t$ and `S[t-1]` for $dg_t$. The code
# counts rows from 0 — row `t` holds step $t+1$ — so there $dq$ reads `S[t + 1]` and $dg$ reads
# `S[t]`; reading `S[t]` for $dq$ is the classic off-by-one (workbook 12's grader names it). After
# the first step the carried $\operatorname{diag}(\alpha_1)\,dS_1$ is the gradient of the initial state.
# $dq_t$ and $dg_t$ need the forward's states — we recompute them and keep all $T+1$ (fine for a
# reference; the chunkwise version below keeps one per chunk). One head, inline:

# %%
def reverse_gla(q, k, v, g, do, S0, dfinal, scale):
    """One head: q, k, g [T, K], v, do [T, V], S0, dfinal [K, V]."""
    a = g.exp()
    S = [S0]
    for t in range(len(q)):                                   # forward, keeping every state
        S.append(a[t, :, None] * S[-1] + k[t, :, None] * v[t])
    dq, dk, dv, dg = (torch.empty_like(x) for x in (q, k, v, g))
    dS = dfinal.clone()
    for t in reversed(range(len(q))):                         # row t is step t + 1
        dS += scale * q[t, :, None] * do[t]                   # the read o_t = scale · q_t S_t
        dq[t] = scale * S[t + 1] @ do[t]                      # S after this step's write
        dk[t], dv[t] = dS @ v[t], k[t] @ dS
        dg[t] = a[t] * (S[t] * dS).sum(-1)                    # S before it
        dS = a[t, :, None] * dS                               # the gradient of the state before
    return dq, dk, dv, dg, dS


h, scale = 1, K ** -0.5
one = [args[n][0, :, h] for n in ("q", "k", "v", "g")]
mine = reverse_gla(*one, do[0, :, h], args["initial_state"][0, h], dfinal[0, h], scale)
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
    want = autograd(fn, a, do[:, :25], dfinal[..., :8, :8])
    got = bwd(**a, do=do[:, :25], dfinal_state=dfinal[..., :8, :8])
    worst = max(testing.rel_err(got[n], want[n]) for n in want)
    print(f"{op:>11} {gate or '':>8}: worst gradient vs autograd {worst:.1e}  ({', '.join(want)})")
    assert worst < testing.tolerance(torch.float64)

# %% [markdown]
# ## 3. The gate gradient needs no state
#
# $dg_t$ above reads $S_{t-1}$: a $K\times V$ state per token, the one thing the chunkwise form
# never materialises. Mao (2022) claimed that gate gradients require it; the GLA paper answers
# that claim (seed 002, §3.1, footnote 10) and derives a closed form (seed 001 writes it out).
# Absorb the decay into the inputs, as chapter 03 did in the forward: with
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
#   + [t = T]\,\textstyle\sum_\nu (S_T \odot dS_{\mathrm{fin}})_{:,\nu},\qquad
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
db[:, -1] += (final * dfinal).sum(-1)                        # S_T = diag(e^{b_T}) S̃_T
dg_closed = suffix_sum(db, 1)                                # Σ_{s ≥ t}
e_ours = testing.rel_err(dg_closed, truth["dg"])
e_seed = testing.rel_err(-dg_closed, truth["dg"])           # the display equation's sign
e_lib = testing.rel_err(backward.gate_grad_closed_form(q, k, truth["dq"], truth["dk"], args["g"],
                                                       final_state=final, dfinal_state=dfinal), truth["dg"])
print(f"closed form vs autograd: {e_ours:.1e} (library {e_lib:.1e}); with the opposite sign: {e_seed:.2f}")
assert max(e_ours, e_lib) < testing.tolerance(torch.float64) and e_seed > 1.9

# %% [markdown]
# The opposite sign gives exactly $-dg$ (relative error 2). For per-head gates ($g$ of shape
# `[B, T, H]`) the same $\partial L/\partial b_t$ is summed over $K$. The delta rule's key has a
# second role, and its part of $dk$ enters this sum with the other sign (section 6.1).
#
# ### What breaks if the gate gradient sums from the start
#
# A prefix sum $\sum_{s\le t}$ instead of the suffix sum is the natural slip ($b_t$ *is* a prefix
# sum of $g$, so its gradient flows the other way). It is not a small error:

# %%
e_prefix = testing.rel_err(db.cumsum(1), truth["dg"])
print(f"prefix sum instead of suffix sum: relative error {e_prefix:.2f}")
assert e_prefix > 0.5

# %% [markdown]
# ## 4. The chunkwise backward
#
# Chapter 04's chunk forward, with $b$ the log-gates summed from the chunk start,
# $\Lambda_i = e^{b_i}$, $\Gamma_j = e^{b_C - b_j}$, $\gamma = e^{b_C}$, and `scale` on the outputs only:
#
# $$O = \text{scale}\cdot\big(P V + (Q\odot\Lambda) S_{[n-1]}\big),\quad P_{ij} = \textstyle\sum_\kappa q_{i\kappa}k_{j\kappa}e^{b_{i\kappa}-b_{j\kappa}}\ (i\ge j),\quad
#   S_{[n]} = \operatorname{diag}(\gamma) S_{[n-1]} + (K\odot\Gamma)^\top V .$$
#
# Differentiate each line. The state gradient obeys the reverse recurrence of section 2 taken a
# chunk at a time — the only sequential part, $N = \lceil T/C\rceil$ steps, started from
# $dS_{[N]} = dS_{\mathrm{fin}}$:
#
# $$dS_{[n-1]} = \operatorname{diag}(\gamma)\, dS_{[n]} + \text{scale}\cdot(Q\odot\Lambda)^\top dO_{[n]} .$$
#
# Given $dS_{[n]}$ (the gradient of the state *after* chunk $n$) every chunk is independent:
#
# $$dP = \text{scale}\cdot\operatorname{tril}(dO\,V^\top),\qquad dV = \text{scale}\cdot P^\top dO + (K\odot\Gamma)\,dS_{[n]},$$
# $$dq_i = \textstyle\sum_{j\le i} dP_{ij}\, k_j\odot e^{b_i-b_j} + \text{scale}\cdot\Lambda_i\odot(dO_i\,S_{[n-1]}^\top),\qquad
#   dk_j = \textstyle\sum_{i\ge j} dP_{ij}\,q_i\odot e^{b_i-b_j} + \underbrace{\Gamma_j\odot(V_j\,dS_{[n]}^\top)}_{w_j\text{, the write}},$$
#
# and the gate gradient by the closed form **inside the chunk**. Everything after chunk $n$ sees
# its gates only through $S_{[n]}$, whose gradient $dS_{[n]}$ already carries that influence, so
# the chunk is a short sequence of its own with "final state" $S_{[n]}$ and "incoming gradient"
# $dS_{[n]}$: $\partial L/\partial b_t = q_t\odot dq_t - k_t\odot dk_t$, plus
# $\sum_\nu(S_{[n]}\odot dS_{[n]})_{:,\nu}$ at the chunk's last token, then a suffix sum over the
# chunk (restarting the sum at each chunk *without* that term is wrong: the gate of a token decays
# everything after it, across chunk borders). The two sums over $j$ and $i$ are the forward's $P$
# tiles again, read along rows and along columns: the same log-space tiles, the same secondary
# chunking.
#
# The code multiplies the queries by `scale` once, `qh` $= \text{scale}\cdot q$, so its `P` is
# $\text{scale}\cdot P$ and its `dP` is $\operatorname{tril}(dO\,V^\top)$; it computes the gradient with
# respect to $\text{scale}\cdot q$ and multiplies by `scale` once at the end. It keeps the diagonal
# of $dP$ ($i = j$, decay 1) apart and hands the gate gradient the pieces it is made of — section 5
# sums the same pieces a second, more accurate way. One head, inline:

# %%
def chunk_gla_backward(q, k, v, g, do, S0, dfinal, scale, C, gate_grad):
    """One head: q, k, g [T, K], v, do [T, V], S0, dfinal [K, V]; chunks of C (the last may be
    shorter). gate_grad(p) turns one chunk's pieces p into its dg."""
    qh, spans = q * scale, [(s, min(s + C, len(q))) for s in range(0, len(q), C)]
    Sin, S = [], S0
    for s, e in spans:                                            # the states entering each chunk
        b = g[s:e].cumsum(0)
        Sin.append(S)
        S = b[-1, :, None].exp() * S + (k[s:e] * (b[-1] - b).exp()).T @ v[s:e]
    Sin.append(S)
    dq, dk, dv, dg = (torch.empty_like(x) for x in (q, k, v, g))
    dS = dfinal.clone()
    for n in reversed(range(len(spans))):
        s, e = spans[n]
        qc, kc, vc, doc, b = qh[s:e], k[s:e], v[s:e], do[s:e], g[s:e].cumsum(0)
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        W = (b[:, None] - b[None]).masked_fill(~causal[..., None], NEG_INF).exp()   # [c, c, K]
        P = torch.einsum("ik,jk,ijk->ij", qc, kc, W)
        dP = (doc @ vc.T) * causal
        lam, gam = b.exp(), (b[-1] - b).exp()                     # Λ, Γ: exponents ≤ 0
        dv[s:e] = P.T @ doc + (kc * gam) @ dS
        off = dP.tril(-1)                                         # i > j; the diagonal apart
        p = dict(q=qc, k=kc, diag=dP.diagonal()[:, None],
                 dq=torch.einsum("ij,jk,ijk->ik", off, kc, W) + lam * (doc @ Sin[n].T),
                 dk=torch.einsum("ij,ik,ijk->jk", off, qc, W),
                 write=gam * (vc @ dS.T), S_in=Sin[n], S_out=Sin[n + 1], dS=dS, gamma=b[-1].exp())
        dq[s:e] = (p["dq"] + p["diag"] * kc) * scale
        dk[s:e] = p["dk"] + p["write"] + p["diag"] * qc
        dg[s:e] = gate_grad(p)
        dS = b[-1, :, None].exp() * dS + (qc * lam).T @ doc       # dS_[n−1]
    return dq, dk, dv, dg, dS


def gate_grad_plain(p):
    """∂L/∂b_t = q̂_t ⊙ dq̂_t − k_t ⊙ dk_t, + Σ_ν S_[n] ⊙ dS_[n] at the chunk's end; suffix sum."""
    dq = p["dq"] + p["diag"] * p["k"]
    dk = p["dk"] + p["write"] + p["diag"] * p["q"]
    db = p["q"] * dq - p["k"] * dk
    db[-1] += (p["S_out"] * p["dS"]).sum(-1)
    return suffix_sum(db)


def head(name):
    """Head h of autograd's gradient `name` (the initial state's is [B, H, K, V], the rest [B, T, H, ...])."""
    return truth[name][0, h] if name == "dinitial_state" else truth[name][0, :, h]


for C in (16, 64):
    got = chunk_gla_backward(*one, do[0, :, h], args["initial_state"][0, h], dfinal[0, h], scale, C,
                             gate_grad_plain)
    names = ("dq", "dk", "dv", "dg", "dinitial_state")
    worst = max(testing.rel_err(x, head(n)) for n, x in zip(names, got))
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
# * **The gate gradient summed where it does not cancel** — the one rule the forward has no twin of.
#
# ### 5.1 The gate gradient, without its cancelling terms
#
# Under strong gates the true $dg$ is tiny — a token's gate only touches what decays through it —
# while $q_t\odot dq_t$ and $k_t\odot dk_t$ are not: the closed form subtracts numbers of size one
# to get it, and every rounding error of those numbers lands in the result. Two sets of terms cancel
# *exactly* in the algebra, so they can be left out before anything is rounded:
#
# * **The diagonal of $dP$.** $dP_{tt}$ (decay $e^0$) puts $dP_{tt}\,k_t$ into $dq_t$ and
#   $dP_{tt}\,q_t$ into $dk_t$; in $q_t\odot dq_t - k_t\odot dk_t$ the two are the same number.
#   Each other pair $i > j$ appears twice too — $q_i\odot dP_{ij}k_j e^{b_i-b_j}$ in row $i$'s
#   $q\odot dq$ and the same with $-$ in the *earlier* row $j$'s $k\odot dk$ — but at different
#   times, so the suffix sums keep the part between $j$ and $i$: that is the gradient.
# * **The writes into the state.** The state term at the chunk's end expands, with
#   $S_{[n]} = \operatorname{diag}(\gamma) S_{[n-1]} + \sum_j (k_j\odot\Gamma_j)^\top v_j$ and $w_j = \Gamma_j\odot(v_j\,dS_{[n]}^\top)$
#   the write part of $dk_j$, into
#   $\sum_\nu (S_{[n]}\odot dS_{[n]})_{:,\nu} = \gamma\odot\sum_\nu(S_{[n-1]}\odot dS_{[n]})_{:,\nu} + \sum_j k_j\odot w_j$.
#   Its suffix-summed partner is $-\sum_{t\ge s} k_t\odot w_t$; together they leave the writes
#   *before* $s$, an exclusive prefix sum.
#
# What is left, for a position $s$ of chunk $n$, with $dq^{\text{off}}$, $dk^{\text{off}}$ the
# gradients without the diagonal of $dP$ (and $dk^{\text{off}}$ without the write):
#
# $$\boxed{dg_s = \sum_{t \ge s}\big(q_t\odot dq^{\text{off}}_t - k_t\odot dk^{\text{off}}_t\big)
#   + \sum_{j < s} k_j\odot w_j + e^{b_C}\odot\textstyle\sum_\nu\big(S_{[n-1]}\odot dS_{[n]}\big)_{:,\nu}}$$
#
# with both sums inside the chunk: at most $C$ terms each, none of which cancels another exactly.
# This is what the library computes, **at every level**: `linattn.chunk.gla_backward.gate_gradient`
# at the chunk level and the Triton backward's kernels (`linattn/triton/gated_backward.py`) take
# exactly this form (the naive level differentiates its loop, where the gate gradient is
# $\alpha_t\odot\sum_\nu S_{t-1}\odot dS_t$ and no such sum arises). Same pieces, new sum, against
# autograd:

# %%
def gate_grad_accurate(p):
    """dg_s = Σ_{t ≥ s} (q̂ ⊙ dq̂^off − k ⊙ dk^off) + Σ_{j < s} k_j ⊙ w_j + γ ⊙ Σ_ν S_[n−1] ⊙ dS_[n]."""
    dg = suffix_sum(p["q"] * p["dq"] - p["k"] * p["dk"])
    kw = (p["k"] * p["write"]).cumsum(0)
    dg[1:] += kw[:-1]                                                 # exclusive: writes before s
    return dg + p["gamma"] * (p["S_in"] * p["dS"]).sum(-1)


got = chunk_gla_backward(*one, do[0, :, h], args["initial_state"][0, h], dfinal[0, h], scale, 16,
                         gate_grad_accurate)
e_acc = testing.rel_err(got[3], head("dg"))
print(f"accurate chunk-local form vs autograd: {e_acc:.1e}")
assert e_acc < testing.tolerance(torch.float64)

# %% [markdown]
# Both forms are exact algebra; they differ in what rounding does to them. The measurement: take
# the pieces in float64, round them as a kernel would store them — to float32, or to bf16 (an
# emulation of a bf16 kernel's stored operands, arithmetic in float32) — and sum them each way:
# the **whole-sequence** closed form of section 3 (`backward.gate_grad_closed_form` on the rounded
# full $dq$, $dk$: one suffix sum over all $T$ tokens) and the **accurate chunk-local** form above
# ($C = 64$). Relative error against the float64 $dg$, as the gates strengthen and $T$ grows; the
# last column is the library's own float32 `chunk.gla` on the same problem:

# %%
def rounded(p, dtype):
    """The pieces as a kernel storing them in `dtype` would have them, computed on in float32."""
    return {n: x.to(dtype).float() for n, x in p.items()}


def gate_grad_errors(strength, Tn, dtype, seed=0):
    """Relative errors of dg: (whole-sequence suffix sum, accurate chunk-local) from the same
    pieces rounded to dtype; one head, per-dimension gates, float64 truth."""
    a = testing.to_float64(testing.make_inputs("gla", B=1, T=Tn, H=1, K=16, V=16, strength=strength,
                                               seed=seed))
    d_o = torch.randn(1, Tn, 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    ref = backward.gla_backward(**a, do=d_o)["dg"][0, :, 0]
    xs = [a[n][0, :, 0] for n in ("q", "k", "v", "g")]
    S0 = torch.zeros(16, 16, dtype=torch.float64)
    acc = chunk_gla_backward(*xs, d_o[0, :, 0], S0, S0, 16 ** -0.5, 64,
                             lambda p: gate_grad_accurate(rounded(p, dtype)).double())
    dq, dk = (x.to(dtype).float()[None, :, None] for x in acc[:2])
    whole = backward.gate_grad_closed_form(xs[0].float()[None, :, None], xs[1].float()[None, :, None],
                                           dq, dk, a["g"].float())[0, :, 0]
    return testing.rel_err(whole, ref), testing.rel_err(acc[3], ref), a, d_o, ref


strengths, lengths = ("normal", "logsigmoid", "strong"), pick(cpu=(64, 256, 1024), gpu=(64, 1024, 4096))
print(f"{'gates':>10} {'T':>5} | {'float32: whole':>14} {'chunk-local':>11} | {'bf16: whole':>11} "
      f"{'chunk-local':>11} | {'chunk.gla f32':>13}")
table = {}
for strength in strengths:
    for Tn in lengths:
        w32, c32, a, d_o, ref = gate_grad_errors(strength, Tn, torch.float32, seed=Tn)
        w16, c16, *_ = gate_grad_errors(strength, Tn, torch.bfloat16, seed=Tn)
        lib = autograd(chunk.gla, {n: x.float() for n, x in a.items()}, d_o.float())["dg"][0, :, 0]
        table[strength, Tn] = (w32, c32, w16, c16, testing.rel_err(lib, ref))
        print(f"{strength:>10} {Tn:>5} | " + " ".join(f"{e:>{w}.1e}" for e, w in
                                                       zip(table[strength, Tn], (14, 11, 13, 11, 15))))
for strength in strengths:                        # what the text below says, checked
    w32, c32, w16, c16, lib = zip(*(table[strength, Tn] for Tn in lengths))
    assert max(c16) < 3 * min(c16) and max(c32) < 3 * min(c32)         # chunk-local: flat in T
    assert c32[-1] < w32[-1] and c16[-1] < w16[-1]                     # and the better one at length
    assert max(lib) < 1e-5
for i in (0, 2):                                  # whole sequence: grows with T and with the gates
    assert table["strong", lengths[-1]][i] > 2 * table["strong", lengths[0]][i]
    assert all(table["strong", Tn][i] > table["normal", Tn][i] for Tn in lengths)

# %% [markdown]
# What the table shows. The whole-sequence sum's error **grows with the gate strength and with
# $T$**: each extra token adds rounding errors of size $|q\odot dq|$ to a result that strong gates
# make small, and in bf16 it becomes a sizeable part of the gradient itself. The chunk-local form's
# error stays at the storage precision however long the sequence and however strong the gates —
# it sums at most $C$ terms that do not cancel. (At $T \le C$ there is one chunk and few
# terms either way: the two errors are alike.) In float32 the whole-sequence error stays small at
# these lengths but still grows with both; the library's float32 `chunk.gla` column is the
# accurate form at work. Hence the rule, taken at every level of the library: the gate gradient is
# summed inside each chunk, without the terms that cancel.
#
# ### What breaks if the gradient goes through $e^{-b}$
#
# The forward's absorption trick has a backward twin: the intra-chunk part of $dq_i$ is $e^{b_i}\odot\sum_j dP_{ij}\,(k_j\odot
# e^{-b_j})$, two matmul-friendly factors. Under strong gates ($g$ down to −20 per token),
# $e^{-b_j}$ over a 64-token chunk far exceeds float32's range ($e^{88.7}$): it overflows to
# $\infty$, and $\infty\cdot 0$ turns the gradient into NaN.

# %%
a = testing.make_inputs("gla", B=1, T=64, H=1, K=16, V=16, strength="strong", seed=9)
qc, kc, vc, gc = (a[n][0, :, 0] for n in ("q", "k", "v", "g"))
doc = torch.randn(64, 16)
b = gc.cumsum(0)                                                   # [C, K], falling by up to 20 a token
dP = (doc @ vc.T).tril()
absorbed = b.exp() * (dP @ (kc * (-b).exp()))                     # e^{b_i} Σ_j dP_ij k_j e^{−b_j}
W = (b[:, None] - b[None]).masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril()[..., None],
                                       NEG_INF).exp()
log_space = torch.einsum("ij,jk,ijk->ik", dP, kc, W)
bad = (~torch.isfinite(absorbed)).sum().item()
print(f"min b = {b.min():.0f}; absorbed: {bad} of {absorbed.numel()} entries not finite; "
      f"log space: {(~torch.isfinite(log_space)).sum().item()} not finite")
assert bad > 0 and torch.isfinite(log_space).all()

# %% [markdown]
# ## 6. The delta rule and KDA
#
# ### 6.1 Token by token: the key reads and writes
#
# KDA's step (the delta rule is $D_t = I$, Gated DeltaNet a scalar $D_t$), with $S'$ the decayed
# state and $r_t$ the residual the step writes:
#
# $$S' = D_t S_{t-1},\quad D_t = \operatorname{diag}(e^{g_t}),\qquad r_t = v_t - k_t S',\qquad
#   S_t = S' + \beta_t\, k_t^\top r_t,\qquad o_t = \text{scale}\cdot q_t S_t .$$
#
# The key appears twice: it **reads** the state ($k_t S'$ inside $r_t$) and it is the direction the
# step **writes** ($\beta_t k_t^\top r_t$). With $dS_t$ as in section 2 (the read of $o_t$ collected
# first), differentiate from the last line up:
#
# $$dq_t = \text{scale}\cdot do_t\,S_t^\top,\qquad d\beta_t = k_t\, dS_t\, r_t^\top,\qquad
#   dk_t^{\text{write}} = \beta_t\, r_t\, dS_t^\top,\qquad dr_t = \beta_t\, k_t\, dS_t = dv_t,$$
# $$dk_t^{\text{read}} = -\,dr_t\, S'^\top,\qquad dk_t = dk_t^{\text{write}} + dk_t^{\text{read}},\qquad
#   dS' = dS_t - k_t^\top dr_t,\qquad dg_t = \textstyle\sum_\nu (S'\odot dS')_{:,\nu},\qquad dS_{t-1} = D_t\, dS' .$$
#
# ($dS'$ has two parts: $S'$ passes into $S_t$ directly and, with a minus sign, through the read.)
# In the closed form of section 3 the two roles take opposite signs: in absorbed form the read is
# $(k_t\odot e^{b_t})\tilde S_{t-1}$, on the query side, and the write $\tilde k_t = k_t\odot e^{-b_t}$, so
#
# $$\frac{\partial L}{\partial b_t} = q_t\odot dq_t + k_t\odot dk_t^{\text{read}} - k_t\odot dk_t^{\text{write}}
#   \;\big(+[t = T]\textstyle\sum_\nu S_T\odot dS_{\mathrm{fin}}\big),\qquad dg_t = \sum_{s\ge t}\frac{\partial L}{\partial b_s}.$$
#
# One head, inline, against autograd — and the closed form with the read part passed as `dk_read`:

# %%
def reverse_kda(q, k, v, g, beta, do, S0, dfinal, scale):
    """One head: q, k, g [T, K], v, do [T, V], beta [T], S0, dfinal [K, V]. Also returns dk^read."""
    a = g.exp()
    S, Sd = [S0], []                                          # S_t, and S' = D_t S_{t−1}
    for t in range(len(q)):
        Sd.append(a[t, :, None] * S[-1])
        S.append(Sd[-1] + beta[t] * k[t, :, None] * (v[t] - k[t] @ Sd[-1]))
    dq, dk, dk_read, dv, dg = (torch.empty_like(x) for x in (q, k, k, v, g))
    dbeta, dS = torch.empty_like(beta), dfinal.clone()
    for t in reversed(range(len(q))):                         # row t is step t + 1
        dS += scale * q[t, :, None] * do[t]
        r = v[t] - k[t] @ Sd[t]
        dq[t] = scale * S[t + 1] @ do[t]
        dbeta[t] = k[t] @ dS @ r
        dr = beta[t] * k[t] @ dS
        dv[t], dk_read[t] = dr, -Sd[t] @ dr
        dk[t] = beta[t] * dS @ r + dk_read[t]                 # write + read
        dS = dS - k[t, :, None] * dr                          # dS'
        dg[t] = (Sd[t] * dS).sum(-1)
        dS = a[t, :, None] * dS                               # dS_{t−1}
    return dq, dk, dv, dg, dbeta, dS, dk_read


kd = testing.to_float64(testing.make_inputs("kda", B=1, T=30, H=1, K=8, V=8, gate="per_dim",
                                            initial_state=True, seed=3))
kdo, kdS = torch.randn(1, 30, 1, 8, dtype=torch.float64), torch.randn(1, 1, 8, 8, dtype=torch.float64)
ktruth = autograd(naive.kda, kd, kdo, kdS)
kx = [kd[n][0, :, 0] for n in ("q", "k", "v", "g", "beta")]
mine = reverse_kda(*kx, kdo[0, :, 0], kd["initial_state"][0, 0], kdS[0, 0], 8 ** -0.5)
for name, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), mine):
    ref = ktruth[name][0, 0] if name == "dinitial_state" else ktruth[name][0, :, 0]
    print(f"{name:>15}: reverse recurrence vs autograd {testing.rel_err(x, ref):.1e}")
    assert testing.rel_err(x, ref) < testing.tolerance(torch.float64)
kfinal = naive.kda(**kd, output_final_state=True)[1]
grads = backward.kda_backward(**kd, do=kdo, dfinal_state=kdS)
closed = backward.gate_grad_closed_form(kd["q"], kd["k"], grads["dq"], grads["dk"], kd["g"],
                                        dk_read=grads["dk_read"], final_state=kfinal, dfinal_state=kdS)
e_read = testing.rel_err(closed, ktruth["dg"])
e_noread = testing.rel_err(backward.gate_grad_closed_form(kd["q"], kd["k"], grads["dq"], grads["dk"], kd["g"],
                                                          final_state=kfinal, dfinal_state=kdS), ktruth["dg"])
print(f"closed-form dg with dk_read: {e_read:.1e}; treating all of dk as a write: {e_noread:.2f}")
assert e_read < testing.tolerance(torch.float64) and e_noread > 0.01

# %% [markdown]
# ### 6.2 One chunk, step by step
#
# Chapter 07's chunk forward goes through the WY/UT transform. With $b$ the chunk's cumulative
# log-gates, $\Lambda$, $\Gamma$, $\gamma$ as before, $E_{ij} = e^{b_i - b_j}$ ($i \ge j$, per key
# dimension) and $S$ the entering state:
#
# $$A^{kk}_{ij} = \textstyle\sum_\kappa k_{i\kappa}k_{j\kappa}E_{ij\kappa}\ (i > j),\quad A = \operatorname{diag}(\beta)A^{kk},\quad
#   \mathcal T = (I + A)^{-1},\quad U = \mathcal T\operatorname{diag}(\beta)V,\quad W = \mathcal T\operatorname{diag}(\beta)(K\odot\Lambda),$$
# $$\tilde V = U - W S,\qquad A^{qk}_{ij} = \textstyle\sum_\kappa q_{i\kappa}k_{j\kappa}E_{ij\kappa}\ (i \ge j),\qquad
#   O = \text{scale}\,\big((Q\odot\Lambda) S + A^{qk}\tilde V\big),\qquad S' = \operatorname{diag}(\gamma) S + (K\odot\Gamma)^\top\tilde V .$$
#
# ($\mathcal T$ is the inverse; $T$ stays the sequence length.) The loss of one chunk is
# $\langle O, dO\rangle + \langle S', dS'\rangle$, $dS'$ the gradient of the state leaving it. We
# build the forward from float64 leaves, let autograd give the gradient of every intermediate, and
# then derive each one by hand, in the order the backward runs. In the code `dO` already carries
# `scale` ($\text{scale}\cdot dO$), so no other line needs it.

# %%
def kda_chunk_forward(q, k, v, g, beta, S, scale):
    """One chunk of one head (float64): every intermediate of the WY/UT forward, by name."""
    n = len(q)
    b = g.cumsum(0)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    E = (b[:, None] - b[None]).masked_fill(~causal[..., None], NEG_INF).exp()   # [c, c, K], i ≥ j
    Akk = torch.einsum("ik,jk,ijk->ij", k, k, E).tril(-1)
    A = beta[:, None] * Akk
    I = torch.eye(n, dtype=q.dtype)
    Tinv = torch.linalg.solve_triangular(I + A, I, upper=False, unitriangular=True)   # 𝒯
    Lam, Gam, gam = b.exp(), (b[-1] - b).exp(), b[-1].exp()
    KL, QL, Kdec = k * Lam, q * Lam, k * Gam
    U, W = Tinv @ (beta[:, None] * v), Tinv @ (beta[:, None] * KL)
    Vt = U - W @ S
    Aqk = torch.einsum("ik,jk,ijk->ij", q, k, E)
    O = scale * (QL @ S + Aqk @ Vt)
    S_out = gam[:, None] * S + Kdec.T @ Vt
    return dict(q=q, k=k, v=v, beta=beta, S=S, E=E, Akk=Akk, A=A, Tinv=Tinv, Lam=Lam, Gam=Gam,
                gam=gam, KL=KL, QL=QL, Kdec=Kdec, U=U, W=W, Vt=Vt, Aqk=Aqk, O=O, S_out=S_out)


c6 = 16
x6 = testing.to_float64(testing.make_inputs("kda", B=1, T=c6, H=1, K=8, V=8, gate="per_dim",
                                            strength="logsigmoid", seed=4))
leaves = {n: x6[n][0, :, 0].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
leaves["S"] = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
dO6, dS6 = torch.randn(c6, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
f = kda_chunk_forward(**leaves, scale=8 ** -0.5)
inner = ("Vt", "U", "W", "Aqk", "QL", "Kdec", "A", "Akk", "KL")
loss = (f["O"] * dO6).sum() + (f["S_out"] * dS6).sum()
ag = dict(zip(list(leaves) + list(inner),
              torch.autograd.grad(loss, list(leaves.values()) + [f[n] for n in inner])))
f = {n: x.detach() for n, x in f.items()}
dO6s = 8 ** -0.5 * dO6                                            # scale · dO


def agree(name, mine, want=None):
    err = testing.rel_err(mine, ag[name] if want is None else want)
    print(f"{name:>5}: by hand vs autograd {err:.1e}")
    assert err < testing.tolerance(torch.float64)


# %% [markdown]
# **The state and the residuals.** $\tilde V$ feeds the outputs and the leaving state; $S$ feeds
# the outputs, $\tilde V$ (with a minus) and the leaving state:
#
# $$d\tilde V = \text{scale}\,A^{qk\top} dO + (K\odot\Gamma)\,dS',\qquad
#   dS = \text{scale}\,(Q\odot\Lambda)^\top dO - W^\top d\tilde V + \operatorname{diag}(\gamma)\,dS' .$$
#
# Over a sequence this is the reverse pass, the only sequential step: $dS$ of chunk $n$ is $dS'$ of
# chunk $n-1$.

# %%
def state_grads(f, dO, dS_out):
    """dṼ and the gradient of the entering state S (dO already times scale)."""
    dVt = f["Aqk"].T @ dO + f["Kdec"] @ dS_out
    return dVt, f["QL"].T @ dO - f["W"].T @ dVt + f["gam"][:, None] * dS_out


dVt, dS_in = state_grads(f, dO6s, dS6)
agree("Vt", dVt)
agree("S", dS_in)

# %% [markdown]
# **The factors.** Each product differentiates as a product: $dA^{qk} = \text{scale}\cdot\operatorname{tril}(dO\,\tilde V^\top)$
# (the lower triangle with its diagonal is where $A^{qk}$ lives), $d(Q\odot\Lambda) = \text{scale}\cdot dO\,S^\top$,
# $d(K\odot\Gamma) = \tilde V\,dS'^\top$, and from $\tilde V = U - WS$: $dU = d\tilde V$, $dW = -\,d\tilde V S^\top$.

# %%
def factor_grads(f, dO, dS_out, dVt):
    return dict(Aqk=(dO @ f["Vt"].T).tril(), QL=dO @ f["S"].T, Kdec=f["Vt"] @ dS_out.T,
                U=dVt, W=-dVt @ f["S"].T)


d6 = factor_grads(f, dO6s, dS6, dVt)
agree("Aqk", d6["Aqk"], ag["Aqk"].tril())
for name in ("QL", "Kdec", "U", "W"):
    agree(name, d6[name])

# %% [markdown]
# **Through the inverse.** For $X = \mathcal T Y$ with $\mathcal T = (I + A)^{-1}$:
# $dY = \mathcal T^\top dX$, and from $d\mathcal T = -\mathcal T\,dA\,\mathcal T$,
# $dA = -\mathcal T^\top dX\,Y^\top\mathcal T^\top = -\,dY\,X^\top$, kept on the strict lower triangle where
# $A$ lives. $U$ and $W$ are both $\mathcal T\cdot$something, so with $dY_U = \mathcal T^\top dU$ and
# $dY_W = \mathcal T^\top dW$ (one product with $\mathcal T^\top$ each, or a triangular solve with $(I + A)^\top$):
#
# $$dA = -\operatorname{tril}_{-1}\big(dY_U\,U^\top + dY_W\,W^\top\big).$$

# %%
def inverse_grads(f, dU, dW):
    Tt = f["Tinv"].T
    dYU, dYW = Tt @ dU, Tt @ dW
    return dYU, dYW, -(dYU @ f["U"].T + dYW @ f["W"].T).tril(-1)


dYU, dYW, dA = inverse_grads(f, d6["U"], d6["W"])
agree("A", dA, ag["A"].tril(-1))

# %% [markdown]
# **$\beta$ and $v$.** $\beta$ enters three times — in $U$'s right side $\operatorname{diag}(\beta)V$,
# in $W$'s $\operatorname{diag}(\beta)(K\odot\Lambda)$ and in $A = \operatorname{diag}(\beta)A^{kk}$ — so
#
# $$d\beta_i = dY_{U,i}\cdot v_i + dY_{W,i}\cdot(k_i\odot\Lambda_i) + \textstyle\sum_{j<i} dA_{ij}\,A^{kk}_{ij},\qquad
#   dv_i = \beta_i\,dY_{U,i},\qquad d(K\odot\Lambda)_i = \beta_i\,dY_{W,i},\qquad dA^{kk}_{ij} = \beta_i\,dA_{ij}.$$

# %%
def beta_grads(f, dYU, dYW, dA):
    """dβ, dv, d(K ⊙ Λ) (of W's right side) and dA^kk."""
    b = f["beta"][:, None]
    dbeta = (dYU * f["v"]).sum(-1) + (dYW * f["KL"]).sum(-1) + (dA * f["Akk"]).sum(-1)
    return dbeta, b * dYU, b * dYW, b * dA


dbeta6, dv6, dKL, dAkk = beta_grads(f, dYU, dYW, dA)
agree("beta", dbeta6)
agree("v", dv6)
agree("KL", dKL)
agree("Akk", dAkk, ag["Akk"].tril(-1))

# %% [markdown]
# **$q$ and $k$.** Both score matrices have the form $P_{ij} = \sum_\kappa a_{i\kappa} b_{j\kappa} E_{ij\kappa}$;
# for a gradient $M = dP$ the row side gets $da_i = \sum_j M_{ij}\, b_j\odot E_{ij}$ and the column side
# $db_j = \sum_i M_{ij}\, a_i\odot E_{ij}$ — the forward's decayed tiles read by rows and by columns,
# as in GLA. The query has two places ($A^{qk}$'s rows and $Q\odot\Lambda$):
# $dq = dq^{qk} + \Lambda\odot d(Q\odot\Lambda)$. The key has **five**:
#
# $$dk = \underbrace{dk^{qk}}_{A^{qk}\text{'s columns}} + \underbrace{dk^{\text{row}}}_{A^{kk}\text{'s rows}}
#   + \underbrace{dk^{\text{col}}}_{A^{kk}\text{'s columns}} + \underbrace{\Lambda\odot d(K\odot\Lambda)}_{\text{in }W}
#   + \underbrace{\Gamma\odot d(K\odot\Gamma)}_{\text{the write, decayed to the chunk's end}} .$$
#
# Leave any one out and the check fails; the printout says by how much.

# %%
def score_grads(M, a, b, E):
    """P_ij = Σ_κ a_iκ b_jκ E_ijκ: the gradients of the rows a and the columns b for dP = M."""
    return torch.einsum("ij,jk,ijk->ik", M, b, E), torch.einsum("ij,ik,ijk->jk", M, a, E)


def qk_grads(f, d, dKL, dAkk):
    dq_s, dk_s = score_grads(d["Aqk"], f["q"], f["k"], f["E"])
    dk_row, dk_col = score_grads(dAkk, f["k"], f["k"], f["E"])
    parts = dict(qk=dk_s, row=dk_row, col=dk_col, W=f["Lam"] * dKL, write=f["Gam"] * d["Kdec"])
    return dq_s + f["Lam"] * d["QL"], parts, dq_s


dq6, kparts, dq_s = qk_grads(f, d6, dKL, dAkk)
agree("q", dq6)
agree("k", sum(kparts.values()))
for left_out in kparts:
    partial_dk = sum(x for n, x in kparts.items() if n != left_out)
    print(f"       without the {left_out:>5} part: relative error {testing.rel_err(partial_dk, ag['k']):.2f}")
    assert testing.rel_err(partial_dk, ag["k"]) > 1e-3

# %% [markdown]
# **The gate.** Every place a decay enters gives $\partial L/\partial b$ by the rule of section 3: a
# factor $x\odot e^{\pm b}$ contributes $\pm\,x\odot dx$. Per position $i$ (with $b_i$ the chunk-local
# cumulative gate): the scores give $q_i\odot dq^{qk}_i - k_i\odot dk^{qk}_i$ and
# $k_i\odot(dk^{\text{row}}_i - dk^{\text{col}}_i)$ (row side $+$, column side $-$), $Q\odot\Lambda$ and
# $K\odot\Lambda$ give $+\,(Q\odot\Lambda)_i\odot d(Q\odot\Lambda)_i$ and $+\,(K\odot\Lambda)_i\odot d(K\odot\Lambda)_i$,
# and $\Gamma_i = e^{b_C - b_i}$ gives $-\,(K\odot\Gamma)_i\odot d(K\odot\Gamma)_i$ at $i$ and the same with $+$ at
# the chunk's end $C$, where $\gamma = e^{b_C}$ adds $\gamma\odot\sum_\nu(S\odot dS')_{:,\nu}$. Then
# $dg_s = \sum_{i\ge s}\partial L/\partial b_i$ inside the chunk. As in section 5.1, the $\Gamma$ pair is
# better summed as what it is — the writes *before* $s$, an exclusive prefix — and the diagonal of
# $A^{qk}$ left out; `linattn.chunk.delta_backward.gate_grad` does both. Per-head gates (Gated
# DeltaNet) sum the same per-dimension terms over $K$. Here, in float64, the plain sum:

# %%
def kda_gate_grad(f, d, dKL, kparts, dq_s, dS_out):
    db = (f["q"] * dq_s - f["k"] * kparts["qk"] + f["k"] * (kparts["row"] - kparts["col"])
          + f["QL"] * d["QL"] + f["KL"] * dKL - f["Kdec"] * d["Kdec"])
    db[-1] += f["gam"] * (f["S"] * dS_out).sum(-1) + (f["Kdec"] * d["Kdec"]).sum(0)
    return suffix_sum(db)


agree("g", kda_gate_grad(f, d6, dKL, kparts, dq_s, dS6))

# %% [markdown]
# ### 6.3 The whole sequence
#
# The steps compose into one chunk's backward; a forward pass over the chunks gives the entering
# states (recomputed, as the library does by default), and the reverse pass hands $dS$ from chunk to
# chunk, starting from $dS_{\mathrm{fin}}$. Against float64 autograd through the token loop, with a
# last chunk shorter than the others:

# %%
def kda_chunk_backward(f, dO, dS_out):
    """One chunk: (dq, dk, dv, dg, dβ, dS) from its forward f, scale · dO and dS'."""
    dVt, dS = state_grads(f, dO, dS_out)
    d = factor_grads(f, dO, dS_out, dVt)
    dYU, dYW, dA = inverse_grads(f, d["U"], d["W"])
    dbeta, dv, dKL, dAkk = beta_grads(f, dYU, dYW, dA)
    dq, kparts, dq_s = qk_grads(f, d, dKL, dAkk)
    return dq, sum(kparts.values()), dv, kda_gate_grad(f, d, dKL, kparts, dq_s, dS_out), dbeta, dS


def chunk_kda_backward(q, k, v, g, beta, do, S0, dfinal, scale, C):
    """One head, float64; chunks of C, the last may be shorter."""
    spans = [(s, min(s + C, len(q))) for s in range(0, len(q), C)]
    fs, S = [], S0
    for s, e in spans:                                            # forward: the entering states
        fs.append(kda_chunk_forward(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], S, scale))
        S = fs[-1]["S_out"]
    grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
    dS = dfinal
    for (s, e), fn in reversed(list(zip(spans, fs))):             # reverse pass
        *chunk_grads, dS = kda_chunk_backward(fn, scale * do[s:e], dS)
        for out, x in zip(grads, chunk_grads):
            out[s:e] = x
    return (*grads, dS)


got = chunk_kda_backward(*kx, kdo[0, :, 0], kd["initial_state"][0, 0], kdS[0, 0], 8 ** -0.5, 8)
for name, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), got):
    ref = ktruth[name][0, 0] if name == "dinitial_state" else ktruth[name][0, :, 0]
    print(f"{name:>15}: chunkwise (C = 8, T = 30) vs autograd {testing.rel_err(x, ref):.1e}")
    assert testing.rel_err(x, ref) < testing.tolerance(torch.float64)

# %% [markdown]
# The library's chunkwise delta-rule backward (`linattn.chunk.delta_rule` / `kda`, module
# `chunk/delta_backward.py`) chains exactly these steps for `[B, T, H, K]` tensors, all chunks at
# once, with the forward's sub-chunk blocks for the decayed tiles and the gate gradient summed as
# in section 5.1. Its gradients — $d\beta$ included — against float64 autograd through the token
# loop, float32 inputs, both gate shapes:

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
# loop). The GLA paper recomputes by default (seed 001): the states cost memory for as long as the
# network waits between the layer's forward and its backward (all later layers' forwards and
# backwards), while recomputing them costs a small part of the backward's time. The library takes
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
MODES = {"recompute": True, "materialise": False}
res = {m: {"ms": [], "peak": [], "held": []} for m in MODES}
base = []                                                          # inputs + outputs + one state per head
for Tn in Ts:
    a = testing.make_inputs("gla", B=1, T=Tn, H=Hm, K=Km, V=Km, device=dev, seed=Tn)
    a = {n: x.requires_grad_() for n, x in a.items()}
    d_o = torch.randn(1, Tn, Hm, Km, device=dev)
    base.append(sum(x.numel() * x.element_size() for x in a.values()) + d_o.numel() * 4 + Hm * Km * Km * 4)
    for mode, rc in MODES.items():
        def fwd_bwd():
            o, _ = chunk.gla(**a, recompute=rc)
            o.backward(d_o)
        res[mode]["ms"].append(bench.fastest_ms(fwd_bwd, runs=7))
        res[mode]["peak"].append(bench.memory_use(fwd_bwd)[0])
        res[mode]["held"].append(bench.memory_use(lambda: chunk.gla(**a, recompute=rc))[1])

print(f"{'T':>6} {'mode':>12} {'fwd+bwd ms':>11} {'peak MB':>8} {'held MB':>8}  (inputs+outputs+state MB)")
for i, Tn in enumerate(Ts):
    for mode in res:
        r = res[mode]
        print(f"{Tn:>6} {mode:>12} {r['ms'][i]:>11.1f} {r['peak'][i] / 1e6:>8.2f} {r['held'][i] / 1e6:>8.2f}"
              f"  ({base[i] / 1e6:.2f})")

# Two panels: time and held memory. The peak is the same in both modes (the table), so it is not
# drawn; the two modes get different markers and line styles, so a curve on top of the other
# still shows both.
STYLE = {"recompute": dict(color="C0", marker="o", ls="-", ms=6),
         "materialise": dict(color="C1", marker="s", ls="--", ms=10, mfc="none", mew=1.5)}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
for mode, style in STYLE.items():
    ax1.plot(Ts, res[mode]["ms"], label=mode, **style)
    ax2.plot(Ts, [p / 1e6 for p in res[mode]["held"]], label=f"{mode}: held from forward to backward",
             **style)
ax2.plot(Ts, [x / 1e6 for x in base], "k:", label="inputs + outputs + one state per head")
plain = FuncFormatter(lambda y, _: f"{y:g}")
# minor ticks labelled at 2, 3, 5 and 7 only (0.2, 0.3, 0.5, 0.7, 2, …): all eight would crowd
sparse = FuncFormatter(lambda y, _: f"{y:g}" if f"{y:.0e}"[0] in "2357" else "")
for ax in (ax1, ax2):
    ax.set(xscale="log", yscale="log", xlabel="sequence length T (tokens)")
    ax.set_xticks(Ts, [str(t) for t in Ts])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.yaxis.set_major_formatter(plain)                            # 1, 10, 100 — not 10⁰, 10¹
    ax.yaxis.set_minor_formatter(sparse)                           # and 2, 3, 5, 7 — not 2×10⁰
    ax.grid(True, which="both", alpha=0.3)
ax1.set(ylabel="forward + backward (ms, fastest run)", title=f"GLA per-dim gates, H={Hm}, K=V={Km}: time")
ax2.set(ylabel="memory (MB)", title="memory held between forward and backward")
ax1.legend(loc="upper left")
ax2.legend(loc="upper left", fontsize=8)
fig.tight_layout()
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
# * **Peak during one layer's forward + backward** (the table) is about the same for both modes: it
#   is set by the backward's working set — here the intra-chunk tiles of all chunks at once, several
#   times the inputs — and recomputed states are alive during the backward either way. On a CPU
#   this chunk level's peak is far above "inputs + outputs + one state"; a fused GPU kernel keeps
#   such tiles on chip.
# * **Time:** recomputing adds one state pass, small next to the intra-chunk work. Compare the two
#   curves on the left: on a CPU the gap between the modes is small either way, and the
#   materialise path is not necessarily the faster one (keeping the states is not free either: the
#   forward writes them out and autograd holds them); for a GPU kernel seed 001 calls the cost of
#   recomputing negligible.
#
# That is the GLA paper's argument: recomputation costs little time and saves the memory that
# matters, the memory held while the rest of the network runs.
#
# ## Summary
#
# * The backward of a linear recurrence is a linear recurrence **in reverse time**:
#   $dS_{t-1} = \operatorname{diag}(\alpha_t)\,dS_t + \text{scale}\cdot q_{t-1}^\top do_{t-1}$, started from
#   $dS_T = \text{scale}\cdot q_T^\top do_T + dS_{\mathrm{fin}}$ and ending at the initial state's gradient.
#   $dq_t$ reads $S_t$ (after the write), $dg_t$ reads $S_{t-1}$ (before it). `linattn.naive.backward`
#   has the walk for all four operations, equal to autograd to float64 rounding.
# * **Closed-form gate gradient**: $\partial L/\partial b_t = q_t\odot dq_t - k_t\odot dk_t$ (plus
#   $\sum_\nu S_T\odot dS_{\mathrm{fin}}$ at the end), $dg_t = \sum_{s\ge t}\partial L/\partial b_s$ — no state
#   per token. Sign: $+$ on the query side; the sum runs to the end. For the delta rule the read
#   key adds $+k\odot dk^{\text{read}}$, the write $-k\odot dk^{\text{write}}$.
# * **Chunkwise**: a reverse pass over chunk states ($dS_{[n-1]} = \operatorname{diag}(\gamma)dS_{[n]} +
#   \text{scale}\cdot(Q\odot\Lambda)^\top dO$), then independent chunks whose $dq$, $dk$ are the forward's
#   decayed tiles read by rows and by columns.
# * **Precision** as in the forward — exponents ≤ 0 (a gradient through $e^{-b}$ overflows under
#   strong gates), diagonal tiles in float32 — plus one rule of its own: the gate gradient is summed
#   **inside each chunk, without the terms that cancel** (the diagonal of $dP$; the writes, left as an
#   exclusive prefix; $e^{b_C}\sum_\nu S_{[n-1]}\odot dS_{[n]}$ per chunk). The whole-sequence suffix
#   sum loses precision as gates strengthen and $T$ grows; the library uses the chunk-local form at
#   every level.
# * **Delta rule / KDA**: through $X = \mathcal T Y$, $\mathcal T = (I + A)^{-1}$: $dY = \mathcal T^\top dX$,
#   $dA = -\operatorname{tril}_{-1}(dY X^\top)$; $d\beta$ collects from $U$, $W$ and $A$; the key has five
#   places ($A^{qk}$'s columns, $A^{kk}$'s rows and columns, $W$, the decayed write); the gate
#   gradient gathers every decay's $\pm x\odot dx$.
# * **Recompute vs materialise**: same peak within one layer, less memory held between forward and
#   backward for recompute, at the cost of one more state pass.
#
# **Workbook:** `exercises/12_backward.py` — the closed-form gate gradient, the reverse-time
# recurrence, the chunkwise GLA backward, your own `torch.autograd.Function` (gradchecked and
# trained through), and the delta rule's chunkwise backward through the WY/UT transform, each
# graded against float64 autograd with the classic mistakes named.
#
# **Next:** chapter 13 (`book/13_backward_triton.py`) writes this backward as Triton kernels.
