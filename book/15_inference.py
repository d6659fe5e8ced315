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
# the whole sequence would and write the decode step as one fused Triton kernel; then serve as a
# server does — a batch of prompts of different lengths, sampling with a temperature and top-k,
# a long prompt read in pieces — checking each against the simpler computation it must equal;
# and measure memory and time per generated token against softmax attention, whose KV cache grows
# with every token, down to one decode step against the memory-bandwidth floor.

# %%
from dataclasses import replace

import matplotlib.pyplot as plt
import torch

import linattn
from linattn import bench, mqar, naive, testing
from linattn.device import pick
from linattn.nn import generate
from linattn.nn.conv import ShortConv
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
# `linattn.naive.step` on a CPU). The models are built like those chapter 14 trains
# (`linattn.mqar.RecallModel`: an embedding, residual blocks around the mixer, a read-out), with
# GLA, KDA and softmax attention as the mixer, and left untrained, since only the cost and the
# equality of the two paths matter here. Chapter 14 trains one block on a CPU and two on a GPU;
# here both sizes build two blocks, so that one layer's input is another layer's output, and the
# width and number of heads follow the device (the cell prints them). The check: the greedy tokens
# are exactly those the model predicts when it re-reads the whole generated sequence at once.

# %%
VOCAB, D, HEADS, BLOCKS = 256, pick(cpu=64, gpu=256), pick(cpu=2, gpu=4), 2
print(f"models: d_model = {D}, {HEADS} heads, {BLOCKS} blocks, vocabulary {VOCAB}")
models = {name: mqar.RecallModel(name, VOCAB, d_model=D, n_heads=HEADS, layers=BLOCKS).to(DEVICE).eval()
          for name in ("softmax", "gla", "kda")}
P = 37                                                              # prompt length
prompt = torch.randint(0, VOCAB, (1, P), device=DEVICE)
for name, model in models.items():
    seq, states = generate(model, prompt, 20)
    with torch.no_grad():
        logits, _ = model(seq)
    same = torch.equal(seq[:, P:], logits[:, P - 1:-1].argmax(-1))
    print(f"{name:8s} generated {seq[0, P:].tolist()[:8]}…  state {sum(s.nbytes() for s in states):7d} bytes;"
          f" equals re-reading the whole sequence: {same}")
    assert same

# %% [markdown]
# ## 4. A batch of prompts of different lengths
#
# A server decodes many sequences at once: the step of section 2 takes a batch of states, one row
# per sequence. The prompts, though, come in different lengths, and the prefill must leave each row
# in the state its own prompt leads to.
#
# The obvious way to prefill them together is to pad every prompt on the right to the longest, $T$,
# and run the batch in one call. Causality keeps each prompt's outputs right — the padding comes
# after every real token — but the final state is wrong: the recurrence runs on over the padding,
# decaying $S$ and writing the padding's keys and values into it. Decoding would start from a state
# that has read tokens the prompt never had. At the level of the operation (KDA, three prompts):

# %%
lens = [pick(cpu=23, gpu=300), pick(cpu=40, gpu=517), pick(cpu=9, gpu=64)]
T = max(lens)
padded = testing.make_inputs("kda", B=len(lens), T=T, H=2, K=32, V=32, seed=4, device=DEVICE)
alone = [linattn.kda(**{n: a[i:i + 1, :L] for n, a in padded.items()}, output_final_state=True)
         for i, L in enumerate(lens)]                                # each prompt on its own


def row_errors(o, S):
    """Per prompt: (error of its outputs, error of its final state) against the prompt alone."""
    return [(testing.rel_err(o[i:i + 1, :L], alone[i][0]), testing.rel_err(S[i:i + 1], alone[i][1]))
            for i, L in enumerate(lens)]


o_pad, S_pad = linattn.kda(**padded, output_final_state=True)
for L, (eo, eS) in zip(lens, row_errors(o_pad, S_pad)):
    print(f"prompt of {L:3d} tokens padded to {T}: outputs {eo:.1e}, final state {eS:.1e}")
    assert eo < testing.tolerance(torch.float32)                    # causality: outputs are fine
    assert (eS > 0.1) if L < T else (eS < testing.tolerance(torch.float32))  # the state is not

