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
# # 01 — Linear attention
#
# **Goal.** Start from softmax attention, replace the exponential by a dot product of features,
# and find that attention becomes a recurrent network whose hidden state is a K×V matrix. We
# build the two exact forms of linear attention — the **recurrent** form (one token at a time)
# and the **parallel** form (one masked matrix product) — check them against each other and the
# library, see why the normaliser of the original formulation is usually dropped, and measure
# what each form costs as the sequence grows, in time and in memory at inference.
#
# Conventions of the whole book: per head, queries and keys are rows $q_t, k_t \in
# \mathbb{R}^{1\times K}$, values $v_t \in \mathbb{R}^{1\times V}$; the state $S$ is a $K\times V$
# matrix; outputs are read as $o_t = \text{scale}\cdot q_t S_t$, with $\text{scale} = K^{-1/2}$
# unless said otherwise. The library's tensors are `q, k: [B, T, H, K]`, `v: [B, T, H, V]`.

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import linattn
from linattn import bench, chunk, naive, testing
from linattn.device import pick

torch.manual_seed(0)  # the same random inputs at every run
print(linattn.device.describe())

# %% [markdown]
# ## 1. Softmax attention, and where the quadratic cost comes from
#
# Causal softmax attention for one head computes, for every position $t$,
#
# $$o_t = \frac{\sum_{i\le t} \exp(\text{scale}\cdot q_t k_i^\top)\, v_i}
#              {\sum_{i\le t} \exp(\text{scale}\cdot q_t k_i^\top)} .$$
#
# Every query meets every earlier key: a $T\times T$ table of scores. In matrix form
# $O = \operatorname{softmax}(\text{scale}\cdot QK^\top + \text{mask})\,V$, where the mask puts
# $-\infty$ above the diagonal. At inference time, each new token must look at all the keys and
# values seen so far, so they are kept: the **KV cache**, which grows with every token.
#
# We work on one head first, as plain `[T, K]` matrices in float64, so that the algebra stays
# visible.

# %%
T, K, V = pick(cpu=256, gpu=1024), 16, 24
scale = K ** -0.5
q1, k1, v1 = torch.randn(T, K, dtype=torch.float64), torch.randn(T, K, dtype=torch.float64), \
    torch.randn(T, V, dtype=torch.float64)
causal = torch.ones(T, T, dtype=torch.bool).tril()         # M[t, i] = 1 when i ≤ t


def softmax_attention(q, k, v, scale):
    scores = (scale * q @ k.T).masked_fill(~causal[: len(q), : len(q)], -math.inf)  # [T, T]
    return torch.softmax(scores, dim=-1) @ v


o_softmax = softmax_attention(q1, k1, v1, scale)
o_torch = F.scaled_dot_product_attention(q1[None], k1[None], v1[None], is_causal=True, scale=scale)[0]
print(f"softmax attention {tuple(o_softmax.shape)}, vs PyTorch's SDPA: relative error "
      f"{testing.rel_err(o_softmax, o_torch):.1e}")
assert testing.rel_err(o_softmax, o_torch) < testing.tolerance(torch.float64)

# %% [markdown]
# ## 2. The kernel trick
#
# The exponential couples $q_t$ and $k_i$ in a way that cannot be split. Replace it by a kernel
# that *can* be split, a dot product of feature maps: $\exp(q_t k_i^\top) \to \phi(q_t)\,\phi(k_i)^\top$.
# Then the sums factor:
#
# $$o_t = \frac{\sum_{i\le t} \phi(q_t)\phi(k_i)^\top v_i}{\sum_{i\le t}\phi(q_t)\phi(k_i)^\top}
#       = \frac{\phi(q_t)\,\overbrace{\textstyle\sum_{i\le t}\phi(k_i)^\top v_i}^{S_t\ (K\times V)}}
#              {\phi(q_t)\,\underbrace{\textstyle\sum_{i\le t}\phi(k_i)^\top}_{z_t\ (K\times 1)}} .$$
#
# $\phi(q_t)$ moved out of the sum: that is the **associativity** of matrix products,
# $(QK^\top)V = Q(K^\top V)$. Without a causal mask it changes the cost from
# $2T^2(K+V)$ flops to $4TKV$ — linear in $T$. With the mask, each query needs
# its own prefix sum $S_t$, which is exactly what a recurrence provides:
# $S_t = S_{t-1} + \phi(k_t)^\top v_t$ and $z_t = z_{t-1} + \phi(k_t)^\top$.
#
# First the unmasked identity, numerically (the order of the products changes, the result
# does not):

