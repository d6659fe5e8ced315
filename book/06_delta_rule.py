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
# # 06 — The delta rule
#
# **Goal.** Linear attention *adds* every $k_t^\top v_t$ to its state and never takes anything
# back: write the same key twice with two different values and the state returns their sum. The
# delta rule (DeltaNet) writes only the *error* of the state's current prediction, so a key that
# is written again is overwritten. This chapter derives the rule from a regression loss, looks at
# its transition $I - \beta k^\top k$ as a (generalised) Householder matrix — which explains why
# keys are L2-normalised and what $\beta > 1$ does — adds the decays of chapters 03–04 (Gated
# DeltaNet, KDA), and ends with the problem chapter 07 solves: the residual depends on the whole
# history, so the chunkwise trick of chapter 02 no longer applies as it is.
#
# Convention as everywhere in the book: state $S \in \mathbb{R}^{K\times V}$, keys and queries are
# rows, transitions act on the left, $o_t = \text{scale}\cdot q_t S_t$.

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import linattn
from linattn import InputError, naive, testing, validate
from linattn.device import pick

print(linattn.device.describe())
torch.manual_seed(0)

# %% [markdown]
# ## 1. The state as an online regression
#
# Read the state as a linear map from keys to values: $S$ *predicts* the value of key $k$ as
# $kS$. A token $(k_t, v_t)$ then comes with a loss on the state,
#
# $$\mathcal{L}_t(S) = \tfrac12\,\lVert k_t S - v_t\rVert^2, \qquad
#   \nabla_S \mathcal{L}_t = k_t^\top (k_t S - v_t),$$
#
# and one gradient step with learning rate $\beta_t$ from $S_{t-1}$ is
#
# $$\boxed{S_t = S_{t-1} + \beta_t\, k_t^\top \big(v_t - k_t S_{t-1}\big)}$$
#
# — the **delta rule** (Widrow–Hoff): the write is the outer product of the key with the
# prediction error $v_t - k_t S_{t-1}$, the "delta". Linear attention is a gradient step too, on
# the loss $-\langle k_t S, v_t\rangle$ whose gradient $-k_t^\top v_t$ does not depend on $S$ at
# all: it never looks at what the state already holds. Let autograd confirm the gradient.

# %%
K, V = 8, 5
S = torch.randn(K, V, dtype=torch.float64, requires_grad=True)
k = F.normalize(torch.randn(K, dtype=torch.float64), dim=0)
v = torch.randn(V, dtype=torch.float64)
(0.5 * (k @ S - v).pow(2).sum()).backward()
by_hand = torch.outer(k, k @ S.detach() - v)
print("autograd vs kᵀ(kS − v):", testing.rel_err(S.grad, by_hand))
assert testing.rel_err(S.grad, by_hand) < 1e-14

# %% [markdown]
# ## 2. What the correction buys: an associative memory that can overwrite
#
# Store key–value pairs one after another and read a key back with $kS$. With unit keys and
# $\beta = 1$ the delta rule writes exactly what is missing, $k^\top(v - kS)$, so *right after*
# the write $k S = v$ holds exactly. Linear attention returns $v$ plus the cross-talk
# $\sum_j (k\cdot k_j)\, v_j$ of every other key. Below: $K = 32$ dimensions, random unit keys; each
# token writes a pair, and we ask for the most recent value of the first key, which is written
# again (with a new value) halfway through.

