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
# # 14 — Layers and training: multi-query associative recall
#
# **Goal.** Wrap the operations of the first half of the book into attention *layers* — the GLA
# layer of the GLA paper, DeltaNet, Gated DeltaNet, KDA, plain linear attention and a softmax
# baseline — and train small models with them on a task that measures exactly what a recurrent
# state is for: remembering key–value associations. We will see the loss fall, the models
# separate, and the delta-rule family recall more from the same state size.
#
# Everything here trains through the chunkwise level and its hand-written backward (chapter 12)
# on a CPU, through the Triton kernels on a GPU: the dispatcher picks (`impl="auto"`).

# %%
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
print(linattn.device.describe())

# %% [markdown]
# ## 1. From an operation to a layer
#
# An operation maps $(q, k, v, \dots)$ to outputs; a layer maps a sequence of model vectors
# $x_t \in \mathbb{R}^{d}$ to new ones. Every layer of this chapter has the same skeleton (the GLA
# paper's, §4.4, itself following RetNet and the gated attention unit):
#
# $$[q_t, k_t, v_t] = \mathrm{SiLU}\big(\mathrm{conv}_4(x W_{qkv})\big)_t,\qquad
#   o_t = \mathrm{op}(q, k, v, \dots)_t,$$
# $$y_t = \Big(\mathrm{Norm}_{\text{per head}}(o_t) \odot \mathrm{Swish}(x_t W_r + c_r)\Big) W_o .$$
#
# * $\mathrm{conv}_4$ is a short causal depthwise convolution over the last four positions. It
#   lets position $t$ see the token before it — which associative recall needs (a value must be
#   bound to the key *before* it) — and it is cheap; every model below has it, the softmax
#   baseline too, so the comparison isolates the memory.
# * The normalisation acts on each head's output separately (the paper: "LayerNorm is applied
#   after the output of each head individually"). It is what lets the layers drop the normaliser
#   of the original linear attention (chapter 01).
# * $\mathrm{Swish}(x W_r + c_r)$ is the output gate $R_t$ of the paper's eq. (10). (The $W$s with
#   subscripts are learned projections and the $c$s their biases; $b$ stays the cumulative
#   log-gate and $W$ alone the WY factor of chapter 07.)
#
# What differs is the operation and what the layer computes from $x$ besides $q, k, v$:
#
# | layer | state update | extra inputs |
# |---|---|---|
# | `LinearAttention` | $S \leftarrow S + k^\top v$ | — |
# | `GatedLinearAttention` | $S \leftarrow \mathrm{diag}(\alpha_t) S + k^\top v$ | $\log\alpha_t$ per key dimension |
# | `DeltaNet` | $S \leftarrow S + \beta_t k^\top (v - kS)$ | $\beta_t = \sigma(x_t W_\beta)$; $q, k$ L2-normalised |
# | `GatedDeltaNet` | the same after $S \leftarrow \alpha_t S$ | one $\log\alpha_t$ per head, $\beta_t$ |
# | `KimiDeltaAttention` | the same after $S \leftarrow \mathrm{diag}(\alpha_t) S$ | $\log\alpha_t$ per key dimension, $\beta_t$ |
#
# ### The GLA gate, in log space
#
# The GLA paper makes the forget gate data-dependent and cheap: a low-rank projection (rank 16)
# and a temperature $\tau = 16$,
#
# $$\alpha_t = \sigma\big(x_t W_\alpha^1 W_\alpha^2 + c_\alpha\big)^{1/\tau}
#   \quad\Longleftrightarrow\quad
#   \log\alpha_t = \frac{\log\sigma\big(x_t W_\alpha^1 W_\alpha^2 + c_\alpha\big)}{\tau} \le 0 .$$
#
# The paper applies the temperature in log space, and so do we: the kernels take log-decays
# (chapter 03), so the layer never forms $\alpha$ at all. $\log\sigma(z) = -\mathrm{softplus}(-z)$
# is computed directly (`F.logsigmoid`): forming $\sigma(z)$ first and taking its log rounds to
# $\log 0 = -\infty$ once $z \lesssim -104$ in float32.

# %%
z = torch.tensor([-200.0, -20.0, 0.0, 5.0])
print("log(sigmoid(z)):", torch.sigmoid(z).log().tolist())
print("logsigmoid(z):  ", F.logsigmoid(z).tolist())
assert torch.isinf(torch.sigmoid(z).log()[0]) and torch.isfinite(F.logsigmoid(z)).all()