# %%
QK_V = (q1 @ k1.T) @ v1        # [T, T] then [T, V]: the T×T table is built
Q_KV = q1 @ (k1.T @ v1)        # [K, V] then [T, V]: no T×T table at all
print(f"(QKᵀ)V vs Q(KᵀV): relative difference {testing.rel_err(Q_KV, QK_V):.1e}")
assert testing.rel_err(Q_KV, QK_V) < testing.tolerance(torch.float64)
print(f"flops: (QKᵀ)V {2 * T * T * (K + V):,}   Q(KᵀV) {4 * T * K * V:,}   (T={T}, K={K}, V={V})")

# %% [markdown]
# Now the causal version with the feature map of the first linear transformer,
# $\phi(x) = \operatorname{elu}(x) + 1$ (positive, so the denominator is positive). We compute it
# twice: as a $T\times T$ table like softmax attention, and as a recurrence over $(S_t, z_t)$.

# %%
def phi(x):
    return F.elu(x) + 1


def kernel_attention_quadratic(q, k, v):
    A = (phi(q) @ phi(k).T) * causal[: len(q), : len(q)]     # [T, T] kernel scores, masked
    return (A @ v) / A.sum(-1, keepdim=True)


def kernel_attention_recurrent(q, k, v):
    S = torch.zeros(q.shape[1], v.shape[1], dtype=q.dtype)    # K×V
    z = torch.zeros(q.shape[1], dtype=q.dtype)                # K
    out = []
    for t in range(len(q)):
        S, z = S + torch.outer(phi(k[t]), v[t]), z + phi(k[t])
        out.append((phi(q[t]) @ S) / (phi(q[t]) @ z))
    return torch.stack(out)


err = testing.rel_err(kernel_attention_recurrent(q1, k1, v1), kernel_attention_quadratic(q1, k1, v1))
print(f"kernelised attention, recurrence vs T×T table: relative error {err:.1e}")
assert err < testing.tolerance(torch.float64)

# %% [markdown]
# ## 3. Linear attention as the book uses it
#
# Modern linear-attention layers (RetNet, GLA, Lightning attention, DeltaNet and the rest of this
# book) keep this structure but simplify it twice: the feature map is the identity, or at most
# a normalisation such as DeltaNet's L2-normalised keys (the projections that produce $q$ and
# $k$ are learned anyway), and the denominator is dropped —
# section 4 shows why. With a constant scale for the logits, what remains is
#
# $$\boxed{S_t = S_{t-1} + k_t^\top v_t, \qquad o_t = \text{scale}\cdot q_t S_t}$$
#
# a linear RNN whose hidden state is a $K\times V$ matrix, written to by outer products. (The GLA
# paper, §2.1 Eq. 3, writes $O_t = Q_t S_t$ without a scale; a constant scale commutes with
# everything, so the two agree up to that factor. We follow the library and
# flash-linear-attention: $K^{-1/2}$.)
#
# **Recurrent form**, one head, a few lines:

# %%
def recurrent(q, k, v, scale, S0=None):
    S = torch.zeros(q.shape[1], v.shape[1], dtype=q.dtype) if S0 is None else S0.clone()  # K×V
    out = []
    for t in range(len(q)):
        S = S + torch.outer(k[t], v[t])      # write: k_tᵀ v_t, before reading
        out.append(scale * q[t] @ S)         # read: o_t = scale · q_t S_t
    return torch.stack(out), S


# %% [markdown]
# **Parallel form.** Unroll the recurrence: $S_t = S_0 + \sum_{i\le t} k_i^\top v_i$, so
# $o_t = \text{scale}\,\big(\sum_{i\le t}(q_t k_i^\top)\,v_i + q_t S_0\big)$, and for all $t$ at once
#
# $$O = \text{scale}\cdot\big((QK^\top)\odot M\big)V + \text{scale}\cdot Q S_0, \qquad
#   M_{ti} = [\,i \le t\,], \qquad S_T = S_0 + K^\top V.$$
#
# The mask includes the diagonal: token $t$ sees its own key and value, because the recurrence
# writes $k_t^\top v_t$ *before* reading with $q_t$.

