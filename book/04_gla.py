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
# # 04 — Gated linear attention
#
# **Goal.** Chapter 03's decay was one number per head: every key dimension of the state forgot
# at the same rate. Gated Linear Attention (GLA; Yang, Wang, Shen, Panda & Kim, ICML 2024 — seed
# document 002) gives each of the $K$ rows of the state its own data-dependent forget gate. We
# build the small network that produces the gates and look at what it produces, write the
# recurrence, derive the parallel form and see why it cannot run on tensor cores, and then the
# chunkwise form with the decay absorbed at chunk level — exactly equal to the recurrence, which
# we check. What remains non-matmul inside each chunk is the subject of chapter 05.

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import linattn
from linattn import chunk, decay, naive, testing
from linattn.device import pick
from linattn.naive.gated import attention_matrix

print(linattn.device.describe())
torch.manual_seed(0)

# %% [markdown]
# ## 1. Gates from the data
#
# The GLA layer computes, for every token $x_t \in \mathbb{R}^d$ and head, a gate vector
#
# $$\alpha_t = \sigma\big(x_t W_\alpha^1 W_\alpha^2 + b_\alpha\big)^{1/\tau} \in (0, 1)^{K},\qquad
#   W_\alpha^1 \in \mathbb{R}^{d\times 16},\ W_\alpha^2 \in \mathbb{R}^{16\times K},\ \tau = 16 .$$
#
# The projection is **low rank** (16): gates are cheap, $d\cdot 16 + 16\cdot K$ parameters. The
# **temperature** $\tau = 16$ pushes every gate towards 1: the paper applies it in log space,
#
# $$g_t = \log\alpha_t = \tfrac{1}{16}\,\log\sigma\big(x_t W_\alpha^1 W_\alpha^2 + b_\alpha\big),$$
#
# which is exactly the log-decay the library takes (`F.logsigmoid(z) / 16` — never
# `log(sigmoid(z))`, which rounds to $\log 0 = -\infty$ for very negative $z$). Let us build it
# with random weights and look at the gates it produces for random tokens.
#
# **Where the sources differ.** The paper's §3.1 prints $\alpha = \sigma(XW_\alpha + b_\alpha)/\tau$,
# and its footnote 8 says what the experiments use: the temperature in log space,
# $\log\alpha = \log\sigma(XW_\alpha + b_\alpha)/16$ — our $\sigma(\cdot)^{1/\tau}$. `seeds/001` writes
# $\alpha_t = \sigma\big((x_tW_{\alpha_1}W_{\alpha_2} + b_\alpha)/\tau\big)^{1/\tau}$, which applies the
# temperature twice (inside the sigmoid and as the power); we follow the paper's footnote.

# %%
d_model, rank, Kg, Tg = 256, 16, 64, pick(cpu=512, gpu=4096)
W1 = torch.randn(d_model, rank) / d_model ** 0.5
W2 = torch.randn(rank, Kg) / rank ** 0.5
b_alpha = torch.zeros(Kg)
x = torch.randn(Tg, d_model)


def gate(x, tau=16.0):
    """log α_t = logsigmoid(x W1 W2 + b) / τ: [T, d] → [T, K] log-decays ≤ 0."""
    return F.logsigmoid(x @ W1 @ W2 + b_alpha) / tau


g16, g1 = gate(x), gate(x, tau=1.0)
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
a1.hist(g1.exp().flatten(), bins=60, alpha=0.6, label="τ = 1")
a1.hist(g16.exp().flatten(), bins=60, alpha=0.6, label="τ = 16 (GLA)")
a1.set(xlabel="α = exp(g)", ylabel="count", title="gate values")
a1.legend()
memory = 1 / (1 - g16.exp())                                  # tokens until a row decays by 1/e (≈)
a2.hist(memory.flatten().clamp(max=200), bins=60)
a2.set(xlabel="1 / (1 − α): memory length in tokens (≥ 200 in the last bin)",
       title="τ = 16: slow forgetting")
