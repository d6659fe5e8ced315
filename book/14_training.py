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
# # 14 — Layers and training
#
# **Goal.** Wrap the operations of the first half of the book into attention *layers*: the GLA
# layer first, built piece by piece from its weights and checked at every step against the
# library's `linattn.nn.GatedLinearAttention`; then the same skeleton around linear attention,
# DeltaNet, Gated DeltaNet and KDA, with a softmax-attention baseline. Then train small models
# with them on a task that measures exactly what a recurrent state is for — remembering key–value
# associations — and read what the memories recall. The chapter ends with the same experiment at
# GPU size, from a recorded run.
#
# Everything here trains through the chunkwise level and its hand-written backward (chapter 12)
# on a CPU, through the Triton kernels on a GPU: the dispatcher picks (`impl="auto"`).

# %%
import copy
import math
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import linattn
from linattn import bench, mqar, nn as lnn, testing
from linattn.device import pick

torch.manual_seed(0)
DEVICE = linattn.device.default_device()
F64 = torch.float64
print(linattn.device.describe())

# %% [markdown]
# ## 1. From an operation to a layer
#
# An operation maps $(q, k, v, g)$ to outputs; a layer maps a sequence of model vectors
# $x_t \in \mathbb{R}^{d}$ to new ones. The GLA paper (Yang et al., seed 002) defines its layer in
# §3.1 for one head and in §3.4 for $H$ heads. Per head $h$, with the state $S^h$ of shape
# $d'_k \times d'_v$ ($d'_k = d_k/H$, $d'_v = d_v/H$):
#
# $$q_t = x_t W_Q,\quad k_t = x_t W_K,\quad v_t = x_t W_V \qquad\text{(§3.1)}$$
# $$S^h_t = \mathrm{diag}(\alpha^h_t)\, S^h_{t-1} + k_t^{h\top} v^h_t,\qquad o^h_t = q^h_t S^h_t
#   \qquad\text{(eqs. 8–9, per head in §3.4)}$$
# $$R_t = \mathrm{Swish}(x_t W_r + c_r),\qquad
#   y_t = \big(R_t \odot \mathrm{concat}_h\,\mathrm{LN}(o^h_t)\big)\, W_O
#   \qquad\text{(eqs. 10–11, LN per head in §3.4)}$$
#
# (The paper writes $b$ for biases; here $b$ stays the cumulative log-gate of chapter 03, so the
# biases are $c$s.) The gate is the paper's $G_t = \alpha_t^\top \beta_t$ with $\beta_t = 1$: §3.4
# drops $W_\beta$ ("contributes very marginally") and so does the library, which leaves one decay
# per key dimension — the per-dimension GLA of chapter 04. Also from §3.4: $W_\alpha$ is low-rank,
# $W_\alpha^1 W_\alpha^2$ with rank 16, and $d_k = d/2$, $d_v = d$, so one layer holds about $4d^2$
# parameters, as a softmax-attention layer does. The block around the layer — pre-norm residual,
# then a feed-forward network — is §3.4's too (the paper's FFN is a SwiGLU; the small models of
# this chapter use a two-layer MLP).
#
# One piece of the library's layer is **not** in the GLA paper: a short causal depthwise
# convolution (width 4, followed by SiLU) over the projected $q, k, v$ channels,
#
# $$[q_t, k_t, v_t] = \mathrm{SiLU}\big(\mathrm{conv}_4(x W_{qkv})\big)_t .$$
#
# It comes from the state-space line of work (H3's shift SSM; Mamba's causal convolution of width
# 4 before its SiLU) and is part of the DeltaNet and Gated DeltaNet layers; flash-linear-attention's
# GLA layer offers it as an option. Section 7 shows what it is for. Every layer of this chapter has
# it, the softmax baseline too, so a comparison of the layers isolates their memories.
#
# The other layers share the skeleton and differ in the operation and in what they compute from
# $x$ besides $q, k, v$:
#
# | layer | state update | extra inputs | from |
# |---|---|---|---|
# | `LinearAttention` | $S \leftarrow S + k^\top v$ | — | chapter 01 |
# | `GatedLinearAttention` | $S \leftarrow \mathrm{diag}(\alpha_t) S + k^\top v$ | $\log\alpha_t$ per key dimension | GLA paper, §3.1 and §3.4 |
# | `DeltaNet` | $S \leftarrow S + \beta_t k^\top (v - kS)$ | $\beta_t = \sigma(x_t W_\beta)$; $q, k$ L2-normalised | DeltaNet (Yang et al., 2024) |
# | `GatedDeltaNet` | the same after $S \leftarrow \alpha_t S$ | one $\log\alpha_t$ per head, $\beta_t$ | Gated DeltaNet |
# | `KimiDeltaAttention` | the same after $S \leftarrow \mathrm{diag}(\alpha_t) S$ | $\log\alpha_t$ per key dimension, $\beta_t$ | KDA (seed 003) |
#
# Their per-head norm is an RMSNorm (the library's choice); the GLA layer keeps the paper's
# LayerNorm.

# %% [markdown]
# ## 2. The GLA layer, piece by piece
#
# Build a GLA layer with the paper's proportions — $d_k = d/2$, so each head has
# $K = d/(2H)$ key dimensions (`head_k`) and $V = d/H$ value dimensions — and list its weights.