# %%
def parallel(q, k, v, scale, S0=None):
    P = (q @ k.T) * causal[: len(q), : len(q)]     # [T, T] scores, lower triangle incl. diagonal
    o = scale * P @ v
    return o if S0 is None else o + scale * q @ S0


o_rec, S_rec = recurrent(q1, k1, v1, scale)
o_par = parallel(q1, k1, v1, scale)
print(f"parallel vs recurrent: relative error {testing.rel_err(o_par, o_rec):.1e}")
assert testing.rel_err(o_par, o_rec) < testing.tolerance(torch.float64)

# %% [markdown]
# The library has both at its first level, `linattn.naive`, with the batched layout
# `[B, T, H, K]`, an initial state, and the final state on request. Our one-head versions are
# the case $B = H = 1$; we check them against it, with an initial state this time.

# %%
def batched(x):          # [T, D] -> [1, T, 1, D]
    return x[None, :, None, :]


S0 = torch.randn(K, V, dtype=torch.float64)
o_lib, S_lib = naive.linear_attn(batched(q1), batched(k1), batched(v1),
                                 initial_state=S0[None, None], output_final_state=True)
o_mine, S_mine = recurrent(q1, k1, v1, scale, S0)
o_mine_par = parallel(q1, k1, v1, scale, S0)
for label, a, b in [("recurrent o", o_mine, o_lib[0, :, 0]), ("recurrent S_T", S_mine, S_lib[0, 0]),
                    ("parallel o", o_mine_par, o_lib[0, :, 0])]:
    print(f"{label:>14} vs linattn.naive.linear_attn: {testing.rel_err(a, b):.1e}")
    assert testing.rel_err(a, b) < testing.tolerance(torch.float64)

o_lib_par, _ = naive.linear_attn_parallel(batched(q1), batched(k1), batched(v1), initial_state=S0[None, None])
assert testing.rel_err(o_lib_par, o_lib) < testing.tolerance(torch.float64)

# %% [markdown]
# ### What breaks if the mask is wrong
#
# Causality means: changing a token can only change the outputs at and after it. Perturb the
# value at position $p$ and look at how much every output moves, for the correct mask, the
# strict triangle (without the diagonal) and no mask at all.

# %%
p = T // 2
v_moved = v1.clone()
v_moved[p] += 1.0
masks = {"no mask": (torch.ones(T, T, dtype=torch.bool), dict(color="C2", lw=3, alpha=0.4)),
         "causal (tril)": (causal, dict(color="C0", lw=1.2)),
         "strict (tril −1)": (causal.tril(-1), dict(color="C3", lw=1.2, ls="--"))}
fig, ax = plt.subplots(figsize=(7, 3))
for label, (m, style) in masks.items():
    change = scale * ((q1 @ k1.T * m) @ (v_moved - v1)).norm(dim=-1)   # |Δo_t| per position
    ax.plot(change, label=label, **style)
    print(f"{label:>17}: outputs before p changed by {change[:p].max():.2e}, at p by {change[p]:.2e}")
ax.axvline(p, color="gray", ls=":")
ax.set(xlabel="position t", ylabel="|Δ o_t|", title=f"perturbing v at position p={p}")
ax.legend()
plt.show()

# %% [markdown]
# With the causal mask nothing before $p$ moves and the output at $p$ itself does (token $p$
# sees its own value). The strict triangle leaves position $p$ unchanged as well: it is the
# recurrence that reads the state *before* writing $k_p^\top v_p$, an off-by-one that the grader
# of workbook 01 catches. Without a mask the past "sees" the future (the wide green curve moves
# everywhere): a model trained that way would learn to copy from the future and could not
# generate text. After $p$ all three curves coincide.