plt.show()
print(f"τ = 16: median α = {g16.exp().median():.3f}, 1%–99%: "
      f"{g16.exp().quantile(0.01):.3f}–{g16.exp().quantile(0.99):.3f}; "
      f"mean log α = {g16.mean():.3f}")
assert (g16 <= 0).all() and (g16.exp() > g1.exp()).all()

# %% [markdown]
# With $\tau = 16$ almost every gate lies between 0.9 and 1: a row of the state keeps its
# contents for tens to hundreds of tokens, and different rows (key dimensions) forget at
# different, token-dependent rates. That is the whole point of per-dimension gates: some
# dimensions can hold long-range information while others are overwritten quickly.
#
# ## 2. The recurrence
#
# The paper (§3.1) writes the gate as an outer product $\alpha_t^\top \beta_t \in (0,1)^{K\times V}$ (its
# $\mathbf G_t$; in this book $G$ is the matrix of cumulative log-gates) of a key-side gate
# $\alpha_t$ and a value-side gate $\beta_t$ (not the delta rule's $\beta_t$ of chapter 06), applied
# elementwise, $S_t = (\alpha_t^\top\beta_t) \odot S_{t-1} + k_t^\top v_t$; the GLA Transformer (§3.4)
# then sets $\beta_t = \mathbf{1}$, leaving $\alpha_t^\top \mathbf{1}$. With the state $K\times V$ (the
# book's convention, and the paper's) that is a diagonal matrix on the left:
#
# $$\boxed{S_t = \operatorname{diag}(\alpha_t)\, S_{t-1} + k_t^\top v_t,\qquad o_t = \text{scale}\cdot q_t S_t}$$
#
# Row $\kappa$ of $S$ — everything stored under key dimension $\kappa$ — is multiplied by
# $\alpha_{t\kappa}$. `linattn.naive.gla` with `g` of shape `[B, T, H, K]` is this loop; with a
# `[B, T, H]` gate it is chapter 03's scalar decay (the same number for every row).

# %%
B, T, H, K, V = 1, pick(cpu=160, gpu=512), 2, 32, 48   # the parallel form below is O(T² K) memory
args = testing.to_float64(testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, gate="per_dim",
                                              initial_state=True, seed=4))
o_rec, S_rec = naive.gla(**args, output_final_state=True)
print("o", tuple(o_rec.shape), "final state", tuple(S_rec.shape))

# %% [markdown]
# ## 3. The parallel form, and why it is not a matrix product
#
# Unrolling as in chapter 03, but now every dimension has its own prefix sum
# $b_t = \sum_{s\le t} g_s \in \mathbb{R}^K$:
#
# $$o_t = \text{scale}\cdot\Big(\sum_{j\le t} \underbrace{\sum_\kappa q_{t\kappa}\, k_{j\kappa}\, e^{\,b_{t\kappa} - b_{j\kappa}}}_{P_{tj}}\, v_j
#   + (q_t \odot e^{\,b_t})\, S_0\Big) .$$
#
# The decay now sits **inside** the sum over $\kappa$. In chapter 03 it was the same for every
# $\kappa$ and could be pulled out as a mask $D_{tj}$ after $QK^\top$; here each term of the dot
# product carries its own factor. Computing $P$ means forming a $T\times T\times K$ tensor of
# decays and reducing it: the same multiply-adds as $QK^\top$, but elementwise work with an
# `exp` in the middle, which tensor cores (hardware for $A_{t\kappa}B_{\kappa j}$ sums and nothing
# else) cannot do. That is the paper's parallel form (§3.2, Eqs. 12–13), which it proposes to run in
# log space "for numerical stability".

# %%
def parallel_gla(q, k, v, g, S0, scale):
    """One head: q, k, g [T, K], v [T, V], S0 [K, V]."""
    b = g.cumsum(0)                                            # [T, K] prefix sums
    diff = b[:, None, :] - b[None, :, :]                       # [T, T, K]: b_t − b_j per dimension
    causal = torch.ones(len(q), len(q), dtype=torch.bool).tril()[:, :, None]
    P = torch.einsum("tk,jk,tjk->tj", q, k, diff.masked_fill(~causal, float("-inf")).exp())
    return scale * (P @ v + (q * b.exp()) @ S0)