# %% [markdown]
# The fix makes a padded token a no-op of the recurrence. A token leaves $S$ unchanged when its
# decay is $e^{0} = 1$ and it writes nothing: $g_t = 0$, and $k_t = 0$ (linear attention, GLA) or
# $\beta_t = 0$ (the delta rule, whose write $\beta_t k_t^\top(v_t - k_t S)$ then vanishes). So
# multiply $g$, $k$ and $\beta$ by a mask that is 1 on a row's real tokens and 0 on its padding
# (workbook 15's `ch15.padded_prefill` asks for this, and names the masks that miss a term):

# %%
real = (torch.arange(T, device=DEVICE)[None, :] < torch.tensor(lens, device=DEVICE)[:, None]).float()
masked = dict(padded, k=padded["k"] * real[..., None, None], g=padded["g"] * real[..., None, None],
              beta=padded["beta"] * real[..., None])                 # [B, T] mask over [B, T, H(, K)]
o_fix, S_fix = linattn.kda(**masked, output_final_state=True)
for L, (eo, eS) in zip(lens, row_errors(o_fix, S_fix)):
    print(f"prompt of {L:3d} tokens, padding masked: outputs {eo:.1e}, final state {eS:.1e}")
    assert max(eo, eS) < testing.tolerance(torch.float32)

# %% [markdown]
# The short convolution needs the same care. Its cache must hold the last $w-1$ *real* inputs of
# each row, not the last $w-1$ positions of the padded batch. With the $w-1$ zeros a sequence
# starts from placed in front of the row's inputs $u_b$, the last $w-1$ inputs before position
# $L_b$ are positions $L_b, \dots, L_b + w - 2$ of $[0, u_b]$:

# %%
conv = ShortConv(24, width=4).to(DEVICE)
u = torch.randn(len(lens), T, 24, device=DEVICE)
with torch.no_grad():
    _, cache_pad = conv(u)
    front = torch.cat([u.new_zeros(len(lens), conv.width - 1, 24), u], dim=1)
    cache_fix = torch.stack([front[i, L:L + conv.width - 1] for i, L in enumerate(lens)])
    for i, L in enumerate(lens):
        _, cache_alone = conv(u[i:i + 1, :L])
        print(f"prompt of {L:3d} tokens: cache of the padded batch equals its own: "
              f"{torch.equal(cache_pad[i], cache_alone[0])}; per-row cache: {torch.equal(cache_fix[i], cache_alone[0])}")
        assert torch.equal(cache_fix[i], cache_alone[0])

# %% [markdown]
# The layers of `linattn.nn` take no per-row lengths, so for whole models the other way is the
# simple one, and exact: prefill each prompt alone, then stack the states row by row — a recurrent
# layer's state is $[1, H, K, V]$ and its convolution cache $[1, w-1, C]$ whatever the prompt's
# length — and decode the batch together. The check: every row of the batch generates the tokens
# it generates alone, with the same logits.


# %%
def stack_states(per_prompt):
    """One LayerState per layer for the batch, from one list of LayerStates per prompt."""
    # `seen` differs between the rows; the recurrent layers never read it (softmax attention does,
    # to place its causal mask: its caches have a length axis and cannot be stacked like this).
    return [replace(layer[0], memory=torch.cat([s.memory for s in layer]),
                    conv=torch.cat([s.conv for s in layer]), seen=max(s.seen for s in layer))
            for layer in zip(*per_prompt)]


@torch.no_grad()
def greedy_batch(model, prompts, n):
    """Greedy tokens [B, n] and their logits [B, n, vocab]: prompts prefilled alone, decoded together."""
    firsts, states = zip(*(model(p[None]) for p in prompts))
    logits, states = torch.cat([f[:, -1:] for f in firsts]), stack_states(states)
    toks, lgs = [], []
    for _ in range(n):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt); lgs.append(logits[:, -1])
        logits, states = model(nxt, states)
    return torch.cat(toks, 1), torch.stack(lgs, 1)


prompts = [torch.randint(0, VOCAB, (L,), device=DEVICE) for L in lens]
for name in ("gla", "kda"):
    toks, lgs = greedy_batch(models[name], prompts, 12)
    for i, p in enumerate(prompts):
        tok1, lg1 = greedy_batch(models[name], [p], 12)
        print(f"{name} prompt of {len(p):3d} tokens: same tokens as alone {torch.equal(toks[i], tok1[0])}, "
              f"logits {testing.rel_err(lgs[i], lg1[0]):.1e}")
        assert torch.equal(toks[i], tok1[0]) and testing.rel_err(lgs[i], lg1[0]) < testing.tolerance(torch.float32)