# %% [markdown]
# ## 4. The normaliser, and why it is usually dropped
#
# The original formulation divides by $\phi(q_t) z_t$. Three things go wrong with it:
#
# * with a feature map that can be negative (the identity, which works well in practice), the
#   denominator $q_t z_t = \sum_{i\le t} q_t k_i^\top$ is a sum of signed terms; it passes near
#   zero and the output explodes;
# * with a positive feature map the output is a weighted *average* of the values seen so far;
#   as $t$ grows the weights flatten and the outputs shrink towards the mean value;
# * without any denominator the output is a *sum* of $t$ terms, whose size grows like $\sqrt t$
#   for uncorrelated random inputs like ours (faster, up to $\propto t$, when keys and values agree).
#
# Following TransNormer (Qin et al., 2022), modern layers take the third option and normalise
# the output instead — the GLA layer applies a LayerNorm to each head's output, RetNet a
# GroupNorm. A normalisation layer divides by the *output's own size*, which cannot approach zero
# the way a data-dependent denominator can. Let us see all four (with RMSNorm, the simplest
# such layer).

# %%
o_sum, _ = recurrent(q1, k1, v1, scale)                        # no denominator
den_identity = scale * (q1 * k1.cumsum(0)).sum(-1)           # scale · q_t z_t, z_t = Σ_{i≤t} k_i
o_identity = o_sum / den_identity[:, None]                     # identity φ, normalised
o_positive = kernel_attention_quadratic(q1, k1, v1)             # elu+1, normalised
o_rmsnorm = F.rms_norm(o_sum, (V,))                             # no denominator + RMSNorm

print(f"identity φ: smallest |denominator| {den_identity.abs().min():.2e}, "
      f"largest |o_t| {o_identity.norm(dim=-1).max():.1f} (values have |v| ≈ {v1.norm(dim=-1).mean():.1f})")
fig, ax = plt.subplots(figsize=(7, 3.2))
t_axis = torch.arange(1, T + 1)
for label, o in [("identity φ, ÷ q_t z_t", o_identity), ("elu+1 φ, ÷ φ(q_t) z_t", o_positive),
                 ("no denominator", o_sum), ("no denominator + RMSNorm", o_rmsnorm)]:
    ax.plot(t_axis, o.norm(dim=-1), label=label, lw=1)
ax.plot(t_axis, o_sum.norm(dim=-1)[T // 4:].mean() * (t_axis / t_axis[T // 4:].float().mean()).sqrt(),
        "k:", lw=1, label="∝ √t")
ax.set(yscale="log", xlabel="position t", ylabel="|o_t| (log scale)", title="size of the output along the sequence")
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))   # beside the curves, not over them
fig.tight_layout()
plt.show()

# %% [markdown]
# The signed denominator produces spikes orders of magnitude above the values; the positive
# one gives outputs that fade as the average gets longer; the sum grows like $\sqrt t$, smoothly
# and predictably, and one RMSNorm brings it back to a constant size. The book therefore
# drops the normaliser everywhere, as the libraries it mirrors do.
#
# In low precision the signed denominator is even worse: it is a cancellation-prone sum, and in
# bfloat16 its relative error near a zero crossing is unbounded. We check the claim:

# %%
den_bf16 = scale * (q1.bfloat16() * k1.bfloat16().cumsum(0)).sum(-1)   # all in bfloat16
near_zero = den_identity.abs().argmin()
rel = ((den_bf16[near_zero].double() - den_identity[near_zero]) / den_identity[near_zero]).abs()
print(f"denominator at t={near_zero.item()}: float64 {den_identity[near_zero]:.3e}, "
      f"computed in bfloat16 {den_bf16[near_zero].item():.3e} (relative error {rel:.0%})")

# %% [markdown]
# ## 5. Cost as $T$ grows
#
# Count multiply–adds as 2 flops each, per head:
#
# | form | flops | memory beyond inputs/outputs | parallel over $t$? |
# |---|---|---|---|
# | recurrent | $4TKV$ (write $k_t^\top v_t$: $2KV$; read $q_tS_t$: $2KV$) | one $K\times V$ state | no: $T$ dependent steps |
# | parallel | $2T^2(K+V)$ ($QK^\top$, then $PV$; dense matmuls compute the masked half too) | the $T\times T$ matrix | yes |
# | softmax attention | $2T^2(K+V)$ + $T^2$ exponentials | the $T\times T$ matrix (or recomputed, FlashAttention) | yes |
#
# The recurrence does the least work but is a chain of $T$ small steps; the parallel form does
# $T(K+V)/(2KV)$ times more ($T/K$ for $K = V$) but as large matrix products, which is what accelerators are
# built for. Measured on this device, with the library's three implementations of linear
# attention (the chunkwise one is the next chapter's subject, shown here as a preview):