# %% [markdown]
# Why $\tau = 16$: $\sigma$ saturates quickly, and its $16^{\text{th}}$ root stays close to 1 over
# most of its range, so the state forgets slowly unless the layer pushes $z$ far down. At $z = 0$,
# $\alpha = 2^{-1/\tau}$ and the state keeps half of what it holds after $\tau$ tokens; with
# $\tau = 1$ it would halve at every token. The library also starts the gate's bias at $c_\alpha = 4$
# (`linattn.nn.gates.GATE_BIAS`): a half-life of about 600 tokens, so a fresh model remembers
# like an ungated one and learns where to forget — a model that cannot yet retrieve anything gets
# little gradient telling it to keep its state longer.

# %%
for tau in (1, 4, 16):
    for z0 in (0.0, 4.0):                                   # z of a zero input: the bias c_α
        a0 = math.exp(F.logsigmoid(torch.tensor(z0)).item() / tau)
        print(f"τ = {tau:2d}, z = {z0:g}: α = {a0:.5f}, half-life {math.log(0.5) / math.log(a0):7.1f} tokens")

# %% [markdown]
# Build a GLA layer and look at its parts. The paper's GLA uses $d_k = d/2$ for the keys and
# $d_v = d$ for the values, summed over the heads: the paper's $d_k$ and $d_v$ are $H\cdot K$ and
# $H\cdot V$ here, so each head has $K = d/(2H)$ (`head_k`) and $V = d/H$.