# %% [markdown]
# Softmax attention cannot be batched this way: its cache has a length axis, so prompts of
# different lengths leave caches of different shapes. Padding them needs an attention mask per row
# that hides the padded keys, in the prefill and in every decode step after it. A state of one
# size for every prompt is what makes a batch of unequal prompts simple for a recurrent model.
#
# ## 5. Sampling: temperature and top-k
#
# Greedy decoding repeats itself; language models are usually sampled. From the logits $z$ of the
# last position, draw the next token $i$ with probability $p_i \propto e^{z_i/\theta}$: the
# temperature $\theta$ sharpens the distribution below 1 and flattens it above. *Top-k* keeps only
# the $k$ largest logits (the others get probability 0). A seeded `torch.Generator` makes the draws
# reproducible. As $\theta \to 0$ all the probability goes to the largest logit: greedy decoding is
# sampling at temperature 0, and top-$k$ with $k = 1$ is greedy at any temperature. (Workbook 15's
# `ch15.next_token_probs` asks for the distribution $p$.)


# %%
def sample(logits, temperature=1.0, top_k=None, generator=None):
    """One token per row of logits [B, vocab] → [B, 1]: argmax at temperature 0, else a draw from
    softmax(logits / temperature) over the top_k largest logits (all of them when top_k is None)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    z = logits.float() / temperature
    if top_k is not None:
        kth = z.topk(top_k, dim=-1).values[..., -1:]                # the k-th largest per row
        z = z.masked_fill(z < kth, float("-inf"))
    return torch.multinomial(z.softmax(-1), 1, generator=generator)


@torch.no_grad()
def generate_sampled(model, prompt, n, *, seed=0, **how):
    """The prompt followed by n sampled tokens: generate()'s loop with `sample` choosing."""
    gen = torch.Generator(device=prompt.device).manual_seed(seed)
    logits, states = model(prompt)
    out = [prompt]
    for _ in range(n):
        out.append(sample(logits[:, -1], generator=gen, **how))
        logits, states = model(out[-1], states)
    return torch.cat(out, dim=1)


# %% [markdown]
# First the sampler against the distribution it should draw from: many draws from one row of logits,
# their frequencies beside $p$.

# %%
model = models["gla"]
with torch.no_grad():
    z = model(prompt)[0][0, -1]                                      # the logits after the prompt
theta, k, N = 0.7, 8, 20000
gen = torch.Generator(device=DEVICE).manual_seed(0)
draws = sample(z.expand(N, -1), theta, k, gen)[:, 0]
freq = torch.bincount(draws, minlength=VOCAB).double() / N
p = torch.zeros(VOCAB, dtype=torch.float64, device=DEVICE)
top = z.topk(k)
p[top.indices] = (top.values.double() / theta).softmax(-1)
print(f"top-{k} at temperature {theta}: {N} draws, tokens outside the top {k}: {(p[draws] == 0).sum().item()},"
      f" largest |frequency − p| {(freq - p).abs().max():.4f}")
assert (p[draws] > 0).all() and (freq - p).abs().max() < 0.02      # ~6 standard errors at this N

# %% [markdown]
# Then whole generations: the same seed gives the same tokens, another seed other tokens;
# temperature 0 and top-1 give the greedy tokens of `linattn.nn.generate`. Below which temperature
# does sampling become greedy? When the largest logit leads the next by a gap $\Delta$, every other
# token has probability at most $e^{-\Delta/\theta}$ of the winner's, so $\theta$ must be small
# against the smallest gap met along the way. The cell measures that gap on the greedy path and
# samples at a fiftieth of it.

# %%
n = 20
greedy, _ = generate(model, prompt, n)
with torch.no_grad():
    top2 = model(greedy)[0][0, P - 1:-1].topk(2, dim=-1).values     # the two largest logits per step
gap = (top2[:, 0] - top2[:, 1]).min().item()
print(f"smallest gap between the two largest logits along the greedy path: {gap:.2e}")
for theta in (1.0, 0.3, 0.1, 0.03, 0.01):
    print(f"  temperature {theta:<5}: probability of the greedy token at the first step "
          f"{(z / theta).softmax(-1).max().item():.3f}")