# %%
B, H, Kb, Vb = 1, 2, 64, 64
lengths = pick(cpu=[64, 128, 256, 512, 1024, 2048], gpu=[64, 256, 1024, 2048, 4096, 8192, 16384])
forms = {"recurrent (naive.linear_attn)": naive.linear_attn,
         "parallel (naive.linear_attn_parallel)": naive.linear_attn_parallel,
         "chunkwise (chunk.linear_attn)": chunk.linear_attn}
times = {name: [] for name in forms}


for n in lengths:
    args = testing.make_inputs("linear_attn", B=B, T=n, H=H, K=Kb, V=Vb, device=linattn.device.default_device())
    for name, fn in forms.items():
        times[name].append(bench.fastest_ms(lambda: fn(**args)))
    fastest = min(forms, key=lambda name: times[name][-1]).split()[0]
    print(f"T={n:>6}: " + "  ".join(f"{name.split()[0]} {times[name][-1]:8.2f} ms" for name in forms)
          + f"   fastest: {fastest}")

# %%
Ts = torch.tensor(lengths, dtype=torch.float64)
flops = {"recurrent": 4 * Ts * Kb * Vb * B * H, "parallel / softmax": 2 * Ts**2 * (Kb + Vb) * B * H,
         "chunkwise (C=64)": (2 * Ts * 64 * (Kb + Vb) + 4 * Ts * Kb * Vb) * B * H}
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
for name, f in flops.items():
    a1.plot(lengths, f, "o-", label=name)
a1.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="flops",
       title=f"flops (B={B}, H={H}, K=V={Kb})")
for name, ts in times.items():
    a2.plot(lengths, ts, "o-", label=name.split()[0])
a2.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="ms (fastest of 5)",
       title=f"measured on {'GPU' if linattn.device.has_cuda() else 'CPU'}")
for a in (a1, a2):
    a.set_xticks(lengths, [str(n) for n in lengths], minor=False)
    a.minorticks_off()
    a.legend(fontsize=8)
plt.show()

# %% [markdown]
# Read the two panels together. On the left, the parallel form's flops grow with slope 2 on a
# log–log plot, the recurrence's with slope 1; they cross at $T = 2KV/(K+V) = K$. On the right,
# the recurrence is far slower than its flop count suggests: each of its $T$ steps is a tiny
# operation, and the per-step overhead (a Python loop here, a kernel launch or a serial
# dependency inside a kernel) dominates.
#
# Which of the other two wins depends on the device, and the printout above says it for yours.
# On a small CPU the parallel form's time follows its $T^2$ flops, and the chunkwise form is
# the fastest from a few hundred tokens on. On a large GPU expect the parallel form's few big
# matmuls to stay ahead of the chunkwise *PyTorch* level to much longer sequences, because that
# level's state pass steps through the chunks one by one, a few small kernels each (run the
# chapter on a GPU: the same cell prints where the two cross there); what stops the parallel
# form is memory, $B\cdot H\cdot T^2$ scores — at $T$ = 16384 already 1 GiB per head in float32. The chunkwise
# form keeps the recurrence's slope and memory *and* uses matrix products; fusing its loop into
# one kernel is what the Triton chapters do. Chapter 02 builds it.

# %% [markdown]
# ## 6. Inference: a constant-size state instead of a growing cache
#
# Generating text produces one token at a time. Softmax attention must keep every key and value
# (the KV cache: $t\cdot(K+V)$ numbers per head after $t$ tokens). Linear attention keeps
# $S_t$: $K\times V$ numbers per head, whatever $t$ is — the whole past is compressed into it.
# We run both decoders step by step on random projections, measure the bytes they actually hold,
# and check that token-by-token decoding with the state gives exactly the library's one-pass
# result.