# %%
d_model, n_heads = 64, 2
gla = lnn.GatedLinearAttention(d_model, n_heads, head_k=d_model // (2 * n_heads))
for name, p in gla.named_parameters():
    print(f"{name:22s} {tuple(p.shape)}")
print("state per sequence:", gla.state_size(), "numbers (H·K·V)")

# %% [markdown]
# **Check against the previous level.** The layer runs its operation through the dispatcher; the
# same layer with `impl="naive"` runs the float64-faithful recurrence of chapter 04 instead. The
# outputs must agree to float32 tolerance.

# %%
x = torch.randn(2, 50, d_model)
with torch.no_grad():
    y, state = gla(x)
    print("ran:", linattn.which("gla"))
    gla.impl = "naive"
    y_ref, _ = gla(x)
    gla.impl = "auto"
print("layer, chunkwise vs naive:", testing.rel_err(y, y_ref))
assert testing.rel_err(y, y_ref) < testing.tolerance(torch.float32)

# %% [markdown]
# ## 2. One code path for a prompt and for generation
#
# `forward(x, state=None) -> (y, state)` starts from `state` and returns the state after the last
# token: the recurrent state $S$ ($[B, H, K, V]$) and the last three inputs of the short
# convolution. A whole sequence goes through the chunkwise operation; a single token through the
# one-token step of `linattn.naive.step` (a fused Triton kernel on a GPU, chapter 15). So a prompt
# and the tokens after it are the same computation cut at different places — check it: a prompt
# of 17 tokens, then 33 steps of one token, against the 50 tokens at once.

# %%
with torch.no_grad():
    y_pre, s = gla(x[:, :17])
    ys = [y_pre]
    for t in range(17, 50):
        y_t, s = gla(x[:, t:t + 1], s)
        ys.append(y_t)
print("prefill + steps vs whole sequence:", testing.rel_err(torch.cat(ys, 1), y))
assert testing.rel_err(torch.cat(ys, 1), y) < testing.tolerance(torch.float32)

# %% [markdown]
# A state remembers which layer made it and for how many sequences, so handing it to the wrong
# layer fails with an error that says so, instead of silently mixing two conversations:

# %%
other = lnn.GatedLinearAttention(d_model, n_heads)
try:
    other(x[:, :1], s)
except linattn.InputError as e:
    print("InputError:", e)

# %% [markdown]
# ## 3. Multi-query associative recall
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
# ## 4. Training the models
#
# The same small model for every layer: an embedding, `LAYERS` pre-norm residual blocks (the
# layer, then a two-layer MLP), a read-out over the vocabulary. AdamW with warm-up and cosine
# decay, fresh sequences every step with $n$ drawn from $n_{\max}/4 \dots n_{\max}$ pairs (so one
# run can be evaluated at any $n$ up to $n_{\max}$). A tqdm bar per model shows the loss.
#
# Sizes come from `pick`: on a CPU a one-layer model of width 32 with four heads of $8\times 8$
# states, $n_{\max} = 12$ pairs and a vocabulary of 64 — small enough to train each model in
# well under a minute of one CPU thread, and more pairs than a head has key dimensions, so a
# recurrent state cannot hold them all apart. On a GPU the chapter
# trains two-layer models of width 64 on 32 pairs. Gated DeltaNet is trained on a GPU only: on a
# CPU it would add about half a minute of processor time (trained at the CPU size in the same
# budget, it recalled less than DeltaNet and more than KDA); the recorded GPU run below has it.

# %%
CFG = dict(
    d_model=pick(cpu=32, gpu=64), n_heads=pick(cpu=4, gpu=2), layers=pick(cpu=1, gpu=2),
    steps=pick(cpu=600, gpu=1000), batch=pick(cpu=32, gpu=128), lr=pick(cpu=1e-2, gpu=3e-3))
MODELS = pick(cpu=["softmax", "linear", "gla", "deltanet", "kda"],
              gpu=["softmax", "linear", "gla", "deltanet", "gated_deltanet", "kda"])
LABEL = {"softmax": "softmax (SDPA)", "linear": "linear attention", "gla": "GLA",
         "deltanet": "DeltaNet", "gated_deltanet": "Gated DeltaNet", "kda": "KDA"}
torch.set_num_threads(1)          # the timings below: one CPU thread (GPU kernels are not affected)
print(CFG, "pairs", PAIRS, "vocab", VOCAB)

runs, models = {}, {}
for name in MODELS:
    torch.manual_seed(0)
    models[name] = mqar.RecallModel(name, VOCAB, d_model=CFG["d_model"], n_heads=CFG["n_heads"],
                                    layers=CFG["layers"])
    runs[name] = mqar.train(models[name], n_pairs=PAIRS, vocab=VOCAB, steps=CFG["steps"],
                            batch_size=CFG["batch"], lr=CFG["lr"], device=DEVICE, name=LABEL[name])
print("ran:", ", ".join(linattn.which(op) for op in ("linear_attn", "gla", "delta_rule", "kda")))

# %%
def smooth(xs, w=25):
    xs = torch.tensor(xs)
    return torch.nn.functional.avg_pool1d(xs[None, None], w, 1, padding=0)[0, 0] if len(xs) > w else xs


fig, ax = plt.subplots(figsize=(7.5, 4))
for name, run in runs.items():
    ax.plot(smooth(run.losses), label=LABEL[name])
ax.axhline(math.log(VOCAB // 2), color="grey", ls=":", label="guessing a value: log(vocab/2)")
ax.set_xlabel("training step"); ax.set_ylabel("cross-entropy on the recall positions (nats)")
ax.set_yscale("log"); ax.set_title(f"MQAR, up to {PAIRS} pairs: training loss (moving average of 25)")
ax.legend(loc="center right", fontsize=8); plt.show()

# %% [markdown]
# The loss starts at $\log(\text{vocab}) \approx 4.2$ nats and falls in two stages: first to
# about $\log(\text{vocab}/2) \approx 3.5$ — the model has learned that the answer is *some*
# value — then, once the layer learns to store and read the pairs, on towards zero. That second
# drop comes at a different step for each memory.

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
# On a GPU the first model of each kind also pays for Triton compiling its kernels, forward and
# backward — once per machine, since compiled kernels are cached on disk. There the table's times
# are mostly compilation, not training: on an H200 (torch 2.11, triton 3.6, 2026-11-23), with an
# empty cache, the first 60 steps and one evaluation took 25 s for linear attention, 50 s for
# DeltaNet and 145 s for KDA (about 40 kernels each; KDA's, with their per-dimension gate walks,
# are the slowest to compile), and every step after that 9, 15 and 16 ms — the 1000 steps
# themselves take 9–16 s. Run the chapter a second time on the same machine and the table shows that.
#
# ## 5. Recall against the number of pairs and the state size
#
# Each trained model answers fresh sequences with $n = 2 \dots 2n_{\max}$ pairs: up to $n_{\max}$
# it has seen such sequences, beyond it has not (and longer lists than it was trained on test
# whether its memory generalises). The right panel puts accuracy at $n_{\max}$ against state
# size; for that, a few of the recurrent models are trained once more with half as many heads of
# twice the width — the same number of parameters in $q, k, v$, twice the state ($H\cdot K\cdot V
# = d^2/H$).

# %%
WIDER = ["linear", "deltanet"]
wide = {}
for name in WIDER:
    torch.manual_seed(0)
    m = mqar.RecallModel(name, VOCAB, d_model=CFG["d_model"], n_heads=CFG["n_heads"] // 2,
                         layers=CFG["layers"])
    wide[name] = mqar.train(m, n_pairs=PAIRS, vocab=VOCAB, steps=CFG["steps"], batch_size=CFG["batch"],
                            lr=CFG["lr"], device=DEVICE, name=LABEL[name] + f", {CFG['n_heads'] // 2} heads")
    print(f"{LABEL[name]:18s} state {runs[name].state_size:5d}: {runs[name].accuracy:.3f}   "
          f"state {wide[name].state_size:5d}: {wide[name].accuracy:.3f}")

# %%
ns = sorted({2, PAIRS // 2, PAIRS, 3 * PAIRS // 2, 2 * PAIRS} | set(range(2, 2 * PAIRS + 1, max(1, PAIRS // 4))))
ns = [n for n in ns if n <= VOCAB // 2]
acc = {name: [mqar.accuracy(m, n, VOCAB, device=DEVICE) for n in ns] for name, m in models.items()}
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
for name in models:
    a1.plot([3 * n for n in ns], acc[name], marker="o", ms=3, label=LABEL[name])
    pts = sorted([(runs[name].state_size, runs[name].accuracy)]
                 + ([(wide[name].state_size, wide[name].accuracy)] if name in wide else []))
    a2.plot(*zip(*pts), marker="o", label=LABEL[name])
a1.axvline(3 * PAIRS, color="grey", ls=":", label="longest training sequence")
a1.set_xlabel("sequence length T = 3n (n key–value pairs)"); a1.set_ylabel("recall accuracy")
a1.set_ylim(0, 1.02); a1.legend(fontsize=8); a1.set_title("accuracy against sequence length")
a2.set_xscale("log"); a2.set_xlabel("state per sequence (numbers, all layers)")
a2.set_ylabel(f"recall accuracy at n = {PAIRS}"); a2.set_ylim(0, 1.02)
a2.set_title("accuracy against state size"); a2.legend(fontsize=8)
plt.tight_layout(); plt.show()

# %% [markdown]
# Softmax attention does not lose accuracy with length: its cache grows with the sequence. Every
# fixed-size state loses accuracy as $n$ grows, smoothly, with no cliff at the longest training
# length — the models do recall beyond it, just less. In the CPU run the size of the state matters
# more than the kind of memory: doubling $H\cdot K\cdot V$ moves a model further than switching
# between linear attention, GLA and DeltaNet at the same size.

# %% [markdown]
# ## 6. The same experiment at GPU size (a recorded run)
#
# `tools/mqar_gpu.py` trains all six models — softmax attention, linear attention, GLA, DeltaNet,
# Gated DeltaNet and KDA — at width $d_{\text{model}} = 64$ with 2 heads and 2 layers, a vocabulary
# of 512, 2000 steps of batch 128, one seed, at the learning rate each table lists (given several, a
# table shows each model at its best one, as the published comparisons do). It does so for two
# tasks: training lists of up to 32 pairs, and of up to 64. Each head of a recurrent layer then has
# a $32 \times 32$ state, so the first task asks a head to keep about as many pairs as it has key
# dimensions, the second twice as many. Every model is then tested on fresh sequences at the
# numbers of pairs its table lists; for the larger task these go on to twice the longest training
# list, so they also show how a memory does on sequences longer than any it was trained on. The
# run is recorded in `book/data/mqar.json` with the device, versions and date; read on a CPU, the
# chapter shows it here. The cell prints the settings from the file, then one table per task.

# %%
rec = bench.recorded_run("mqar.json")
if rec is None:
    print("No GPU run is recorded yet (book/data/mqar.json is missing): run "
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
    tasks = {}                                         # most pairs in training -> its runs
    for (pairs, _, _), r in best.items():
        tasks.setdefault(pairs, []).append(r)
    for pairs, rs in sorted(tasks.items()):
        ns = rs[0]["test_pairs"]
        print(f"\nup to {pairs} pairs in training; recall accuracy on test sequences of n pairs:")
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
        name = (LABEL[r["model"]] + (f", d={r['d_model']}" if len(widths) > 1 else "")
                + (f", lr {r['lr']:.0e}" if len(lrs) > 1 else ""))
        ax.plot(ns, [r["accuracy"][str(n)] for n in ns], marker="o", ms=4, label=name)
    ax.axvline(pairs, color="grey", ls=":", label="longest training list")
    state = max(r["state_size"] for r in rs if r["model"] != "softmax")
    ax.set(xlabel="key–value pairs n in the test sequence", ylabel="recall accuracy", ylim=(0, 1.02),
           xticks=rs[0]["test_pairs"], xlim=(0, 1.05 * max(rs[0]["test_pairs"] + [pairs])),
           title=f"up to {pairs} pairs in training\n(state {state} numbers for the recurrent models)")
    ax.legend(fontsize=8, loc="lower left")


if rec is not None:
    fig, axes = plt.subplots(1, len(tasks), figsize=(11, 4), squeeze=False)
    for ax, (pairs, rs) in zip(axes[0], sorted(tasks.items())):
        plot_task(ax, pairs, rs)
    plt.tight_layout(); plt.show()

# %% [markdown]
# With up to 32 pairs every model recalls nearly every pair, also at $n = 32$: the task fits in
# what a 4096-number state can hold, and the kinds of memory cannot be told apart. With up to 64
# pairs they separate. Softmax attention keeps every token — its cache is 49152 numbers at 64
# pairs, and grows with the sequence — and recalls every pair at every tested length. The
# fixed-size states lose accuracy as $n$ grows past what a head's 32 key dimensions can keep apart,
# and more beyond the longest training list.
#
# Among them, each at its best learning rate, DeltaNet and Gated DeltaNet recall best, then GLA,
# then linear attention: the delta rule's correcting write — each new pair first subtracts what the
# state already returns for its key — is worth most where the state is overfull. That part of the
# ordering is the one the DeltaNet and Gated DeltaNet papers report. KDA does not follow it here: the
# delta rule with a per-dimension gate recalls *least* of the recurrent layers, although it is the
# most expressive of them. The learning rate matters as much as the layer: at $10^{-3}$ every
# recurrent model stays below 0.81 at $n = 64$, and linear attention is best at $3\cdot10^{-3}$,
# the delta rules at $10^{-2}$ — which is why the published comparisons sweep it.
#
# ### Why KDA lags here: a probe
#
# KDA with its gate held at $\alpha = 1$ computes exactly DeltaNet's recurrence, through KDA's own
# kernels. `tools/mqar_probe.py` trains KDA on the 64-pair task three ways: with its gate learned
# (the layer as built), with the gate held at 1 (its output weights zero and not trained), and
# with the gate's bias started at 12 instead of 4 ($\alpha$ nearer 1 at the start); and, with
# the gate learned, for three times as many steps beside Gated DeltaNet.

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
# Started nearer 1, it loses less; trained three times as long, KDA closes much of the gap, but
# Gated DeltaNet trained as long is still ahead. A per-dimension gate has 32 values per head to
# keep near 1 on a task where forgetting never helps, a per-head gate one; at this budget KDA
# learns that slowly. So the ordering of the gated delta rules here says how fast each gate
# learns what this task wants, not what its state can hold. The papers that find KDA ahead train
# larger models for much longer, on tasks where forgetting is also useful. (One seed again: a
# single run per row is evidence, not a measurement of the spread.)

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
# attention itself (an "induction head"), which is what the Zoology models without convolution
# do; the short convolution gives it for free, which is why every modern linear-attention layer
# has one.
#
# **…the gate is formed outside log space.** Computed as `torch.sigmoid(z).log()`, a saturated
# gate ($z \lesssim -104$ in float32) becomes $-\infty$, and the chunkwise kernels' differences
# of cumulative sums turn into $-\infty - (-\infty) = \text{NaN}$; the library's checks refuse a
# $-\infty$ gate by name before that happens (section 1).
#
# ## Summary
#
# * A layer is an operation between projections: $q, k, v$ (after a short convolution), the
#   operation's extra inputs (a log-space gate, $\beta$), a per-head norm, a Swish output gate and
#   an output projection. The GLA gate is $\log\alpha = \log\sigma(xW_\alpha^1W_\alpha^2 + c_\alpha)/16$, formed in log
#   space.
# * `forward(x, state) -> (y, state)` makes the prompt and generation one code path; a state is
#   tied to its layer and batch.
# * On MQAR the memories separate. Softmax attention, which keeps every token, recalls (nearly)
#   every pair. The fixed-size states fall behind as the number of pairs approaches and passes what
#   a head's $K$ key dimensions can keep apart, and further on sequences longer than they were
#   trained on. Which recurrent layer leads after a few hundred CPU steps (the ranking printed in
#   section 4) says more about how fast each learns than about what its state can hold; the
#   delta rule's advantage — each write corrects what the state already predicts, so it can
#   overwrite instead of superposing — shows in the recorded GPU run of section 6: with each model at
#   its best learning rate, DeltaNet and Gated DeltaNet recall the most pairs of the fixed-size
#   states, then GLA, then linear attention. KDA recalls least there, and the probe shows why: held
#   at 1, its gate gives DeltaNet's recall; learning it costs recall at this training budget.
# * Chapter 15 uses these layers to generate: prefill with the chunkwise kernel, then one token at a
#   time with a state that never grows.
#
# **Workbook:** `exercises/14_layers.py` — the GLA gate in log space, and the prefill-then-decode
# loop that must equal the whole-sequence output.