h = 0
q, k, v, g = (args[n][0, :, h] for n in ("q", "k", "v", "g"))
S0 = args["initial_state"][0, h]
err = testing.rel_err(parallel_gla(q, k, v, g, S0, K ** -0.5), o_rec[0, :, h])
print(f"parallel form vs recurrence (float64): {err:.1e}")
assert err < testing.tolerance(torch.float64)

# %% [markdown]
# **Could we factor it?** $e^{\,b_t - b_j} = e^{\,b_t}\cdot e^{-b_j}$, so
# $P = \operatorname{tril}\big((Q\odot e^{G})(K\odot e^{-G})^\top\big)$ *is* a matrix product ($G$ stacks the rows
# $b_t$). But $b_j$ keeps decreasing along the sequence, so $e^{-b_j}$ grows without bound. With the
# GLA gates of section 1 (their mean $\log\alpha$ is printed there):

# %%
bg = g16.cumsum(0)                                             # [T, K] prefix sums of the layer's gates
for name, limit in [("float16", torch.finfo(torch.float16).max),
                    ("bfloat16/float32", torch.finfo(torch.float32).max)]:
    over = (-bg > torch.tensor(limit).log()).any(1)
    first = int(over.float().argmax()) if over.any() else None
    print(f"exp(−b) overflows {name:17} after {first if first is not None else f'> {Tg}'} tokens")
assert (-bg > torch.tensor(65504.0).log()).any()            # fp16 overflows within this sequence

# %% [markdown]
# In float16 it overflows within about 200 tokens, in float32 within about 1 600 (run at GPU size
# to see it) — and
# with strong gates (log-decays down to −20 per step) within about ten tokens. The parallel form in log
# space avoids the overflow but has a quieter problem in float32: $b_t$ is a sum over the
# *whole* sequence, and $b_t - b_j$ loses the digits $b_t$ needed for its magnitude. Its error
# grows with $T$ under strong gates — past float32's tolerance of $10^{-5}$ within a few hundred
# tokens — while the recurrence's does not:

# %%
print(f"{'T':>5} {'parallel (float32)':>19} {'recurrence (float32)':>21}")
errs = []
for Tn in [32, 128, pick(cpu=384, gpu=1024)]:
    a = testing.make_inputs("gla", B=1, T=Tn, H=1, K=16, V=16, strength="strong", seed=Tn)
    ref, _ = naive.gla(**testing.to_float64(a))
    e_par, e_rec = testing.rel_err(naive.gla_parallel(**a)[0], ref), testing.rel_err(naive.gla(**a)[0], ref)
    errs.append((e_par, e_rec))
    print(f"{Tn:>5} {e_par:>19.1e} {e_rec:>21.1e}")
assert errs[-1][0] > 5 * errs[0][0] and max(e for _, e in errs) < testing.tolerance(torch.float32)

# %% [markdown]
# Both problems have the same cure: keep the sums **short**. Restart them at chunk boundaries,
# and the exponents stay bounded by what one chunk can accumulate.
#
# ## 4. Chunkwise GLA
#
# Cut the sequence into chunks of $C$ tokens and restart the prefix sums at every chunk: $b_i$,
# $i = 1..C$, now sums the gates from the chunk start, separately for each dimension. Chapter 03's
# absorption factors become vectors in $\mathbb{R}^K$ — one decay per key dimension —
#
# $$\Lambda_i = e^{\,b_i},\qquad \Gamma_j = e^{\,b_C - b_j},\qquad \gamma = e^{\,b_C},$$
#
# and the chunk recurrence keeps its shape, with $\operatorname{diag}(\gamma)$ in place of the scalar:
#
# $$\boxed{O_{[n]} = \text{scale}\cdot\big((Q_{[n]}\odot\Lambda)\,S_{[n-1]} + P_{[n]}V_{[n]}\big),\qquad
#   S_{[n]} = \operatorname{diag}(\gamma)\,S_{[n-1]} + (K_{[n]}\odot\Gamma)^\top V_{[n]}}$$
#
# with $P_{[n]}$ the parallel form's matrix restricted to the chunk, $P_{ij} = \sum_\kappa
# q_{i\kappa}k_{j\kappa}e^{\,b_{i\kappa}-b_{j\kappa}}$ for $i \ge j$. The argument is chapter 03's, row by
# row of the state: a key $j$ of an earlier chunk reaches query $i$ decayed by $e^{\,b_{i\kappa}}$ in
# dimension $\kappa$ after the boundary, and by its own decay before it, which is what $S_{[n-1]}$
# holds in row $\kappa$.
#
# The inter-chunk output and the state update are now matrix products on absorbed operands
# ($Q\odot\Lambda$, $K\odot\Gamma$) with every factor $\le 1$; only $P_{[n]}$ remains elementwise, on a
# $C\times C\times K$ tensor whose exponents are bounded by one chunk of gates.