# %%
d_model, n_heads = 64, 2
gla = lnn.GatedLinearAttention(d_model, n_heads, head_k=d_model // (2 * n_heads))
H, K, V = gla.n_heads, gla.head_k, gla.head_v
for name, p in gla.named_parameters():
    print(f"{name:22s} {tuple(p.shape)}")
print(f"H = {H}, K = {K}, V = {V}; state per sequence: {gla.state_size()} numbers (H·K·V)")

# %% [markdown]
# Each piece below is computed by hand from these weights, in float64, and checked against the
# module of the layer that computes it. `P` holds the weights by name (`nn.Linear` stores its
# matrix out × in, so a projection is `x @ W.T`).

# %%
layer64 = copy.deepcopy(gla).double()
layer64.impl = "naive"                                   # the float64 token loop of chapter 04
P = {n: p.detach() for n, p in layer64.state_dict().items()}
x = torch.randn(2, 50, d_model, dtype=F64)
B, T = x.shape[:2]
TOL64 = testing.tolerance(F64)

# %% [markdown]
# ### 2.1 Projections and the short convolution
#
# One matrix product gives the channels of $q$, $k$ and $v$ side by side, $HK + HK + HV$ of them.
# The convolution mixes each channel with its three predecessors — output $t$ reads inputs
# $t-3 \dots t$ and nothing later, with zeros before the start of the sequence — and applies
# SiLU. Written as its definition, a sum over the four taps:

# %%
u = x @ P["qkv.weight"].T                                          # [B, T, H(2K+V)]
taps = P["conv.conv.weight"][:, 0]                                 # [C, 4], one row per channel
width = taps.shape[-1]
before = torch.cat([u.new_zeros(B, width - 1, u.shape[-1]), u], dim=1)   # zeros before t = 0
u_conv = F.silu(sum(taps[:, i] * before[:, i:i + T] for i in range(width)))
print("short convolution, by hand vs the layer's:", testing.rel_err(u_conv, layer64.conv(u)[0]))
assert testing.rel_err(u_conv, layer64.conv(u)[0]) < TOL64

q, k, v = u_conv.split([H * K, H * K, H * V], dim=-1)
q, k, v = q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), v.unflatten(-1, (H, V))
print("q, k, v:", tuple(q.shape), tuple(k.shape), tuple(v.shape))

# %% [markdown]
# ### 2.2 The gate, in log space
#
# The GLA paper makes the forget gate data-dependent and cheap: the low-rank projection and a
# temperature $\tau = 16$,
#
# $$\alpha_t = \sigma\big(x_t W_\alpha^1 W_\alpha^2 + c_\alpha\big)^{1/\tau}
#   \quad\Longleftrightarrow\quad
#   \log\alpha_t = \frac{\log\sigma\big(x_t W_\alpha^1 W_\alpha^2 + c_\alpha\big)}{\tau} \le 0 .$$
#
# The paper applies the temperature in log space (its footnote to §3.1), and so do we: the kernels
# take log-decays (chapter 03), so the layer never forms $\alpha$ at all. $\log\sigma(z) =
# -\mathrm{softplus}(-z)$ is computed directly (`F.logsigmoid`): forming $\sigma(z)$ first and
# taking its log rounds to $\log 0 = -\infty$ once $z \lesssim -104$ in float32.

# %%
z_demo = torch.tensor([-200.0, -20.0, 0.0, 5.0])
print("log(sigmoid(z)):", torch.sigmoid(z_demo).log().tolist())
print("logsigmoid(z):  ", F.logsigmoid(z_demo).tolist())
assert torch.isinf(torch.sigmoid(z_demo).log()[0]) and torch.isfinite(F.logsigmoid(z_demo)).all()

z = x @ P["gate.proj.0.weight"].T @ P["gate.proj.1.weight"].T + P["gate.proj.1.bias"]   # [B, T, HK]
g = (F.logsigmoid(z) / 16).unflatten(-1, (H, K))                                       # log α ≤ 0
print("gate, by hand vs the layer's:", testing.rel_err(g, layer64.gate(x)))
assert testing.rel_err(g, layer64.gate(x)) < TOL64

# %% [markdown]
# Why $\tau = 16$: $\sigma$ saturates quickly, and its $16^{\text{th}}$ root stays close to 1 over
# most of its range, so the state forgets slowly unless the layer pushes $z$ far down. At $z = 0$,
# $\alpha = 2^{-1/\tau}$ and the state keeps half of what it holds after $\tau$ tokens; with
# $\tau = 1$ it would halve at every token. The library also starts the gate's bias at
# `linattn.nn.gates.GATE_BIAS` (a choice of the library, not of the paper): a fresh model then
# remembers almost like an ungated one and learns where to forget — a model that cannot yet
# retrieve anything gets little gradient telling it to keep its state longer. The half-lives:

# %%
for tau in (1, 4, 16):
    for z0 in (0.0, lnn.gates.GATE_BIAS):                    # z of a zero input: the bias c_α
        a0 = math.exp(F.logsigmoid(torch.tensor(z0)).item() / tau)
        print(f"τ = {tau:2d}, z = {z0:g}: α = {a0:.5f}, half-life {math.log(0.5) / math.log(a0):7.1f} tokens")

# %% [markdown]
# ### 2.3 The recurrence, token by token
#
# With $q, k, v$ and $\log\alpha$ in hand, the operation is the GLA recurrence of chapter 04,
# head by head. The readout carries the scale $K^{-1/2}$, the default of every operation in this
# book. The paper's eq. (9) has none, and in this layer it makes no difference: a constant factor
# before the per-head LayerNorm cancels, up to the norm's $\varepsilon$.

# %%
S = torch.zeros(B, H, K, V, dtype=F64)
outs = []
for t in range(T):
    S = g[:, t].exp()[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]   # [B, H, K, V]
    outs.append(K ** -0.5 * (q[:, t, :, :, None] * S).sum(-2))                      # q_t S_t
