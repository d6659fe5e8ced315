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
# # 15 — Inference: prefill, then a state that never grows
#
# **Goal.** Generate text with the layers of chapter 14. A prompt is read in one pass by the
# chunkwise kernel (*prefill*); then each new token costs one step of the recurrence (*decode*),
# reading and writing a state of fixed size. We check that the two phases compute exactly what
# the whole sequence would, write the decode step as one fused Triton kernel, and measure memory
# and time per generated token against softmax attention, whose KV cache grows with every token.

# %%
import matplotlib.pyplot as plt
import torch

import linattn
from linattn import bench, mqar, naive, testing
from linattn.device import pick
from linattn.nn import generate
from linattn.triton import step as fused

torch.manual_seed(0)
DEVICE = linattn.device.default_device()
print(linattn.device.describe())

# %% [markdown]
# ## 1. Two phases, one recurrence
#
# For a recurrent layer the state after $t$ tokens summarises the prefix completely:
#
# $$S_t = D_t S_{t-1} + (\text{write of token } t), \qquad o_t = \text{scale}\cdot q_t S_t .$$
#
# So generation needs nothing but $S$ (plus the short convolution's last three inputs): the
# prompt's $L$ tokens go through the chunkwise algorithm, which returns $S_L$ (its
# `output_final_state`). $L$, the context length, is the number of tokens read so far — the
# prompt, or the prompt and what has been generated since; $T$ stays the length of a whole
# sequence. Every generated token then runs one step from the state the previous
# one left. The step is the recurrence of chapters 01–06 for a single $t$ — for KDA:
#
# $$S \leftarrow \mathrm{diag}(e^{g})\,S,\quad r = v - kS,\quad S \leftarrow S + \beta\,k^\top r,
#   \quad o = \text{scale}\cdot qS .$$
#
# `linattn.naive.step` holds these steps for the four operations. Carried over a sequence they
# reproduce the whole-sequence result:

# %%
args = testing.make_inputs("kda", B=2, T=pick(cpu=40, gpu=200), H=2, K=32, V=32, initial_state=True)
o_ref, S_ref = naive.kda(**testing.to_float64(args), output_final_state=True)
S, outs = args["initial_state"], []
for t in range(args["q"].shape[1]):
    o, S = naive.kda_step(args["q"][:, t], args["k"][:, t], args["v"][:, t], args["g"][:, t],
                          args["beta"][:, t], S)
    outs.append(o)
print("token-by-token steps vs the recurrence:", testing.rel_err(torch.stack(outs, 1), o_ref))
assert testing.rel_err(torch.stack(outs, 1), o_ref) < testing.tolerance(torch.float32)

# %% [markdown]
# ## 2. The step as one kernel
#
# Generating is memory-bound: per token and head the step reads $S$ ($K\times V$ numbers) and
# writes it back, and does $O(KV)$ arithmetic — about one multiply-add per number moved. Written as
# PyTorch operations it moves $S$ several times (decay, residual $kS$, update, read-out $qS$), one
# kernel launch each. `linattn.triton.step` fuses them: one program per (sequence·head, block of 64
# value columns) loads its block of $S$ into registers, applies all four stages, stores it once.
# Splitting the value columns is exact because every stage treats the columns of $S$ separately:
# each entry of the residual $r = v - kS$ needs only the matching column of $S$.
#
# It is inference-only: it refuses inputs that require grad (by name) rather than return a result
# cut off from autograd. Check it against the float64 step (here in the Triton interpreter on a
# CPU, compiled on a GPU):

# %%
one = testing.make_inputs("kda", B=2, T=1, H=2, K=32, V=80, initial_state=True, seed=1)
tok = {n: a[:, 0] for n, a in one.items() if n != "initial_state"}
o_ref, S_ref = naive.kda_step(**testing.to_float64(tok), state=one["initial_state"].double())
q, k, v, g, beta = (tok[n].to(DEVICE) for n in ("q", "k", "v", "g", "beta"))
o, S = fused.kda_step(q, k, v, g, beta, one["initial_state"].to(DEVICE))
print("fused Triton step vs float64 naive step: o", testing.rel_err(o, o_ref), " S", testing.rel_err(S, S_ref))
assert testing.rel_err(o, o_ref) < testing.tolerance(torch.float32)
assert testing.rel_err(S, S_ref) < testing.tolerance(torch.float32)
try:
    fused.kda_step(q, k, v.requires_grad_(), g, beta, S)
except linattn.InputError as e:
    print("InputError:", str(e)[:110], "…")

# %% [markdown]
# ## 3. Generating with a model
#
# `linattn.nn.generate(model, prompt, n)` prefills the prompt and then feeds back the most likely
# token `n` times. The layers choose their path by the length of what they get: the prompt goes
# through the chunkwise kernel, each single token through the step (the fused kernel on a GPU,
# `linattn.naive.step` on a CPU). Below, two-layer models of chapter 14 with GLA, KDA and softmax
# attention — untrained, since only the cost and the equality of the two paths matter here. The
# check: the greedy tokens are exactly those the model predicts when it re-reads the whole
# generated sequence at once.

# %%
VOCAB, D = 256, pick(cpu=64, gpu=256)
models = {name: mqar.RecallModel(name, VOCAB, d_model=D, n_heads=pick(cpu=2, gpu=4), layers=2).to(DEVICE).eval()
          for name in ("softmax", "gla", "kda")}