# %%
def chunkwise_gla(q, k, v, g, S0, scale, C):
    """One head: q, k, g [T, K], v [T, V], S0 [K, V]."""
    S, out = S0.clone(), []
    for s in range(0, len(q), C):
        qc, kc, vc, gc = q[s:s + C], k[s:s + C], v[s:s + C], g[s:s + C]   # [c, *], c ≤ C
        lam, gam = decay.query_decay(gc), decay.key_decay(gc)            # [c, K] each, ≤ 1
        P = attention_matrix(qc, kc, gc)                                 # [c, c] log space, chunk-local
        out.append(scale * ((qc * lam) @ S + P @ vc))
        S = decay.total_decay(gc)[:, None] * S + (kc * gam).T @ vc       # diag(γ) S + (K ⊙ Γ)ᵀ V
    return torch.cat(out), S


for C in (16, 64, T):
    o_c, S_c = chunkwise_gla(q, k, v, g, S0, K ** -0.5, C)
    e_o, e_S = testing.rel_err(o_c, o_rec[0, :, h]), testing.rel_err(S_c, S_rec[0, h])
    print(f"C = {C:>3}: chunkwise vs recurrence (float64)  o {e_o:.1e}  state {e_S:.1e}")
    assert max(e_o, e_S) < testing.tolerance(torch.float64)

# %% [markdown]
# Exact for every chunk size (to float64 rounding), including $C = T$ (one chunk: the parallel
# form) and chunk sizes that do not divide $T$. The library's `linattn.chunk.gla` is this
# algorithm for `[B, T, H, K]` tensors, with the intra parts of a group of chunks computed at once
# and the intra-chunk matrix built by secondary chunking (chapter 05). The same check in float32
# with strong gates — where the whole-sequence parallel form lost digits — now against the library:

# %%
a = testing.make_inputs("gla", B=2, T=pick(cpu=400, gpu=4096) + 5, H=2, K=32, V=16,
                        strength="strong", initial_state=True, seed=2)
o_ref, S_ref = naive.gla(**testing.to_float64(a), output_final_state=True)
o_lib, S_lib = chunk.gla(**a, output_final_state=True)
qa, ka, va, ga = (a[n][1, :, 0] for n in ("q", "k", "v", "g"))
o_inl, _ = chunkwise_gla(qa, ka, va, ga, a["initial_state"][1, 0], 32 ** -0.5, C=64)
e_lib, e_inl = testing.rel_err(o_lib, o_ref), testing.rel_err(o_inl, o_ref[1, :, 0])
print(f"float32, strong gates: library {e_lib:.1e}, inline chunkwise {e_inl:.1e}, "
      f"library state {testing.rel_err(S_lib, S_ref):.1e}")
assert max(e_lib, e_inl, testing.rel_err(S_lib, S_ref)) < testing.tolerance(torch.float32)