# %%
K, V, T = 32, 16, pick(cpu=64, gpu=256)
gen = torch.Generator().manual_seed(1)
keys = F.normalize(torch.randn(T, K, generator=gen, dtype=torch.float64), dim=-1)
vals = torch.randn(T, V, generator=gen, dtype=torch.float64)
keys[T // 2] = keys[0]                                    # the first key comes back with a new value
S_lin, S_dlt = torch.zeros(K, V, dtype=torch.float64), torch.zeros(K, V, dtype=torch.float64)
err_lin, err_dlt = [], []
for t in range(T):
    S_lin = S_lin + torch.outer(keys[t], vals[t])
    S_dlt = S_dlt + torch.outer(keys[t], vals[t] - keys[t] @ S_dlt)
    want = vals[0] if t < T // 2 else vals[T // 2]        # the latest value of key 0
    err_lin.append((keys[0] @ S_lin - want).norm().item() / want.norm().item())
    err_dlt.append((keys[0] @ S_dlt - want).norm().item() / want.norm().item())
plt.figure(figsize=(7, 3.5))
plt.plot(err_lin, label="linear attention: S += kᵀv")
plt.plot(err_dlt, label="delta rule, β = 1: S += kᵀ(v − kS)")
plt.axvline(T // 2, color="grey", ls=":", label="key 0 rewritten")
plt.xlabel("tokens written"); plt.ylabel("relative error reading key 0"); plt.yscale("log")
plt.legend(); plt.title(f"K = {K}: recall of one key while others are written"); plt.show()
print(f"after the rewrite: linear attention {err_lin[T // 2]:.2f}, delta rule {err_dlt[T // 2]:.1e}")
assert err_dlt[T // 2] < 1e-12 < err_lin[T // 2]

# %% [markdown]
# Right after its rewrite the delta rule returns the new value exactly, while linear attention
# returns the *sum* of old and new. Between rewrites both degrade as other keys are written —
# with more keys than dimensions ($T > K$) no linear memory can keep them all apart — but the
# delta rule forgets gracefully instead of accumulating.

# %% [markdown]
# ## 3. The transition is a generalised Householder matrix
#
# Collect the terms in $S_{t-1}$:
#
# $$S_t = \big(I - \beta_t\, k_t^\top k_t\big)\, S_{t-1} + \beta_t\, k_t^\top v_t .$$
#
# The transition $H_t = I - \beta_t k_t^\top k_t$ ($K\times K$, symmetric) leaves every direction
# orthogonal to $k_t$ alone (eigenvalue 1, $K-1$ times) and scales the direction of $k_t$ by
# $1 - \beta_t\lVert k_t\rVert^2$. With unit keys:
#
# * $\beta = 0$: nothing happens; $\beta = 1$: the $k_t$-component is *erased* before $v_t$ is
#   written (a projection); $\beta = 2$: the Householder reflection $I - 2k^\top k$;
# * $\beta \in (1, 2]$ gives a **negative** eigenvalue $1 - \beta \in [-1, 0)$: the old content along
#   $k_t$ is flipped, not just shrunk. DeltaNet, Gated DeltaNet and KDA produce $\beta$ with a
#   sigmoid, $\beta \in (0, 1)$; the **negative-eigenvalue** variant, which `seeds/004` presents as an
#   option, scales it to $\beta \in (0, 2)$ — negative eigenvalues let a linear RNN track state like
#   parity, which a transition with eigenvalues in $[0, 1]$ cannot;
# * every eigenvalue stays in $[-1, 1]$ exactly when $\beta\lVert k\rVert^2 \le 2$. That is why keys
#   are L2-normalised: with $\lVert k\rVert = 1$ any $\beta \in [0, 2]$ is safe.

# %%
k = F.normalize(torch.randn(1, 6, dtype=torch.float64), dim=-1)     # a unit key, as a row
for beta in (0.5, 1.0, 1.5, 2.0):
    ev = torch.linalg.eigvalsh(torch.eye(6, dtype=torch.float64) - beta * k.T @ k)
    print(f"β = {beta}: eigenvalues {[round(x, 3) for x in ev.tolist()]}")
ev = torch.linalg.eigvalsh(torch.eye(6, dtype=torch.float64) - 1.5 * k.T @ k)
assert abs(ev.min() + 0.5) < 1e-12                         # 1 − β = −0.5 for β = 1.5

# %% [markdown]
# **What breaks if the keys are not normalised.** With $\lVert k\rVert = 2$ and $\beta = 1$ the
# eigenvalue along $k$ is $1 - 4 = -3$: every write of a similar key triples (and flips) what the
# state holds along it, and the state grows geometrically. The library refuses such inputs with an
# `InputError` that names `k` (the condition it checks is $\beta_t\lVert k_t\rVert^2 \le 2$, with a
# little slack for keys normalised in bfloat16); `linattn.validate.value_checks(False)` switches
# the check off, and then you see the blow-up.

# %%
a = testing.make_inputs("delta_rule", B=1, T=pick(cpu=60, gpu=200), H=1, K=16, V=16,
                        dtype=torch.float64, seed=2)
a["beta"] = torch.ones_like(a["beta"])
sizes = {}
for norm in (1.0, 1.2, 2.0):
    b = {**a, "k": norm * F.normalize(torch.randn_like(a["k"]) + 3.0, dim=-1)}  # similar keys
    try:
        naive.delta_rule(**b)
        print(f"‖k‖ = {norm}: accepted")
    except InputError as e:
        print(f"‖k‖ = {norm}: InputError: {str(e)[:100]}…")
    with validate.value_checks(False):
        o, _ = naive.delta_rule(**b)
    sizes[norm] = o[0, :, 0].norm(dim=-1)
plt.figure(figsize=(7, 3.3))
for norm, s in sizes.items():
    plt.semilogy(s, label=f"‖k‖ = {norm}")
plt.xlabel("token t"); plt.ylabel("‖o_t‖"); plt.legend(); plt.title("β = 1, similar keys")
plt.show()
assert sizes[2.0][-1] > 1e6 * sizes[1.0][-1]

# %% [markdown]
# ## 4. The library's recurrences, and a check against linear attention
#
# `linattn.naive.delta_rule(q, k, v, beta)` runs the rule token by token (`beta` has shape
# `[B, T, H]`); on float64 inputs it is the ground truth for chapters 06–08 and 11. An independent
# check: when the keys are **orthonormal** (possible while $T \le K$), $k_t S_{t-1} = 0$ for every
# earlier write, the residual is $v_t$ itself, and the delta rule *is* linear attention with values
# $\beta_t v_t$ — chapter 01's function.

# %%
B, T, H, K, V = 1, 24, 2, 32, 8
a = testing.make_inputs("delta_rule", B=B, T=T, H=H, K=K, V=V, dtype=torch.float64, seed=4)
Qr, _ = torch.linalg.qr(torch.randn(H, K, T, dtype=torch.float64))  # orthonormal columns
a["k"] = Qr.permute(2, 0, 1)[None].contiguous()                      # [1, T, H, K], k_i · k_j = δ_ij
o_delta, S_delta = naive.delta_rule(**a, output_final_state=True)
o_lin, S_lin = naive.linear_attn(a["q"], a["k"], a["v"] * a["beta"][..., None],
                                 output_final_state=True)
print("delta rule vs linear attention, orthonormal keys:", testing.rel_err(o_delta, o_lin))
assert testing.rel_err(o_delta, o_lin) < testing.tolerance(torch.float64)
assert testing.rel_err(S_delta, S_lin) < testing.tolerance(torch.float64)

# %% [markdown]
# ## 5. Decay first, then correct: Gated DeltaNet and KDA
#
# Chapters 03–04 multiplied the state by a decay before each write. Gated DeltaNet does the same
# with one factor per head, KDA with one per key dimension ($D_t = \operatorname{diag}(e^{g_t})$,
# $g_t \le 0$), and the correction is computed against the **decayed** state:
#
# $$S_t = D_t S_{t-1} + \beta_t\, k_t^\top\big(v_t - k_t D_t S_{t-1}\big)
#       = \big(I - \beta_t k_t^\top k_t\big)\, D_t\, S_{t-1} + \beta_t k_t^\top v_t .$$
#
# So the transition is "decay, then the Householder step". The order matters: correcting the
# undecayed state and decaying afterwards is a different model (and a mistake the workbook's grader
# knows). `linattn.naive.kda(q, k, v, g, beta)` takes `g` of shape `[B, T, H]` (Gated DeltaNet) or
# `[B, T, H, K]` (KDA). With $g = 0$ it is DeltaNet again; with a per-head gate written out per
# dimension it is the same Gated DeltaNet.

# %%
a = testing.make_inputs("kda", B=1, T=50, H=2, K=16, V=8, dtype=torch.float64, gate="per_head",
                        initial_state=True, seed=5)
o_g, _ = naive.kda(**a)
o_d, _ = naive.kda(**{**a, "g": a["g"][..., None].expand(1, 50, 2, 16)})
o_0, _ = naive.kda(**{**a, "g": torch.zeros_like(a["g"])})
o_n, _ = naive.delta_rule(**{n: x for n, x in a.items() if n != "g"})
print("per-head vs per-dimension gate:", testing.rel_err(o_g, o_d), "· g = 0 vs DeltaNet:",
      testing.rel_err(o_0, o_n))
assert testing.rel_err(o_g, o_d) < 1e-12 and testing.rel_err(o_0, o_n) < 1e-12

# %% [markdown]
# ## 6. Why the chunkwise trick of chapter 02 does not carry over
#
# In chapter 02 a chunk needed the state only at its start: every write inside the chunk was
# $k_i^\top v_i$, known in advance, so the chunk was a few matmuls. Here the write of token $i$ is
# $\beta_i k_i^\top(v_i - k_i S_{i-1})$, and $S_{i-1}$ contains the writes of tokens $1..i-1$ of the
# *same* chunk. Unrolled over two tokens from a chunk-start state $S$:
#
# $$r_1 = v_1 - k_1 S, \qquad r_2 = v_2 - k_2 S - \beta_1 (k_2\cdot k_1)\, r_1, \qquad
#   r_3 = v_3 - k_3 S - \beta_1 (k_3\cdot k_1)\, r_1 - \beta_2 (k_3 \cdot k_2)\, r_2, \ \dots$$
#
# Each residual depends on all earlier residuals of the chunk: a triangular *system*, not a
# product. The naive attempt — compute every residual against the chunk-start state,
# $r_i \approx v_i - k_i S$, and then proceed as in chapter 02 — is exact only for chunks of one
# token, and its error grows with the chunk size:

# %%
def naive_chunking(q, k, v, beta, C):
    """The wrong chunkwise delta rule: residuals against the chunk-start state only."""
    q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))               # [H, T, *]
    b = beta[0].transpose(0, 1)[..., None]                            # [H, T, 1]
    T = q.shape[1]
    S = torch.zeros(q.shape[0], q.shape[2], v.shape[2], dtype=q.dtype)
    out = []
    mask = torch.ones(C, C, dtype=torch.bool).tril()
    for s in range(0, T, C):
        qc, kc, vc, bc = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C], b[:, s:s + C]
        R = bc * (vc - kc @ S)                                        # every residual vs S: wrong
        P = (qc @ kc.transpose(-1, -2)).masked_fill(~mask[:qc.shape[1], :qc.shape[1]], 0)
        out.append(qc.shape[-1] ** -0.5 * (qc @ S + P @ R))
        S = S + kc.transpose(-1, -2) @ R
    return torch.cat(out, 1).transpose(0, 1)[None]


