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
# # 13 — The backward pass in Triton
#
# **Goal.** Chapter 12 derived the backward of the chunkwise forms and wrote it in PyTorch;
# chapters 10 and 11 wrote the forwards as Triton kernels. Here the backward becomes kernels too,
# so a model can *train* through `linattn.triton`. We ask, for GLA and linear attention:
#
# * which kernels the backward needs and why — recompute the chunk states, one **reverse pass**
#   over the state gradients, then gradient tiles for $dq$, $dk$, $dv$ built with the forward's
#   secondary chunking, and the gate gradient in closed form;
# * what runs in parallel and what must walk the chunks in order;
# * where the time goes, and how forward + backward compares with softmax attention (the left
#   panel of the GLA paper's Figure 2, now for training);
# * and, near the end, what the delta rules add (their kernels are described from their code).
#
# On a CPU the kernels run in the Triton interpreter at small sizes and timings come from a
# recorded GPU run in `book/data/`, when there is one; on a GPU the same cells run natively.

# %%
import matplotlib.pyplot as plt
import torch

import linattn  # first: without a GPU it switches Triton to its interpreter
from linattn import bench, chunk, naive, testing
from linattn import triton as lt
from linattn.device import pick
from linattn.triton import gated, gated_backward
from linattn.validate import check_inputs

print(linattn.device.describe())
DEV = linattn.device.default_device()

# %% [markdown]
# ## 1. What the backward computes, chunk by chunk
#
# Notation of chapters 10 and 12: in chunk $n$, $i$ is a query position and $j$ a key position
# ($1, \dots, C$), $b_i$ the log-gate summed from the chunk start (float32), $b_C$ its sum over the
# whole chunk, $G$ the matrix of rows $b_i$, $S_{[n-1]}$ the state entering the chunk (`h` in the
# code), and `scale` sits on the outputs only:
#
# $$o_i = \text{scale}\Big((q_i\odot e^{b_i})\,S_{[n-1]} + \sum_{j\le i}P_{ij}v_j\Big),\qquad
#   P_{ij}=\sum_\kappa q_{i\kappa}k_{j\kappa}e^{\,b_{i\kappa}-b_{j\kappa}},\qquad
#   S_{[n]} = \operatorname{diag}(e^{b_C})\,S_{[n-1]} + \sum_j (k_j\odot e^{\,b_C-b_j})^\top v_j .$$
#
# (The kernels call the score matrix $P$ `A`, as FLA does; in this book $A$ is the delta rule's
# matrix.) Backpropagation hands the layer $dO$ and the gradient of the final state (chapter 12,
# §1). Let $dS_{[n]}$ be the gradient of the state *after* the chunk and
# $dP_{ij} = \text{scale}\cdot dO_i\cdot v_j$ for $j\le i$. Differentiating each line (chapter 12, §4):
#
# $$dS_{[n-1]} = \operatorname{diag}(e^{b_C})\,dS_{[n]} + \text{scale}\,(Q\odot e^{G})^\top dO
#   \qquad\text{(reverse pass, sequential)}$$
#
# $$dq_i = \text{scale}\,(dO_i\,S_{[n-1]}^\top)\odot e^{b_i} + \sum_{j\le i} dP_{ij}\,k_j\odot e^{\,b_i-b_j},\qquad
#   dk_j = (v_j\, dS_{[n]}^\top)\odot e^{\,b_C-b_j} + \sum_{i\ge j} dP_{ij}\,q_i\odot e^{\,b_i-b_j},$$
#
# $$dv_j = (k_j\odot e^{\,b_C-b_j})\,dS_{[n]} + \text{scale}\sum_{i\ge j}P_{ij}\,dO_i,$$
#
# and over the whole sequence ($t = 1, \dots, T$, $b_t$ summed from its start)
#
# $$\frac{\partial L}{\partial b_t} = q_t\odot dq_t - k_t\odot dk_t\ \ (+\textstyle\sum_\nu S_T\odot dS_T \text{ at } t=T),\qquad
#   dg_t = \sum_{s\ge t}\frac{\partial L}{\partial b_s}.$$
#
# Two inputs of these formulas are not at hand after the forward: the state $S_{[n-1]}$ entering
# every chunk (the forward's fused mode never writes it) and, for per-dimension gates, the matrix $P$.
# The GLA paper **recomputes** both in the backward; `recompute=False` keeps them instead (§6).
# Everything else splits into kernels by how much parallelism it has:
#
# | step | kernel | grid (programs) | walks the chunks? |
# |---|---|---|---|
# | recompute $S_{[n-1]}$ | `gated._states_kernel` | (K-block, V-block, batch·head) | **yes** |
# | reverse pass | `_dstates_kernel` | (K-block, V-block, batch·head) | **yes** (last to first) |
# | $dP = \text{scale}\,dO\,V^\top$ | `_dA_kernel` | (row block of a chunk, batch·head) | no |
# | intra $dq$, $dk$ | `_intra_grad_kernel` | (K-block, sub-chunk, batch·head) | no |
# | $dv$ | `_dv_kernel` | (V-block, row block, batch·head) | no |
# | $dq$, $dk$, $\partial L/\partial b$ summed per row block | `_dqk_kernel` | (K-block, row block, batch·head) | no |
# | $dg$ | a reverse cumsum of the block totals (PyTorch), `_dg_kernel` | (K-block, row block, batch·head) | no |
#
# `linattn/triton/gated_backward.py` holds the kernels; `GatedAttention` (an
# `autograd.Function`) runs them when an input requires grad. First, the whole thing against
# float64 autograd through the token loop, for the three gate kinds — $T$ not a multiple of the
# chunk, $K \ne V$, an initial state, and a gradient arriving on the final state too:

# %%
B, T, H, K, V = 1, pick(cpu=45, gpu=1000), 2, pick(cpu=32, gpu=128), pick(cpu=48, gpu=96)
C, c = pick(cpu=32, gpu=64), 16
gen = torch.Generator().manual_seed(0)
dO = torch.randn(B, T, H, V, generator=gen).to(DEV)
dS_T = torch.randn(B, H, K, V, generator=gen).to(DEV)


def gradients(fn, args, **kw):
    """∂/∂(every input) of <o, dO> + <S_T, dS_T>; all output buffers NaN-poisoned."""
    x = {n: a.detach().clone().requires_grad_(True) for n, a in args.items()}
    with testing.poisoned():
        o, S = fn(**x, output_final_state=True, **kw)
        ((o * dO.to(o.dtype)).sum() + (S * dS_T.to(S.dtype)).sum()).backward()
    return {n: a.grad for n, a in x.items()}, S.detach()


cases = {"linear attention": ("linear_attn", {}), "GLA, per-head gates": ("gla", {"gate": "per_head"}),
         "GLA, per-dimension gates": ("gla", {"gate": "per_dim"})}
results = {}
for name, (op, kw) in cases.items():
    args = testing.make_inputs(op, B=B, T=T, H=H, K=K, V=V, initial_state=True, seed=1, device=DEV, **kw)
    extra = dict(chunk_size=C, sub_chunk_size=c) if op == "gla" else dict(chunk_size=C)
    ours, S_final = gradients(getattr(lt, op), args, **extra)
    truth, _ = gradients(getattr(naive, op), testing.to_float64(args))
    errs = {n: testing.rel_err(ours[n], truth[n]) for n in ours}
    results[name] = (args, ours, truth, S_final)
    print(f"{name:26s}" + "  ".join(f"d{n}: {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) < 1e-4          # float32 gradients (the library's tests use the same bound)

# %% [markdown]
# And against the previous level, the chunkwise PyTorch backward of chapter 12, on the same
# float32 inputs:

# %%
args, ours, _, _ = results["GLA, per-dimension gates"]
cpu_args = {n: a.cpu() for n, a in args.items()}
dO, dS_T = dO.cpu(), dS_T.cpu()
prev, _ = gradients(chunk.gla, cpu_args, chunk_size=C, sub_chunk_size=c)
dO, dS_T = dO.to(DEV), dS_T.to(DEV)
errs = {n: testing.rel_err(ours[n], prev[n]) for n in ours}
print("Triton vs linattn.chunk:", "  ".join(f"d{n}: {e:.1e}" for n, e in errs.items()))
assert max(errs.values()) < 1e-4

# %% [markdown]
# ## 2. The reverse pass over the state gradients
#
# The forward's one sequential part carries the state forward through the chunks; the backward's
# one sequential part carries the state gradient $dS$ **backward**: start from the final state's
# gradient, and before stepping to the previous chunk, decay $dS$ by the chunk's total gate and add
# what the chunk's outputs ask of the state, $\text{scale}\,(Q\odot e^{G})^\top dO$. Each program of
# `_dstates_kernel` owns a $64\times 64$ block of $dS$ for one (batch, head) — the rows and columns
# of $dS$ never mix, exactly as in the forward's state pass — and writes the $dS_{[n]}$ of every
# chunk for the parallel kernels.
# After the first chunk, $dS$ *is* the gradient of the initial state.
#
# In a dozen lines of PyTorch (float64), checked against the kernel's $d\,\text{initial\_state}$:

# %%
def reverse_pass(q, g, do, dS_T, C, scale):
    """dS (`D` here) before the first chunk: the initial state's gradient. q, g [B,T,H,K], do [B,T,H,V]."""
    D = dS_T.double()                                                   # [B, H, K, V]
    for t0 in reversed(range(0, q.shape[1], C)):
        sl = slice(t0, t0 + C)
        b = g[:, sl].double().cumsum(1)                                 # [B, c, H, K] from the chunk start
        qd = q[:, sl].double() * b.exp()                                # queries decayed from the chunk start
        D = b[:, -1].exp()[..., None] * D + scale * torch.einsum("bthk,bthv->bhkv", qd, do[:, sl].double())
    return D


args, ours, truth, _ = results["GLA, per-dimension gates"]
D0 = reverse_pass(args["q"], args["g"], dO, dS_T, C, K ** -0.5)
print(f"reverse pass (PyTorch) vs the kernel's d initial_state: {testing.rel_err(ours['initial_state'], D0):.1e}")
assert testing.rel_err(ours["initial_state"], D0) < 1e-5

# %% [markdown]
# ## 3. Gradient tiles with secondary chunking
#
# The intra-chunk sums $\sum_{j\le i} dP_{ij}\,k_j\odot e^{b_i-b_j}$ (for $dq$) and
# $\sum_{i\ge j} dP_{ij}\,q_i\odot e^{b_i-b_j}$ (for $dk$) have the shape of $P$ itself — a decay
# *inside* the sum over tokens, per key dimension — so they are built like $P$ in chapter 10, from
# $c\times c$ tiles (sub-chunks counted from 0, as in chapter 05):
#
# * **Off-diagonal tiles** become tensor-core matmuls after splitting $e^{b_i-b_j}$ at a position $r$
#   between the two sub-chunks into two factors $\le 1$. The point differs for the two gradients.
#   A program computing $dq$ for query sub-chunk $i$ sums over key sub-chunks $j<i$: $r = ic$, the
#   last position *before* sub-chunk $i$, $dq_{[i]} = e^{G_{[i]} - b_r}\odot\sum_{j<i} dP_{[i][j]}\,(K_{[j]}\odot e^{b_r-G_{[j]}})$.
#   A program computing $dk$ for key sub-chunk $i$ sums over query sub-chunks $i'>i$: $r = (i+1)c$,
#   the *last position* of sub-chunk $i$, $dk_{[i]} = e^{b_r-G_{[i]}}\odot\sum_{i'>i} dP_{[i'][i]}^\top(Q_{[i']}\odot e^{G_{[i']}-b_r})$.
#   Either way one reference serves every tile a program sums, and every exponent is $\le 0$.
# * **Diagonal tiles** have no point between their queries and keys; they are summed in float32
#   with decay tiles built one gate factor ($\le 1$) at a time. For $dq$ (a sum over columns $j$ for
#   each row $i$) a column walk: the decay column $E_j[i] = e^{b_i-b_j}$ from $E_{j+1}$
#   with one exponential per key dimension. For $dk$ (a sum over rows $i$ for each column $j$) the
#   same walk over rows, $F_i[j] = F_{i-1}[j]\,e^{g_i}$: each row adds the rank-one tile
#   $dP_{i,\cdot}\otimes q_i \odot F_i$ to all of $dk$ at once, where walking columns would need a
#   sum across the rows and a write into one row per column — on the GPU that version of the
#   kernel took about twice as long.
#
# Given $dP$, each key dimension is independent of the others, so the kernel also splits $K$ into
# blocks of 64 — its float32 tiles stay $c\times 64$ whatever $K$ is. $dP$ itself
# ($\text{scale}\,dO\,V^\top$, lower triangle) is one kernel before it, summed over $V$ in blocks. For
# per-head gates and linear attention the decay leaves the sum over $\kappa$ and every tile,
# diagonal included, is a masked matmul. The state parts ($dO\,S_{[n-1]}^\top$ and $V\,dS_{[n]}^\top$, sums over
# $V$) are added by `_dqk_kernel`, which also forms $\partial L/\partial b$ while $dq$, $dk$ are
# still float32 — before they are rounded to the input's dtype.
#
# **What breaks if** the $dk$ tiles used $dq$'s reference (the position $r = ic$ *before* sub-chunk
# $i$)? The key factor becomes $e^{b_r-b_j}$ with $j$ in sub-chunk $i$, *after* $r$: a positive
# exponent (`r_before` below holds $b_r$, `r_last` the right reference).
# Under strong gates (down to $-20$ per step) it overflows:

# %%
g_strong = testing.log_gates((1, 16, 1, 4), "strong", generator=torch.Generator().manual_seed(2))
b_sub = g_strong[0, :, 0].cumsum(0)                   # b over one sub-chunk of 16 tokens, [16, 4]
r_before = torch.zeros(4)                             # b just before the sub-chunk (its start)
r_last = b_sub[-1]                                    # b at its last token
print("max exponent, dq's reference for dk:", f"{(r_before - b_sub).max():.0f}",
      "→ factor", (r_before - b_sub).exp().max().item())
print("max exponent, dk's own reference:   ", f"{(r_last - b_sub).max():.0f}",
      "→ factor", (r_last - b_sub).exp().max().item())
assert torch.isinf((r_before - b_sub).exp()).any() and (r_last - b_sub).max() <= 0

# %% [markdown]
# One sub-chunk of strong gates already takes the wrong factor past float32's range (inf, and
# $\infty\cdot 0$ = NaN in the matmul); with the right reference the largest factor is exactly 1.
# The library's kernels stay finite at that strength:

# %%
strong = testing.make_inputs("gla", B=1, T=pick(cpu=40, gpu=600), H=1, K=16, V=16, strength="strong",
                             initial_state=True, seed=3, device=DEV)
dO_s = torch.randn(strong["v"].shape, generator=torch.Generator().manual_seed(4)).to(DEV)
x = {n: a.clone().requires_grad_(True) for n, a in strong.items()}
(lt.gla(**x, chunk_size=16, sub_chunk_size=16)[0] * dO_s).sum().backward()
x64 = {n: a.double().requires_grad_(True) for n, a in strong.items()}
(naive.gla(**x64)[0] * dO_s.double()).sum().backward()
errs = {n: testing.rel_err(x[n].grad, x64[n].grad) for n in x}
print("strong gates:", "  ".join(f"d{n}: {e:.1e}" for n, e in errs.items()))
assert max(errs.values()) < 1e-4

# %% [markdown]
# ## 4. The gate gradient: a reverse cumulative sum
#
# Chapter 12 (§3) showed that $dg$ needs no state per token:
# $\partial L/\partial b_t = q_t\odot dq_t - k_t\odot dk_t$ (plus $\sum_\nu S_T\odot dS_T$ on the last
# token), and $dg_t = \sum_{s\ge t}\partial L/\partial b_s$. The kernels already hold $dq$, $dk$
# in float32, so `_dqk_kernel` forms $\partial L/\partial b$ there, before they are rounded. What
# is left is a reverse cumulative sum over $T$ — a scan, the one part of the gate gradient that is
# not local. Written as one PyTorch `flip(cumsum(flip(·)))` over all of $\partial L/\partial b$
# ($[B,T,H,K]$ in float32), the scan took 3.7 ms of GLA's 12.1 ms forward + backward on an H200 at
# $T = 8192$, $B = 4$, $H = 16$, $K = 128$ (torch 2.11, Triton 3.6, 2026-11-22): the single most
# expensive stage. So the scan is split the way the chunkwise form splits the state pass:
#
# 1. `_dqk_kernel` sums each row block of 64 tokens from every row to the block's end
#    (`tl.cumsum(..., reverse=True)`, on chip) and writes the block's total;
# 2. a reverse cumulative sum runs over the block totals only, $T/64$ numbers per column, in PyTorch;
# 3. `_dg_kernel` adds to each token the totals of all later blocks and the final state's term
#    (which every token's gate reaches), and for per-head gates sums over $K$.
#
# The only sequential work left is over $T/64$ block totals.
#
# From the Triton $dq$, $dk$ of §1 and the final state, the closed form reproduces the kernel's
# $dg$ — and **what breaks if** the sum restarts at every chunk (as $b$ does)? The decay of a
# token's gate acts on every later token, across chunk borders:

# %%
args, ours, truth, S_final = results["GLA, per-dimension gates"]
db = args["q"] * ours["q"] - args["k"] * ours["k"]                 # ∂L/∂b, [B, T, H, K]
db[:, -1] += (S_final * dS_T).sum(-1)                              # the final state's own decay
dg = db.flip(1).cumsum(1).flip(1)
restart = torch.cat([x.flip(1).cumsum(1).flip(1) for x in db.split(C, dim=1)], dim=1)
print(f"closed form from the kernel's dq, dk: {testing.rel_err(dg, truth['g']):.1e};"
      f" restarted every chunk: {testing.rel_err(restart, truth['g']):.2f}")
assert testing.rel_err(dg, truth["g"]) < 1e-4 < testing.rel_err(restart, truth["g"])

# %% [markdown]
# ## 5. What runs in parallel
#
# Two kernels walk the chunks: the state recomputation and the reverse pass. Their grid is
# (K-blocks × V-blocks × batch·head) — at the benchmark setting ($32768$ tokens, $H=16$,
# $K=V=128$) the reverse pass's blocks of 64 make $4\cdot 16\cdot B$ programs, and
# $B = 32768/T$ falls as sequences grow. The state recomputation is the forward's state pass,
# with its block shapes (`gated.state_config`: for per-dimension gates $32\times128$, or
# $16\times128$ once that would leave half the multiprocessors idle). The other kernels have a program per chunk (or row block, or sub-chunk), so
# their grid stays the same at every $T$. The figure counts the programs each kernel launches,
# from the same block sizes the library uses, against the 132 multiprocessors of an H100/H200:

# %%
Ts = [1024, 2048, 4096, 8192, 16384, 32768]
KB = -(-128 // gated_backward.GRAD_BLOCK)                       # K-blocks of the gradient kernels
SB = (-(-128 // gated.STATE_BLOCK)) ** 2                        # K×V blocks of the reverse pass
BVv = gated.blocks(128, 128)[1]


def state_blocks(BH):
    BK, BV, _ = gated.state_config(128, 128, BH, gated.DIM_GATE, sms=132)
    return (-(-128 // BK)) * (-(-128 // BV))


def programs(T, C=64, c=16, tokens=32768, H=16):
    Bt, NT = tokens // T, T // C
    return {"state recomputation (sequential)": state_blocks(Bt * H) * Bt * H,
            "reverse pass (sequential)": SB * Bt * H,
            "dA": NT * (C // 64) * Bt * H,
            "intra dq, dk": KB * NT * (C // c) * Bt * H,
            "dv": (128 // BVv) * NT * (C // 64) * Bt * H,
            "dq, dk": KB * NT * (C // 64) * Bt * H}


fig, ax = plt.subplots(figsize=(8, 3.8))
for (name, style) in zip(programs(Ts[0]), ("v-", "o-", "s-", "^-", "D-", "x--")):   # dv and dq, dk coincide
    ax.plot(Ts, [programs(T_)[name] for T_ in Ts], style, label=name)
ax.axhline(132, color="gray", ls="--", lw=1, label="132 SMs (H100/H200)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks(Ts, [f"{t // 1024}k" for t in Ts])
ax.xaxis.set_minor_locator(plt.NullLocator())
ax.set_xlabel("sequence length T (B·T = 32768 tokens)")
ax.set_ylabel("programs launched")
ax.set_title("Backward kernels' grids: H = 16, K = V = 128, C = 64, c = 16")
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
fig.tight_layout()
plt.show()

# %% [markdown]
# At $T = 32\text{k}$ the two sequential kernels launch 64 and 128 programs for 132
# multiprocessors, each walking 512 chunks; every other kernel launches thousands. That is the
# same shape as the forward (chapter 10, §6), and the same remedies exist: narrower state blocks
# for more programs (they pay in the forward's state pass once 64×64 blocks leave half the
# multiprocessors idle; the reverse pass keeps 64×64), or splitting the sequence and composing
# chunk maps (chapter 08) — for the backward the maps run in reverse.
#
# ## 6. Recompute or keep the states
#
# `recompute=True` (default) computes the states $S_{[n]}$ ($B\cdot H\cdot N\cdot K\cdot V$ numbers)
# again in the backward and keeps only what is input-sized: for per-dimension gates the float32
# matrix $P$ ($B\cdot T\cdot H\cdot C$) and the cumulated gates $b$ ($B\cdot T\cdot H\cdot K$),
# which the forward built anyway and which cost about as much to rebuild as the states (FLA makes
# the same choice). `recompute=False` keeps the states as well and skips one more kernel. Both give the
# same gradients (the backward runs the same kernels on the same numbers). What waits between the
# two passes is what the `autograd.Function` saved for the backward beyond the inputs themselves
# (which the network keeps anyway):

# %%
Tm = pick(cpu=64, gpu=8192)
mem_args = bench.anchor_inputs("gla", Tm, **pick(cpu=dict(tokens=64, H=2, K=32, V=32, dtype=torch.float32,
                                                          device="cpu"), gpu={}))
held = {}
for recompute in (True, False):
    x = {n: a.detach().requires_grad_(True) for n, a in mem_args.items()}
    o, _ = lt.gla(**x, recompute=recompute)
    inputs = {a.untyped_storage().data_ptr() for a in x.values()}
    saved = [t for t in o.grad_fn.saved_tensors if t is not None and t.untyped_storage().data_ptr() not in inputs]
    held[recompute] = sum(t.numel() * t.element_size() for t in saved)
    print(f"recompute={recompute!s:5}: saved beyond the inputs {held[recompute] / 2**20:9.3f} MiB "
          f"({', '.join(str(tuple(t.shape)) for t in saved) or 'nothing'}); the output itself "
          f"{o.numel() * o.element_size() / 2**20:.3f} MiB")
    del o
a_and_b = mem_args["q"].numel() // mem_args["q"].shape[-1] * (64 + mem_args["q"].shape[-1]) * 4   # P and b, float32
assert held[True] == a_and_b < held[False]

# %% [markdown]
# Count the bytes per token and head at the benchmark setting (bf16, $K=V=128$, $C=64$): $q$ takes
# $128\cdot 2 = 256$; the states $K V / C = 256$ numbers in bf16, 512 bytes; $P$ 64 float32
# numbers, 256 bytes; the cumulated gates 128 float32 numbers, 512 bytes. The default keeps $P$ and
# $b$, three times the size of $q$ per layer; keeping the states too makes it five, for as long as
# the network waits between this layer's forward and its backward. Recomputing the states costs
# the kernel §7 times as "recompute states".

# %% [markdown]
# ## 7. Where the time goes
#
# `gated_backward.backward(..., timer=dict)` and `delta_backward.backward(..., timer=dict)` record
# the milliseconds of each stage (CUDA events around its launches; on a CPU the interpreter's wall
# clock, which says nothing about a GPU); `bench.backward_stages` runs one at the benchmark
# setting, doing the work of the default call. On a GPU the next cell measures live; on a CPU it
# shows the stages recorded by `tools/bench.py --suite train` in `book/data/bench_train.json`, if
# such a run has been recorded.

# %%
rec = bench.recorded_run("bench_train.json")


def stages_live(T_=8192):
    for op in ("linear_attn", "simple_gla", "gla", "delta_rule", "kda"):
        ms = bench.backward_stages(op, T_)
        print(f"{op}, T = {T_}, live (median of 5):\n" + bench.markdown_table(["stage", "ms"], list(ms.items())))


def stages_recorded():
    if rec is None:
        print("No recorded GPU run of the training benchmark is in book/data/ yet, so this chapter shows "
              "no backward timings on a CPU. On a GPU: python tools/bench.py --suite train --out DIR, "
              "then keep DIR/bench.json as book/data/bench_train.json.")
        return
    print("Recorded run:", bench.run_label(rec["env"]))
    for op, st in rec["train"]["stages"].items():
        if "ms" in st:
            print(f"{op}, T = {st['T']}:\n" + bench.markdown_table(["stage", "ms"], list(st["ms"].items())))


pick(cpu=stages_recorded, gpu=stages_live)()

# %% [markdown]
# ## 8. Forward + backward against softmax attention
#
# The left panel of the GLA paper's Figure 2, for training: at a fixed number of tokens, the time
# of one forward + backward of the layer's attention as the sequence grows, beside
# FlashAttention (causal SDPA) — which costs $O(T)$ per token where the chunkwise form costs
# $O(C + K)$. On a GPU the cell measures GLA and SDPA live; on a CPU it plots the recorded run
# (with FLA's `chunk_gla` beside them), if one exists.

# %%
def fwd_bwd_live():
    def train_ms(fn, inputs):
        """Median ms of one forward + backward (torch.autograd.grad) of fn's (first) output."""
        x = {n: a.requires_grad_(True) for n, a in inputs.items()}
        first = lambda: (lambda out: out[0] if isinstance(out, tuple) else out)(fn(**x))
        do = torch.randn_like(first())
        return bench.median_ms(lambda: torch.autograd.grad(first(), list(x.values()), do))

    ours, sdpa = [], []
    for T_ in Ts:
        ours.append(train_ms(lt.gla, bench.anchor_inputs("gla", T_)))
        qkv = {n: torch.randn(32768 // T_, 16, T_, 128, device="cuda", dtype=torch.bfloat16) for n in "qkv"}
        sdpa.append(train_ms(lambda **x: torch.nn.functional.scaled_dot_product_attention(
            x["q"], x["k"], x["v"], is_causal=True), qkv))
    return Ts, {"GLA (ours, Triton)": ours, "SDPA causal (FlashAttention)": sdpa}, "measured live"


def fwd_bwd_recorded():
    if rec is None:
        return None
    rows = sorted((r for r in rec["train"]["rows"] if r["op"] == "gla"), key=lambda r: r["T"])
    return ([r["T"] for r in rows], {"GLA (ours, Triton)": [r["triton"] for r in rows],
                                     "FLA chunk_gla": [r.get("fla") for r in rows],
                                     "SDPA causal (FlashAttention)": [r["sdpa"] for r in rows]},
            bench.run_label(rec["env"]))


series = pick(cpu=fwd_bwd_recorded, gpu=fwd_bwd_live)()
if series is None:
    print("No recorded GPU run of the training benchmark yet (book/data/bench_train.json): no figure on a CPU.")
else:
    Tx, ys, kind = series
    fig, ax = plt.subplots(figsize=(7, 4))
    bench.plot_times(ax, Tx, ys, title=f"GLA forward + backward, 32768 tokens, H = 16, K = V = 128, bf16\n{kind}")
    ax.set_xticks(Tx, [f"{t // 1024}k" for t in Tx])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_xlabel("sequence length T")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The whole recorded run — every operation, ours beside FLA 0.6.0 and SDPA, with the peak memory
# of one forward + backward (MiB above what was allocated before the call) — reads as a table.
# Where FLA refuses its backward on this toolchain (its gated backward for per-head gates, on
# Hopper with Triton < 3.7.1) the table says so.

# %%
def train_table(rec):
    cols = ["op", "T", "ours ms", "FLA ms", "ours/FLA", "SDPA ms", "ours/SDPA", "ours MiB", "FLA MiB"]
    mib = lambda b: None if b is None else round(b / 2**20)
    fla = lambda r: "refused" if "refused" in r.get("error_fla", "") else r.get("fla")
    rows = [[r["op"], r["T"], r["triton"], fla(r), r.get("ratio_fla"), r["sdpa"], r.get("ratio_sdpa"), mib(r.get("mem_triton")), mib(r.get("mem_fla"))]
            for r in sorted(rec["train"]["rows"], key=lambda r: (r["op"], r["T"]))]
    return bench.markdown_table(cols, rows)


if rec is None:
    print("No recorded GPU run of the training benchmark yet (book/data/bench_train.json).")
else:
    print("Recorded run:", bench.run_label(rec["env"]), "\n")
    print(train_table(rec))

# %% [markdown]
# Read it by family. GLA with per-dimension gates trains at FLA's speed and KDA faster than FLA at
# every length; linear attention and DeltaNet take longer (the stages of §7 show where: for
# DeltaNet the per-chunk gradients through the WY transform and the reverse pass). GLA's
# forward + backward costs about the same at 1k as at 16k tokens per sequence (the work per token
# is fixed), while SDPA's grows with $T$, so the lines cross between 4k and 8k. GLA and KDA hold
# less memory than FLA's; linear attention a little more, DeltaNet more still (it keeps the
# chunks' C×C matrices for the backward, as the table's memory columns show). KDA's gate stage
# (step 4 of §9) is where its per-dimension gates cost most: it takes the forward's split, so its
# sums over a chunk are tensor-core products wherever the chunk's gates decay by less than
# $e^{60}$ — every chunk of these benchmark gates, $\log\sigma(x)/16$, though not of KDA's own gates
# as initialised (chapter 10 §3b) — and walks the chunk one gate factor at a time only past that
# bound.

# %% [markdown]
# ## 9. The delta rules
#
# DeltaNet, Gated DeltaNet and KDA (chapter 11) have their own backward,
# `linattn/triton/delta_backward.py` and `wy_backward.py`. Their forward runs in three stages —
# the per-chunk WY factors ($A$, $\mathcal T = (I+A)^{-1}$, $W$, $U$), the state pass that also
# produces the corrected values $\tilde V = U - W S_{[n-1]}$, and the output — and the backward mirrors
# them:
#
# 1. **Recompute** (or keep, with `recompute=False`) the first two stages: the factors and the
#    states with $\tilde V$.
# 2. **One sequential pass** (`_dstate_kernel`, a program per V-block and head, chunks last to
#    first). The state now feeds back into the chunk through $\tilde V$, so the pass carries more
#    than GLA's: $d\tilde V = \text{scale}\,A_{qk}^\top dO + (K\odot\Gamma)\, dS_{[n]}$ and
#    $dS_{[n-1]} = \operatorname{diag}(e^{b_C})\, dS_{[n]} + \text{scale}\,(Q\odot e^{G})^\top dO - W^\top d\tilde V$
#    (the kernels keep $\text{scale}\,A_{qk}$ and $\text{scale}\,Q\odot e^{G}$, as in chapter 11).
#    The $-W^\top d\tilde V$ term is the delta rule's correction read backwards.
# 3. **Per-chunk reductions over $V$** (`_dchunk_kernel`, a program per chunk and head): every
#    gradient that sums over value dimensions, then the **WY backward** through
#    $\mathcal T = (I+A)^{-1}$: for $X = \mathcal T Y$, $dY = \mathcal T^\top dX$ and
#    $dA = -(\mathcal T^\top dX)\,X^\top$ on the strict lower triangle (chapter 12, §6).
# 4. **The chain rule through the decayed scores and gates** (`wy_backward.gate_stage`, a program
#    per K-block, chunk and head): $dq$, $dk$, $d\beta$ and $dg$. For per-dimension gates the sums
#    over the chunk, $\sum_j dA_{ij}\,e^{b_i - b_j} \odot k_j$ (and the same with
#    $\text{scale}\,dA_{qk}$ in place of $dA$) and their transposes, take the forward's
#    split (chapter 11): where the chunk's gates decay by less than $e^{60}$ in every key dimension
#    of the program, $e^{b_i - b_j} = e^{b_i}\cdot e^{-b_j}$ and each sum is one tensor-core
#    product, $e^{G}\odot dA\,(K\odot e^{-G})$; past the bound every exponent stays $\le 0$ and the
#    decay tiles are built one gate factor at a time (walking the columns for the row sums, the
#    rows for the column sums).
#
# Their tests are in `tests/test_triton_backward_delta.py`; the training benchmark of §8 times
# them beside FLA's `chunk_delta_rule`, `chunk_gated_delta_rule` and `chunk_kda`.
#
# ## Summary
#
# * The Triton backward of GLA and linear attention is seven kernels: recompute the states (the
#   forward's intra-chunk matrix $P$ and cumulated gates are kept), a **reverse pass** over the
#   state gradients, $dP = \text{scale}\,dO\,V^\top$, the intra-chunk parts of $dq$, $dk$, then $dv$, then
#   $dq$, $dk$ with their state parts and $\partial L/\partial b$, then $dg$ as a reverse
#   cumulative sum (within row blocks on chip, across blocks over their totals).
# * Only the state recomputation and the reverse pass walk the chunks; their grid shrinks as
#   sequences grow (64 programs at 32k tokens per sequence), everything else has a program per
#   chunk.
# * Gradient tiles use the forward's **secondary chunking** — off-diagonal tiles as matmuls with
#   a reference point chosen so every exponent is $\le 0$ (before the sub-chunk for $dq$, at its
#   last token for $dk$), diagonal tiles in float32 with decay tiles built one gate factor at a
#   time: a column walk for $dq$, a row walk (one rank-one tile per row) for $dk$.
# * The gate gradient's sum runs to the **end of the sequence**, not of the chunk.
# * `recompute=False` holds the states between forward and backward as well, for one kernel fewer.
#
# **Workbook:** `exercises/13_backward_triton.py` — the reverse state pass, an intra-chunk
# gradient tile, the dk row walk, the gate gradient's scan as kernels, then the whole GLA
# backward, which lets `impl="mine"` train.