runs = {"seed 0": generate_sampled(model, prompt, n, seed=0),
        "seed 0 again": generate_sampled(model, prompt, n, seed=0),
        "seed 1": generate_sampled(model, prompt, n, seed=1),
        "temperature 0": generate_sampled(model, prompt, n, temperature=0),
        "top-1": generate_sampled(model, prompt, n, top_k=1),
        "temperature gap/50": generate_sampled(model, prompt, n, temperature=gap / 50)}
for name, seq in runs.items():
    print(f"{name:19s} {seq[0, P:].tolist()[:10]}…  greedy: {torch.equal(seq, greedy)}")
assert torch.equal(runs["seed 0"], runs["seed 0 again"]) and not torch.equal(runs["seed 0"], runs["seed 1"])
assert all(torch.equal(runs[r], greedy) for r in ("temperature 0", "top-1", "temperature gap/50"))

# %% [markdown]
# ## 6. Chunked prefill
#
# A long prompt need not be read in one call. A server reads it in pieces — to bound the memory of
# one call, or to let other sequences' decode steps run between the pieces — and each piece starts
# from what the previous one left: the recurrent state and the short convolution's cache (for
# softmax attention, the KV cache). It is the same recurrence cut at other places, so the logits
# and the final states must equal those of one pass. The pieces below are not a multiple of the
# chunk size, so the cuts fall inside the kernel's chunks:

# %%
long = torch.randint(0, VOCAB, (2, pick(cpu=150, gpu=4000)), device=DEVICE)
PIECE = pick(cpu=40, gpu=1000)


@torch.no_grad()
def prefill_in_pieces(model, tokens, piece, carry=lambda s: s):
    """Logits of `tokens` read `piece` tokens per call, each call from the states `carry` makes of
    the previous call's (all of them, unchanged, by default); and the final states."""
    states, logits = None, []
    for a in range(0, tokens.shape[1], piece):
        lg, states = model(tokens[:, a:a + piece], states and [carry(s) for s in states])
        logits.append(lg)
    return torch.cat(logits, 1), states


def state_error(a, b):
    """Largest relative error over the layers' states: memory (KV cache for softmax) and conv cache."""
    return max(max(testing.rel_err(x.memory, y.memory), testing.rel_err(x.conv, y.conv)) for x, y in zip(a, b))


for name, model in models.items():
    with torch.no_grad():
        whole, whole_states = model(long)
    pieces, piece_states = prefill_in_pieces(model, long, PIECE)
    e_logits, e_state = testing.rel_err(pieces, whole), state_error(piece_states, whole_states)
    print(f"{name:8s} {long.shape[1]} tokens in pieces of {PIECE} vs one pass: logits {e_logits:.1e}, "
          f"states {e_state:.1e}")
    assert max(e_logits, e_state) < testing.tolerance(torch.float32)

# %% [markdown]
# **What breaks if the convolution's cache is not carried.** Carry only the recurrent state, and
# every piece starts its convolution from zeros, as if the sequence began there: the first $w-1$
# tokens of each piece mix with zeros instead of their predecessors, and their keys and values —
# written into the state — are wrong from then on:

# %%
for name in ("gla", "kda"):
    with torch.no_grad():
        whole, _ = models[name](long)
    broken, _ = prefill_in_pieces(models[name], long, PIECE, carry=lambda s: replace(s, conv=None))
    print(f"{name}: pieces without the convolution cache vs one pass: logits {testing.rel_err(broken, whole):.1e}")
    assert testing.rel_err(broken, whole) > 100 * testing.tolerance(torch.float32)

# %% [markdown]
# ## 7. Memory and time per generated token
#
# Now the price of one more token after a context of $L$ tokens. Softmax attention's state is the
# KV cache: $2\,L\,d$ numbers per layer, and each new token attends over all $L$ of them, so both
# memory and time grow linearly with $L$. A recurrent layer's state is $H\cdot K\cdot V$ numbers,
# whatever $L$ is. We prefill $L$ tokens, then time one decode call of the whole model
# (`linattn.bench.fastest_ms`: the fastest of several runs, since interference from other work on
# the machine only ever adds time) and read the size of the states it carries.

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

mixer = models["gla"].blocks[0].mixer
cross = mixer.state_size() / (2 * D)                                 # H K V = 2 L d
assert mixer.state_size() == D * D // HEADS                          # square heads: H (d/H)² = d²/H
print(f"KV cache = recurrent state at L = H·K·V / (2d) = d / (2H) = {cross:g} tokens; at L = {Ls[-1]} "
      f"softmax carries {mem['softmax'][-1] / mem['gla'][-1]:.0f}× the memory of GLA")