prompt = torch.randint(0, VOCAB, (1, 37), device=DEVICE)
for name, model in models.items():
    seq, states = generate(model, prompt, 20)
    with torch.no_grad():
        logits, _ = model(seq)
    same = torch.equal(seq[:, 37:], logits[:, 36:-1].argmax(-1))
    print(f"{name:8s} generated {seq[0, 37:].tolist()[:8]}…  state {sum(s.nbytes() for s in states):7d} bytes;"
          f" equals re-reading the whole sequence: {same}")
    assert same

# %% [markdown]
# ## 4. Memory and time per generated token
#
# Now the price of one more token after a context of $L$ tokens. Softmax attention's state is the
# KV cache: $2\,L\,d$ numbers per layer, and each new token attends over all $L$ of them, so both
# memory and time grow linearly with $L$. A recurrent layer's state is $H\cdot K\cdot V$ numbers,
# whatever $L$ is. We prefill $L$ tokens, then time one decode call of the whole model
# (`linattn.bench.timeit`, the median of several) and read the size of the states it carries.

# %%
Ls = pick(cpu=[64, 256, 1024, 4096], gpu=[256, 1024, 4096, 16384])
B = pick(cpu=1, gpu=4)
mem, ms = {n: [] for n in models}, {n: [] for n in models}
for L in Ls:
    ctx = torch.randint(0, VOCAB, (B, L), device=DEVICE)
    nxt = torch.randint(0, VOCAB, (B, 1), device=DEVICE)
    for name, model in models.items():
        with torch.no_grad():
            _, states = model(ctx)                                    # prefill L tokens
            ms[name].append(bench.fastest_ms(lambda: model(nxt, states), runs=pick(cpu=30, gpu=50)))
        mem[name].append(sum(s.nbytes() for s in states) / 2**20)
for name in models:
    print(f"{name:8s} " + "  ".join(f"L={L}: {m:7.2f} MiB {t:7.2f} ms" for L, m, t in zip(Ls, mem[name], ms[name])))

fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
style = {"softmax": dict(marker="o"), "gla": dict(marker="s"), "kda": dict(marker="x", ls="--")}
for name in models:
    a1.plot(Ls, mem[name], label=name + (" (same size as gla)" if name == "kda" else ""), **style[name])
    a2.plot(Ls, ms[name], label=name, **style[name])
for a in (a1, a2):
    a.set_xscale("log", base=2); a.set_xlabel("context length L (tokens already read)"); a.legend()
a1.set_yscale("log"); a1.set_ylabel("state carried (MiB, all layers, batch of %d)" % B)
a1.set_title("memory per sequence")
a2.set_ylabel("ms per generated token (whole model, fastest run)"); a2.set_ylim(bottom=0)
a2.set_title(f"time per token, {linattn.device.describe().split(' · ')[0]}")
plt.tight_layout(); plt.show()

# %% [markdown]
# The left panel is exact arithmetic: the KV cache grows linearly and passes the fixed recurrent
# state at a context of $L = H K V / (2d)$ tokens ($H K V = d^2 / H$ for square heads, so $L = d/(2H)$:
# 16 tokens for the CPU-sized model, 32 for the GPU-sized one); at the longest context above it is
# already hundreds of times larger. The right panel is a measurement on the
# reader's device. On a CPU with a small model the per-token time is dominated by fixed costs
# (Python, a dozen small operations per layer) until the softmax model's cache is long enough for
# its $O(L)$ attention to show; on a GPU the same holds for small $L$ (a decode step is a few tiny
# kernel launches) and the softmax curve rises once reading the cache costs more than the launches.
#
# ## 5. What breaks if…
#
# **…the state is carried in low precision.** The decode step keeps $S$ in float32 whatever the
# model's dtype (the kernels' rule, chapter 03): a bfloat16 state rounds every update to 8
# significant bits, and a long generation accumulates those roundings. Carry the same KDA
# recurrence with the state rounded to bfloat16 after each step:

# %%
args = testing.make_inputs("kda", B=1, T=pick(cpu=300, gpu=2000), H=2, K=32, V=32, seed=3)
o_ref, _ = naive.kda(**testing.to_float64(args))
errs = {}
for state_dtype in (torch.float32, torch.bfloat16):
    S, outs = None, []
    for t in range(args["q"].shape[1]):
        o, S = naive.kda_step(args["q"][:, t], args["k"][:, t], args["v"][:, t], args["g"][:, t],
                              args["beta"][:, t], S)
        S = S.to(state_dtype)
        outs.append(o)
    errs[state_dtype] = testing.rel_err(torch.stack(outs, 1), o_ref)
    print(f"state kept in {state_dtype}: relative error of the outputs {errs[state_dtype]:.1e}")
assert errs[torch.bfloat16] > 100 * errs[torch.float32]

# %% [markdown]
# ## Summary
#
# * Prefill runs the chunkwise kernel over the prompt and returns the state; decoding runs one step
#   per token from it. Both are the same recurrence, so the output equals the whole-sequence one
#   (checked above with greedy generation).
# * The decode step is memory-bound; the fused Triton step reads and writes each block of $S$ once
#   and is split over value columns, which the delta-rule correction allows because it acts on each
#   column separately.
# * A recurrent layer carries $H\cdot K\cdot V$ numbers per sequence at any length; softmax
#   attention carries $2Ld$ per layer and reads them all for every token.
#
# **Workbook:** `exercises/14_layers.py` has the decode loop as an exercise (prefill, then steps,
# must equal the whole sequence).
