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
# so a model can *train* through `linattn.triton`. This chapter reads the library's backward
# kernels in the order they run, each one's code beside the formula it computes, and checks what
# each kernel writes against the chunk level (`linattn.chunk`) before moving to the next:
#
# 1. the reverse pass over the state gradients, `_dstates_kernel` (with the state recomputation, one of
#    the two kernels that walk the chunks);
# 2. the score gradient $dP$, `_dA_kernel`;
# 3. the intra-chunk parts of $dq$ and $dk$ with the forward's secondary chunking, `_intra_grad_kernel`
#    (steps 2 and 3 for per-dimension gates; otherwise `_dqk_kernel` does both, §5);
# 4. $dv$, `_dv_kernel`; $dq$, $dk$ with their state parts, `_dqk_kernel`;
# 5. the gate gradient in its chunk-local form, `_dqk_kernel` and `_dg_kernel` — with a measurement
#    of why the library does not sum it over the whole sequence;
#
# then what runs in parallel, what the default keeps between the passes, where the time goes, how
# forward + backward compares with softmax attention, and the delta rules' backward kernels.
#
# On a CPU the kernels run in the Triton interpreter at small sizes, and timings come from a
# recorded GPU run in `book/data/`; on a GPU the same cells run natively.

# %%
import contextlib
import inspect
import math
from unittest import mock

import matplotlib.pyplot as plt
import torch

import linattn  # first: without a GPU it switches Triton to its interpreter
from linattn import bench, chunk, naive, testing
from linattn import triton as lt
from linattn.chunk import gla_tiles
from linattn.chunk.gated import dense_chunks
from linattn.device import pick
from linattn.triton import common, delta, delta_backward, gated, gated_backward, wy, wy_backward
from linattn.validate import check_inputs

print(linattn.device.describe())
DEV = linattn.device.default_device()


def show(fn, first=None, last=None):
    """Print the library's source of fn (a @triton.jit kernel too) with its line numbers, from the
    line holding `first` to the line holding `last` (default: all of it)."""
    fn = getattr(fn, "fn", fn)                       # a kernel's Python function
    lines, start = inspect.getsourcelines(fn)
    lo = next((i for i, l in enumerate(lines) if first and first in l), 0)
    hi = next((i for i, l in enumerate(lines) if last and last in l and i >= lo), len(lines) - 1)
    path = inspect.getsourcefile(fn).split("linattn/")[-1]
    print(f"linattn/{path}, lines {start + lo}–{start + hi}:")
    for i in range(lo, hi + 1):
        print(f"{start + i:4d}  {lines[i].rstrip()}")

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
# §1). Let $dS_{[n]}$ be the gradient of the state *after* chunk $n$ and
# $dP_{ij} = \text{scale}\cdot dO_i\cdot v_j$ for $j\le i$ (the kernels' `dA`). Differentiating each
# line (chapter 12, §4):
#
# $$dS_{[n-1]} = \operatorname{diag}(e^{b_C})\,dS_{[n]} + \text{scale}\,(Q\odot e^{G})^\top dO
#   \qquad\text{(reverse pass, sequential)}$$
#
# $$dq_i = \text{scale}\,(dO_i\,S_{[n-1]}^\top)\odot e^{b_i} + \sum_{j\le i} dP_{ij}\,k_j\odot e^{\,b_i-b_j},\qquad
#   dk_j = (v_j\, dS_{[n]}^\top)\odot e^{\,b_C-b_j} + \sum_{i\ge j} dP_{ij}\,q_i\odot e^{\,b_i-b_j},$$
#
# $$dv_j = (k_j\odot e^{\,b_C-b_j})\,dS_{[n]} + \text{scale}\sum_{i\ge j}P_{ij}\,dO_i,$$
#
# and the gate gradient in chapter 12's chunk-local form (§5.1 there derives it), for a position
# $u$ of chunk $n$, with $dk^{\text{intra}}$ the second term of $dk$ and $w_j = k_j\odot(v_j\,dS_{[n]}^\top)\odot e^{b_C-b_j}$
# the first term times $k_j$:
#
# $$dg_u = \sum_{t\ge u}\big(q_t\odot dq_t - k_t\odot dk^{\text{intra}}_t\big) + \sum_{j<u} w_j
#   + e^{b_C}\odot\textstyle\sum_\nu\big(S_{[n-1]}\odot dS_{[n]}\big)_{:,\nu},$$
#
# both sums inside the chunk. `linattn/triton/gated_backward.py` runs these as seven kernels; the
# table lists them in the order they run:
#
# | step | kernel | grid (programs) | walks the chunks? |
# |---|---|---|---|
# | recompute $S_{[n-1]}$ | `gated._states_kernel` (the forward's state pass) | (K-block, V-block, batch·head) | **yes** |
# | reverse pass | `_dstates_kernel` | (K-block, V-block, batch·head) | **yes** (last to first) |
# | $dP = \text{scale}\,dO\,V^\top$ | `_dA_kernel` | (row block of a chunk, batch·head) | no |
# | intra $dq$, $dk$ | `_intra_grad_kernel` | (K-block, sub-chunk, batch·head) | no |
# | $dv$ | `_dv_kernel` | (V-block, row block, batch·head) | no |
# | $dq$, $dk$, each row block's share of $dg$ | `_dqk_kernel` | (K-block, row block, batch·head) | no |
# | $dg$ | `_dg_kernel` | (K-block, row block, batch·head) | no |
#
# Without per-dimension gates, in chunks of up to 64 tokens, `_dqk_kernel` computes $dP$ and the
# intra parts itself and the two rows after the reverse pass do not run (§5).
# `GatedAttention` (an `autograd.Function`) runs them when an input requires grad. First, the whole
# thing against float64 autograd through the token loop, for the three gate kinds — $T$ not a
# multiple of the chunk, $K \ne V$, an initial state, and a gradient arriving on the final state too:

# %%
B, T, H, K, V = 1, pick(cpu=45, gpu=1000), 2, pick(cpu=32, gpu=128), pick(cpu=48, gpu=96)
C, c = pick(cpu=32, gpu=64), 16
gen = torch.Generator().manual_seed(0)
dO = torch.randn(B, T, H, V, generator=gen).to(DEV)
dS_T = torch.randn(B, H, K, V, generator=gen).to(DEV)


