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
# # 10 — GLA in Triton
#
# **Goal.** Chapter 05 built the chunkwise GLA forward with secondary chunking in PyTorch; chapter
# 09 wrote a first Triton kernel. Here the two meet: the GLA forward as Triton kernels, with
#
# * the intra-chunk matrix built from $c\times c$ tiles — off-diagonal tiles as tensor-core
#   matmuls after absorbing the decay, diagonal tiles in float32 by a multiplicative row walk —
#   and, where the gates allow, as one product on chip (the split; §3b measures how often real
#   gates allow it);
# * a design choice made twice and measured: walk the chunks in **one fused pass** with the
#   state on chip, or **materialise the chunk states** first and compute every chunk in parallel;
# * the two shapes of the GLA paper's Figure 2: time against sequence length next to softmax
#   attention, and intra- against inter-chunk time as the chunk size grows.
#
# On a CPU the kernels run in the Triton interpreter at small sizes and the timings come from a
# recorded GPU run (`book/data/`); on a GPU the same cells run natively and time live.

# %%
import textwrap

import matplotlib.pyplot as plt
import torch

import linattn  # first: without a GPU it switches Triton to its interpreter
from linattn import bench, decay, naive, testing
from linattn.chunk import gated as cgated
from linattn.device import pick
from linattn.triton import gated
from linattn.validate import check_inputs

print(linattn.device.describe())
DEV = linattn.device.default_device()
MEASURED = bench.recorded_run("10_gla_triton.json")   # this chapter's recorded GPU measurements