# %%
steps, Hd, Kd, Vd = pick(cpu=384, gpu=4096), 16, 128, 128   # a typical layer: 16 heads of 128
dev = linattn.device.default_device()
qs, ks, vs = (torch.randn(steps, Hd, D, device=dev) for D in (Kd, Kd, Vd))
cache_k = torch.empty(0, Hd, Kd, dtype=torch.bfloat16, device=dev)   # KV caches are usually bf16
cache_v = torch.empty(0, Hd, Vd, dtype=torch.bfloat16, device=dev)
S = torch.zeros(Hd, Kd, Vd, device=dev)                               # the state: float32
cache_bytes, state_bytes, o_decode = [], [], []
for t in range(steps):
    cache_k = torch.cat([cache_k, ks[t, None].bfloat16()])
    cache_v = torch.cat([cache_v, vs[t, None].bfloat16()])
    w = torch.softmax(torch.einsum("hk,thk->ht", qs[t].bfloat16().float(), cache_k.float()) * Kd**-0.5, -1)
    _ = torch.einsum("ht,thv->hv", w, cache_v.float())                # softmax output (not used)
    S = S + ks[t, :, :, None] * vs[t, :, None, :]                     # [H, K, V]
    o_decode.append(Kd**-0.5 * torch.einsum("hk,hkv->hv", qs[t], S))
    cache_bytes.append(cache_k.nbytes + cache_v.nbytes)
    state_bytes.append(S.nbytes)

o_onepass, _ = chunk.linear_attn(qs[None], ks[None], vs[None])
err = testing.rel_err(torch.stack(o_decode)[None], o_onepass)
print(f"token-by-token decoding vs one chunkwise pass: relative error {err:.1e}")
assert err < testing.tolerance(torch.float32)
crossover = Kd * Vd * 4 / ((Kd + Vd) * 2)
print(f"after {steps} tokens: KV cache {cache_bytes[-1] / 2**20:.2f} MiB, state {state_bytes[-1] / 2**20:.2f} MiB; "
      f"the cache is larger from t > {crossover:.0f} tokens on")

# %%
fig, ax = plt.subplots(figsize=(7, 3.2))
tokens = range(1, steps + 1)
ax.plot(tokens, [b / 2**20 for b in cache_bytes], label="softmax: KV cache (bf16)")
ax.plot(tokens, [b / 2**20 for b in state_bytes], label="linear attention: K×V state (fp32)")
ax.axvline(crossover, color="gray", ls=":", lw=1)
ax.set(xlabel="generated tokens t", ylabel="MiB per layer",
       title=f"memory while decoding (H={Hd}, K=V={Kd}), measured from the tensors")
ax.legend()
plt.show()

# %% [markdown]
# The cache grows linearly forever (and each new token reads all of it: the time per token
# grows too); the state is flat. At 128K tokens of context the cache of this one layer would be
# $131072 \cdot 16 \cdot 256 \cdot 2$ bytes = 1 GiB, the state still 1 MiB. The price is that
# the state is a *lossy* summary: a $K\times V$ matrix cannot store arbitrarily many key–value
# pairs exactly. Later chapters add decay (forgetting, chapter 03) and the delta rule
# (overwriting, chapter 06) to make better use of it.
#
# ## Summary
#
# * Replacing $\exp(q k^\top)$ by $\phi(q)\phi(k)^\top$ lets the sum over the past be carried in a
#   $K\times V$ state: $S_t = S_{t-1} + k_t^\top v_t$, $o_t = \text{scale}\cdot q_t S_t$.
# * The same outputs come from one masked product $O = \text{scale}\,((QK^\top)\odot M)V$ (plus
#   $\text{scale}\,Q S_0$), with $M$ the lower triangle including the diagonal.
# * The normaliser is dropped: signed denominators explode, positive ones dilute; a normalisation
#   layer on the output does the job reliably.
# * Recurrent: $O(TKV)$ flops but sequential; parallel: $O(T^2(K+V))$ flops as big matmuls.
#   Inference needs only the constant-size state.
#
# **Your turn:** `exercises/01_linear_attention.py` asks you to write both forms with the
# library's full signature (batches, heads, initial and final state, low-precision inputs).
# Once your recurrence passes, `linattn.set_impl("linear_attn", "mine")` runs the library through
# it. Then chapter 02: chunks.