def gradients(fn, args, dO, dS_T, **kw):
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
    ours, S_final = gradients(getattr(lt, op), args, dO, dS_T, **extra)
    truth, _ = gradients(getattr(naive, op), testing.to_float64(args), dO.double(), dS_T.double())
    errs = {n: testing.rel_err(ours[n], truth[n]) for n in ours}
    results[name] = (args, ours, truth, S_final)
    print(f"{name:26s}" + "  ".join(f"d{n}: {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) < 1e-4          # float32 gradients (the library's tests use the same bound)

# %% [markdown]
# Now the kernels one at a time, on the per-dimension gates' case. The cell below runs the
# library's `backward` once with a recorder around its launches (`gated_backward.launch`), which
# keeps each kernel's arguments by name: every buffer a kernel wrote can then be read and checked.
# The references come from the previous level: `linattn.chunk.gla` in float64, its autograd for the
# gradients and its pieces (`dense_chunks`, `gla_tiles`) for the intermediates.

# %%
args, ours, truth, S_final = results["GLA, per-dimension gates"]


@contextlib.contextmanager
def recorded_launches(*modules):
    """Inside the block, every kernel the modules launch is recorded in order, in the list it yields:
    (kernel name, {argument name: value})."""
    seen = []

    def spy(real):
        def launch(kernel, grid, *a, **kw):
            seen.append((kernel.fn.__name__, {**dict(zip(kernel.arg_names, a)), **kw, "grid": grid}))
            return real(kernel, grid, *a, **kw)
        return launch
    with contextlib.ExitStack() as stack:
        for m in modules:
            stack.enter_context(mock.patch.object(m, "launch", spy(m.launch)))
        yield seen


def traced_backward(args, dO, dS_T, C, c):
    """The library's backward on args, and {kernel name: {argument name: value}} of its launches."""
    q, k, v, g, s0 = (args[n] for n in ("q", "k", "v", "g", "initial_state"))
    d = check_inputs(q, k, v, g=g, initial_state=s0, gate=True)
    with recorded_launches(gated_backward) as seen, testing.poisoned():
        grads = gated_backward.backward(dO, dS_T, q, k, v, g, s0, d, chunk_size=C, sub_chunk_size=c)
    return dict(zip(("q", "k", "v", "g", "initial_state"), grads)), dict(seen)


traced, launched = traced_backward(args, dO, dS_T, C, c)
prev, _ = gradients(chunk.gla, testing.to_float64(args), dO.double(), dS_T.double(), chunk_size=C)
for n in traced:
    assert torch.equal(traced[n], ours[n])       # the traced run is the autograd run
print("kernels launched, in order:", ", ".join(launched))

# %% [markdown]
# ## 2. The reverse pass: `_dstates_kernel`
#
# The forward's one sequential part carries the state forward through the chunks; the backward's
# one sequential part carries the state gradient $dS$ **backward**: start from the final state's
# gradient, and before stepping to the previous chunk, decay $dS$ by the chunk's total gate and add
# what the chunk's outputs ask of the state, $\text{scale}\,(Q\odot e^{G})^\top dO$. Each program
# owns a block of $dS$ for one (batch, head) — the rows and columns of $dS$ never mix, exactly as
# in the forward's state pass — and stores $dS_{[n]}$ for every chunk (`dh`) *before* adding chunk
# $n$'s own term: chunk $n$'s outputs read the state before the chunk, so they do not reach the
# state after it. After the first chunk, what is left is the gradient of the initial state (`ds0`).

# %%
show(gated_backward._dstates_kernel)

# %% [markdown]
# The check needs $dS_{[n]}$ from the chunk level, which never stores it. It does not have to:
# the loss is linear in the state after chunk $n$, so its gradient is the initial state's
# gradient of the *rest of the sequence* — `chunk.gla` on the tokens after chunk $n$, started from
# any state (zeros here), with the same $dO$ and final-state gradient:

# %%
def state_gradient_after(n, args, dO, dS_T, C):
    """dS_[n] at the chunk level: d initial_state of the tokens after chunk n (float64)."""
    rest = {m: args[m][:, (n + 1) * C:].double() for m in ("q", "k", "v", "g")}
    if rest["q"].shape[1] == 0:
        return dS_T.double()
    s = torch.zeros_like(dS_T, dtype=torch.float64).requires_grad_(True)
    o, S = chunk.gla(**rest, initial_state=s, output_final_state=True, chunk_size=C)
    ((o * dO[:, (n + 1) * C:].double()).sum() + (S * dS_T.double()).sum()).backward()
    return s.grad


dh = launched["_dstates_kernel"]["dh"]                    # [B, H, NT, K, V]
NT = dh.shape[2]
for n in range(NT):
    e = testing.rel_err(dh[:, :, n].float(), state_gradient_after(n, args, dO, dS_T, C))
    print(f"dS after chunk {n}: {e:.1e}")
    assert e < 1e-5
e = testing.rel_err(launched["_dstates_kernel"]["ds0"], prev["initial_state"])
print(f"d initial_state: {e:.1e}")
assert e < 1e-5

# %% [markdown]
# ## 3. The score gradient: `_dA_kernel`
#
# $dP = \text{scale}\cdot dO\,V^\top$ on the lower triangle of every chunk (diagonal included),
# float32, summed over $V$ in blocks; the upper triangle is written as zeros, so later kernels may
# read whole tiles. One program per row block of a chunk; no program depends on another.

# %%
show(gated_backward._dA_kernel)

# %% [markdown]
# At the chunk level $dP$ is one line of `linattn.chunk.gla_backward.gradients`, on the same chunks:

# %%
def chunks(x):
    """[B, T, H, ...] → [B, H, N, C, ...] float64, zero past T (the chunk level's layout)."""
    return dense_chunks(x.cpu(), C, torch.float64)


scale = K ** -0.5
dP_chunk = K ** -0.5 * (chunks(dO) @ chunks(args["v"]).transpose(-1, -2)).tril()   # [B, H, N, C, C]
dA = launched["_dA_kernel"]["dA"]                                                    # [B, T, H, C]
e = testing.rel_err(chunks(dA), dP_chunk)
print(f"dA vs the chunk level's scale · tril(dO Vᵀ): {e:.1e}")
assert e < 1e-6

# %% [markdown]
# ## 4. Gradient tiles with secondary chunking: `_intra_grad_kernel`
#
# The intra-chunk sums $\sum_{j\le i} dP_{ij}\,k_j\odot e^{b_i-b_j}$ (for $dq$) and
# $\sum_{i\ge j} dP_{ij}\,q_i\odot e^{b_i-b_j}$ (for $dk$) have the shape of $P$ itself — a decay
# *inside* the sum over tokens, per key dimension — so they are built like $P$ in chapter 10, from
# $c\times c$ tiles (sub-chunks counted from 0, as in chapter 05). One program per (K-block,
# sub-chunk, batch·head) computes both for the rows of its sub-chunk $i$; given $dP$, every key
# dimension is independent, so $K$ is split into blocks of 64 and the float32 tiles stay
# $c\times 64$ whatever $K$ is.
#
# **Off-diagonal tiles** become tensor-core matmuls after splitting $e^{b_i-b_j}$ at a position $r$
# between the two sub-chunks into two factors $\le 1$; the point differs for the two gradients.
# For $dq$ (query sub-chunk $i$, key sub-chunks $j<i$) $r = ic$, the last position *before*
# sub-chunk $i$: $dq_{[i]} = e^{G_{[i]} - b_r}\odot\sum_{j<i} dP_{[i][j]}\,(K_{[j]}\odot e^{b_r-G_{[j]}})$.
# For $dk$ (key sub-chunk $i$, query sub-chunks $i'>i$) $r = (i+1)c$, the *last position* of
# sub-chunk $i$: $dk_{[i]} = e^{b_r-G_{[i]}}\odot\sum_{i'>i} dP_{[i'][i]}^\top(Q_{[i']}\odot e^{G_{[i']}-b_r})$.
# Either way one reference serves every tile a program sums, and every exponent is $\le 0$:

# %%
show(gated_backward._intra_grad_kernel, "# --- dq: key sub-chunks", "# --- the diagonal tile")

# %% [markdown]
# **Diagonal tiles** have no point between their queries and keys; they are summed in float32
# with decay tiles built one gate factor ($e^{g}\le 1$) at a time. For $dq$ (a sum over columns $j$
# for each row $i$) a column walk, last column first: $E_j[i] = e^{b_i-b_j}$ from $E_{j+1}$ with one
# exponential per key dimension. For $dk$ (a sum over rows $i$ for each column $j$) the same walk
# over rows, $F_i[j] = F_{i-1}[j]\,e^{g_i}$: each row adds the rank-one tile
# $dP_{i,\cdot}\otimes q_i \odot F_i$ to all of $dk$ at once. Walking columns for $dk$ instead would
# need a sum across the rows and a write into one row per column, both slower on a GPU than one
# rank-one update per step. Per-head gates and linear attention take the `else` branch: the decay
# leaves the sum over $\kappa$, and the diagonal tile is a masked matmul as in the forward.

# %%
show(gated_backward._intra_grad_kernel, "# --- the diagonal tile", "tl.store(dki")

# %% [markdown]
# The chunk level builds the same sums with its own tiles (`gla_tiles.intra_backward`: blocks split
# at their boundary, halved down to single tokens), on $dP$ *without* its diagonal and with the
# scale folded into the queries. Adding the diagonal back gives what the kernel wrote:
# $dq^{\text{intra}} = \text{scale}\,(dq_{\text{chunk}} + dP_{ii}k_i)$ and
# $dk^{\text{intra}} = dk_{\text{chunk}} + dP_{ii}\,\text{scale}\,q_i$ (here $dP$ without scale):

# %%
qc, kc, gc = (chunks(args[n]) for n in ("q", "k", "g"))
dP_plain = chunks(dO) @ chunks(args["v"]).transpose(-1, -2)                  # [B, H, N, C, C] no scale
diag = dP_plain.diagonal(dim1=-2, dim2=-1)[..., None]                        # dP_ii
_, dq_c, dk_c = gla_tiles.intra_backward(dP_plain.tril(-1), scale * qc, kc, gla_tiles.Sweep(gc.exp()))
want_dq, want_dk = scale * (dq_c + diag * kc), dk_c + diag * scale * qc
e_q = testing.rel_err(chunks(launched["_intra_grad_kernel"]["dqi"]), want_dq)
e_k = testing.rel_err(chunks(launched["_intra_grad_kernel"]["dki"]), want_dk)
print(f"intra dq: {e_q:.1e}   intra dk: {e_k:.1e}  (against linattn.chunk.gla_tiles)")
assert max(e_q, e_k) < 1e-5

# %% [markdown]
# **What breaks if** the $dk$ tiles used $dq$'s reference (the position $r = ic$ *before* sub-chunk
# $i$)? The key factor becomes $e^{b_r-b_j}$ with $j$ in sub-chunk $i$, *after* $r$: a positive
# exponent (`r_before` below holds $b_r$, `r_last` the right reference). Under strong gates (down
# to $-20$ per step) it overflows:

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
# ## 5. $dv$, then $dq$ and $dk$: `_dv_kernel`, `_dqk_kernel`
#
# $dv_j = (k_j\odot e^{b_C-b_j})\,dS_{[n]} + \text{scale}\sum_{i\ge j}P_{ij}\,dO_i$: one program per
# (V-block, row block of keys, batch·head) starts from the state part — the keys decayed to the
# chunk's end times the state gradient `dh` of the reverse pass — and adds $P^\top dO$ over the
# query row blocks at and after its keys. For per-dimension gates $P$ is the forward's matrix
# (kept, §8); otherwise the kernel rebuilds each $P$ tile as a masked product $QK^\top$.

# %%
show(gated_backward._dv_kernel)

# %%
e = testing.rel_err(launched["_dv_kernel"]["dv"], prev["v"])
print(f"dv vs linattn.chunk: {e:.1e}")
assert e < 1e-5

# %% [markdown]
# `_dqk_kernel` adds the state parts, two sums over $V$ per row block:
# $\text{scale}\,(dO\,S_{[n-1]}^\top)\odot e^{b_i}$ into $dq$ and the write part
# $(V\,dS_{[n]}^\top)\odot e^{b_C-b_j}$ into $dk$, to the intra parts of §4. It is also where the gate
# gradient is formed (next section), because only here are $dq$, $dk$ at hand in float32 — before
# they are rounded to the input's dtype:

# %%
show(gated_backward._dqk_kernel)

# %%
e_q, e_k = (testing.rel_err(launched["_dqk_kernel"][n], prev[n[-1]]) for n in ("dq", "dk"))
print(f"dq: {e_q:.1e}   dk: {e_k:.1e}  (against linattn.chunk)")
assert max(e_q, e_k) < 1e-5

# %% [markdown]
# ### Without per-dimension gates, $dP$ never leaves the kernel
#
# Steps 2 and 3 exist for the per-dimension gates: their intra parts need the secondary chunking of
# §4, tile by tile. Without them — linear attention, and per-head gates, where the decay
# $e^{b_i-b_j}$ is one number per pair of tokens — a chunk's whole intra part is
# $dq^{\text{intra}} = (dP \odot \Gamma)\,K$ and $dk^{\text{intra}} = (dP\odot\Gamma)^\top Q$,
# with $\Gamma$ the causal decay mask, and $dP = \text{scale}\,dO\,V^\top$ is one $C\times C$ tile.
# `_dqk_kernel` already reads $dO$ and $V$ of its rows, block by block over $V$, for the state
# parts; where its row block is the whole chunk ($C \le 64$) the same loop sums $dO\,V^\top$ too,
# and the intra parts are two more products at the end. $dP$ is then never written: at the
# benchmark setting (32k tokens, $H = 16$, $C = 64$) that is 128 MiB of float32 that `_dA_kernel`
# writes and `_intra_grad_kernel` reads back once per K-block, and two launches fewer. The lines
# that do it (`INTRA`):

# %%
show(gated_backward._dqk_kernel, "dA = tl.zeros([BR, BR]", "dk_t = dk_s + dk_in")

# %% [markdown]
# `gated_backward.fused_intra` decides, for half-precision inputs only: with float32 inputs the
# tensor-core products run in full float32 (IEEE), the fused kernel holds more than the registers
# take, and it came out slower than the three kernels it replaces (its docstring has the timings).
# The per-head case of §1 again, in bf16, traced both ways — fused, and with the rule switched off:

# %%
args_h = testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, initial_state=True, seed=1, device=DEV,
                             gate="per_head", dtype=torch.bfloat16)
traced_f, launched_f = traced_backward(args_h, dO, dS_T, C, c)
with mock.patch.object(gated_backward, "fused_intra", lambda *a: False):
    traced_s, launched_s = traced_backward(args_h, dO, dS_T, C, c)
print("fused:   ", ", ".join(launched_f))
print("separate:", ", ".join(launched_s))
assert "_dA_kernel" not in launched_f and "_intra_grad_kernel" in launched_s
truth_h, _ = gradients(naive.gla, testing.to_float64(args_h), dO.double(), dS_T.double())
for n in ("q", "k"):
    e_fs = testing.rel_err(traced_f[n], traced_s[n])
    e_f, e_s = testing.rel_err(traced_f[n], truth_h[n]), testing.rel_err(traced_s[n], truth_h[n])
    print(f"d{n}: fused against separate {e_fs:.1e};  against float64: fused {e_f:.1e}, separate {e_s:.1e}")
    assert e_fs < 1e-4 and e_f < 2e-2

# %% [markdown]
# ## 6. The gate gradient, chunk by chunk: `_dqk_kernel` and `_dg_kernel`
#
# The last lines of `_dqk_kernel` evaluate the chunk-local form of §1 over one row block, with
# `d_b` $= q\odot dq - k\odot dk^{\text{intra}}$ and `w` $= k\odot(\text{write part})$:

# %%
show(gated_backward._dqk_kernel, "d_b = q_t", "tl.store(db")

# %% [markdown]
# The line that forms `x` is $\sum_{t\ge u} db_t + \sum_{j<u} w_j + e^{b_C}\sum_\nu S_{[n-1]}\odot dS_{[n]}$ — a reverse
# cumulative sum, an *exclusive* prefix sum and the carried term `hD`, all on chip. A row block is
# the whole chunk when $C \le 64$ (every setting of this chapter); for $C = 128$ or $256$ the kernel
# also writes each row block's two totals, PyTorch sums them over the chunk's other row blocks
# (a few numbers per chunk), and `_dg_kernel` adds that carry to every token and, for per-head
# gates, sums over $K$. Nothing crosses a chunk boundary:

# %%
show(gated_backward._dg_kernel)

# %%
e_db = testing.rel_err(launched["_dqk_kernel"]["db"], prev["g"])          # one row block per chunk here
e_dg = testing.rel_err(launched["_dg_kernel"]["dg"], prev["g"])
print(f"row-block sums of _dqk_kernel: {e_db:.1e}   dg of _dg_kernel: {e_dg:.1e}  (against linattn.chunk)")
assert launched["_dg_kernel"]["HAS_CARRY"] is False and max(e_db, e_dg) < 1e-5

# %% [markdown]
# **Why chunk-local.** Chapter 12 (§3) first wrote the gate gradient as one sum over the whole
# sequence, $dg_t = \sum_{s\ge t}(q_s\odot dq_s - k_s\odot dk_s)$ (plus the final state's term),
# with $dq$, $dk$ the *full* gradients and $b$ summed from the sequence start. It is exact algebra,
# and a kernel could take it from $dq$, $dk$ alone. But under strong gates the true $dg$ is small
# while each $q_s\odot dq_s$ and $k_s\odot dk_s$ is not: the sum adds $T$ terms that cancel, and
# each term's rounding stays in the result. Chapter 12 (§5.1) derives the chunk-local form, which
# drops the cancelling terms before anything is rounded. The measurement here takes both forms
# from the same Triton backward — the whole-sequence sum from its $dq$, $dk$ as returned, the
# chunk-local form as its kernels compute $dg$ — against float64 autograd, as the gates strengthen,
# for float32 and for bf16 inputs (under the interpreter a bf16 kernel computes in float32 and
# rounds what it stores; its gates stay float32):

# %%
Tg = 256                                                   # the same length on every device
factors = (1, 6, 36, 216)                                  # gate strength: normal gates times this


def gate_errors(factor, dtype, seed=5):
    """Relative errors of dg against float64: (whole-sequence suffix sum, the kernels' chunk-local),
    and the gates' mean −g per step."""
    a = testing.make_inputs("gla", B=1, T=Tg, H=1, K=16, V=16, seed=seed, initial_state=True, dtype=dtype,
                            device=DEV)
    a["g"] = a["g"] * factor
    do = torch.randn(a["v"].shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)
    dsT = torch.randn(a["initial_state"].shape, generator=torch.Generator().manual_seed(seed + 1)).to(DEV)
    got, S = gradients(lt.gla, a, do, dsT, chunk_size=64, sub_chunk_size=16)
    ref, _ = gradients(naive.gla, testing.to_float64(a), do.double(), dsT.double())
    db = a["q"].float() * got["q"].float() - a["k"].float() * got["k"].float()   # from the stored dq, dk
    db[:, -1] += (S * dsT).sum(-1)                                               # the final state's decay
    whole = db.flip(1).cumsum(1).flip(1)
    return testing.rel_err(whole, ref["g"]), testing.rel_err(got["g"], ref["g"]), -a["g"].mean().item()


errs = {dt: [gate_errors(f, dt) for f in factors] for dt in (torch.float32, torch.bfloat16)}
print(f"{'mean −g per step':>17} | {'f32: whole':>10} {'chunk-local':>11} | {'bf16: whole':>11} {'chunk-local':>11}")
for (w32, l32, m), (w16, l16, _) in zip(errs[torch.float32], errs[torch.bfloat16]):
    print(f"{m:17.3g} | {w32:10.1e} {l32:11.1e} | {w16:11.1e} {l16:11.1e}")
(w32, l32, strength), (w16, l16, _) = (list(zip(*errs[dt])) for dt in (torch.float32, torch.bfloat16))
print(f"float32, mean log-gate −{strength[-1]:.3g} per step: the whole-sequence sum's error is "
      f"{w32[-1] / l32[-1]:.0f}× the chunk-local form's")
assert max(l32) < 1e-4 and w32[-1] > 5 * l32[-1]                   # float32: apart under strong gates
assert w16[-1] > 10 * w16[0] and w16[-1] > 5 * l16[-1]              # bf16: grows, worse under strong gates
if linattn.device.triton_mode() == "interpreter":                   # bf16 kernels compute in float32 here
    assert max(l16) < 1e-4 and all(w > 100 * l for w, l in zip(w16, l16))

fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
for ax, (title, w, l) in zip(axes, (("bf16 inputs", w16, l16), ("float32 inputs", w32, l32))):
    ax.loglog(strength, w, "o-", color="C3", label="whole-sequence suffix sum")
    ax.loglog(strength, l, "s--", color="C0", mfc="none", ms=10, label="chunk-local (the library's kernels)")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("mean log-gate per step, −g")
    ax.grid(True, which="major", alpha=0.3)
axes[0].set_ylabel("relative error of dg vs float64")
axes[0].legend(fontsize=8, loc="center right")
fig.suptitle(f"GLA gate gradient from the Triton backward, T = {Tg}, C = 64", fontsize=11)
fig.tight_layout()
plt.show()

# %% [markdown]
# With bf16 inputs the whole-sequence sum can only start from $dq$, $dk$ as stored, rounded to
# bf16: their rounding, of the size of $|q\odot dq|$, lands in a gradient that strong gates make
# small, and its error grows with the gate strength until it is a sizeable part of $dg$. The
# kernels form the chunk-local sums inside `_dqk_kernel` while $dq$, $dk$ are still float32, and
# leave out the terms that cancel. Under the interpreter a bf16 kernel computes in float32, so
# their error is float32's; natively its products are bf16 tensor-core products, which put it at
# bf16's level, still below the whole-sequence sum's under strong gates (the cell checks both). With
# float32 inputs the two agree under mild gates and part under strong ones (by the factor the cell
# prints at the strongest gates): the whole-sequence sum cancels across the sequence, while the chunk-local
# sums, and the final state whose decay the last token's term carries, stay at float32's level
# (the state pass sums each chunk's gates from its own end for float32 inputs, see
# `gated._state_step`); the whole-sequence sum's cancellation grows with $T$ as well (chapter 12's
# table). A chunk-local sum is also the cheaper one: nothing runs across chunks, so the scan stays
# on chip.
#
# ## 7. What runs in parallel
#
# Two kernels walk the chunks: the state recomputation and the reverse pass. Their grid is
# (K-blocks × V-blocks × batch·head) — at the benchmark setting ($32768$ tokens, $H=16$,
# $K=V=128$) blocks of 32×128 make $4\cdot 16\cdot B$ programs, and $B = 32768/T$ falls as
# sequences grow. Both write float32 states from bf16 inputs, twice the bytes of the forward's
# states, so they take launches of their own, timed on an H200 for exactly this
# (`gated_backward.state_launches`, shown after the figure). The other kernels have a program per
# chunk (or row block, or sub-chunk), so their grid stays the same at every $T$. The figure counts
# the programs each kernel launches, from the same block sizes the library uses, against the 132
# multiprocessors of an H100/H200:

# %%
Ts = [1024, 2048, 4096, 8192, 16384, 32768]
KB = -(-128 // gated_backward.GRAD_BLOCK)                       # K-blocks of the gradient kernels
BVv = gated.blocks(128, 128)[1]


def state_blocks(BH, which):
    """K×V blocks of the backward's recomputed states (which = 0) or reverse pass (1), bf16 inputs."""
    BK, BV, _, _ = gated_backward.state_launches(128, 128, BH, gated.DIM_GATE, False, 64, sms=132)[which]
    return (-(-128 // BK)) * (-(-128 // BV))


def programs(T, C=64, c=16, tokens=32768, H=16):
    Bt, NT = tokens // T, T // C
    return {"recompute states*": state_blocks(Bt * H, 0) * Bt * H,       # *: walks the chunks
            "reverse pass*": state_blocks(Bt * H, 1) * Bt * H,
            "dA": NT * (C // 64) * Bt * H,
            "intra dq, dk": KB * NT * (C // c) * Bt * H,
            "dv": (128 // BVv) * NT * (C // 64) * Bt * H,
            "dq, dk": KB * NT * (C // 64) * Bt * H}


grids = {}
for name in programs(Ts[0]):                                     # kernels with the same counts: one line
    ys = tuple(programs(T_)[name] for T_ in Ts)
    same = next((n for n, y in grids.items() if y == ys), None)
    grids[f"{same}; {name}" if same else name] = grids.pop(same) if same else ys
fig, ax = plt.subplots(figsize=(9, 4))
for (name, ys), style in zip(grids.items(), ("v-", "o-", "s-", "^-", "D-", "x--")):
    ax.plot(Ts, ys, style, label=name)
ax.axhline(132, color="gray", ls="--", lw=1, label="132 SMs (H100/H200)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks(Ts, [f"{t // 1024}k" for t in Ts])
ax.xaxis.set_minor_locator(plt.NullLocator())
ax.set_xlabel("sequence length T (B·T = 32768 tokens)")
ax.set_ylabel("programs launched")
ax.set_title("Programs per backward kernel (* walks the chunks)\nH = 16, K = V = 128, C = 64, c = 16",
             fontsize=10)
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
fig.tight_layout()
plt.show()
seq = {n: ys[-1] for n, ys in grids.items() if "*" in n}
assert len(grids) == 4                                           # six kernels, four distinct grids
print("at 32k tokens per sequence:", ", ".join(f"{n}: {p} programs" for n, p in seq.items()),
      f"(each walks {32768 // 64} chunks)")

# %% [markdown]
# At the longest sequences the two sequential kernels launch fewer programs than there are
# multiprocessors (the printout above), each walking hundreds of chunks; every other kernel
# launches thousands. That is the same shape as the forward (chapter 10, §6), and the same remedies
# exist: narrower state blocks for more programs, or splitting the sequence and composing chunk
# maps (chapter 08) — for the backward the maps run in reverse. The library takes the first:
# where 64×64 blocks would give at most half the multiprocessors a program (`gated.few_programs`),
# the state passes take 32×64 blocks, twice the programs. The launches, and what they were timed
# against:

# %%
show(gated_backward.state_launches)

# %% [markdown]
# The rule reads its numbers from a sweep of each pass alone (the comment above the function; every
# launch tried wrote the same states bit for bit, so a launch changes only time). Two things in it
# are worth a second look. The best launch at $B = 8$ was not the best at $B = 1$: with 512
# programs the wide 32×128 block, which loads each float32 gate tile once for all of $V$, wins; with
# 64 programs doubling them wins. And a 32-wide block never gets 8 warps, whatever a sweep says:
# `common.warps` gives 8 only where every head-dimension tile is at least 64 wide, since narrow tiles
# split between two warp groups came out wrong or faulted natively while the interpreter computed
# them right (`common.MIN_TILE`, chapter 10 §4).
#
# ## 8. What waits between the passes: recompute or keep
#
# The GLA paper's chunkwise form materialises one $K\times V$ state per chunk, $\frac{L}{C}\,d_k\,d_v$
# numbers, where the recurrent form would keep one per token. Between the forward and the backward
# those states can be kept or computed again; the library's `gla(..., recompute=...)` chooses
# (`linattn/triton/gated.py`, `gated_backward.GatedAttention`):
#
# * **`recompute=True`, the default.** The forward runs as it does without gradients, except that
#   with per-dimension gates it builds the whole intra-chunk matrix $P$ by secondary chunking
#   (not chapter 10's split, §3b there) and keeps it, $[B,T,H,C]$ float32, with the chunk-local
#   cumulative gates $b$, $[B,T,H,K]$ float32: two input-sized tensors it computed anyway. The
#   backward recomputes the states $S_{[n-1]}$ with the forward's state kernel, and for per-head
#   gates also $b$ (a chunk-local cumsum). Per-head gates and linear attention never store $P$:
#   the kernels rebuild its tiles as products $QK^\top$ where they need them.
# * **`recompute=False`.** The forward runs in its states mode and keeps the states
#   $[B,H,N,K,V]$ as well (in the dtype the forward stores them in, `gated.chunk_states`), and $b$
#   for per-head gates: more memory, one kernel fewer.
#
# Both give the same gradients: the backward runs the same kernels on the same numbers. What waits
# between the passes is what the `autograd.Function` saved beyond the inputs (which the network
# keeps anyway), here for the three gate kinds:

# %%
Tm = pick(cpu=64, gpu=8192)
size = pick(cpu=dict(tokens=64, H=2, K=32, V=32, dtype=torch.float32, device="cpu"), gpu={})
held = {}
for op in ("gla", "simple_gla", "linear_attn"):
    mem_args = bench.anchor_inputs(op, Tm, **size)
    fn = lt.linear_attn if op == "linear_attn" else lt.gla
    for recompute in (True, False):
        x = {n: a.detach().requires_grad_(True) for n, a in mem_args.items()}
        o, _ = fn(**x, recompute=recompute)
        inputs = {a.untyped_storage().data_ptr() for a in x.values()}
        saved = [t for t in o.grad_fn.saved_tensors if t is not None and t.untyped_storage().data_ptr() not in inputs]
        held[op, recompute] = saved
        print(f"{op:12s} recompute={recompute!s:5}: saved beyond the inputs "
              f"{sum(t.numel() * t.element_size() for t in saved) / 2**20:8.3f} MiB "
              f"({', '.join(f'{tuple(t.shape)} {str(t.dtype)[6:]}' for t in saved) or 'nothing'})")
        del o
q_ = bench.anchor_inputs("gla", Tm, **size)["q"]
BTH, Kq = q_.numel() // q_.shape[-1], q_.shape[-1]
assert sorted(t.numel() for t in held["gla", True]) == sorted([BTH * Kq, BTH * 64])   # b and P
assert held["simple_gla", True] == [] and held["linear_attn", True] == []             # nothing
assert all(len(held[op, False]) > len(held[op, True]) for op in ("gla", "simple_gla", "linear_attn"))

# per token and head at the benchmark setting (bf16 inputs, K = V = 128, C = 64)
K_, V_, C_ = 128, 128, 64
print(f"per token and head: q {K_ * 2} bytes (bf16); kept by default for per-dimension gates: "
      f"b {K_ * 4} bytes and P {C_ * 4} bytes (float32); the states, kept with recompute=False: "
      f"K·V/C = {K_ * V_ // C_} numbers")

# %% [markdown]
# The default thus holds, for per-dimension gates, three times the bytes of $q$ per layer; keeping
# the states adds $KV/C$ numbers per token and head — twice as many as $q$ has at this setting —
# for as long as the network waits between this layer's forward and its backward. Recomputing them costs one launch of the
# forward's state kernel, timed in §9 as "recompute states".

# %% [markdown]
# ## 9. Where the time goes
#
# `gated_backward.backward(..., timer=dict)` and `delta_backward.backward(..., timer=dict)` record
# the milliseconds of each stage (CUDA events around its launches; on a CPU the interpreter's wall
# clock, which says nothing about a GPU); `bench.backward_stages` runs one at the benchmark
# setting, doing the work of the default call. On a GPU the next cell measures live; on a CPU it
# shows the stages recorded by `tools/bench.py --suite train` in `book/data/bench_train.json`.
#
# The timer waits for each stage to finish before the next starts. Unsynchronised, the GPU starts a
# kernel while the previous one's last programs drain, and the CPU queues launches ahead; timed
# stage by stage, every stage pays its own start and its own tail. So the stages add up to more
# than the same work costs inside one backward — for some operations to more than the *whole*
# forward + backward step of the same run, which the table's last row shows — and the useful
# reading is each stage's **share**:

# %%
rec = bench.recorded_run("bench_train.json")


def stage_table(op, ms, T_, step=None):
    total = sum(ms.values())
    rows = [[name, t, f"{100 * t / total:.0f}%"] for name, t in ms.items()]
    rows.append(["sum of the stages", total, "100%"])
    if step is not None:
        rows.append(["one whole forward + backward, unsynchronised", step, "—"])
    return f"{op}, T = {T_}:\n" + bench.markdown_table(["stage", "ms", "share"], rows)


def stages_live(T_=8192):
    for op in ("linear_attn", "simple_gla", "gla", "delta_rule", "kda"):
        print(stage_table(op, bench.backward_stages(op, T_), T_) + "\n")


def stages_recorded():
    if rec is None:
        print("No recorded GPU run of the training benchmark is in book/data/ yet, so this chapter shows "
              "no backward timings on a CPU. On a GPU: python tools/bench.py --suite train --out DIR, "
              "then keep DIR/bench.json as book/data/bench_train.json.")
        return
    print("Recorded run:", bench.run_label(rec["env"]), "\n")
    for op, st in rec["train"]["stages"].items():
        if "ms" in st:
            step = next((r["triton"] for r in rec["train"]["rows"] if r["op"] == op and r["T"] == st["T"]), None)
            print(stage_table(op, st["ms"], st["T"], step) + "\n")
    largest = {op: max(st["ms"], key=st["ms"].get) for op, st in rec["train"]["stages"].items() if "ms" in st}
    print("largest stage:", "; ".join(f"{op}: {name}" for op, name in largest.items()))
    gla_ms = rec["train"]["stages"]["gla"]["ms"]
    top2 = sorted(gla_ms, key=gla_ms.get)[-2:]
    assert set(top2) == {"intra dq, dk", "dq, dk"}                  # what the text below says
    # DeltaNet's per-chunk stage is "per-chunk grads, WY" or, with the chain rule inside it (§11),
    # "per-chunk grads, WY, dq, dk, dg, dβ"
    assert largest["kda"] == "dq, dk, dg, dβ" and largest["delta_rule"].startswith("per-chunk grads, WY")


pick(cpu=stages_recorded, gpu=stages_live)()

# %% [markdown]
# Read the shares, not the sums (the printout under the tables names each operation's largest
# stage). For GLA with per-dimension gates the intra-chunk gradient tiles and `_dqk_kernel` take
# the largest shares — the two kernels with float32 walks over the diagonal tiles and the most sums
# over $K$ and $V$ — and the two sequential kernels (recompute states, reverse pass) less, although
# theirs is the grid that shrinks at long sequences (§7). For the delta rules the weight sits in
# the per-chunk gradients through the WY transform and, for KDA with its per-dimension gates, in
# the gate stage (§11).
#
# ## 10. Forward + backward against softmax attention
#
# The left panel of the GLA paper's Figure 2, for training: at a fixed number of tokens, the time
# of one forward + backward of the layer's attention as the sequence grows, beside
# FlashAttention (causal SDPA) — which costs $O(T)$ per token where the chunkwise form costs
# $O(C + K)$. On a GPU the cell measures GLA and SDPA live; on a CPU it plots the recorded run
# (with FLA's `chunk_gla` beside them).

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
    for line in ax.get_lines():               # FLA's line dashed, open squares: apart from ours
        if line.get_label() == "FLA chunk_gla":
            line.set(ls="--", marker="s", mfc="none", ms=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.show()
    ours_, sdpa_ = ys["GLA (ours, Triton)"], ys["SDPA causal (FlashAttention)"]
    cross = next(((a, b) for a, b, oa, ob, sa, sb in zip(Tx, Tx[1:], ours_, ours_[1:], sdpa_, sdpa_[1:])
                  if oa > sa and ob <= sb), None)
    print("GLA's forward + backward: from", f"{min(ours_):.2f} to {max(ours_):.2f} ms over these lengths;",
          "SDPA's from", f"{min(sdpa_):.2f} to {max(sdpa_):.2f} ms;",
          f"GLA becomes the faster between T = {cross[0]} and {cross[1]}" if cross else "no crossing here")

# %% [markdown]
# The whole recorded run — every operation, ours beside FLA and SDPA, with the peak memory of one
# forward + backward (MiB above what was allocated before the call) — reads as a table. Where FLA
# refuses its backward on the recorded toolchain (its gated backward for per-head gates, on Hopper
# with Triton < 3.7.1) the table says so.

# %%
def train_table(rec):
    cols = ["op", "T", "ours ms", "FLA ms", "ours/FLA", "SDPA ms", "ours/SDPA", "ours MiB", "FLA MiB"]
    mib = lambda b: None if b is None else round(b / 2**20)
    fla = lambda r: "refused" if "refused" in r.get("error_fla", "") else r.get("fla")
    rows = [[r["op"], r["T"], r["triton"], fla(r), r.get("ratio_fla"), r["sdpa"], r.get("ratio_sdpa"), mib(r.get("mem_triton")), mib(r.get("mem_fla"))]
            for r in sorted(rec["train"]["rows"], key=lambda r: (r["op"], r["T"]))]
    return bench.markdown_table(cols, rows)


def family_summary(rec):
    """Per op: the range of ours/FLA over the lengths, and ours vs FLA in peak memory."""
    out = {}
    for op in sorted({r["op"] for r in rec["train"]["rows"]}):
        rs = [r for r in rec["train"]["rows"] if r["op"] == op and r.get("ratio_fla")]
        if rs:
            out[op] = (min(r["ratio_fla"] for r in rs), max(r["ratio_fla"] for r in rs),
                       max(r["mem_triton"] / r["mem_fla"] for r in rs))
    return out


def gate_summary(rec):
    """Per (op, gate distribution) other than the mild gates: the range of ours/FLA over the lengths."""
    out = {}
    for gates, rows in rec["train"].get("by_gates", {}).items():
        for op in sorted({r["op"] for r in rows}):
            rs = [r["ratio_fla"] for r in rows if r["op"] == op and r.get("ratio_fla")]
            if rs:
                out[op, gates] = (min(rs), max(rs))
    return out


if rec is None:
    print("No recorded GPU run of the training benchmark yet (book/data/bench_train.json).")
else:
    print("Recorded run:", bench.run_label(rec["env"]), "\n")
    print(train_table(rec), "\n")
    fam = family_summary(rec)
    for op, (lo, hi, mem) in fam.items():
        print(f"{op:18s} ours/FLA time {lo:.2f}–{hi:.2f}, peak memory ours/FLA {mem:.2f}")
    strong = gate_summary(rec)
    for (op, gates), (lo, hi) in strong.items():
        print(f"{op:18s} with {gates} gates: ours/FLA time {lo:.2f}–{hi:.2f}")
    # what the text below says, read from the recorded run
    assert fam["gla"][1] < 1 and fam["kda"][1] < 1.01 and fam["linear_attn"][0] < 1 < fam["delta_rule"][0]
    assert max(m for _, _, m in fam.values()) < 1.05 and fam["kda"][2] < 1 and fam["linear_attn"][2] < 1
    assert min(lo for (op, _), (lo, _) in strong.items() if op == "kda") > 1.5
    assert max(hi for (op, _), (_, hi) in strong.items() if op == "gla") < 1

# %% [markdown]
# Read it by family, with the last printout's ratios (below 1: ours faster or smaller). The table
# is the benchmark's mild gates, $\log\sigma(x)/16$. With them KDA trains at or below FLA's time at
# every length, and GLA with per-dimension gates a little faster than FLA's `chunk_gla`, although it
# pays for the precision rules of §12 (float32 states, tf32 products of computed operands, a
# near-float32 $P^\top dO$) that bring its gate gradient level with FLA's. What paid for them is
# launches: the sequential passes that write float32 states, and `_dqk_kernel` and `_dv_kernel`, run
# with the block shapes, warps and pipeline stages that were fastest when timed natively
# (`gated_backward.state_launches`, `dqk_launch`, `dv_warps`; `docs/performance.md` has the tables,
# kernel by kernel beside FLA's). Linear attention is a little faster than FLA at most lengths,
# DeltaNet slower everywhere (§9 shows where: the per-chunk gradients through the WY transform).
# GLA's forward + backward costs about the same at every length (the work per token is fixed), while
# SDPA's grows with $T$, so the lines cross where the figure's printout says. GLA holds as much
# memory as FLA (both keep float32 states for the backward), the others less.
#
# The last lines are the gates models produce: $\log\sigma(x)$ without the damping, and KDA's own
# initialisation (Mamba-2's, $-e^{A_{\log}}\,\mathrm{softplus}(x + \Delta)$), whose 64-token
# chunks decay by $e^{-74}$ to $e^{-246}$. GLA's time does not move with them, nor does FLA's; KDA's
# roughly doubles. Past the split's bound (chapter 11: $e^{G_i}\cdot e^{-G_j}$ with both factors in
# float32's range) the forward redoes such chunks in its exact kernel, and the gate kernel of §11
# moves its reference point to every 16-row block. A benchmark with mild gates alone would have
# called KDA faster than FLA; with the gates of a real layer it is not. The figure draws the same
# record: each gated operation with FLA beside it, one line per gate distribution.

# %%
def by_gates(rec, op, key):
    """{gate distribution: [ms at each T]} of one op's recorded forward + backward (key: triton or fla)."""
    sets = {"mild": rec["train"]["rows"], **rec["train"].get("by_gates", {})}
    out = {}
    for gates, rows in sets.items():
        rs = sorted((r for r in rows if r["op"] == op), key=lambda r: r["T"])
        if rs:
            out[gates] = ([r["T"] for r in rs], [r.get(key) for r in rs])
    return out


if rec is not None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op, name in zip(axes, ("gla", "kda"), ("GLA", "KDA")):
        fla = by_gates(rec, op, "fla")
        for (gates, (Tx, ms)), colour in zip(by_gates(rec, op, "triton").items(), ("C0", "C1", "C2")):
            ax.plot(Tx, ms, marker="o", color=colour, label=f"ours, {gates} gates")
            ax.plot(Tx, fla[gates][1], ls="--", marker="s", mfc="none", color=colour, label=f"FLA, {gates} gates")
        ax.set_xscale("log", base=2)
        ax.set_xticks(Tx, [f"{t // 1024}k" for t in Tx])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set_ylim(0, None)
        ax.set(xlabel="sequence length T (32768 tokens per call)", ylabel="ms, forward + backward",
               title=f"{name}: time by gate distribution")
        ax.legend(fontsize=7, ncol=2, loc="lower right")            # below the lines: nothing there
    fig.suptitle(bench.run_label(rec["env"]), fontsize=9)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## 11. The delta rules' backward kernels
#
# DeltaNet, Gated DeltaNet and KDA (chapter 11) have their own backward,
# `linattn/triton/delta_backward.py` and `wy_backward.py`, derived in chapter 12 (§6). Their
# forward runs in three stages — the per-chunk WY factors ($A$, $\mathcal T = (I+A)^{-1}$, $W$, $U$),
# the state pass that also produces the corrected values $\tilde V = U - W S_{[n-1]}$, and the
# output — and the backward mirrors them:

# %%
show(delta_backward.backward)

# %% [markdown]
# **One sequential pass**, `_dstate_kernel` (a program per V-block and head, chunks last to first).
# The state now feeds back into the chunk through $\tilde V$, so the pass carries more than GLA's:
# $d\tilde V = \text{scale}\,A_{qk}^\top dO + (K\odot\Gamma)\, dS_{[n]}$ and
# $dS_{[n-1]} = \operatorname{diag}(e^{b_C})\, dS_{[n]} + \text{scale}\,(Q\odot e^{G})^\top dO - W^\top d\tilde V$
# (the kernels keep $\text{scale}\,A_{qk}$ and $\text{scale}\,Q\odot e^{G}$, as in chapter 11). The
# $-W^\top d\tilde V$ term is the delta rule's correction read backwards:

# %%
show(delta_backward._dstate_kernel)

# %% [markdown]
# **Per-chunk reductions over $V$**, `_dchunk_kernel` (a program per chunk and head): every
# gradient that sums over value dimensions, then the **WY backward** through
# $\mathcal T = (I+A)^{-1}$: for $X = \mathcal T Y$, $dY = \mathcal T^\top dX$ and
# $dA = -(\mathcal T^\top dX)\,X^\top$ on the strict lower triangle (chapter 12, §6):

# %%
show(delta_backward._dchunk_kernel)

# %% [markdown]
# **The chain rule through the decayed scores and gates**, `wy_backward._gate_kernel` (a program per
# K-block, chunk and head): $dq$, $dk$, $d\beta$ and $dg$. For per-dimension gates the sums over the
# chunk, $\sum_j dA_{ij}\,e^{b_i - b_j} \odot k_j$ (and the same with $\text{scale}\,dA_{qk}$ in place
# of $dA$) and their transposes, take the forward's split (chapter 11): where the chunk's gates
# decay by less than $e^{60}$ in every key dimension of the program, $e^{b_i - b_j} = e^{b_i}\cdot e^{-b_j}$
# and each sum is one tensor-core product. Past the bound the split's reference point moves from
# the chunk start to each 16-row block (`_block_terms`: for the column block $J$ starting after
# token $p$, $e^{b_i - b_j} = e^{b_i - b_p}\cdot e^{b_p - b_j}$, the first factor $\le 1$ outside
# the product, the second at most the block's own decay inside it), which covers the gates KDA's
# layer starts from (a chunk decays by up to $e^{250}$, a block by less than $e^{60}$); every
# exponent is a sum of the gates between its two tokens, never a difference of two sums from the
# chunk start, whose rounding near $-250$ would cost $dg$ two digits. Each is a running sum within
# its own 16-row block, one scan for the whole chunk, plus the totals of the whole blocks in
# between, added to a carry as the kernel walks the blocks. Past that too
# (log-gates of $-20$ per token) every exponent stays $\le 0$ and the decay tiles are built one
# gate factor at a time (`_columns`). Its gate gradient is chunk-local, like GLA's:

# %%
show(wy_backward._gate_kernel)

# %% [markdown]
# ### Without per-dimension gates, the chain rule stays in the per-chunk kernel
#
# For DeltaNet and Gated DeltaNet the decay between two tokens is one number, so $E$ is one
# $C \times C$ tile and each of the four sums above is a single product over the chunk's score
# gradients; nothing needs K-blocks or the split. And `_dchunk_kernel` already holds every key
# dimension of what `_gate_kernel` reads: $dQ_s$, $dK_d$, $dB_k$ ($C \times K$ each) and $dA$,
# $dA_{qk}$ ($C \times C$), summed over $V$ in its loop. Handing them over means writing them to
# memory in float32 and reading them back: at 32k tokens, $H = 16$, $K = 128$, $C = 64$ that is
# 768 MiB of $C \times K$ tiles and 256 MiB of score gradients, written once and read once, plus
# a launch. So for half-precision inputs with key tiles up to 128 wide
# (`delta_backward.fused_gates`) the per-chunk kernel finishes the job with the same function
# `_gate_kernel` calls for these gates. It takes the terms one at a time — $dq$ first, stored at
# once — so that besides the kernel's own tiles only one product and two sums are live:

# %%
show(wy_backward.head_gate_grads)

# %% [markdown]
# and the lines of `_dchunk_kernel` that call it (`FUSE`), where the program's key tile is the
# whole of $K$, so $d\beta$ and the per-head $dg$ are complete sums, not a K-block's part:

# %%
show(delta_backward._dchunk_kernel, "if FUSE:", "dg1.to(dg_out")

# %% [markdown]
# What breaks if the fused epilogue forgets that a chunk ends at $C$: `nxt` masks token $i + 1$
# to the chunk, and without `jc < C - 1` the last row's tail would read the next chunk's first gate,
# wrong only for gated chunks followed by another (the library's test
# `test_fused_gate_step_equals_the_separate_kernel` goes red on exactly that). Gated DeltaNet in
# bf16, traced both ways — fused, and with the rule switched off:


# %%
def launched_kernels(op, args, do, dS, **kw):
    """Gradients of op's Triton level, and the names of the kernels its backward launched in order."""
    with recorded_launches(delta_backward, wy_backward) as seen:
        grads, _ = gradients(getattr(lt, op), args, do, dS, **kw)
    return grads, [name for name, _ in seen]


args_g = testing.make_inputs("kda", B=1, T=40, H=2, K=16, V=16, initial_state=True, seed=7, device=DEV,
                             gate="per_head", dtype=torch.bfloat16)
do_g = torch.randn(args_g["v"].shape, generator=torch.Generator().manual_seed(8)).to(DEV)
dS_g = torch.randn(args_g["initial_state"].shape, generator=torch.Generator().manual_seed(9)).to(DEV)
fused_g, names_f = launched_kernels("kda", args_g, do_g, dS_g, chunk_size=16)
with mock.patch.object(delta_backward, "fused_gates", lambda *a: False):
    separate_g, names_s = launched_kernels("kda", args_g, do_g, dS_g, chunk_size=16)
print("fused:   ", ", ".join(names_f))
print("separate:", ", ".join(names_s))
assert "_gate_kernel" not in names_f and "_gate_kernel" in names_s
truth_g, _ = gradients(naive.kda, testing.to_float64(args_g), do_g.double(), dS_g.double())
for n in ("q", "k", "g", "beta"):
    e_fs = testing.rel_err(fused_g[n], separate_g[n])
    e_f, e_s = testing.rel_err(fused_g[n], truth_g[n]), testing.rel_err(separate_g[n], truth_g[n])
    print(f"d{n:5s} fused against separate {e_fs:.1e};  against float64: fused {e_f:.1e}, separate {e_s:.1e}")
    assert e_fs < 1e-4 and e_f < 2e-2

# %% [markdown]
# Float32 inputs keep the separate kernel: their products run as three tf32 products each, and the
# per-chunk kernel has no registers to spare for them (compiled for an H100/H200 on a CPU, at
# $K = V = 128$ and chunk 64 it spills 3.3–4.1 KB per thread as it is and 5.0–7.0 KB fused). So do
# 256-wide key tiles (the per-chunk kernel's V-blocks are narrow there) and KDA, whose
# per-dimension gates need the split and the block references above.

# %% [markdown]
# Each against the chunk level's backward (`linattn.chunk`, its own `autograd.Function`), and both
# against float64 autograd through the token loop — DeltaNet, Gated DeltaNet (per-head gates) and
# KDA, an initial state and a final-state gradient:

# %%
Td = pick(cpu=40, gpu=600)
for name, op, kw in (("DeltaNet", "delta_rule", {}), ("Gated DeltaNet", "kda", {"gate": "per_head"}),
                     ("KDA", "kda", {"gate": "per_dim"})):
    a = testing.make_inputs(op, B=1, T=Td, H=2, K=16, V=16, initial_state=True, seed=7, device=DEV, **kw)
    do = torch.randn(a["v"].shape, generator=torch.Generator().manual_seed(8)).to(DEV)
    dsT = torch.randn(a["initial_state"].shape, generator=torch.Generator().manual_seed(9)).to(DEV)
    tri, _ = gradients(getattr(lt, op), a, do, dsT, chunk_size=16)
    chk, _ = gradients(getattr(chunk, op), a, do, dsT, chunk_size=16)
    ref, _ = gradients(getattr(naive, op), testing.to_float64(a), do.double(), dsT.double())
    e_chunk = max(testing.rel_err(tri[n], chk[n]) for n in tri)
    e_true = max(testing.rel_err(tri[n], ref[n]) for n in tri)
    print(f"{name:15s} Triton vs chunk level: {e_chunk:.1e}   vs float64 autograd: {e_true:.1e}"
          f"   (worst over d{', d'.join(tri)})")
    assert e_chunk < 1e-4 and e_true < 1e-4

# %% [markdown]
# ### What the interpreter cannot show: the compiled loop
#
# The two sequential passes — the forward's state pass and this reverse pass — are loops over
# chunks. Under the interpreter each statement runs in order on whole tiles. Compiled, Triton
# *software-pipelines* the loop: the loads of chunk $n+1$ and $n+2$ are issued while chunk $n$
# computes (`num_stages`), and it compiles a separate variant when an integer argument equals 1 (one
# chunk). Both transformations are meant to change nothing, and at three shapes they did (an H200,
# Triton 3.6): at $K = 256$, $V = 32$, chunks of 32 without an initial state the pipelined state pass
# left whole chunks' states unwritten; in float32 with $K = 16$ (a 32-wide tile, half padding) and
# chunks of 16 the pipelined reverse pass returned state gradients off by up to $10^{18}$; and the
# one-chunk variant at chunk 64 with $V \le 32$ read out of bounds. The interpreter was right at all
# three. What breaks if only the interpreter is trusted: a silently wrong gradient at a head dimension
# nobody tried.
#
# So the passes are checked on their own: `linattn.conformance.passes` restates each in float64
# PyTorch (the loop above, one einsum per line) and feeds both the same synthetic stage inputs. On a
# CPU the comparison checks the restatement against the interpreter; on a GPU it checks the compiled
# kernels, and `tools/pass_sweep.py` runs it over every head dimension, chunk size, dtype and gate
# kind (2,250 points; `docs/native_correctness.md` has the native results):

# %%
from linattn.conformance import passes  # noqa: E402

for point in [dict(dtype="float32", gate=2, K=32, V=16, C=16, B=1, H=2, T=40, with_h0=True),
              dict(dtype="float32", gate=0, K=16, V=64, C=16, B=1, H=1, T=pick(cpu=33, gpu=300), with_h0=False)]:
    r = passes.check(**point, device=DEV)
    print(f"{point['dtype']}, gate kind {point['gate']}, K = {point['K']}, V = {point['V']}, chunk {point['C']}, "
          f"T = {point['T']}: {'pass' if not r['failed'] else 'FAILED ' + str(r['failed'])} "
          f"(worst relative error over hs, Ṽ, the final state, dS, dṼ, dS₀: {max(e for _, e in r['err'].values()):.1e})")
    assert not r["failed"]

# %% [markdown]
# The fixes are launch rules, each as narrow as the measured fault, since one pipeline stage is not
# free (on an H200 it cost a long sequence 1.7× in the state pass, as `docs/native_correctness.md`
# records, and in float32 at chunk 64 one stage does not even fit): one stage for a 256-wide key
# tile with chunks of 32 or fewer, one stage for the float32 reverse pass with a padded key tile at
# chunks of 16, and no delta-rule kernel specialised on the sequence length, the chunk count or the
# heads (so there is no one-chunk variant, and one compiled loop to trust per tile shape):

# %%
show(delta.state_stages)
show(delta_backward.dstate_stages)
show(common.kernel)

# %% [markdown]
# ## 12. The error budget: every gradient beside FLA's, on the GPU
#
# Every check in this chapter ran at a few shapes. The claim a reader needs is wider: at every head
# dimension from 16 to 256, every length around a chunk boundary, every dtype and every gate strength
# a model produces, each gradient is as precise as the production library's on the same inputs.
# That claim is about compiled kernels (the plain interpreter computes in float32 whatever the inputs;
# its emulated mode, `LINATTN_EMULATE=bf16` or `fp16`, rounds as a GPU does and is how several rules
# below were found on a CPU), so it is measured on a GPU by the conformance suite (`tools/conformance.py`, `linattn.conformance`):
# a generated matrix of cases, each against a float64 reference computed on the same GPU, with FLA
# run beside ours on the cases it accepts. `--record` keeps the worst relative error per variant ×
# dtype × tensor in `book/data/error_budget.json`; the next cell reads it.
#
# Three numbers per entry: ours, the worst over every case of the matrix; and, on the cases FLA also
# ran, ours beside FLA's. Only the pair compares like with like; the first also covers shapes FLA was
# not given (every K × V, chunk size and odd batch) and is the one held to the tolerance.

# %%
budget = bench.recorded_run("error_budget.json")
TENSORS = ("o", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def budget_rows(b, dtype):
    rows = []
    for variant, by_dtype in b["budget"].items():
        e = by_dtype.get(dtype, {})
        for t in TENSORS:
            if t in e:
                rows.append([variant, t, e[t]["ours"], e[t].get("ours_on_fla"), e[t].get("fla")])
    return rows


if budget is None:
    print("No recorded error budget in book/data/ yet. On a GPU: python tools/conformance.py --size native "
          "--workers 14 --out DIR --record")
else:
    c = budget["counts"]
    print("Recorded:", bench.run_label(budget["env"]))
    print(f"variants {', '.join(budget['only'] or budget['budget'])}: {budget['total']} cases in the matrix, "
          f"{sum(c.values())} finished ({c.get('pass', 0)} passed, {c.get('cut', 0)} cut by the time limit, "
          f"{sum(v for k, v in c.items() if k not in ('pass', 'cut'))} failed), {budget['not_run']} not reached\n")
    print(bench.markdown_table(["variant", "tensor", "ours, whole matrix", "ours, FLA's cases", "FLA"],
                               budget_rows(budget, "bfloat16")))
    entries = [(v, dt, t, e[t]) for v, by_dtype in budget["budget"].items() for dt, e in by_dtype.items()
               for t in e if isinstance(e[t], dict) and "ours" in e[t]]
    passing = [(d, x) for _, d, _, x in entries if x["ours"] <= x["tol"]]
    worst = {dt: max(x["ours"] / x["tol"] for d, x in passing if d == dt) for dt in ("float32", "bfloat16", "float16")}
    print("\nworst error as a fraction of its tolerance, over the entries within it:",
          {k: f"{x:.2f}" for k, x in worst.items()})
    over = [[v, dt, t, x["ours"], x["tol"], x["case"]] for v, dt, t, x in entries if x["ours"] > x["tol"]]
    print("\nentries above their tolerance, and the case that put them there:")
    print(bench.markdown_table(["variant", "dtype", "tensor", "ours", "tolerance", "case"], over))
    failed = {f["id"] for f in budget["failures"]}
    assert all(row[-1] in failed for row in over)    # each one is a failed case of the run, none hidden
    above = [[v, dt, t, x["ours_on_fla"], x["fla"]] for v, dt, t, x in entries
             if x.get("fla") and x["ours_on_fla"] > 1.05 * x["fla"]]
    print("\nwhere ours is more than 5 % above FLA's on the same cases (every dtype):")
    print(bench.markdown_table(["variant", "dtype", "tensor", "ours", "FLA"], above))

# %% [markdown]
# The hardest cases for the range of a half-precision dtype are fp16 inputs with strong gates
# (up to −20 per token) and an initial state. The first token of a chunk decays by
# $e^{-15} \approx 3\times10^{-7}$, and that token alone makes the initial state's gradient $dS_0$;
# fp16's normal numbers end at $6\times10^{-5}$, and its subnormals keep only a few bits. A factor
# decayed from the chunk start and rounded to fp16 — $q\odot e^{b}$ in the GLA family's reverse
# pass, $W = \mathcal{T}\,\mathrm{diag}(\beta)(K\odot e^{G})$ stored between the delta rules'
# stages — loses $dS_0$: Gated DeltaNet's came out 0.62 wrong that way on an H200. bf16 carries
# float32's exponent range and is right. Two cures, one per family, both in the table's run:
# the GLA family's reverse pass takes that operand in float32 for fp16 inputs (a tf32 product,
# `common.decayed_dtype`, shown below); Gated DeltaNet takes $W$ and $q\odot e^{G}$ from each
# chunk's *first* token, $\tilde W = e^{-G_0}W$ and $q\odot e^{G-G_0}$, whose largest factor is 1,
# and multiplies the products by the one number $e^{G_0}$ in float32 (`wy.first_gate`, shown
# below; the state, output and reverse passes all do it). No stored tile then carries the tiny
# factor, and it cost Gated DeltaNet 1–3 % of its time.

# %%
show(common.decayed_dtype)
show(wy.first_gate)

# %% [markdown]
# A picture of the pairs: each point is one variant × dtype × tensor, ours against FLA's on the same
# cases. Below the diagonal ours is the more precise. Which pairs there are depends on where FLA
# ran: FLA 0.6.0 refuses some of its backward passes on this toolchain (Gated DeltaNet's, per-head
# GLA's, and DeltaNet's in float32), and its autotuned kernels compile for minutes per class of
# shapes, so the recorded runs put it beside ours on the bf16 and fp16 cases of the matrix's core
# shape ($K = V = 128$, every length and gate strength) for DeltaNet, KDA, GLA and linear attention;
# `tools/conformance.py --no-fla` leaves it out. No float32 pair is recorded: in float32 FLA
# multiplies tiles as tf32 (10 mantissa bits) and ours as three tf32 products or exactly, which says
# more about that choice than about either method.

# %%
if budget is not None:
    fig, ax = plt.subplots(figsize=(5.2, 5))
    marks = {"bfloat16": ("o", "C0"), "float16": ("s", "C1"), "float32": ("^", "C2")}
    for dt, (m, col) in marks.items():
        pts = [(x["fla"], x["ours_on_fla"]) for _, d, _, x in entries if d == dt and x.get("fla")]
        if pts:
            ax.scatter(*zip(*pts), marker=m, color=col, label=dt, alpha=0.8)
    vals = [v for _, d, _, x in entries if x.get("fla") for v in (x["fla"], x["ours_on_fla"])]
    lo, hi = 10.0 ** math.floor(math.log10(min(vals))), 10.0 ** math.ceil(math.log10(max(vals)))   # whole decades
    ax.plot([lo, hi], [lo, hi], color="0.5", lw=1)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="FLA's relative error",
           ylabel="ours, same cases", title="Error budget, ours against FLA (GPU)")
    ax.legend(loc="upper left")
    plt.show()

# %% [markdown]
# A point more than 5 % above the diagonal would be a row of the last table: the budget is what the
# library measured, not what it hoped, and `docs/native_correctness.md` keeps what is open. Points
# on the diagonal to a few digits are tensors both libraries compute with the same roundings (linear
# attention's final state, the pair near $2\times10^{-6}$, and its bf16 output; GLA's final state);
# the two points far below it are linear attention's initial-state gradient, float32-exact in ours
# where FLA's error is that of one bf16 or fp16 rounding. Five rules keep the points on or below the
# diagonal, each found by comparing with FLA on these cases:
#
# * the backward keeps GLA's chunk states $h$ and their gradients $D$ in float32: the gate gradient
#   $e^{b_C}\odot\sum_v h\odot D$ is an elementwise sum, and bf16 states rounded it to three digits;
# * operands computed in float32 — the decayed queries and keys of the split and of the
#   off-diagonal tiles — enter the tensor cores as float32 (tf32 products), not rounded to bf16;
# * $dv$'s intra-chunk product $P^\top dO$ runs at about float32 precision, because $P$ is a float32
#   intermediate the next rounding would cost $dv$ directly. For bf16 inputs $dO$ is exact in bf16,
#   so $P$ is split into a bf16 high part and a bf16 remainder, $P = P_{hi} + P_{lo}$, and the product
#   is two bf16 products with $P$'s error near $2^{-17}$; for fp16 inputs two tf32 products of
#   $P$'s tf32 part and its remainder (`common.dot_split`);
# * in the delta rules the same split takes every computed float32 tile that meets an input exact in
#   its dtype — $U = (\mathcal{T}\,\mathrm{diag}\,\beta)\,V$, $W$, the score gradients against the
#   keys — as do linear attention's and per-head GLA's intra-chunk $dq = dA\,K$ and
#   $dk = dA^\top Q$ (with $dA$ rounded to bf16 first, linear attention's $dk$ on a single token
#   was 1.4× FLA's error), and the queries' scale multiplies $QS$ and $Q^\top dO$ after the
#   product, so no product rounds $\text{scale}\cdot q$ or $\beta v$ into a half-precision operand;
# * the forward's output step of the GLA family takes the same split for $(q\odot e^{b})\,S$ and for
#   $A V$ (with per-dimension gates in both half dtypes, where strong gates spread $A$'s entries over
#   many binades; linear attention and per-head gates in fp16 only); per-head gates multiply $qS$ by
#   $e^{b_t}$ after the product; and
#   KDA's reverse pass in bf16 takes the two gradients it carries from chunk to chunk, $dS$ and
#   $d\tilde V$, as two bf16 parts each.
#
# Each rule costs time (measured in `docs/performance.md`); where precision and speed pull apart,
# the library takes precision.
#
# The split of the third rule in numbers, in float64 on the CPU with the roundings written out (on
# the GPU the two products are tensor-core products of the same bf16 tiles, accumulated in
# float32): $P_{hi}$ alone carries bf16's 8 significant bits, $P_{hi} + P_{lo}$ about 16.

# %%
def split_demo(seed=0, C=64, V=128):
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(C, C, generator=g, dtype=torch.float64).tril().float()    # a float32 intermediate
    dO = torch.randn(C, V, generator=g).bfloat16().double()                    # an input: exact in bf16
    exact = P.double().T @ dO
    hi = P.bfloat16()
    lo = (P - hi.float()).bfloat16()                                           # what rounding hi lost
    one = hi.double().T @ dO
    two = hi.double().T @ dO + lo.double().T @ dO
    return testing.rel_err(one, exact), testing.rel_err(two, exact)


e_one, e_two = split_demo()
print(f"P^T dO with P rounded to bf16: {e_one:.1e};  as P_hi + P_lo: {e_two:.1e}")
assert e_one > 1e-3 and e_two < 1e-5                  # what breaks if the remainder is dropped

# %% [markdown]
# ## Summary
#
# * The Triton backward of GLA and linear attention is seven kernels, run in this order: recompute
#   the states, a **reverse pass** over the state gradients (`_dstates_kernel`), the score gradient
#   $dP = \text{scale}\,dO\,V^\top$ (`_dA_kernel`), the intra-chunk parts of $dq$, $dk$
#   (`_intra_grad_kernel`), $dv$ (`_dv_kernel`), $dq$, $dk$ with their state parts and each row
#   block's gate-gradient sums (`_dqk_kernel`), and $dg$ (`_dg_kernel`). Each was checked above
#   against the chunk level. Without per-dimension gates (half-precision inputs, chunks up to 64)
#   `_dqk_kernel` forms $dP$ and the intra parts itself, and $dP$ never goes to memory.
# * The delta rules' backward is a reverse pass (`_dstate_kernel`), the per-chunk sums over $V$ with
#   the WY backward through $\mathcal T$ (`_dchunk_kernel`), and the chain rule through the scores and
#   gates (`wy_backward._gate_kernel`). Without per-dimension gates (DeltaNet, Gated DeltaNet in half
#   precision) the per-chunk kernel applies the chain rule itself and its float32 tiles never go to
#   memory.
# * Only the state recomputation and the reverse pass walk the chunks; their grid shrinks as
#   sequences grow, everything else has a program per chunk (or row block, or sub-chunk).
# * Gradient tiles use the forward's **secondary chunking** — off-diagonal tiles as matmuls with
#   a reference point chosen so every exponent is $\le 0$ (before the sub-chunk for $dq$, at its
#   last token for $dk$), diagonal tiles in float32 with decay tiles built one gate factor at a
#   time: a column walk for $dq$, a row walk (one rank-one tile per row) for $dk$.
# * The gate gradient is summed **inside each chunk** (chapter 12's chunk-local form): a reverse
#   cumulative sum, an exclusive prefix of the writes and a carried term, on chip. Summed over the
#   whole sequence instead, its float32 error grows with the gate strength.
# * The default recomputes the states (and, except for per-dimension gates, the cumulated gates);
#   per-dimension gates keep $b$ and $P$ from the forward. `recompute=False` keeps the states too.
# * Stage timings are taken one synchronised stage at a time: read their shares, not their sum.
# * The sequential passes are the loops the compiler pipelines across chunks, where compiled and
#   interpreted kernels can part: they are checked on their own against a float64 restatement at
#   every head dimension, chunk size, dtype and gate kind, and narrow launch rules (one pipeline
#   stage at the shapes that failed, no one-chunk variant) keep them right.
# * The error budget, measured on a GPU over a generated matrix of shapes, dtypes and gates, puts
#   each gradient beside FLA's on the same inputs; the precision rules behind it are float32 states
#   in the backward and float32 operands wherever an operand is computed rather than given.
#
# **Workbook:** `exercises/13_backward_triton.py` — the reverse state pass, an intra-chunk
# gradient tile, the dk row walk and the gate gradient's scan as kernels, then the whole GLA
# backward, whose pass lets `linattn.gla(..., impl="mine")` train through your kernels.