o = torch.stack(outs, dim=1)                                                        # [B, T, H, V]

# %% [markdown]
# ### 2.4 The per-head norm, the output gate and the output projection
#
# Each head's output is normalised over its own $V$ features (mean and biased variance of that
# head at that token), scaled and shifted by weights the heads share; then the heads are
# concatenated, multiplied by the output gate $R_t$ — computed from the layer's *input* $x_t$ —
# and projected back to the model width.

# %%
mu, var = o.mean(-1, keepdim=True), o.var(-1, unbiased=False, keepdim=True)
o_norm = (o - mu) / torch.sqrt(var + layer64.norm.eps) * P["norm.weight"] + P["norm.bias"]
print("per-head norm, by hand vs the layer's:", testing.rel_err(o_norm, layer64.norm(o)))
assert testing.rel_err(o_norm, layer64.norm(o)) < TOL64

R = F.silu(x @ P["out_gate.weight"].T + P["out_gate.bias"])                   # Swish, eq. (10)
y_hand = (o_norm.flatten(-2) * R) @ P["out.weight"].T                          # eq. (11)

# %% [markdown]
# ### 2.5 The whole layer, level by level
#
# The hand-built layer must equal the library layer at the naive level (float64, the same token
# loop inside); the chunkwise level (float32, chapters 04–05) must equal that to float32
# tolerance; the Triton level must equal the chunkwise one (its kernels run on `DEVICE`: natively
# on a GPU, with a copy of the layer and the input moved there; on a CPU in Triton's interpreter).

# %%
with torch.no_grad():
    y_naive, _ = layer64(x)
    print("by hand vs layer (naive, float64):    ", testing.rel_err(y_hand, y_naive))
    assert testing.rel_err(y_hand, y_naive) < TOL64
    gla.impl = "chunk"
    ys = {"chunk": gla(x.float())[0]}
    gla.impl = "auto"
    on_device = copy.deepcopy(gla).to(DEVICE)
    on_device.impl = "triton"
    ys["triton"] = on_device(x.float().to(DEVICE))[0].cpu()
print("layer (chunk, float32) vs naive:      ", testing.rel_err(ys["chunk"], y_naive))
print("layer (Triton, float32) vs chunk:     ", testing.rel_err(ys["triton"], ys["chunk"]))
assert testing.rel_err(ys["chunk"], y_naive) < testing.tolerance(torch.float32)
assert testing.rel_err(ys["triton"], ys["chunk"]) < testing.tolerance(torch.float32)

# %% [markdown]
# Training needs the gradients too. Through the chunkwise level they come from the hand-written
# backward of chapter 12; through the naive level, float64 autograd through the token loop. They
# must agree for every weight of the layer:

# %%
def weight_grads(layer, x, dy):
    layer.zero_grad()
    (layer(x)[0] * dy).sum().backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


dy = torch.randn(B, T, d_model, dtype=F64)
gla.impl = "chunk"
g32 = weight_grads(gla, x.float(), dy.float())
gla.impl = "auto"
g64 = weight_grads(layer64, x, dy)
worst = max(testing.rel_err(g32[n], g64[n]) for n in g64)
print(f"weight gradients, chunk (float32) vs naive (float64): worst relative error {worst:.1e}")
assert worst < testing.GRAD_TOLERANCE[torch.float32]

# %% [markdown]
# ## 3. One code path for a prompt and for generation
#
# `forward(x, state=None) -> (y, state)` starts from `state` and returns the state after the last
# token: the recurrent state $S$ ($[B, H, K, V]$) and the last three inputs of the short
# convolution, which the next call's convolution reads before its first token. A whole sequence
# goes through the chunkwise operation; a single token through the one-token step of
# `linattn.naive.step` (a fused Triton kernel on a GPU, chapter 15). So a prompt and the tokens
# after it are the same computation cut at different places — check it: a prompt of 17 tokens,
# then one token per call, against the whole sequence at once.

# %%
xs = x.float()
with torch.no_grad():
    y_all, _ = gla(xs)
    y_pre, s = gla(xs[:, :17])
    pieces = [y_pre]
    for t in range(17, T):
        y_t, s = gla(xs[:, t:t + 1], s)
        pieces.append(y_t)
print("prefill + steps vs whole sequence:", testing.rel_err(torch.cat(pieces, 1), y_all))
assert testing.rel_err(torch.cat(pieces, 1), y_all) < testing.tolerance(torch.float32)

# %% [markdown]
# A state remembers which layer made it and for how many sequences, so handing it to the wrong
# layer fails with an error that says so, instead of silently mixing two conversations:

# %%
other = lnn.GatedLinearAttention(d_model, n_heads)
try:
    other(xs[:, :1], s)
except linattn.InputError as e:
    print("InputError:", e)

# %% [markdown]
# ## 4. Multi-query associative recall
#
# Language models spend much of their capacity on *recall*: a name defined early in a document,
# used again later. The Zoology study (Arora et al., 2023) distilled this into a synthetic task,
# MQAR, on which the gap between attention and the early subquadratic models showed clearly, and
# the DeltaNet and Gated DeltaNet papers use it to show the delta rule's advantage. A sequence lists
# $n$ key–value pairs, then asks for the keys again in a random order; the model must answer each
# with its value:
#
# $$\underbrace{k_1\, v_1\, k_2\, v_2 \cdots k_n\, v_n}_{\text{store}}\;
#   \underbrace{k_{\pi(1)}\, k_{\pi(2)} \cdots k_{\pi(n)}}_{\text{recall: predict } v_{\pi(i)}}$$
#
# Keys and values are drawn at random for every sequence, so nothing can be learned into the
# weights: the pairs must be written into the memory while reading and read back later. Softmax
# attention keeps every token and can look the key up exactly. A recurrent layer must fit $n$
# associations into its $K \times V$ state per head — linear attention superposes them and reads
# back with cross-talk $\sum_j (q\cdot k_j) v_j$; the delta rule *corrects* each write against
# what the state already predicts (chapter 06), so it can hold up to $K$ of them exactly.