def measured(key):
    """Print one recorded measurement of this chapter with its device, date, versions and setting."""
    if not MEASURED:
        return print("No recorded measurements next to this notebook (book/data/10_gla_triton.json comes "
                     "with a clone of the repository).")
    m = MEASURED["measured"][key]
    print(f"{m['what']}\n  [{bench.run_label({**MEASURED['env'], 'date': m['date']})}; {m['setting']}]")
    for name, v in m["values"].items():
        print(f"  {name}: " + (" / ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else f"{v:.3f}"))
    for name, counts in m.get("sass", {}).items():
        print(f"  compiled for sm_90, per loop step, {name}: " + ", ".join(f"{c} {what}" for what, c in counts.items()))

# %% [markdown]
# ## 1. The chunk form, and who computes what
#
# State $S\in\mathbb R^{K\times V}$, $S_t = \mathrm{diag}(e^{g_t})S_{t-1} + k_t^\top v_t$,
# $o_t = \text{scale}\cdot q_t S_t$, log-gates $g_t \le 0$ per key dimension ($[B,T,H,K]$, GLA) or
# per head ($[B,T,H]$). For the chunk starting at $t_0$, let $b_t = g_{t_0}+\dots+g_t$ (float32,
# restarting every chunk; the $C\times K$ matrix $G$ stacks these rows, as in chapter 04) and $S$ the
# state entering the chunk. Then (chapter 04, with $P$ its intra-chunk matrix)
#
# $$o_t = \text{scale}\Big((q_t\odot e^{b_t})\,S + \sum_{s\le t}P_{ts}\,v_s\Big),\qquad
#   P_{ts} = \sum_\kappa q_{t\kappa}k_{s\kappa}e^{\,b_{t\kappa}-b_{s\kappa}},$$
#
# $$S_{\text{next}} = \mathrm{diag}(e^{b_C})\,S + \sum_s (k_s\odot e^{\,b_C-b_s})^\top v_s ,$$
#
# with $b_C$ the sum over the whole chunk.
#
# Every exponent is $b$ itself or a difference $b_t-b_s$ with $t\ge s$: all factors are $\le 1$.
# The library splits the work into kernels by how much parallelism each part has:
#
# | kernel | grid (programs) | sequential over chunks? | what it computes |
# |---|---|---|---|
# | `_local_cumsum_kernel` | (columns of $H\cdot K$ or $H$, chunk, batch) | no | $b$, float32 (either gate shape) |
# | `_intra_kernel` | (sub-chunk, chunk, batch·head) | no | rows of $P$, $[B,T,H,C]$ float32: secondary chunking (past the split's bound, §3b) |
# | `_states_kernel` | (K-block, V-block, batch·head) | **yes** | the state entering every chunk, $[B,H,N_T,K,V]$ |
# | `_output_kernel` | (V-block, chunk, batch·head) | no | $o = (Q\odot e^{b})S + PV$ per chunk ($P$ itself within the bound) |
# | `_fused_kernel` | (V-block, batch·head) | **yes** | output and state step together, state in registers |
#
# `mode="states"` runs the first four; `mode="fused"` runs the first two and the fused one. In the
# plain forward the intra kernel fills $P$ only for chunks past the split's bound, and the output
# (or fused) kernel builds $P$ of the others itself; a forward that keeps $P$ for the backward has
# the intra kernel fill all of it. One load, $b$ at the chunk's last token (`gated._split_flag`,
# read by both kernels), decides, so every chunk's $P$ is built exactly once. For
# per-head gates the decay leaves the sum over $\kappa$, so $P = (QK^\top)\odot e^{\,b_t-b_s}$ is one
# matmul inside the output step and the intra kernel is skipped; for linear attention ($g=0$) the
# same kernels run with the gate compiled out and no $b$ at all (chapter 09).
#
# A design that loses: the per-dimension case can also run without $P$ and $b$ in memory, each
# kernel summing its own gates and the output kernel building the secondary-chunking tiles of $P$
# on chip. It saves memory traffic and costs time, most likely because its state pass then scans a
# $[C, 64]$ gate tile with `tl.cumsum` — a scan across warps — in every step of the sequential
# chunk loop, where a states kernel just reads $b$. Saving memory traffic is not always saving
# time: §6 prints that design's recorded time beside the kernels above and beside other ways of
# dropping $b$. The split of §3b does get $P$ on chip, for the chunks whose gates allow it, and at
# lower cost: one tensor-core product per chunk instead of tiles and a row walk, with $b$ still
# summed once.

# %%
B, T, H, K, V = 1, pick(cpu=90, gpu=2000), 2, 32, 48
C, c = pick(cpu=32, gpu=64), 16
args = testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, gate="per_dim", device=DEV,
                           initial_state=True, seed=10)
q, k, v, g, S0 = (args[n] for n in ("q", "k", "v", "g", "initial_state"))
d = check_inputs(q, k, v, g=g, gate=True)
NT = -(-T // C)
print(f"T={T}, C={C}, c={c}: {NT} chunks (the last has {T - (NT - 1) * C} tokens)")
print(f"programs — intra: {C // c * NT * B * H}, states pass: {B * H} × K/V blocks, "
      f"output: {NT * B * H} × V blocks, fused: {B * H} × V blocks")

# %% [markdown]
# ## 2. Cumulative gates
#
# For per-dimension gates the first kernel views $g$ as $[B, T, H\cdot K]$, loads a $[C, 128]$
# tile per program and writes its running sum down the rows (`tl.cumsum`), restarting at every
# chunk: one read of $g$ and one float32 write, and every later kernel reads $b$ for any row it
# needs rather than recomputing a prefix sum. Per-head gates ($C$ numbers per chunk and head) go
# through the same kernel with $g$ viewed as $[B, T, H]$. Scanning them inside the state pass
# instead, in its sequential loop over chunks, puts a reduction across threads — barriers and
# shuffles — on the loop's critical path in every chunk step, and the per-head forward is slower
# at long $T$ (recorded on a GPU; printed next).

# %%
measured("gate_scan")

# %% [markdown]
# Check $b$ against the PyTorch helper of chapter 03:

# %%
b = gated.local_cumsum(g, C)
b_ref = decay.chunk_local_prefix(g.double(), C)
print(f"b: rel err vs float64 {testing.rel_err(b, b_ref):.1e}, max {b.max().item():.3f} (≤ 0)")
assert testing.rel_err(b, b_ref) < testing.tolerance(torch.float32)

# %% [markdown]
# ## 3. The intra-chunk matrix: secondary chunking as a kernel
#
# This kernel builds $P$ for every chunk when the backward needs it, and otherwise only for the
# chunks that §3b cannot split. One program owns the $c$ rows of sub-chunk $i$ of one chunk.
# With $r = ic$ the last position before sub-chunk $i$ (chapter 05's notation: $b_r$ is a row of
# $b$, $b_0 = 0$ for the first sub-chunk), it loads its queries once and absorbs the decay
# relative to $b_r$ ($Q_{[i]}$, $G_{[i]}$: the rows of sub-chunk $i$):
#
# $$\hat Q_{[i]} = Q_{[i]}\odot e^{\,G_{[i]}-b_r}\quad(\le |Q_{[i]}|),\qquad
#   \text{for each } j<i:\ \hat K_{[j]} = K_{[j]}\odot e^{\,b_r-G_{[j]}}\quad(\le |K_{[j]}|),\qquad
#   P_{[i][j]} = \hat Q_{[i]}\hat K_{[j]}^\top .$$
#
# Both operands are cast to the input dtype, so for bf16 inputs each off-diagonal tile is one
# tensor-core `tl.dot` with float32 accumulation.
#
# The diagonal tile $P_{[i][i]}$ has no split point between its queries and keys (chapter 05), so
# it is built in float32, row by row. Computing $e^{\,b_{t\kappa}-b_{s\kappa}}$ afresh for
# every row costs $c\cdot K$ exponentials per row — at the benchmark size about 2000 per token
# per head, a quarter of a millisecond of the GPU's special-function units alone. The kernel
# walks the rows in order instead and keeps the *decayed keys*
# $R_t[s,\kappa] = k_{s\kappa}\,e^{\,b_{t\kappa}-b_{s\kappa}}$ up to date by one multiplication:
#
# $$R_t[s,:] = R_{t-1}[s,:]\odot e^{\,g_t}\ (s<t),\qquad R_t[t,:]=k_t,\qquad R_t[s,:] = 0\ (s>t),$$
#
# $$P_{ts} = \sum_\kappa q_{t\kappa}\,R_t[s,\kappa].$$
#
# One exponential per key dimension per row (of the gate $g_t$ itself, read from $g$), every
# factor $\le 1$ (products that underflow become 0, which is what they are), and entries $s>t$
# are exact zeros, never a masked $\infty$. Row $t$ of $P$ is one contiguous vector, stored
# straight to memory; the next row's query and gate are loaded while this row is computed. And
# since $R_t$ is zero below row $t$, the kernel keeps the key rows in two halves: while
# $t < c/2$ the second half is all zeros and skipped, after that the first half only decays.
#
# Walking the *columns* instead (from the last to the first, with the decay tile
# $E_s[t] = e^{b_t-b_s}$) is the same arithmetic, but a column of $P$ must be pasted into a
# register tile or stored with a stride; compiled for sm_90 that walk waits on barriers and loads
# in every step, and the kernel takes about twice as long (recorded on a GPU; printed next).

# %%
measured("diag_walk")

# %% [markdown]
# Check each chunk's $P$ against chapter 05's PyTorch construction (float32 here, so the tiles
# multiply in float32 in both):

# %%
A = gated.intra_attention(q, k, g, d, C, c)                  # [B, T, H, C]
errs = []
for n in range(NT):
    t0, t1 = n * C, min((n + 1) * C, T)
    L = t1 - t0                                              # the last chunk may be short
    P = cgated.intra_chunk_matrix(q[:, t0:t1].transpose(1, 2).double(), k[:, t0:t1].transpose(1, 2).double(),
                                  g[:, t0:t1].transpose(1, 2).double(),
                                  sub_chunk_size=c if L % c == 0 else L)   # [B, H, L, L], float64
    mine = A[:, t0:t1, :, :L].transpose(1, 2).tril()         # entries above the diagonal are not written
    errs.append(testing.rel_err(mine, P))
print("A per chunk, rel err vs float64:", " ".join(f"{e:.1e}" for e in errs))
assert max(errs) < testing.tolerance(torch.float32)

# %% [markdown]
# The map of one chunk of $P$ (log scale of $|P_{ts}|$): sub-chunk tiles below the diagonal come
# from matmuls, the diagonal tiles from the float32 row walk, and the decay shows as the
# fading away from the diagonal.

# %%
fig, ax = plt.subplots(figsize=(4.6, 4.2))
tile = A[0, :C, 0, :].tril().abs().clamp(min=1e-6).log10().cpu()
im = ax.imshow(tile, cmap="viridis")
for e in range(c, C, c):
    ax.axhline(e - 0.5, color="w", lw=0.8)
    ax.axvline(e - 0.5, color="w", lw=0.8)
ax.set(xlabel="key s in the chunk", ylabel="query t in the chunk", title=f"log10 |A| of chunk 0 (c = {c})")
fig.colorbar(im, ax=ax, shrink=0.8).set_label("log10 |A_ts| (above the diagonal: not used)")
plt.show()

# %% [markdown]
# **What breaks if** the tiles absorb the decay from the *chunk* start instead, $\hat K = K\odot
# e^{-b}$? With strong gates (down to −20 per token, `testing.log_gates(..., "strong")`), $-b$
# passes float32's exponent limit (about 88) after a few tokens. The kernel's factors stay $\le 1$:

# %%
strong = testing.make_inputs("gla", B=1, T=pick(cpu=64, gpu=512), H=1, K=K, V=16, strength="strong",
                             device=DEV, seed=4)
b_strong = decay.chunk_local_prefix(strong["g"], C)
print("min b in a chunk:", f"{b_strong.min().item():.0f}", "· e^{-b} finite everywhere?",
      bool(torch.exp(-b_strong).isfinite().all()))
A_strong = gated.intra_attention(strong["q"], strong["k"], strong["g"],
                                 check_inputs(strong["q"], strong["k"], strong["v"], g=strong["g"], gate=True), C, c)
Ts_ = A_strong.shape[1]
written = (torch.arange(C)[None, :] <= (torch.arange(Ts_) % C)[:, None]).to(DEV)   # [T, C]: s ≤ t in the chunk
finite = A_strong.isfinite().all(dim=2)[0][written].all().item()                     # over heads, then written entries
print("kernel's A finite on every entry it writes:", finite)
assert finite

# %% [markdown]
# ## 3b. The split: $P$ as one product where the gates allow
#
# Secondary chunking exists because the decay sits inside the sum over $\kappa$. Yet each factor
# splits at the chunk start:
#
# $$e^{\,b_{t\kappa}-b_{s\kappa}} = e^{\,b_{t\kappa}}\cdot e^{-b_{s\kappa}}
#   \qquad\Longrightarrow\qquad P = \mathrm{tril}\big((Q\odot e^{G})\,(K\odot e^{-G})^\top\big),$$
#
# one $C\times C$ tensor-core product per chunk — no sub-chunks, no row walk. The first factor is
# $\le 1$; the second is $\ge 1$ and, since $b$ only falls along a chunk ($g\le 0$), at most
# $e^{-b_{C\kappa}}$, the chunk's whole decay in dimension $\kappa$. So the product is safe exactly
# when that decay is bounded. The library's bound is $b_{C\kappa} > -60$ in every key dimension
# (`decay.SPLIT_RANGE`): $e^{60}\approx 10^{26}$, which float32 and bf16 hold (8 exponent bits,
# largest $\approx 3\cdot 10^{38}\approx e^{88}$), with room to spare for $|k|$ and for the entries
# above the diagonal — there $e^{\,b_t-b_s}\ge 1$, up to $e^{60}$: finite, and selected away by
# `tl.where`. fp16 (largest 65504 $\approx e^{11}$) cannot hold the factor, so for fp16 inputs the
# kernels round the split's operands to bf16 instead. Each operand is rounded once, as the
# off-diagonal tiles of §3 are, so every term $q_{t\kappa}k_{s\kappa}e^{\,b_{t\kappa}-b_{s\kappa}}$
# carries the relative error of two roundings whatever the size of its factors; the prefix sum
# adds about $\varepsilon|b|\le 60\,\varepsilon$ to each factor. To pass the bound, the 64 gates
# of a chunk must average below $-60/64 \approx -0.94$ per token in some key dimension; whether
# real gates do depends on how they are parametrised, measured at the end of this section.
#
# Past the bound secondary chunking is still needed. With log-gates down to −20 per token, $b_C$
# reaches about $-640$ at $C = 64$ (down to $-1280$): $e^{-b}$ overflows float32 (and $e^{1280}$
# even float64), while $e^{b}$ underflows to 0, and $0\cdot\infty$ is NaN. One load decides:
# `gated._split_flag` reads $b$ at the chunk's last token, its lowest. In the plain forward
# `_intra_kernel` (`intra_attention(..., skip_split=True)`) fills $P$ only for chunks that fail
# the test — for the others its programs return at once — and the output kernel builds $P$ for
# the chunks that pass, so every chunk's $P$ is built by exactly one of them. The backward reads
# $P$ of every chunk, so a forward that keeps $P$ for it runs `_intra_kernel` on all chunks.
#
# Which chunks split, for the chapter's inputs (normal gates) and the strong ones of §3:

# %%
def chunk_ends(b_, C):
    """b at every chunk's last token, [B, N_T, H, K]: b only falls along a chunk, so its lowest value."""
    last = torch.arange(C, b_.shape[1] + C, C).clamp(max=b_.shape[1]) - 1
    return b_[:, last]


def split_chunks(b_, C):
    """[B, N_T, H]: True where a chunk takes the split (decays by less than e^60 in every key dimension)."""
    return chunk_ends(b_, C).amin(-1) > -decay.SPLIT_RANGE


for name, b_ in (("normal", b), ("strong", b_strong)):
    takes = split_chunks(b_, C)
    print(f"{name} gates: lowest b at a chunk's end {chunk_ends(b_, C).min().item():7.1f} · "
          f"(batch, chunk, head) that split: {int(takes.sum())} of {takes.numel()}")
assert split_chunks(b, C).all() and not split_chunks(b_strong, C).any()

# %% [markdown]
# The product is the same matrix as §3's tiles: per chunk, in float64, against the kernel's
# secondary chunking. **What breaks if** a chunk past the bound is split anyway, in float32 as
# the kernel would: $\infty\cdot 0$ in the product, NaN in $P$.

# %%
errs = []
for n in range(NT):
    t0, t1 = n * C, min((n + 1) * C, T)
    qn, kn, bn = (x[:, t0:t1].transpose(1, 2).double() for x in (q, k, b_ref))   # [B, H, L, K]
    A_split = ((qn * bn.exp()) @ (kn * (-bn).exp()).transpose(-1, -2)).tril()     # one product
    errs.append(testing.rel_err(A[:, t0:t1, :, :t1 - t0].transpose(1, 2).tril(), A_split))
print("split A per chunk vs the kernel's secondary chunking, rel err:", " ".join(f"{e:.1e}" for e in errs))
assert max(errs) <= testing.tolerance(torch.float32)

qs, ks, bs = (x[0, :C, 0].float() for x in (strong["q"], strong["k"], b_strong))    # strong gates, chunk 0
A_bad = ((qs * bs.exp()) @ (ks * (-bs).exp()).T).tril()
print(f"strong gates split anyway: largest e^-b {(-bs).exp().max().item()}, "
      f"NaN entries of A: {int(A_bad.isnan().sum())} of {C * (C + 1) // 2}")
assert A_bad.isnan().any()

# %% [markdown]
# The two kernels share the work without overlap. Give one chunk strong gates, so that it alone
# fails the test, and run under `testing.poisoned()` (every output buffer starts as NaN): the intra
# kernel leaves the rows of the split chunks unwritten, and the output of both modes still matches
# the float64 recurrence — the output step never reads those rows.

# %%
g_mix = g.clone()                                              # chunk 1 strong, the others as they were
g_mix[:, C:2 * C] = testing.log_gates(g_mix[:, C:2 * C].shape, "strong",
                                      generator=torch.Generator().manual_seed(5)).to(DEV)
mix = dict(args, g=g_mix)
takes = split_chunks(gated.local_cumsum(g_mix, C), C)                          # [B, NT, H]
per_token = takes.repeat_interleave(C, dim=1)[:, :T]                           # [B, T, H]
causal = (torch.arange(C)[None, :] <= (torch.arange(T) % C)[:, None]).to(DEV)  # [T, C]: s ≤ t
with testing.poisoned():
    A_mix = gated.intra_attention(q, k, g_mix, d, C, c, skip_split=True)
    o_mix = {mode: linattn.gla(**mix, impl="triton", chunk_size=C, sub_chunk_size=c, mode=mode)[0]
             for mode in ("states", "fused")}
unwritten = A_mix[per_token].isnan().all().item()
written = A_mix[(~per_token)[..., None] & causal[None, :, None, :]].isfinite().all().item()
print("chunk splits (batch 0, head 0):", takes[0, :, 0].tolist())
print(f"rows of split chunks unwritten (NaN): {unwritten} · other chunks' entries s ≤ t written: "
      f"{written}")
o_mix_ref, _ = naive.gla(**testing.to_float64(mix))
for mode, o_ in o_mix.items():
    print(f"{mode:6s} o: rel err vs float64 {testing.rel_err(o_, o_mix_ref):.1e}")
    assert testing.rel_err(o_, o_mix_ref) <= testing.tolerance(torch.float32)
assert unwritten and written and not takes[:, 1].any() and takes[:, torch.arange(NT) != 1].all()

# %% [markdown]
# **How strong are real gates?** The split pays off only if most chunks pass the test, and that
# depends on how a model makes its gates. `tools/gate_strength.py` measured the decay of every
# 64-token chunk, $-b_{C\kappa}$ per head and key dimension (`linattn.gate_stats`), for the gates
# this book tests with and for the parametrisations of real layers, on a CPU:
#
# * the tests' gates: *mild* $\log\sigma(x)/16$ with $x\sim\mathcal N(0,1)$ (the benchmarks'
#   "normal" gates) and *strong* ones down to $-20$ per token;
# * GLA's sigmoid without its temperature, $\log\sigma(x)$, and GLA's layer gate
#   $\log\sigma(xW_1W_2+b)/16$ as `linattn.nn` initialises it ($b = 4$) and with PyTorch's default
#   bias, on inputs $x\sim\mathcal N(0,1)$ of width 2048;
# * Mamba-2's decay (one per head, as in Gated DeltaNet) and KDA's (one per key dimension),
#   $-e^{A_{\log}}\,\mathrm{softplus}(xW + \Delta_{\text{bias}})$ with $e^{A_{\log}}\sim U(1, 16)$
#   and $\Delta_{\text{bias}} = \mathrm{softplus}^{-1}(\Delta)$, $\Delta$ log-uniform in
#   $[10^{-3}, 0.1]$ (Mamba-2's initialisation), and KDA with $\Delta_{\text{bias}} = 0$;
# * the GLA and KDA models chapter 14 trains on a CPU, before and after training, on MQAR
#   sequences laid end to end.
#
# The kernel decides per (chunk, head) by the strongest key dimension, so the figure shows that
# one; the table adds the spread over all dimensions.

# %%
gs = bench.recorded_run("gate_strength.json")
env = gs["env"]
print(f"Recorded on {env['device']} (CPU), {env['date']}, torch {env['torch']}; chunks of "
      f"{gs['chunk_size']} tokens, bound e^{decay.SPLIT_RANGE:.0f}")
GS_ROWS = {"mild": "mild: logσ(x)/16", "strong": "strong: −20·U(0,1)", "gla_raw": "GLA gate without τ: logσ(x)",
           "gla_init": "GLA layer, initialised (b = 4)", "gla_init_b0": "GLA layer, default bias",
           "ch14_gla": "GLA, trained (chapter 14)", "mamba2_init": "Mamba-2, initialised",
           "kda_init": "KDA, initialised", "kda_init_dt0": "KDA, initialised, Δ_bias = 0",
           "ch14_kda": "KDA, trained (chapter 14)"}
print(f"{'gates':31s} {'−b_C per dimension: p50':>24s} {'p99':>7s} {'max':>7s}   "
      f"{'strongest dim p50':>17s} {'(chunk, head) past e^60':>24s}")
for key, label in GS_ROWS.items():
    r = gs["distributions"][key]
    print(f"{label:31s} {r['percentiles']['50']:24.2f} {r['percentiles']['99']:7.1f} {r['max']:7.1f}   "
          f"{r['strongest_dim_percentiles']['50']:17.2f} {r['frac_chunks_past_bound']:24.1%}")

fig, ax = plt.subplots(figsize=(8, 4.2))
for y, (key, label) in enumerate(reversed(GS_ROWS.items())):
    p = gs["distributions"][key]["strongest_dim_percentiles"]
    ax.plot([p["1"], p["99"]], [y, y], color="C0", lw=1.5)
    ax.plot([p["5"], p["95"]], [y, y], color="C0", lw=5, solid_capstyle="butt")
    ax.plot(p["50"], y, "o", color="w", mec="C0", ms=6)
ax.axvline(decay.SPLIT_RANGE, color="C3", ls="--", label="split bound: −b_C = 60")
ax.set_xscale("log")
ticks = [0.01, 0.1, 1, 10, 60, 1000]
ax.set_xticks(ticks, [str(t) for t in ticks]); ax.xaxis.set_minor_locator(plt.NullLocator())
ax.set_yticks(range(len(GS_ROWS)), list(reversed(GS_ROWS.values())), fontsize=8)
ax.set_xlabel("decay of a 64-token chunk in its strongest key dimension, −b_C (nats, log scale)")
ax.set_title("Chunk decay per (chunk, head): 1–99 % (thin), 5–95 % (thick), median (dot)", fontsize=9)
ax.legend(loc="upper left", fontsize=8); plt.tight_layout(); plt.show()

# %%
dist = gs["distributions"]
gla_keys = ("mild", "gla_init", "gla_init_b0", "ch14_gla")
print("past the bound, GLA's τ = 16 gates (mild, layer initialised, trained):",
      ", ".join(f"{dist[k]['frac_chunks_past_bound']:.0%}" for k in gla_keys))
print(f"past the bound: GLA's sigmoid without τ {dist['gla_raw']['frac_chunks_past_bound']:.0%}, "
      f"Mamba-2 initialised {dist['mamba2_init']['frac_chunks_past_bound']:.1%}, "
      f"KDA initialised {dist['kda_init']['frac_chunks_past_bound']:.0%} "
      f"(with Δ_bias = 0: {dist['kda_init_dt0']['frac_chunks_past_bound']:.0%})")
print(f"KDA trained in chapter 14: strongest chunk decays by {dist['ch14_kda']['max']:.0f} "
      f"(bound {decay.SPLIT_RANGE:.0f}), {dist['ch14_kda']['frac_chunks_past_bound']:.0%} past it")
print(f"largest chunk decay as initialised: Mamba-2 {dist['mamba2_init']['max']:.0f}, KDA "
      f"{dist['kda_init']['max']:.0f} (e^-b overflows float32 past 88)")
assert all(dist[k]["frac_chunks_past_bound"] == 0 for k in gla_keys)
assert min(dist["mamba2_init"]["max"], dist["kda_init"]["max"]) > 88
assert dist["kda_init"]["frac_chunks_past_bound"] > 0.05 and dist["mamba2_init"]["frac_chunks_past_bound"] > 0

# %% [markdown]
# So "trained gates stay inside the bound" is not a law. GLA's temperature $\tau = 16$ is what
# keeps its gates mild: every measured chunk of the tests' mild gates, of GLA's layer gate as
# initialised (with either bias) and of chapter 14's trained GLA model passes, while the same
# sigmoid without $\tau$ fails in most chunks. Mamba-2's and KDA's initialisation spreads the
# per-token decay rate $e^{A_{\log}}\Delta$ over three orders of magnitude on purpose ($e^{A_{\log}}$
# from 1 to 16, $\Delta$ from $10^{-3}$ to $0.1$), so that some heads forget within a few tokens: a few per cent of Mamba-2's (chunk, head) pairs and a large share of KDA's (where
# one fast dimension among the 128 of a head is enough) fail the test from the first step, and
# with $\Delta_{\text{bias}} = 0$ nearly all do. Chapter 14's small KDA model, trained from GLA's
# gate, moved its strongest chunks most of the way to the bound. The exact paths are therefore
# not a rare fallback: a KDA or Mamba-2 model as initialised runs them in a real share of its
# chunks.

# %% [markdown]
# ## 4. The state pass
#
# The only inherently sequential part: one program per (K-block, V-block, batch·head) walks the
# chunks, stores the state it enters each chunk with, and steps it:
# $S \leftarrow \mathrm{diag}(e^{b_C})S + (K\odot e^{\,b_C-G})^\top V$ — one
# `tl.dot` per chunk, $[K_b, C]\times[C, V_b]$. Split over K and V blocks, the columns and rows of
# $S$ evolve independently, so blocks add parallelism for free.
#
# Because the loop is sequential, each chunk's loads must be in flight while the previous chunk
# is being multiplied: Triton *software-pipelines* the loop, issuing the asynchronous copies of
# the next chunks' $k$, $v$ and $b$ tiles ahead (`num_stages` copies in shared memory). It does
# so only if every load in the loop feeds a `tl.dot` operand. **What breaks if** $b_C$
# is loaded on its own to scale $S$ (the dot's accumulator) and nowhere else: the compiled loop
# (sm_90) then waits on its $k$ and $v$ loads every chunk — visible without a GPU, by compiling
# the kernel for sm_90 on a CPU as chapter 11 describes and counting the asynchronous copies
# (`LDGSTS`) against plain loads (`LDG`) in the SASS — and the per-head state pass is markedly
# slower at long $T$ (recorded below). So the step takes $b_C$ into the key decay $e^{b_C-b}$, and
# with per-dimension gates reads it off the $b$ tile it already holds.
#
# Block shapes. With one long sequence ($B\cdot H = 16$ at $T = 32\text{k}$), $64\times64$ blocks
# make only 64 programs for an H200's 132 multiprocessors, and narrower blocks pay: $32\times64$
# with four stages for per-head gates, $64\times32$ for linear attention. Per-dimension gates
# also carry a float32 gate tile as large as the key tile, which a program holding all of $V$
# loads once rather than once per V-block: $32\times128$ beats $64\times64$ at every length. With
# few programs $16\times128$ was faster still, but no head-dimension tile is narrower than 32
# columns (`common.MIN_TILE`: 16-column products were miscompiled elsewhere), so the library runs
# $32\times128$ there. Per-head gates take four pipeline stages once $64\times64$ blocks fill the
# GPU. `gated.state_config` holds these rules; the recorded measurements behind them:

# %%
for key in ("pipelining", "state_blocks", "state_blocks_dim_short", "head_stages"):
    measured(key)

# %% [markdown]
# The stored state of chunk $n$ must equal the recurrence's state after $nC$ tokens:

# %%
h, S_T = gated.chunk_states(k, v, g, d, s0=S0.float().contiguous(),
                            sT=torch.empty(B, H, K, V, device=DEV), chunk_size=C)   # h [B, H, NT, K, V]
for n in range(NT):
    if n == 0:
        S_n = S0
    else:
        prefix = {name: x[:, :n * C] for name, x in testing.to_float64(args).items() if name != "initial_state"}
        _, S_n = naive.gla(**prefix, initial_state=S0.double(), output_final_state=True)
    print(f"state entering chunk {n}: rel err {testing.rel_err(h[:, :, n], S_n):.1e}")
    assert testing.rel_err(h[:, :, n], S_n) < testing.tolerance(torch.float32)
_, S_end = naive.gla(**testing.to_float64(args), output_final_state=True)
assert testing.rel_err(S_T, S_end) < testing.tolerance(torch.float32)

# %% [markdown]
# ## 5. The output, in both modes
#
# Given $P$ and the entering state, a chunk's output is two matmuls:
# $O = \text{scale}\,\big((Q\odot e^{G})S + PV\big)$ — $P$ cast to the input dtype for the tensor
# cores, the causal half selected with `tl.where` (a select, not a product, so entries never
# written cannot leak). For a chunk that splits (§3b) $P$ is a third product, made in the same
# program. `mode="states"` does this for every chunk in parallel from the stored states — with the
# split, its programs are 128 columns of $V$ wide (`gated.output_blocks`), so $q$, $k$ and $b$ are
# loaded and $P$ is built once per chunk, not once per 64 columns; `mode="fused"` does it inside
# the chunk loop, right before the state step, and never stores a state. Check both against the
# float64 recurrence, for each dtype and both gate shapes:

# %%
for gate in ("per_dim", "per_head"):
    for dt in (torch.float32, torch.bfloat16):
        a2 = testing.make_inputs("gla", B=1, T=T, H=2, K=K, V=V, dtype=dt, gate=gate, device=DEV,
                                 initial_state=True, seed=12)
        o_ref, S_ref = naive.gla(**testing.to_float64(a2), output_final_state=True)
        for mode in ("fused", "states"):
            with testing.poisoned():
                o, S = linattn.gla(**a2, impl="triton", chunk_size=C, sub_chunk_size=c, mode=mode,
                                   output_final_state=True)
            e = testing.rel_err(o, o_ref)
            print(f"{gate:8s} {str(dt):15s} {mode:6s} o: {e:.1e} (tol {testing.tolerance(dt):.0e}) · "
                  f"state: {testing.rel_err(S, S_ref):.1e}")
            assert e <= testing.tolerance(dt) and testing.rel_err(S, S_ref) <= testing.tolerance(dt)
print("ran:", linattn.which("gla"))

# %% [markdown]
# ## 6. Fused or materialised states: the trade-off
#
# Both modes do the same arithmetic. They differ in **parallelism** and **memory traffic**:
#
# * fused: $B\cdot H\cdot\lceil V/B_V\rceil$ programs, each walking all $N_T = T/C$ chunks in order;
#   no state ever leaves the chip.
# * states: the state pass has $B\cdot H\cdot\lceil K/K_b\rceil\lceil V/V_b\rceil$ sequential programs
#   (one `tl.dot` per chunk: short steps), then $B\cdot H\cdot N_T\cdot\lceil V/B_V\rceil$ output
#   programs in parallel; it writes and reads back $B\cdot H\cdot N_T\cdot K\cdot V$ state values.
#
# At the benchmark setting ($B\cdot T = 32\,768$ tokens, $H=16$, $K=V=128$, bf16, $C=64$, $B_V=64$),
# the number of states is the same at every $T$ — 512 chunks × 16 heads — so materialising always
# costs $512\cdot16\cdot128\cdot128\cdot2$ bytes = 268 MB written and read back: about 0.13 ms at
# the H200's copy bandwidth of 4.25 TB/s (read + write, measured in the recorded run below). What
# changes with $T$ is how many programs the fused kernel has:

# %%
SMS = 132  # streaming multiprocessors of an H200
Ts = [1024, 2048, 4096, 8192, 16384, 32768]
rows = []
for T_ in Ts:
    B_ = 32768 // T_
    fused_programs = B_ * 16 * (128 // 64)
    rows.append([T_, B_, fused_programs, f"{fused_programs / SMS:.2f}", B_ * 16 * (T_ // 64) * 2,
                 T_ // 64, f"{B_ * 16 * (T_ // 64) * 128 * 128 * 2 / 1e6:.0f}"])
print(bench.markdown_table(["T", "B", "fused programs", "per SM", "output programs (states)",
                            "chunks walked in order", "state MB written"], rows))

# %% [markdown]
# From $T = 8192$ ($B = 4$) on, the fused grid has fewer programs than the GPU has
# multiprocessors, and each walks hundreds of chunks in sequence: most of the chip idles. The
# state mode's parallel output kernel fills the GPU at every $T$, at a fixed extra ~0.13 ms of
# traffic — and its sequential pass does one matmul per chunk instead of four. So the model says:
# fused for many short sequences, states for few long ones. `mode="auto"` follows what was
# measured rather than the model alone (`gated.choose_mode`, with the numbers in its comments):
# for linear attention and per-head gates fused while its grid has more programs than half the
# multiprocessors; with per-dimension gates always states. (For per-head gates in half precision
# the fused program takes all 128 columns of $V$ with 8 warps, so its grid is $B\cdot H$, half the
# table's count: fused up to $T = 4096$.)
#
# Measured: on a GPU the next cell times both modes live at the benchmark setting. On a CPU it
# shows the recorded run of `tools/bench.py --suite anchors` (`book/data/bench.json`; its
# caption names the device, date and versions). `floor` is the time to read every input once
# and write $o$ once at the copy bandwidth measured in that run.

# %%
caption = bench.run_label          # device, date, software versions of a recorded run


rec = bench.recorded_run("bench.json")   # also read by the sections below
NO_RECORD = ("No recorded GPU run next to this notebook: book/data/bench.json comes with a clone of the "
             "repository, not with the wheel (on Colab, upload it into a folder data/ beside the notebook).")
by_op = {op: [r for r in (rec["anchors"]["rows"] if rec else []) if r["op"] == op]
         for op in ("linear_attn", "gla", "simple_gla")}


def show_recorded_modes():
    if not rec:
        return print(NO_RECORD)
    print(f"Recorded run: {caption(rec['env'])}; forward ms, bf16, H = 16, K = V = 128, "
          f"B·T = {rec['size']['tokens']} tokens, C = 64")
    print(bench.markdown_table(
        ["op", "T", "B", "fused", "states", "auto", "FLA", "auto/FLA", "SDPA causal", "floor", "auto/floor"],
        [[r["op"], r["T"], r["B"], r["triton:fused"], r["triton:states"], r["triton"], r["fla"],
          r.get("ratio_fla"), r["sdpa"], r.get("floor"), r.get("ratio_floor")]
         for rows_ in by_op.values() for r in rows_]))


def live_modes():
    rows = []
    for T_ in Ts:
        a3 = bench.anchor_inputs("gla", T_)
        rows.append([T_, a3["q"].shape[0]] + [bench.median_ms(bench.library_call("gla", "triton", a3, mode=m))
                                              for m in ("fused", "states")])
        del a3
    print("live GLA forward, ms:\n" + bench.markdown_table(["T", "B", "fused", "states"], rows))


pick(cpu=show_recorded_modes, gpu=live_modes)()

# %% [markdown]
# The facts to read off the table, per operation (printed from the recorded numbers):

# %%
def span(xs, fmt="{:.2f}"):
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


if not rec:
    print(NO_RECORD)
else:
    for op, rows_ in by_op.items():
        wins = ", ".join(f"{r['T']}: {'fused' if r['triton:fused'] < r['triton:states'] else 'states'}" for r in rows_)
        auto_ok = all(abs(r["triton"] - min(r["triton:fused"], r["triton:states"])) <= 0.05 * r["triton"] for r in rows_)
        print(f"{op}: faster mode by T — {wins}")
        print(f"    auto within 5 % of the faster mode at every T: {auto_ok}; auto/FLA {span([r['ratio_fla'] for r in rows_])}"
              f" (≤ 1 at T = {', '.join(str(r['T']) for r in rows_ if r['ratio_fla'] <= 1) or 'none'});"
              f" auto/floor {span([r['ratio_floor'] for r in rows_], '{:.1f}')}")
    gla_fla_floor = [r["fla"] / r["floor"] for r in by_op["gla"]]
    print(f"FLA's chunk_gla against the same floor: {span(gla_fla_floor, '{:.1f}')}×")
    strong = {}                       # the gates models produce (§3b), timed in the same run
    for gates, rows_ in rec["anchors"]["by_gates"].items():
        for op in ("gla", "simple_gla"):
            strong[gates, op] = [r["ratio_fla"] for r in rows_ if r["op"] == op]
            print(f"{op}, gates {gates}: auto/FLA {span(strong[gates, op])}")
    assert max(r["ratio_fla"] for r in by_op["gla"] + by_op["simple_gla"]) < 1   # what the text below says
    assert max(max(v) for v in strong.values()) < 1.05

# %% [markdown]
# Against the model:
#
# * **Linear attention** follows it. Fused is flat while its grid fills the GPU; the states mode
#   costs a little more there — less than the ~0.13 ms of traffic estimated above (a likely
#   reason: part of the writing overlaps with computing). At the two longest lengths the fused grid falls below the
#   number of multiprocessors, fused slows down, and states wins. `auto` picks the faster mode.
# * **GLA (per-dimension gates)** does not: states is faster at *every* length, and fused degrades
#   further at long $T$, as predicted. `auto` always picks states for these gates. A likely reason
#   the fused GLA kernel loses even with a full grid is its size: with the state, the gates and four
#   dots per chunk in one loop, its bf16 tiles at $K = V = 128$ need more shared memory than an
#   H200 has with Triton's default three pipeline stages (it runs with two), which leaves little
#   room for a second program per multiprocessor to hide latency.
# * **Scalar-gate GLA** (`simple_gla`, per-head gates) follows the model once its fused program
#   is wide: with all 128 columns of $V$ and 8 warps, $q$, $k$ and the gates are loaded once per
#   chunk instead of once per 64 columns, and fused is a little faster than states while the grid
#   fills the GPU ($T \le 4$k), states beyond. With 64 columns and 4 warps fused loses at every
#   length (the recorded times are printed below, with the kernel profile): each program applies the decays inside its sequential loop and, with that
#   loop's loads pipelined (§4), needs more than half a multiprocessor's shared memory, so no
#   second program hides its latency; fewer, wider programs do the same work with half the
#   loads. The gate sums come from one small launch before the chunk kernels, so no scan sits in
#   the sequential loop.
# * **Against FLA.** The aim for these kernels is a forward no slower than FLA's at every $T$; the
#   lines above list where each op meets it. In the recorded run GLA with per-dimension gates is
#   ahead at every length, mostly through the split of §3b: for these gates the intra kernel has
#   no chunk to build and returns at once, and the output kernel makes $P$ with one product, where
#   FLA spends two kernels on the intra-chunk matrix. Per-head GLA is ahead of FLA at every length
#   too, by little at 8k–16k, where both spend their time in the same two steps, the state pass
#   and the output (ours with four pipeline stages in the state pass), more up to 4k (the fused
#   mode) and at 32k. With the gates models produce (§3b's logsigmoid and Mamba-2/KDA
#   initialisations, timed in the same run) per-head GLA's times do not change, but the per-dimension
#   lead shrinks to level or a little ahead: chunks past the split's bound go to the exact
#   secondary chunking of §3, which the mild gates never need.
#
# The next cell prints where the time goes, kernel by kernel (`tools/profile_ops.py`, which times
# every kernel of both libraries on the same inputs), and the recorded designs for the
# per-dimension forward that the library does not run (`book/data/10_gla_triton.json`). Every one
# of them drops work that the kernels above do — building $P$ by secondary chunking for every
# chunk instead of the split, or summing the raw gates inside the kernels instead of one launch
# that writes $b$ — and every one is slower or unproven. Summing inside the kernels puts a scan in
# the sequential state loop and makes each intra program sum its whole chunk to decide the split.
# The sums can also be products — a $0/1$ triangle times the gate tile, each product exact in the
# gates' own dtype (a gate or 0) — with the split decided once per chunk by the state pass. The
# gates here are float32, and an exact float32 product (`input_precision="ieee"`) does not run on
# the tensor cores; split into three bf16 parts (exact: 3 × 8 bits of significand) it does, and
# that version is faster than the library's kernels at $T = 1$k, but it has not passed its tests on
# a GPU, so the library does not run it. A smaller step — the state pass summing its gates with
# those products and writing $b$ in place of the launch — passed them and gained little: at
# $T = 32$k, where 128 programs each walk 512 chunks, the products in the sequential loop cost
# more than the launch they replace.

# %%
measured("head_fused")
gla_rec = MEASURED
if not gla_rec:
    print(NO_RECORD)
else:
    prof = gla_rec["profile"]
    print(f"Per kernel, T = {prof['T']}, B = {prof['B']}: {caption({**gla_rec['env'], 'date': prof['date']})}; "
          f"{gla_rec['env']['setting']}; `{prof['command']}`")
    for who in ("ours", "fla"):
        ks = prof[who]
        print(f"  {who:4s} {sum(ks.values()):.3f} ms = " + " + ".join(f"{n} {ms:.3f}" for n, ms in ks.items()))
    rows_d = []
    for dz in gla_rec["designs"]:
        total = dz.get("total", sum(dz["kernels"].values()))
        rows_d.append([dz["design"], dz["date"], dz["T"], total, dz["kernels"].get("states"), dz["status"]])
    print("\nDesigns of the per-dimension forward, ms of all its kernels (the first row is what the library runs):")
    print(bench.markdown_table(["design", "date", "T", "ms", "state pass", "status"], rows_d))
    onchip = next(dz for dz in gla_rec["designs"] if "library_then" in dz)
    print(f"The on-chip design was measured against separate kernels in the same run ({onchip['library_then']} ms); "
          f"its state pass took {onchip['kernels']['states'] / onchip['fla_states']:.1f}× FLA's ({onchip['fla_states']} ms).")
    t32 = next(dz["T32768_states"] for dz in gla_rec["designs"] if "T32768_states" in dz)
    print("the state pass at T = 32768, ms: " + ", ".join(f"{k} {v}" for k, v in t32.items()))

# %% [markdown]
# **Against the memory floor.** GLA's time over the floor, and FLA's `chunk_gla`'s, are printed
# above: ours is the smaller, and still short of the aim of 3×. What is left is mostly traffic the
# floor does not count: the float32 gates are summed once more into $b$, written, and read back by
# the state pass and the output kernel; the states are written and read back; $k$ and $v$ are
# read by both the state pass and the output. The next cell counts those bytes from the tensor
# sizes of the benchmark and prices them at the copy bandwidth of the recorded run (the one its
# floor was computed with). Linear attention comes closest to the floor.

# %%
def traffic_ms(row, size, C=64):
    """The bytes each kernel of the per-dimension forward must move, at the run's copy bandwidth."""
    x = size["tokens"] * size["H"] * size["K"]                  # numbers in one [B, T, H, K] tensor
    h = size["tokens"] // C * size["H"] * size["K"] * size["V"]  # the states entering every chunk
    half, f32 = 2, 4                                             # bytes: bf16 inputs, float32 gates
    floor_bytes = 4 * x * half + x * f32                         # q, k, v and g read once, o written once
    per_ms = floor_bytes / row["floor"]                          # bytes per ms, as the floor was priced
    passes = {"gate sums (read g, write b)": 2 * x * f32,
              "state pass (read k, v, b; write the states)": 2 * x * half + x * f32 + h * half,
              "output (read q, k, v, b, the states; write o)": 4 * x * half + x * f32 + h * half}
    return {name: nbytes / per_ms for name, nbytes in passes.items()}


if not rec:
    print(NO_RECORD)
else:
    r1 = by_op["gla"][0]
    est = traffic_ms(r1, rec["size"])
    for name, ms in est.items():
        print(f"{name:48s} {ms:.3f} ms")
    print(f"all three {sum(est.values()):.3f} ms = {sum(est.values()) / r1['floor']:.1f}× the floor "
          f"({r1['floor']:.3f} ms), {sum(est.values()) - r1['floor']:.3f} ms above it; "
          f"measured at T = {r1['T']}: {r1['triton']:.3f} ms")

# %% [markdown]
# ## 7. Figure 2 of the GLA paper, left: time against sequence length
#
# The paper's claim is that a chunkwise linear-attention kernel overtakes FlashAttention as
# sequences grow: at a fixed number of tokens, softmax attention costs $O(T)$ per token, GLA
# $O(C + K)$. On a GPU the cell times our GLA (auto mode) and causal SDPA over $T = 1k\dots32k$; on
# a CPU it plots the recorded run of §6, with FLA's `chunk_gla` beside it.

# %%
def series_live():
    ours, sdpa = [], []
    for T_ in Ts:
        a3 = bench.anchor_inputs("gla", T_)
        ours.append(bench.median_ms(bench.library_call("gla", "triton", a3)))
        sdpa.append(bench.median_ms(bench.sdpa_call(T_)))
        del a3
    return Ts, {"GLA (ours, Triton)": ours, "SDPA causal (FlashAttention)": sdpa}, "measured live"


def series_recorded():
    rows = by_op["gla"]
    if not rows:
        return [], {}, NO_RECORD
    return ([r["T"] for r in rows], {"GLA (ours, Triton, auto)": [r["triton"] for r in rows],
                                     "FLA chunk_gla": [r["fla"] for r in rows],
                                     "SDPA causal (FlashAttention)": [r["sdpa"] for r in rows]},
            caption(rec["env"]))


Tx, series, kind = pick(cpu=series_recorded, gpu=series_live)()
if not series:
    print(kind)
else:
    fig, ax = plt.subplots(figsize=(7, 4))
    bench.plot_times(ax, Tx, series, title=f"GLA forward, 32768 tokens, H = 16, K = V = 128, bf16\n{kind}")
    ax.set_xticks(Tx, [f"{t // 1024}k" for t in Tx])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ys = [0.25, 0.5, 1, 2, 4, 8]                  # plain numbers on the log axis, no 10^x minor labels
    ax.set_yticks(ys, [f"{y:g}" for y in ys])
    ax.yaxis.set_minor_locator(plt.NullLocator())
    ax.set_ylabel("forward time (ms, log scale)")
    fig.tight_layout()
    plt.show()
    print(bench.markdown_table(["T"] + list(series), [[t] + [s[i] for s in series.values()] for i, t in enumerate(Tx)]))
    cross = [t for t, o, a in zip(Tx, list(series.values())[0], list(series.values())[-1]) if o < a]
    print(f"ours faster than causal SDPA at T = {', '.join(map(str, cross)) or 'no length'}")

# %% [markdown]
# The shape of the paper's left panel is there: softmax attention's time doubles with $T$ while
# GLA's stays nearly flat, so the lines cross. Where they cross depends on how fast each kernel
# is: the paper's GLA overtakes FlashAttention-2 between 2k and 4k (forward and backward; the
# paper does not name the GPU of its Figure 2). In this forward-only setting the printed line
# above — from the recorded run on a CPU, measured live on a GPU — says from which length ours
# overtakes causal SDPA; FLA's `chunk_gla`, slower than ours at every length, overtakes it later.
# Near the crossing the two times are close, so which side of it a length falls on can change
# from run to run. Our aim — GLA faster than SDPA from $T = 2048$ — is not reached: at 2k SDPA is
# still the faster of the two (table above).

# %% [markdown]
# ## 8. Figure 2, right: intra- against inter-chunk time as $C$ grows
#
# The chunk size moves work between the two halves. Per token, the **intra** part (the $C\times C$
# matrix and $PV$) costs $O(C(K+V))$ — it grows with $C$; the **inter** part (states) costs
# $O(KV)$ per token whatever $C$ is, but its sequential pass takes $T/C$ steps, and the states it
# stores number $T/C$ per head — both shrink as $C$ grows. A cost model at the benchmark size
# makes the two trends concrete (FLOPs of each part, and the length of the sequential pass):

# %%
Cs = [16, 32, 64, 128, 256]
Kd = Vd = 128
tokens, heads = 32768, 16
intra_gflop = [2 * tokens * heads * C_ * (Kd + Vd) / 2 / 1e9 for C_ in Cs]   # causal half of QKᵀ and AV
inter_gflop = [2 * tokens * heads * 2 * Kd * Vd / 1e9 for C_ in Cs]            # K̃ᵀV and (Q⊙e^b)S
steps = [8192 // C_ for C_ in Cs]                                              # chunks walked in order at T = 8192


def chunk_axis(ax, Cs):
    """Chunk sizes on a log-2 axis, labelled 16 … 256 and nothing else (no minor tick labels)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(Cs, [str(x) for x in Cs])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_xlabel("chunk size C (tokens)")


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
ax1.plot(Cs, intra_gflop, "o-", label="intra (A and AV)")
ax1.plot(Cs, inter_gflop, "s-", label="inter (states, QS)")
chunk_axis(ax1, Cs)
ax1.set(ylabel="GFLOP per forward", title="work, 32768 tokens, H = 16, K = V = 128")
ax1.legend()
ax2.plot(Cs, steps, "o-", color="tab:red")
chunk_axis(ax2, Cs)
ax2.set_yscale("log", base=2)
ax2.set_yticks(steps, [str(x) for x in steps])
ax2.yaxis.set_minor_locator(plt.NullLocator())
ax2.set(ylabel="sequential steps (chunks)", title="state pass length, T = 8192")
fig.tight_layout()
plt.show()

# %% [markdown]
# The paper measured (its own kernels, on a GPU it does not name) intra rising from 1.8 to 5 ms and inter falling from
# 2.9 to 1.3 ms as $C$ goes from 16 to 256. Our division: inter = cumulative gates + the state
# pass (`gated.chunk_states`), intra = the rest of a `mode="states"` call (the intra kernel and the
# output kernel, which builds $P$ of the split chunks and also does $QS$). On a GPU the next cell
# measures it live for $C = 16\dots256$; on a CPU it shows the recorded sweep of the same sizes
# (`tools/bench.py --suite chunks`, $T = 8192$, $B = 4$, states mode; its caption names the run).
#
# $C = 128$ and $256$ need two things from the kernels. The output step goes in row blocks of 64
# rows (`gated.ROW_BLOCK`), each adding the column blocks up to its diagonal, so no tile of $P$ is
# larger than $64\times64$. The state pass launches with the most software-pipeline stages that fit
# in shared memory (`linattn.triton.common.launch`: 3, else 2, else 1): at $C = 256$, three stages
# of the k, v and float32 gate tiles would need 257 KB, over the H200's 227 KB.

# %%
def sweep_live():
    a3 = bench.anchor_inputs("gla", 8192)
    d3 = check_inputs(a3["q"], a3["k"], a3["v"], g=a3["g"], gate=True)
    rows = []
    for C_ in Cs:
        total = bench.median_ms(bench.library_call("gla", "triton", a3, chunk_size=C_, sub_chunk_size=16,
                                                   mode="states"))
        inter = bench.median_ms(lambda: gated.chunk_states(a3["k"], a3["v"], a3["g"], d3, chunk_size=C_))
        rows.append({"C": C_, "inter": inter, "intra": total - inter, "total": total})
    return rows, "measured live"


def sweep_recorded():
    sw = rec.get("chunks") if rec else None
    if not sw:
        return None, "not recorded"
    env = sw.get("env", rec["env"])
    label = caption(env) + (f"; {env['kernels']}" if env.get("kernels") else "")
    return sw["rows"], label


sweep, kind = pick(cpu=sweep_recorded, gpu=sweep_live)()
if sweep is None:
    print("No GPU sweep recorded yet: run `python tools/bench.py --suite chunks --out book/data` on a GPU "
          "(it writes book/data/bench.json). The cost model above shows the expected shape.")
else:
    print("Sweep:", kind)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["C"] for r in sweep], [r["intra"] for r in sweep], "o-", label="intra")
    ax.plot([r["C"] for r in sweep], [r["inter"] for r in sweep], "s-", label="inter")
    chunk_axis(ax, [r["C"] for r in sweep])
    ax.set(ylabel="time (ms)", title="GLA forward, states mode, T = 8192, B = 4\n" + textwrap.fill(kind, 80))
    ax.title.set_fontsize(8)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    plt.show()
    print(bench.markdown_table(["C", "inter", "intra", "total (states)", "fused"],
                               [[r["C"], r["inter"], r["intra"], r["total"], r.get("fused")] for r in sweep]))
    fastest = min(sweep, key=lambda r: r["total"])
    print(f"fastest recorded chunk size: C = {fastest['C']} ({fastest['total']:.2f} ms, states mode)")

# %% [markdown]
# Reading the recorded sweep (the table above):
#
# * **Inter** falls as in the paper while the sequential pass gets shorter (512 → 128 steps from
#   $C = 16$ to $64$), then rises slightly to $C = 256$. A likely reading: fewer steps, but each
#   step loads and multiplies bigger tiles, and at $C = 256$ fewer pipeline stages fit.
# * **Intra** rises from $C = 64$ to $256$, the paper's shape: the $C\times C$ matrix,
#   $O(C(K+V))$ per token, is now the growing term.
# * Below $C = 64$ intra is larger again. The output kernel reads the state entering every chunk,
#   $K\times V$ values, so its traffic per token grows as $KV/C$: at $C = 16$ the state reads
#   (2 KB per token and head in bf16) outweigh those of $q$, $k$, $v$ and $b$ together.
#
# The two effects meet at the library's default chunk, $C = 64$, the fastest recorded size.

# %% [markdown]
# ## Summary
#
# * GLA in Triton is five small kernels, sorted by parallelism: cumulative gates, the intra-chunk
#   matrix (secondary chunking: matmul tiles below the diagonal, float32 diagonal tiles by a
#   multiplicative row walk), the state pass (the only sequential part), and the output — or
#   the state pass and the output fused into one loop with the state in registers.
# * The split: where a chunk decays by less than $e^{60}$ in every key dimension (every measured
#   chunk of GLA's $\tau = 16$ gates, initialised or trained; far from all of Mamba-2's or KDA's as
#   initialised), $P = \mathrm{tril}((Q\odot e^{G})(K\odot e^{-G})^\top)$ is one product, built
#   in the output kernel; the intra kernel fills $P$ only for the chunks past the bound (all of
#   them when the backward needs $P$). One load of $b$ decides for both kernels.
# * Every other exponent is a difference measured from a point before the query: all factors
#   $\le 1$, finite for log-gates of −20 per token, where the split would give $0\cdot\infty$.
# * Fused keeps the state on chip but has only $B\cdot H\cdot V/B_V$ programs; materialising the
#   states costs a fixed ~0.13 ms of traffic at the benchmark size (estimated) and fills the GPU
#   at any $T$. On an H200 fused wins for linear attention while its grid is full and states
#   beyond, and so does per-head GLA once its program takes all of $V$; with per-dimension gates
#   states wins at every $T$. `mode="auto"` encodes that rule.
# * The sequential state pass is pipelined only if every load in its loop feeds a `tl.dot`
#   operand; with few (batch, head) pairs, narrower state blocks give idle multiprocessors work.
# * Against FLA and softmax attention (recorded run on an H200, §6–7): linear attention is ahead
#   of FLA at every length, and so is per-head GLA (by little at 8k–16k); per-dimension GLA takes
#   well under FLA's time at every length, mostly through the split, and overtakes causal SDPA
#   within the lengths measured — the paper's Figure 2, left, in shape, not yet at the crossing
#   we aim for (2k). It is still several times the memory floor; the rest is mostly traffic
#   (§6 counts it).
# * The chunk size trades intra work ($\propto C$) against the length of the sequential pass
#   ($\propto T/C$): the paper's Figure 2, right. In the recorded sweep ($C = 16\dots256$) inter
#   falls to $C = 64$ and then rises slightly, intra rises from 64 to 256 as in the paper and is
#   larger below 64, where reading every chunk's state dominates; $C = 64$ is fastest.
#
# How the recorded numbers were measured, kernel by kernel, is in `docs/performance.md`.
#
# **Workbook:** [`exercises/10_gla_triton.py`](../exercises/10_gla_triton.py) — build the
# cumulative gates, the intra-chunk tiles and the state pass yourself, checked against this
# chapter's library functions. A further exercise: write `_diagonal_tile` yourself and check it
# against `linattn.chunk.gated.intra_chunk_matrix` restricted to the diagonal tiles.