# %% [markdown]
# The left panel is exact arithmetic: the KV cache grows linearly and passes the fixed recurrent
# state at a context of $L = H K V / (2d)$ tokens ($H K V = d^2 / H$ for square heads, so
# $L = d/(2H)$; the cell prints it for this model, and how far apart the two are at the longest
# context). The right panel is a measurement on the reader's device. On a CPU with a small model the
# per-token time is dominated by fixed costs (Python, a dozen small operations per layer) until the
# softmax model's cache is long enough for its $O(L)$ attention to show; on a GPU the same holds for
# small $L$ (a decode step is a few tiny kernel launches) and the softmax curve rises once reading
# the cache costs more than the launches.
#
# ## 8. One decode step against the bandwidth floor
#
# A decode step is memory-bound, so the question to ask of it is how close it comes to the time
# its bytes take at the memory's bandwidth. Per step and layer, a recurrent layer must read $S$ and
# write it back — $2\cdot B H K V$ float32 numbers, at every $L$ — and softmax attention must read
# its whole cache, $2\cdot B H L D$ numbers in the model's dtype. `linattn.bench_decode` times one
# step of the memory alone (no projections) for a batch of sequences: the fused Triton step, the
# unfused step (`linattn.naive.step`, one PyTorch operation per stage, each a pass over $S$) and
# softmax attention over a preallocated KV cache, beside the floor bytes ÷ bandwidth, with the
# bandwidth measured as a copy on the same device. The chapter runs it live at the size
# `linattn.device` chooses (small heads in float32 on a CPU; on a GPU the heads of the book's
# benchmark setting, in bf16); the first line of its report names the setting and the device, date
# and versions that produced the numbers. On a CPU the fused step runs in Triton's interpreter,
# where a time would measure Python: it is checked against the unfused step but not timed.

# %%
from linattn import bench_decode

run = bench_decode.measure(progress=lambda _: None)
print(bench_decode.report(run))

# %%
def plot_decode(run):
    """The report's times per decode step against L, with the floors, and the share of the floor."""
    Lr, t, fl, by = run["L"], run["ms"], run["floor_ms"], run["bytes"]
    flat = lambda x: [x] * len(Lr)                                   # noqa: E731  the same at every L
    series = {"unfused step (naive)": (flat(t["unfused"]), flat(fl["recurrent"]), "C0"),
              "softmax, KV cache": (t["softmax"], fl["softmax"], "C3")}
    if t["fused"] is not None:
        series["fused Triton step"] = (flat(t["fused"]), flat(fl["recurrent"]), "C2")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, (ys, floor, c) in series.items():
        a1.plot(Lr, ys, marker="o", color=c, label=label)
        a2.plot(Lr, [f / y for f, y in zip(floor, ys)], marker="o", color=c, label=label)
    a1.plot(Lr, flat(fl["recurrent"]), ls=":", color="k", label="floor: S read + written")
    a1.plot(Lr, fl["softmax"], ls="--", color="C3", label="floor: KV cache read")
    a1.set_ylabel("ms per decode step (one layer's memory)"); a1.set_yscale("log")
    a1.set_title(f"{run['setting']['op']}, B = {run['setting']['B']}, H = {run['setting']['H']}, "
                 f"K = V = {run['setting']['K']} · {run['env']['device']}, {run['env']['date']}")
    a2.set_ylabel("floor ÷ measured time"); a2.set_yscale("log")
    a2.set_title("share of the bandwidth floor reached")
    for a in (a1, a2):
        a.set_xscale("log", base=2); a.set_xlabel("context length L (tokens already read)")
    fig.legend(*a1.get_legend_handles_labels(), loc="lower center", ncol=5, fontsize=8)  # below the data
    plt.tight_layout(rect=(0, 0.07, 1, 1)); plt.show()
    # The arithmetic the text states: the recurrent step's bytes stay put, the cache's grow with L.
    assert by["softmax"] == sorted(by["softmax"]) and by["softmax"][-1] > by["recurrent"]
    print(f"the softmax step reads more than the recurrent step moves from L ≈ "
          f"{by['recurrent'] / (by['softmax'][-1] / Lr[-1]):.0f} tokens on")