# %%
VOCAB = pick(cpu=64, gpu=512)
PAIRS = pick(cpu=12, gpu=32)
tokens, targets = mqar.batch(4, 1, VOCAB, generator=torch.Generator().manual_seed(0))
print("tokens: ", tokens[0].tolist())
print("targets:", [t if t != mqar.IGNORE else "·" for t in targets[0].tolist()])

# %% [markdown]
# ## 5. Training the models
#
# The same small model for every layer: an embedding, a few pre-norm residual blocks (the layer,
# then a two-layer MLP), a read-out over the vocabulary. AdamW with warm-up and cosine decay, fresh
# sequences every step with $n$ drawn from $n_{\max}/4 \dots n_{\max}$ pairs, so one run can be
# evaluated at any $n$ up to $n_{\max}$. A progress bar per model shows the loss.
#
# The sizes come from `pick`, one helper for the device: on a CPU one layer, a width and a
# vocabulary small enough to train each model within a minute or so of one processor thread; on a
# GPU two layers and more pairs. Either way $n_{\max}$ is at least a head's $K$, so the longest
# lists fill a recurrent state up to, or past, the $K$ pairs it could keep exactly apart. On a CPU the chapter trains five of the six layers — Gated
# DeltaNet only on a GPU, to keep the CPU run short; the recorded GPU run of section 8 has all six.

# %%
CFG = dict(
    d_model=pick(cpu=32, gpu=64), n_heads=pick(cpu=4, gpu=2), layers=pick(cpu=1, gpu=2),
    steps=pick(cpu=600, gpu=1000), batch=pick(cpu=32, gpu=128), lr=pick(cpu=1e-2, gpu=3e-3))
MODELS = pick(cpu=["softmax", "linear", "gla", "deltanet", "kda"],
              gpu=["softmax", "linear", "gla", "deltanet", "gated_deltanet", "kda"])
LABEL = {"softmax": "softmax (SDPA)", "linear": "linear attention", "gla": "GLA",
         "deltanet": "DeltaNet", "gated_deltanet": "Gated DeltaNet", "kda": "KDA"}
torch.set_num_threads(1)          # the timings below: one CPU thread (GPU kernels are not affected)
head_k = CFG["d_model"] // CFG["n_heads"]
WIDER = ["linear", "deltanet"]    # trained again with half the heads in section 6
print(CFG, f"pairs {PAIRS}, vocab {VOCAB}, head state {head_k}×{head_k}")
assert PAIRS >= head_k

# %% [markdown]
# On a GPU each layer's first step compiles its Triton kernels, and one model after another that
# is minutes of waiting. The kernels depend on the head dims, the dtype, the layer's options and
# (through the blocks a launch picks) the batch size, not on the sequence length, so one step of
# each model at the training's batch size compiles all of them: `mqar.warm_up` runs that step for
# every model at once, each in a process of its own (compiling is CPU-bound, and a GPU machine has
# many cores), and the training below finds every kernel in Triton's on-disk cache.
# Each line is one model's cold compile; the last, the wait for all of them. On a CPU the layers run
# the chunk level in PyTorch, and there is nothing to compile.

# %%
def job(name, n_heads):
    return dict(mixer=name, vocab=VOCAB, d_model=CFG["d_model"], n_heads=n_heads, layers=CFG["layers"],
                n_pairs=PAIRS, batch_size=CFG["batch"])