a = testing.make_inputs("delta_rule", B=1, T=pick(cpu=128, gpu=512), H=2, K=16, V=16,
                        dtype=torch.float64, seed=6)
o_ref, _ = naive.delta_rule(**a)
sizes = [1, 2, 4, 8, 16, 32, 64]
errs = [testing.rel_err(naive_chunking(a["q"], a["k"], a["v"], a["beta"], C), o_ref) for C in sizes]
for C, e in zip(sizes, errs):
    print(f"chunk {C:3d}: relative error {e:.2e}")
plt.figure(figsize=(6, 3.2))
plt.loglog(sizes, [max(e, 1e-17) for e in errs], "o-")
plt.xscale("log", base=2); plt.xticks(sizes, [str(C) for C in sizes]); plt.minorticks_off()
plt.xlabel("chunk size C (tokens)"); plt.ylabel("relative error vs float64 (log scale)")
plt.title("residuals against the chunk-start state"); plt.tight_layout()
plt.show()
assert errs[0] < 1e-12 and errs[-1] > 1e-2

# %% [markdown]
# Chapter 07 solves the triangular system once per chunk — it has the form
# $(I + A)\tilde V = \dots$ with a strictly lower-triangular $A$ — and splits the solution into a
# part that does not depend on $S$ at all and a part linear in $S$ (the **WY representation**).
# The chunk becomes matmuls again, and its action on the state an affine map $S' = MS + B$.
# Its result, `linattn.chunk.delta_rule` / `chunk.kda`, already passes the check it will have to
# pass there:

# %%
a = testing.make_inputs("delta_rule", B=2, T=pick(cpu=150, gpu=2000), H=2, K=32, V=32,
                        initial_state=True, seed=7)
o_ref, S_ref = naive.delta_rule(**testing.to_float64(a), output_final_state=True)
o, S = linattn.delta_rule(**a, output_final_state=True, chunk_size=32)
print(linattn.which("delta_rule"), "· relative error vs float64 recurrence:",
      f"{testing.rel_err(o, o_ref):.1e}")
assert testing.rel_err(o, o_ref) <= testing.tolerance(torch.float32)

# %% [markdown]
# ## Summary
#
# * The delta rule is one gradient step on $\tfrac12\lVert k_t S - v_t\rVert^2$: it writes the
#   prediction error, so rewritten keys are overwritten instead of summed.
# * Its transition $I - \beta k^\top k$ is a generalised Householder matrix with eigenvalue
#   $1 - \beta\lVert k\rVert^2$ along $k$; normalised keys and $\beta \in [0, 2]$ keep all
#   eigenvalues in $[-1, 1]$, and $\beta > 1$ gives negative ones (the negative-eigenvalue variant;
#   DeltaNet, Gated DeltaNet and KDA take $\beta \in (0, 1)$ from a sigmoid). The library rejects
#   $\beta_t\lVert k_t\rVert^2 > 2$ with an error naming `k`.
# * Gated DeltaNet and KDA decay the state *before* the correction:
#   $S_t = (I - \beta_t k_t^\top k_t) D_t S_{t-1} + \beta_t k_t^\top v_t$.
# * Inside a chunk the residuals depend on each other; treating them as independent is wrong at
#   every chunk size above one.
#
# **Workbook:** `exercises/06_delta_rule.py` — DeltaNet and KDA token by token (they unlock
# `linattn.set_impl("delta_rule", "mine")` and `("kda", "mine")`).