plot_decode(run)

# %% [markdown]
# On a CPU the fused kernel cannot be timed, so the chapter also shows a run of the same tool on a
# GPU when one has been recorded (`book/data/decode_gpu.json`, written by
# `python tools/bench_decode.py --size full --out book/data/decode_gpu.json`), with the device,
# date and versions that produced it.

# %%
recorded = bench.recorded_run("decode_gpu.json")
if DEVICE == "cpu":
    if recorded:
        print("recorded GPU run:\n" + bench_decode.report(recorded))
        share = recorded["floor_ms"]["recurrent"] / recorded["ms"]["fused"]
        print(f"fused step: {recorded['ms']['fused']:.3f} ms against a floor of "
              f"{recorded['floor_ms']['recurrent']:.4f} ms, {share:.0%} of the bandwidth")
        plot_decode(recorded)
    else:
        print("No GPU run recorded yet: on a GPU, `python tools/bench_decode.py --size full "
              "--out book/data/decode_gpu.json` records one.")

# %% [markdown]
# Read the figure by its floors. The recurrent floor is flat: a step costs the same at any context.
# The softmax floor rises with $L$ and crosses it at the context the cell prints (a cache row per
# token against a fixed $S$ in float32). How close a step comes to its floor is its efficiency:
# the unfused step moves $S$ once per stage and pays a launch (on a CPU, Python's dispatch) per
# operation, so at small sizes it sits far above its floor; the fused step moves $S$ once each way
# in one launch. At the GPU size a step moves megabytes, and the right panel shows what share of
# the bandwidth each reaches. Megabytes are still little for a GPU: in the recorded run the fused
# step stays a small fraction of its floor (the line it prints), because its 16 MiB ($S$ read and
# written back) move in a few microseconds and a launch and its memory latency cost more. Its time
# is flat in $L$ all the same, so the KV cache overtakes it after a few thousand tokens. In that run
# the cache's step at the longest context even comes out a little faster than its floor: the floor's
# bandwidth is a copy's, which reads and writes, and a step that only reads can go slightly faster.
# On a CPU the small problem stays in the processor's caches from one run to the next, so a step
# there can beat the floor by more, the floor being measured with a copy too large for them: the
# floors are drawn for main memory.
#
# ## 9. What breaks if…
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
# The other breakages of this chapter were shown where they arise: right padding without a mask
# (section 4: the outputs are right, the state is not) and a prefill in pieces that drops the
# convolution's cache (section 6).
#
# ## Summary
#
# * Prefill runs the chunkwise kernel over the prompt and returns the state; decoding runs one step
#   per token from it. Both are the same recurrence, so the output equals the whole-sequence one
#   (checked above with greedy generation).
# * A batch of prompts of different lengths: right padding corrupts the state unless padded tokens
#   neither decay nor write ($g = 0$, $k = 0$ or $\beta = 0$) and the convolution cache is taken
#   at each row's length; or prefill each prompt alone and stack the fixed-size states.
# * Sampling draws from $\mathrm{softmax}(z/\theta)$ over the top $k$ logits with a seeded generator;
#   temperature 0 (and top-1) is greedy decoding.
# * Chunked prefill carries the state and the convolution cache from piece to piece and equals one
#   pass.
# * The decode step is memory-bound; the fused Triton step reads and writes each block of $S$ once
#   and is split over value columns, which the delta-rule correction allows because it acts on each
#   column separately. `tools/bench_decode.py` measures it against the unfused step, softmax
#   attention with a KV cache and the bandwidth floor.
# * A recurrent layer carries $H\cdot K\cdot V$ numbers per sequence at any length; softmax
#   attention carries $2Ld$ per layer and reads them all for every token.
#
# **Workbook:** `exercises/15_inference.py` — prefill a right-padded batch of prompts into each
# prompt's own state in one call (`ch15.padded_prefill`, graded against every prompt run alone) and
# the distribution of temperature and top-k sampling (`ch15.next_token_probs`); each grader names
# the usual mistakes (padding left unmasked, the decay or the write left on, the mask off by one;
# the temperature multiplied, top-k not renormalised or one too wide). Decoding itself is the last
# exercise of `exercises/14_layers.py` (`ch14.decode`): one step of the layer that carries both the
# recurrent state and the short convolution's cache, run token by token, graded against the
# whole-sequence layer.