jobs = {LABEL[n]: job(n, CFG["n_heads"]) for n in MODELS if n != "softmax"}   # SDPA: nothing to compile
jobs |= {f"{LABEL[n]}, half the heads": job(n, CFG["n_heads"] // 2) for n in WIDER}
start = time.perf_counter()
compiled = mqar.warm_up(jobs, device=DEVICE)
for label, seconds in compiled.items():
    print(f"{label:28s} " + (f"{seconds:6.1f} s" if isinstance(seconds, float) else f"not compiled here: {seconds}"))
print(f"compiled in parallel: {time.perf_counter() - start:.1f} s" if compiled
      else "nothing to compile on a CPU: the layers run the chunk level")

# %%
runs, models = {}, {}
for name in MODELS:
    torch.manual_seed(0)
    models[name] = mqar.RecallModel(name, VOCAB, d_model=CFG["d_model"], n_heads=CFG["n_heads"],
                                    layers=CFG["layers"])
    runs[name] = mqar.train(models[name], n_pairs=PAIRS, vocab=VOCAB, steps=CFG["steps"],
                            batch_size=CFG["batch"], lr=CFG["lr"], device=DEVICE, name=LABEL[name])
print("ran:", ", ".join(linattn.which(op) for op in ("linear_attn", "gla", "delta_rule", "kda")))

# %% [markdown]
# Two losses mark the way. A model that knows nothing pays $\log(\text{vocab})$ nats per answer;
# one that has learned that every answer is *some* value, but not which, pays
# $\log(\text{vocab}/2)$ (values are half the vocabulary). At this task's size:

# %%
LOSS_START, LOSS_ANY_VALUE = math.log(VOCAB), math.log(VOCAB // 2)
print(f"log(vocab) = {LOSS_START:.2f} nats, log(vocab/2) = {LOSS_ANY_VALUE:.2f} nats")


def smooth(xs, w=25):
    xs = torch.tensor(xs)
    return F.avg_pool1d(xs[None, None], w, 1, padding=0)[0, 0] if len(xs) > w else xs


fig, ax = plt.subplots(figsize=(7.5, 4))
for name, run in runs.items():
    ax.plot(smooth(run.losses), label=LABEL[name])
ax.axhline(LOSS_ANY_VALUE, color="grey", ls=":", label="guessing a value: log(vocab/2)")
ax.set_xlabel("training step"); ax.set_ylabel("cross-entropy on the recall positions (nats)")
ax.set_yscale("log"); ax.set_title(f"MQAR, up to {PAIRS} pairs: training loss (moving average of 25)")
ax.legend(loc="lower left", fontsize=8); plt.show()

# %% [markdown]
# The loss starts near $\log(\text{vocab})$ and falls in two stages: first to about
# $\log(\text{vocab}/2)$ — the model has learned that the answer is a value — then, once the layer
# learns to store and read the pairs, on towards zero. That second drop comes at a different step
# for each memory.

# %%
print(f"{'model':18s} {'state (numbers)':>16s} {'recall at n = ' + str(PAIRS):>18s} "
      f"{'wall s':>8s} {'CPU s':>8s}")
for name, run in runs.items():
    print(f"{LABEL[name]:18s} {run.state_size:16d} {run.accuracy:18.3f} {run.seconds:8.1f} "
          f"{run.cpu_seconds:8.1f}")
first, last = ({n: sum(r.losses[i]) / 20 for n, r in runs.items()} for i in (slice(0, 20), slice(-20, None)))
assert all(last[n] < 0.7 * first[n] for n in runs), (first, last)              # every model learned
ranking = sorted(runs, key=lambda n: -runs[n].accuracy)
print("ranking by recall at n_max:", " > ".join(LABEL[n] for n in ranking))

# %% [markdown]
# The table's "state" column counts what a model carries per sequence: $H\cdot K\cdot V$ per
# recurrent layer, and for softmax attention its whole KV cache, $2\,T\,d$ per layer, at the
# $T = 3n$ tokens of the longest sequence. "CPU s" is the processor time of the training loop;
# on a shared machine it is a fairer measure of the work than the wall-clock time.
#
# On a GPU the first model of each kind also pays for Triton compiling its kernels — the forward
# and backward kernels of its operation, for each shape it meets — once per machine, since
# compiled kernels are cached on disk. On a fresh machine the table's times are therefore mostly
# compilation; run the chapter a second time on the same machine and they are the training alone.
#
# ## 6. Recall against the number of pairs and the state size
#
# Each trained model answers fresh sequences with $n = 2 \dots 2n_{\max}$ pairs: up to $n_{\max}$
# it has seen such sequences, beyond it has not (and longer lists than it was trained on test
# whether its memory generalises). To see what the state size is worth, two of the recurrent
# models (linear attention and DeltaNet, `WIDER`, whose kernels section 5 compiled with the others;
# the others only as trained, to keep the run short) are trained once more with half as many heads
# of twice the width — the same number of parameters in $q, k, v$, twice the state
# ($H\cdot K\cdot V = d^2/H$).

# %%
wide = {}
for name in WIDER:
    torch.manual_seed(0)
    m = mqar.RecallModel(name, VOCAB, d_model=CFG["d_model"], n_heads=CFG["n_heads"] // 2,
                         layers=CFG["layers"])
    wide[name] = mqar.train(m, n_pairs=PAIRS, vocab=VOCAB, steps=CFG["steps"], batch_size=CFG["batch"],
                            lr=CFG["lr"], device=DEVICE, name=LABEL[name] + f", {CFG['n_heads'] // 2} heads")
    print(f"{LABEL[name]:18s} state {runs[name].state_size:5d}: {runs[name].accuracy:.3f}   "
          f"state {wide[name].state_size:5d}: {wide[name].accuracy:.3f}")
recurrent = [n for n in runs if n != "softmax"]
spread = max(runs[n].accuracy for n in recurrent) - min(runs[n].accuracy for n in recurrent)
gain = {n: wide[n].accuracy - runs[n].accuracy for n in wide}
print(f"spread between the recurrent layers at one state size: {spread:.3f}")
print("gain from twice the state:", ", ".join(f"{LABEL[n]} {gain[n]:+.3f}" for n in gain))

# %% [markdown]
# The left panel shows recall against the length of the test sequence, one line per model. The right
# one shows recall at $n_{\max}$ for each model, one row each: a ring for the model as trained
# above, a filled dot for the same layer with twice the state (the `WIDER` ones), each labelled with
# its state size (for softmax attention, its cache at the longest training sequence).

# %%
ns = sorted({2, PAIRS // 2, PAIRS, 3 * PAIRS // 2, 2 * PAIRS} | set(range(2, 2 * PAIRS + 1, max(1, PAIRS // 4))))
ns = [n for n in ns if n <= VOCAB // 2]
acc = {name: [mqar.accuracy(m, n, VOCAB, device=DEVICE) for n in ns] for name, m in models.items()}
STYLE = {"softmax": ("k", "s", "-"), "linear": ("C0", "o", "--"), "gla": ("C1", "^", "-."),
         "deltanet": ("C2", "D", "-"), "gated_deltanet": ("C4", "v", "--"), "kda": ("C3", "P", ":")}

fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.1, 1]})
for name in models:
    color, marker, ls = STYLE[name]
    a1.plot([3 * n for n in ns], acc[name], color=color, marker=marker, ls=ls, ms=4, label=LABEL[name])
a1.axvline(3 * PAIRS, color="grey", ls=":", label="longest training sequence")
a1.set_xlabel("sequence length T = 3n (n key–value pairs)"); a1.set_ylabel("recall accuracy")
a1.set_ylim(0, 1.05); a1.set_title("accuracy against sequence length")
a1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)

rows = list(models)
for i, name in enumerate(rows):
    color, _, _ = STYLE[name]
    base = runs[name]
    a2.plot([base.accuracy], [i], "o", mfc="white", mec=color, mew=2, ms=9)
    a2.annotate(f"{base.state_size}", (base.accuracy, i), xytext=(0, 9), textcoords="offset points",
                ha="center", fontsize=8, color=color)
    if name in wide:
        w = wide[name]
        a2.annotate("", (w.accuracy, i), (base.accuracy, i), arrowprops=dict(arrowstyle="->", color=color))
        a2.plot([w.accuracy], [i], "o", color=color, ms=9)
        a2.annotate(f"{w.state_size}", (w.accuracy, i), xytext=(0, -14), textcoords="offset points",
                    ha="center", fontsize=8, color=color)
a2.set_yticks(range(len(rows)), [LABEL[n] for n in rows])
a2.set_ylim(-0.7, len(rows) - 0.3); a2.invert_yaxis()
a2.set_xlim(0, 1.05); a2.set_xlabel(f"recall accuracy at n = {PAIRS}")
a2.set_title("ring: as trained; dot: twice the state\n(numbers: state per sequence)")
a2.grid(axis="x", alpha=0.3)
plt.tight_layout(); plt.show()

# %% [markdown]
# Softmax attention does not lose accuracy with length: its cache grows with the sequence. Every
# fixed-size state loses accuracy as $n$ grows, smoothly, with no cliff at the longest training
# length — the models do recall beyond it, just less. The two numbers printed above the figure say
# how much the size of the state is worth against the kind of memory in this run: the gain from
# doubling $H\cdot K\cdot V$ beside the spread between linear attention, GLA, DeltaNet and KDA at
# one size.

# %% [markdown]
# ## 7. What breaks if…
#
# **…the layer has no short convolution.** Then a position sees only its own token when it
# forms $q, k, v$: at a value's position the key before it is invisible, so no single layer can
# write "this key maps to this value". Train the linear-attention model without it
# (`conv_width=1`) on the same task:

# %%
torch.manual_seed(0)
no_conv = mqar.RecallModel("linear", VOCAB, d_model=CFG["d_model"], n_heads=CFG["n_heads"],
                           layers=CFG["layers"], conv_width=1)
run = mqar.train(no_conv, n_pairs=PAIRS, vocab=VOCAB, steps=CFG["steps"] // 2, batch_size=CFG["batch"],
                 lr=CFG["lr"], device=DEVICE, name="linear, no conv")
print(f"linear attention without the short convolution: recall {run.accuracy:.3f} "
      f"(with it: {runs['linear'].accuracy:.3f}); chance is {2 / VOCAB:.3f}")

# %% [markdown]
# With several layers a model can learn to move the previous token's information forward with
# attention itself (the first half of an "induction head"); the short convolution gives it to a
# single layer for free.
#
# **…the convolution is padded on both sides.** `padding="same"` centres the window: output $t$
# then reads inputs $t+1$ and $t+2$ — the layer sees the future. The whole-sequence forward still
# runs and a model still trains, but on something generation cannot compute: one token at a time,
# the next tokens do not exist yet, so the decoding path of section 3 no longer equals the
# whole-sequence one, and a model trained to lean on the future fails when it generates.
# Causality is a property to check, not to assume: change the last input and see which outputs
# move.

# %%
with torch.no_grad():
    u1 = u.clone()
    u1[:, -1] += 1.0                                                  # change only the last input
    causal = (layer64.conv(u1)[0] - layer64.conv(u)[0]).abs().amax((0, 2))
    same = lambda a: F.conv1d(a.transpose(1, 2), P["conv.conv.weight"], groups=a.shape[-1],
                              padding="same").transpose(1, 2)
    leaky = (same(u1) - same(u)).abs().amax((0, 2))
print("outputs changed by the last input, causal conv:   ", (causal > 0).nonzero().flatten().tolist())
print("outputs changed by the last input, padding='same':", (leaky > 0).nonzero().flatten().tolist())
assert (causal[:-1] == 0).all() and (leaky[:-1] > 0).any()

# %% [markdown]
# **…the gate is formed outside log space.** Computed as `torch.sigmoid(z).log()`, a saturated
# gate ($z \lesssim -104$ in float32) becomes $-\infty$, and the chunkwise kernels' differences
# of cumulative sums turn into $-\infty - (-\infty) = \text{NaN}$; the library's checks refuse a
# $-\infty$ gate by name before that happens (section 2.2).

# %% [markdown]
# ## 8. The experiment at GPU size (a recorded run)
#
# `tools/mqar_gpu.py` trains all six models at a larger size — the widths, heads, layers,
# vocabulary, steps and batch are printed from the record below — with one seed and the
# learning rates each table lists (given several, a table shows each model at its best one, as
# published comparisons do). It does so for two tasks with different longest training lists.
# Every model is then tested on fresh sequences at the numbers of pairs its table lists; for the
# larger task these go on to twice the longest training list. The run is recorded in
# `book/data/mqar.json` with the device, versions and date; the chapter reads it on any machine.

# %%
rec = bench.recorded_run("mqar.json")
tasks = {}                                             # most pairs in training -> its runs
if rec is None:
    print("No GPU run is recorded (book/data/mqar.json is missing): run "
          "`python tools/mqar_gpu.py` on a GPU to make one. No numbers are shown in its place.")
else:
    env = rec["env"]
    print(f"recorded on {env['device']}, {env['date']}, torch {env['torch']}, triton {env['triton']}")
    print("config:", rec["config"])
    best = {}                          # (pairs, model, d) -> the run with the best recall at n = pairs
    for r in rec["runs"]:
        key = (r["pairs"], r["model"], r["d_model"])
        if key not in best or r["accuracy"][str(r["pairs"])] > best[key]["accuracy"][str(r["pairs"])]:
            best[key] = r
    for (pairs, _, _), r in best.items():
        tasks.setdefault(pairs, []).append(r)
    for pairs, rs in sorted(tasks.items()):
        ns = rs[0]["test_pairs"]
        head = next(r for r in rs if r["model"] != "softmax")
        per_head_k = head["d_model"] // rec["config"]["heads"]
        print(f"\nup to {pairs} pairs in training ({pairs / per_head_k:g} per key dimension of a head); "
              "recall accuracy on test sequences of n pairs:")
        print(f"{'model':16s} {'d':>4s} {'lr':>7s} {'state':>8s} " + " ".join(f"{'n=' + str(n):>7s}" for n in ns))
        for r in rs:
            print(f"{LABEL[r['model']]:16s} {r['d_model']:4d} {r['lr']:7.0e} {r['state_size']:8d} "
                  + " ".join(f"{r['accuracy'][str(n)]:7.3f}" for n in ns))


# %%
def plot_task(ax, pairs, rs):
    """Recall against the number of pairs in the test sequence, one line per model."""
    widths, lrs = {r["d_model"] for r in rs}, {r["lr"] for r in rs}
    for r in rs:
        ns = r["test_pairs"]
        color, marker, ls = STYLE[r["model"]]
        name = (LABEL[r["model"]] + (f", d={r['d_model']}" if len(widths) > 1 else "")
                + (f", lr {r['lr']:.0e}" if len(lrs) > 1 else ""))
        ax.plot(ns, [r["accuracy"][str(n)] for n in ns], color=color, marker=marker, ls=ls, ms=5,
                label=name)
    ax.axvline(pairs, color="grey", ls=":", label="longest training list")
    state = max(r["state_size"] for r in rs if r["model"] != "softmax")
    lowest = min(min(r["accuracy"].values()) for r in rs)
    # where every model is near 1, zoom in: on a 0–1 axis the lines would lie on top of each other
    ylim = (0, 1.05) if lowest < 0.8 else (1 - 1.6 * (1 - lowest), 1 + 0.15 * (1 - lowest))
    ax.set(xlabel="key–value pairs n in the test sequence", ylabel="recall accuracy", ylim=ylim,
           xticks=rs[0]["test_pairs"], xlim=(0, 1.05 * max(rs[0]["test_pairs"] + [pairs])),
           title=f"up to {pairs} pairs in training" + (" (accuracy axis zoomed)" if lowest >= 0.8 else "")
           + f"\n(state {state} numbers for the recurrent models)")
    ax.legend(fontsize=8, loc="lower left")


if tasks:
    fig, axes = plt.subplots(1, len(tasks), figsize=(11, 4.2), squeeze=False)
    for ax, (pairs, rs) in zip(axes[0], sorted(tasks.items())):
        plot_task(ax, pairs, rs)
    plt.tight_layout(); plt.show()

# %% [markdown]
# The cell below reads off the record what the figure shows: for each task, whether the fixed-size
# states can still be told apart at the longest training list, and their order at the larger task,
# each model at its best learning rate.

# %%
def at_longest(rs, pairs):
    return {r["model"]: r["accuracy"][str(pairs)] for r in rs}


if tasks:
    small, large = min(tasks), max(tasks)
    acc_small, acc_large = at_longest(tasks[small], small), at_longest(tasks[large], large)
    rec_small = [a for m, a in acc_small.items() if m != "softmax"]
    print(f"up to {small} pairs: recurrent recall at n = {small} between {min(rec_small):.3f} and {max(rec_small):.3f}")
    order = sorted((m for m in acc_large if m != "softmax"), key=lambda m: -acc_large[m])
    print(f"up to {large} pairs, recall at n = {large}: softmax {acc_large['softmax']:.3f}; "
          + " > ".join(f"{LABEL[m]} {acc_large[m]:.3f}" for m in order))
    best_lr = {r["lr"]: 0 for r in rec["runs"]}
    for r in rec["runs"]:
        if r["pairs"] == large and r["model"] != "softmax":
            best_lr[r["lr"]] = max(best_lr[r["lr"]], r["accuracy"][str(large)])
    print("best recurrent recall at n =", large, "per learning rate:",
          ", ".join(f"{lr:.0e}: {a:.3f}" for lr, a in sorted(best_lr.items()) if a))
    # what the text below states about this record
    assert acc_large["softmax"] >= max(acc_large[m] for m in order)
    assert order[-1] == "kda" and set(order[:2]) == {"deltanet", "gated_deltanet"}

# %% [markdown]
# With the smaller task every model recalls nearly every pair at the longest training list: the
# task fits in what the state can hold, and the kinds of memory cannot be told apart. With the
# larger one they separate. Softmax attention keeps every token — its cache grows with the
# sequence — and recalls best. The fixed-size states lose accuracy as $n$ grows past what a head's
# key dimensions can keep apart, and more beyond the longest training list.
#
# Among them, each at its best learning rate, DeltaNet and Gated DeltaNet recall best: the delta
# rule's correcting write — each new pair first subtracts what the state already returns for its
# key — is worth most where the state is overfull. That is the ordering the DeltaNet and Gated
# DeltaNet papers report. KDA does not follow it here: the delta rule with a per-dimension gate
# recalls *least* of the recurrent layers, although it is the most expressive of them. The
# learning rate matters as much as the layer (the last line above), which is why published
# comparisons sweep it.
#
# ### Why KDA lags here: a probe
#
# KDA with its gate held at $\alpha = 1$ computes exactly DeltaNet's recurrence, through KDA's own
# kernels. `tools/mqar_probe.py` trains KDA on the larger task three ways: with its gate learned
# (the layer as built), with the gate held at 1 (its output weights zero and not trained), and
# with the gate's bias started higher ($\alpha$ nearer 1 at the start); and, with the gate
# learned, for more steps beside Gated DeltaNet.

# %%
probe = bench.recorded_run("mqar_probe.json")
if probe is None:
    print("No probe run is recorded (book/data/mqar_probe.json): run `python tools/mqar_probe.py` on a GPU.")
else:
    env = probe["env"]
    print(f"recorded on {env['device']}, {env['date']}, torch {env['torch']}, triton {env['triton']}")
    ns = list(probe["runs"][0]["accuracy"])
    print(f"{'model':15s} {'gate':9s} {'steps':>6s} {'lr':>6s} " + " ".join(f"{'n=' + n:>7s}" for n in ns))
    for r in probe["runs"]:
        print(f"{LABEL[r['model']]:15s} {r['gates']:9s} {r['steps']:6d} {r['lr']:6.0e} "
              + " ".join(f"{r['accuracy'][n]:7.3f}" for n in ns))

# %% [markdown]
# With its gate held at 1, KDA recalls as DeltaNet does (compare DeltaNet at the same learning rate
# in the table above): its kernels and its layer are not what costs it recall. The learned gate is.
# Started nearer 1, it loses less; trained longer, KDA closes much of the gap, but Gated DeltaNet
# trained as long is still ahead. A per-dimension gate has one value per key dimension of each head
# to keep near 1 on a task where forgetting never helps, a per-head gate one; at this budget KDA
# learns that slowly. So the ordering of the gated delta rules here says how fast each gate learns
# what this task wants, not what its state can hold. The papers that find KDA ahead train larger
# models for much longer, on tasks where forgetting is also useful. (One seed: a single run per row
# is evidence, not a measurement of the spread.)
#
# ### What a training step costs at scale
#
# These models are small; at language-model size the time of a step is the time of the operations'
# forward and backward. `tools/bench.py --suite train` records it (chapter 13 reads the whole
# record, with the gates real layers produce beside the mild ones); for the operations of this
# chapter's layers, at the recorded setting with mild gates:

# %%
train_rec = bench.recorded_run("bench_train.json")
if train_rec is None:
    print("No recorded training benchmark (book/data/bench_train.json): run "
          "`python tools/bench.py --suite train` on a GPU.")
else:
    size = train_rec["size"]
    print("recorded on", bench.run_label(train_rec["env"]))
    print(f"setting: {size['tokens']} tokens per call (B·T), H = {size['H']}, K = {size['K']}, "
          f"V = {size['V']}; forward + backward of the operation, ms\n")
    rows = [[r["op"], r["T"], r["triton"], r.get("fla"), r["sdpa"]]
            for r in sorted(train_rec["train"]["rows"], key=lambda r: (r["op"], r["T"]))
            if r["op"] in ("linear_attn", "gla", "delta_rule", "kda")]
    print(bench.markdown_table(["op", "T", "ours ms", "FLA ms", "SDPA ms"], rows))

# %% [markdown]
# ## Summary
#
# * The GLA layer of the GLA paper (§3.1, §3.4): projections to $q, k, v$, the operation with a
#   per-dimension gate $\log\alpha = \log\sigma(xW_\alpha^1W_\alpha^2 + c_\alpha)/16$ formed in log
#   space, a LayerNorm per head, a Swish output gate $R_t$ (eq. 10) and an output projection
#   (eq. 11). The library adds a short causal convolution before the split into heads, from the
#   state-space and DeltaNet line of layers.
# * Built by hand, piece by piece, it equals the library layer at the naive level in float64; the
#   chunkwise and Triton levels agree to float32 tolerance, gradients included.
# * `forward(x, state) -> (y, state)` makes the prompt and generation one code path; a state
#   carries $S$ and the convolution's cache and is tied to its layer and batch.
# * On MQAR the memories separate. Softmax attention, which keeps every token, recalls (nearly)
#   every pair. The fixed-size states fall behind as the number of pairs approaches and passes
#   what a head's $K$ key dimensions can keep apart, and further on sequences longer than they were
#   trained on. Which recurrent layer leads after a few hundred CPU steps says more about how fast
#   each learns than about what its state can hold; the delta rule's advantage shows in the
#   recorded GPU run, where KDA's learned gate, not its state, costs it recall.
# * Chapter 15 uses these layers to generate: prefill with the chunkwise kernel, then one token at a
#   time with a state that never grows.
#
# **Workbook:** `exercises/14_layers.py` — build the GLA layer from its weights (the split into
# heads, the low-rank gate, the short convolution, the per-head norm, the output gate), train a
# model with it, and decode with it one token at a time.