# %% [markdown]
# The inline version is within float32 tolerance but about 20× less accurate than the library:
# `attention_matrix` takes differences of prefix sums that run over the whole chunk, while the
# library sums every segment separately (`decay.segment_sums`) inside sub-chunks.
#
# ## 5. What is still not on tensor cores
#
# Per chunk and head, count the multiply-adds: the inter-chunk output $(Q\odot\Lambda)S$ and the
# state update $(K\odot\Gamma)^\top V$ are $CKV$ each, $PV$ is $C^2V/2$ (causal), all matrix
# products. Building $P$ costs $C^2K/2$ — elementwise, with an `exp` per term. As a share of the
# multiply-adds that is small; as a share of the *time* it is not, because a GPU runs dense
# half-precision matmuls about 16× faster than float32 elementwise arithmetic (the factor the GLA
# paper quotes for the A100 in its §2.3):

# %%
def shares(C, K, V, speedup=16):
    matmul = 2 * C * K * V + C * C * V / 2                      # Q S, Kᵀ V, P V
    elementwise = C * C * K / 2                                 # P in log space
    return elementwise / (matmul + elementwise), elementwise * speedup / (matmul + elementwise * speedup)


for C, Kh, Vh in [(64, 64, 128), (64, 128, 256), (128, 128, 256)]:
    flops, time = shares(C, Kh, Vh)
    print(f"C={C:>3} K={Kh:>3} V={Vh:>3}: log-space P is {flops:4.0%} of the multiply-adds, "
          f"≈{time:4.0%} of the time at a 16× matmul advantage")
assert shares(64, 64, 128)[0] < 0.1 and shares(64, 64, 128)[1] > 0.5

# %% [markdown]
# Under a tenth of the arithmetic, about half of the time or more. Chapter 05 moves all but a thin band
# of $P$ onto matrix products.
#
# ## 6. Through the dispatcher
#
# In a model you call `linattn.gla`; on this machine it runs the chunkwise level. Every input
# dtype, with the GLA layer's own gates (section 1) rather than synthetic ones:

# %%
Tl = min(Tg, pick(cpu=300, gpu=4096))
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    a = testing.make_inputs("gla", B=1, T=Tl, H=1, K=Kg, V=32, dtype=dtype, initial_state=True, seed=6)
    a["g"] = g16[None, :Tl, None, :].contiguous()              # [B, T, H, K] from the gate network
    o, S = linattn.gla(**a, output_final_state=True)
    o_ref, S_ref = naive.gla(**testing.to_float64(a), output_final_state=True)
    e_o, e_S = testing.rel_err(o, o_ref), testing.rel_err(S, S_ref)
    print(f"{str(dtype):15} o {e_o:.1e}  state {e_S:.1e}  (tolerance {testing.tolerance(dtype):.0e})")
    assert max(e_o, e_S) < testing.tolerance(dtype)
print("ran:", linattn.which("gla"))

# %% [markdown]
# ## Summary
#
# * GLA's gate is a low-rank, temperature-softened sigmoid: $\log\alpha_t = \log\sigma(x_tW^1W^2+b)/16$,
#   one decay per key dimension, mostly in $[0.9, 1)$.
# * Recurrence: $S_t = \operatorname{diag}(\alpha_t)S_{t-1} + k_t^\top v_t$ — each row of the state
#   forgets at its own rate.
# * Parallel form: $P_{tj} = \sum_\kappa q_{t\kappa}k_{j\kappa}e^{\,b_{t\kappa}-b_{j\kappa}}$ — the decay is
#   inside the dot product, so $P$ is elementwise work, not a matmul; factoring it as
#   $(Q\odot e^{B})(K\odot e^{-B})^\top$ overflows, and whole-sequence prefix sums lose float32 digits.
# * Chunkwise form: restart the sums per chunk; $\Lambda$, $\Gamma$, $\gamma\in\mathbb{R}^K$ absorb the
#   decay into the inter-chunk matmuls and the state pass; exact for any chunk size (checked).
#   The chunk's own $P$ is still elementwise: under a tenth of the arithmetic but, at tensor-core
#   speeds, most of the time — chapter 05 fixes that.
#
# **Workbook:** `exercises/04_gla.py` — the recurrence, then chunkwise GLA; once they pass,
# `linattn.set_impl("gla", "mine")` runs the library through your code.
