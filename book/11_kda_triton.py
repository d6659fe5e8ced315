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
# # 11 — KDA in Triton
#
# **Goal.** The chunkwise delta rule of the earlier chapters is a recipe of five formulas: decayed
# key–key scores, a triangular inverse, the WY factors $W, U$, a pass over chunk states, and the
# outputs. Here we turn that recipe into three stages of Triton kernels that run on tensor cores:
#
# 1. **WY/UT** — every chunk at once, in two kernels: the factors $A_{qk}$ and $(I+A)^{-1}$ (for
#    KDA also $W$), then $U$ (and $W$ for the others);
# 2. **the affine state pass** — chunk after chunk: $\tilde V = U - WS$, $S \leftarrow e^{b_C} S + \tilde K^\top \tilde V$;
# 3. **the output** — every chunk at once: $O = \text{scale}\,\big((Q\odot e^{G})S + A_{qk}\tilde V\big)$.
#
# We look at how each stage maps to programs and `tl.dot`, why no exponential in them can
# overflow even with log-gates of $-20$ per token, check each stage against `linattn.chunk`,
# then the whole kernel against the float64 recurrence `linattn.naive.kda` — for KDA, and for
# its two special cases, Gated DeltaNet and DeltaNet. Last, its measured speed against
# flash-linear-attention (FLA) on an H200.
#
# On a CPU the kernels run in the Triton interpreter (slowly, so sizes here are small); on a GPU
# the same cells compile them natively.

# %%
import matplotlib.pyplot as plt
import torch

import linattn
from linattn import bench, chunk, naive, testing
from linattn.chunk import delta as cdelta
from linattn.device import pick
from linattn.triton import delta as tdelta
from linattn.validate import check_inputs

print(linattn.device.describe())
DEV = linattn.device.default_device()

# %% [markdown]
# ## 1. The recipe, and who computes what
#
# Recall the chunk form (chapter 07, `linattn/chunk/delta.py`). A chunk of $C$ tokens enters with
# state $S\in\mathbb R^{K\times V}$; $b_i = g_1+\dots+g_i$ sums the log-decays from the chunk
# start (a vector per token for KDA, a number for Gated DeltaNet, $0$ for DeltaNet), and the
# $C\times K$ matrix $G$ stacks the rows $b_i$. Then
#
# $$A_{ij} = \beta_i \sum_d k_{id}k_{jd}\,e^{b_{id}-b_{jd}}\ (i>j),\qquad
#   \mathcal T = (I+A)^{-1},\qquad U = \mathcal T\,\mathrm{diag}(\beta)V,\qquad
#   W = \mathcal T\,\mathrm{diag}(\beta)(K\odot e^{G}),$$
#
# $$\tilde V = U - W S,\qquad
#   O = \text{scale}\,\big((Q\odot e^{G})\,S + A_{qk}\tilde V\big),\qquad
#   S' = e^{b_C}\odot S + (K\odot e^{b_C-G})^\top \tilde V,$$
#
# with $(A_{qk})_{ij} = \sum_d q_{id}k_{jd}e^{b_{id}-b_{jd}}$ for $j\le i$, as in chapter 07 (the kernels
# store $\text{scale}\,A_{qk}$ and $\text{scale}\,Q\odot e^{G}$, so stage 3 needs no multiply by
# `scale`). Only the middle
# line involves $S$. So the work splits into three stages, the first of them two kernels (for
# KDA a third one that runs only where the gates decay very fast):
#
# | stage | program grid | what one program holds | the dots |
# |---|---|---|---|
# | 1a factors `_factor_kernel` (DeltaNet, Gated DeltaNet) | (chunk, head) | $K,Q$ tiles $[C,K]$, and $K$ again as four 16-row blocks | $QK^\top$; the ten 16×16 blocks of $KK^\top$, inverted in registers; writes $A_{qk}$ and $\mathcal T=(I+A)^{-1}$ |
# | 1a KDA factors `_kda_split_kernel` | (chunk, head) | four 16-row blocks of $K\odot e^{G}$, $K\odot e^{-G}$, $Q\odot e^{G}$ | the ten blocks of $A$ and of $A_{qk}$, $A$ inverted in registers, then $W = \mathcal T(\beta K\odot e^G)$; writes $A_{qk}$, $\mathcal T$, $W$, $\tilde K = K\odot e^{b_C-G}$, $e^{b_C}$, $\text{scale}\,Q\odot e^{G}$, and flags chunks whose gates decay too fast |
# | 1b KDA exact `_kda_exact_kernel` | (chunk, head) | a flagged chunk (the others return at once): its rows by 16-row blocks | the same outputs with every exponent $\le 0$ (section 2) |
# | 1c W/U `_wu_kernel` | (chunk, head, part of 2; KDA: part 2 only) | $\mathcal T$ $[C,C]$ with $K$ and the gates, or with $V$ | $\mathcal T(\beta K\odot e^G)$, storing also $\tilde K$ and $e^{b_C}$; or $\mathcal T(\beta V)$, $B_V$ columns at a time |
# | 2 state pass `_state_kernel` | (V-block, head) | $S$ $[K,B_V]$ in registers, loops over chunks | $WS$, $\tilde K^\top\tilde V$ |
# | 3 output `_output_kernel` | (V-block, chunk, head) | one chunk's $Q$, $S$, $A_{qk}$, $\tilde V$ | $QS$, $A_{qk}\tilde V$ |
#
# Stages 1 and 3 have a program for every chunk of every head: thousands of programs, all
# independent. Stage 2 is the only sequential part, and its state never leaves the chip between
# chunks; it writes each chunk's entering state and $\tilde V$ for stage 3. Every kernel of stage
# 1 is plain: each tile is loaded or computed at the size it is used at, goes through `tl.dot` or
# elementwise math, and goes back to memory — no tile is ever cut out of, or pasted into, a bigger
# register tile (Triton has no cheap way to do that: the copies can cost more than the arithmetic
# they serve). Where the 16×16 blocks of a $C\times C$ matrix are needed, they are
# ten separate variables from the start. The library exposes the stages one by one (`plan`,
# `factor_stage`, `wu_stage`, together `wy_stage`; then `state_stage`, `output_stage`), and we
# use that to check each on its own. The chunk $C$ is a power of two from 16 to 64 (64 by default,
# FLA's fixed chunk too); a larger `chunk_size` is refused by name: stage 1 holds a chunk's
# $C\times C$ blocks in registers, and compiling it for $C = 128$ or $256$ at $K = V = 128$ takes
# many minutes per specialisation, far past any use.

# %%
B, T, H, K, V, C = 1, pick(cpu=80, gpu=1000), 2, 32, 48, pick(cpu=32, gpu=64)
args = testing.make_inputs("kda", B=B, T=T, H=H, K=K, V=V, gate="per_dim", device=DEV,
                           initial_state=True, seed=11)
q, k, v, g, beta, S0 = (args[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
d = check_inputs(q, k, v, g=g, beta=beta, gate=True, delta=True)
p = tdelta.plan(q, g, d, C)
print(f"T={T}, chunk C={C}: {p.NT} chunks × {B * H} heads = {p.NT * B * H} (chunk, head) pairs, "
      "each a program of every stage-1 kernel")

# %% [markdown]
# ## 2. Stage 1: scores split at the chunk start, and when that is not safe
#
# The tempting way to build $A$ with one matmul is the factorised form
# $(K\odot e^{G})(K\odot e^{-G})^\top$. Over a chunk of 64 tokens with log-gates near $-20$, $G$
# reaches $-1280$: $e^{-G}$ is $+\infty$ in float32 (whose exponent range ends near $\pm 88$), and
# $e^{G}$ is $0$, so their product is NaN. See it happen:

# %%
Gs = torch.cumsum(testing.log_gates((64, 16), "strong"), 0)          # [C, K], one chunk
ks = torch.nn.functional.normalize(torch.randn(64, 16), dim=-1)
factorised = (ks * Gs.exp()) @ (ks * (-Gs).exp()).T
exact = torch.einsum("id,jd,ijd->ij", ks.double(), ks.double(),
                     (Gs[:, None] - Gs[None]).double().clamp(max=0).exp())
print("min G over the chunk:", Gs.min().item())
print("factorised form: NaN entries", factorised.isnan().sum().item(), "of", factorised.numel())
print("exact scores finite:", bool(exact.isfinite().all()))

# %% [markdown]
# Only the range goes wrong, though. Where the chunk's gates decay by less than 60 in every key
# dimension ($-b_C < 60$), $e^{-b_j} \le e^{60} \approx 10^{26}$ is far from float32's
# $3\cdot 10^{38}$, and the factorised form is exact up to rounding: each term
# $k_{id}e^{b_{id}}\cdot k_{jd}e^{-b_{jd}}$ keeps its true size, so rounding the two factors
# (to bf16, say) costs what rounding $k_{id}k_{jd}$ would. bf16 has float32's exponent range;
# fp16 (largest value 65504) does not, so the kernels do these products in bf16 for fp16 inputs
# too. How often do chunks stay inside the bound? The benchmarks' mild gates, $\log\sigma(x)/16$,
# against the strong ones, per chunk of 64 tokens — and, from the measurement of chapter 10 §3b
# (`book/data/gate_strength.json`), KDA's own gate, $-e^{A_{\log}}\,\mathrm{softplus}(xW +
# \Delta_{\text{bias}})$, as initialised, and the KDA model chapter 14 trains. The mild gates are
# GLA's (a sigmoid with temperature 16); KDA's initialisation is far stronger:

# %%
for strength in ("normal", "strong"):
    gates = testing.log_gates((64, 64, 128), strength)               # [chunks, C, K]
    spread = -gates.sum(1).min(-1).values                            # [chunks] max_d −G_C
    print(f"{strength:6s} gates: the fastest-decaying key dim per chunk decays by "
          f"{spread.min():7.1f} … {spread.max():7.1f}; past 60: {(spread >= 60).float().mean():.0%} of chunks")
gs = bench.recorded_run("gate_strength.json")
for key, label in (("kda_init", "KDA initialised"), ("ch14_kda", "KDA trained (ch. 14)")):
    r = gs["distributions"][key]
    print(f"{label:20s} (recorded, {gs['env']['date']}): fastest dim per (chunk, head) median "
          f"{r['strongest_dim_percentiles']['50']:.1f}, largest {r['max']:.1f}; past 60: "
          f"{r['frac_chunks_past_bound']:.0%} of (chunk, head) pairs, {r['frac_blocks_past_bound']:.0%} of "
          f"(16-token block, head) pairs")
init = gs["distributions"]["kda_init"]
assert init["frac_chunks_past_bound"] > 0.1 and init["frac_blocks_past_bound"] == 0      # what the text says
Gn = torch.cumsum(testing.log_gates((64, 16), "normal"), 0)
split = (ks * Gn.exp()) @ (ks * (-Gn).exp()).T
exact_n = torch.einsum("id,jd,ijd->ij", ks.double(), ks.double(),
                       (Gn[:, None] - Gn[None]).double().clamp(max=0).exp())
err = testing.rel_err(split.tril(), exact_n.tril())
print(f"normal gates: factorised form in float32 vs exact, lower triangle: rel err {err:.1e}")
assert err < 1e-6

# %% [markdown]
# So stage 1 of KDA takes the fast form where it is safe and checks where it is not:
#
# * `_kda_split_kernel` computes every chunk by the factorised form. It still builds $A$ and
#   $A_{qk}$ as ten 16×16 blocks — from four 16-row blocks of $K\odot e^{G}$, $K\odot e^{-G}$ and
#   $Q\odot e^{G}$, one `tl.dot` per block, as the Gated DeltaNet kernel does — so that $A$ is
#   inverted where it was computed (section 3). With $K\odot e^{G}$ at hand, it also gives
#   $W = \mathcal T(\beta K\odot e^G)$, and $\tilde K = K\odot e^{b_C-G} = (K\odot e^{-G})\,e^{b_C}$
#   (two factors in range) and $e^{b_C}$ for the state pass, so that the sequential loop of stage
#   2 has no exponentials at all. A chunk with $-b_C \ge 60$ in some key dimension is flagged
#   (its outputs are kept finite: $e^{-G}$ is capped at $e^{60}$).
# * `_kda_exact_kernel` redoes the flagged chunks (the others cost it one load of a flag). It
#   never lets an exponent exceed the bound. It treats the $C\times C$ score matrix in two kinds
#   of 16×16 blocks:
#   - **below the diagonal blocks** (row $i$ in block $s$, column $j$ in an earlier one; blocks
#     numbered from 0, positions from 1): split the decay at the last position $p = 16s$ before
#     block $s$, $e^{b_i-b_j} = e^{b_i-b_p}\cdot e^{b_p-b_j}$. Both exponents are $\le 0$ ($i$ after
#     $p$, $j$ up to $p$), so each block is one tensor-core `tl.dot`, in bf16 when the inputs are bf16.
#     Factors that underflow to 0 belong to scores that really are below float32's range.
#   - **the diagonal blocks**: no boundary lies between $i$ and $j$, so a split must let one
#     factor exceed 1. The kernel splits at the token before the block, safe when the block's
#     own 16 gates decay by less than 60; for stronger ones (log-gates of $-20$ per token) it
#     goes column by column: $E_i = e^{b_i-b_j}$ for all rows $i\ge j$ at once, updated from
#     column $j+1$ to $j$ by the factor $e^{g_{j+1}}\le 1$ — one exponential per key dimension
#     per column, and no exponent is ever positive. Each block sums its own 16 gates from zero:
#     a small sum rounds less than the chunk's running sum near $-1000$.
#
# With KDA's initialisation many chunks pass the bound but no 16-token block does (printed above):
# the exact kernel's block form, not its column walk, is what those gates need, and so the
# question is its speed (section 8 measures it; `docs/performance.md`, "Gate strength", weighs
# running it for every chunk).
#
# For Gated DeltaNet the decay is one number per pair $(i,j)$: the factor kernel takes each
# 16×16 block of $KK^\top$ with one dot and multiplies it by its block of $e^{\min(b_i-b_j,0)}$ —
# no split needed, and no bound; DeltaNet skips the factor. Its tail $b_C - b_i = g_{i+1}+\dots+g_C$
# is summed from the end of the chunk (`tl.cumsum(…, reverse=True)`), not formed as a difference
# of two large prefix sums. The picture shows how the exact kernel builds a chunk's $A$ (strict)
# and $A_{qk}$ (diagonal included):

# %%
Cf, sub = 64, 16
i, j = torch.meshgrid(torch.arange(Cf), torch.arange(Cf), indexing="ij")
role = torch.zeros(Cf, Cf)
role[(i // sub > j // sub)] = 1                           # dots split at a sub-chunk boundary
role[(i // sub == j // sub) & (i >= j)] = 2               # diagonal blocks
fig, ax = plt.subplots(figsize=(4.2, 4.2))
ax.imshow(role, cmap=plt.matplotlib.colors.ListedColormap(["white", "#7fb3d5", "#f0a35e"]))
for s in range(1, Cf // sub):
    ax.axhline(s * sub - 0.5, color="k", lw=0.5); ax.axvline(s * sub - 0.5, color="k", lw=0.5)
ax.set_title("the exact kernel's scores of one chunk (C=64)\n"
             "blue: tl.dot split at a block boundary · orange: diagonal block", fontsize=9)
ax.set_xlabel("key j"); ax.set_ylabel("row i")
plt.show()

# %% [markdown]
# ## 3. Stage 1: the triangular inverse from 16×16 blocks
#
# $\mathcal T = (I+A)^{-1}$ with $A$ strictly lower triangular. Forward substitution row by row is
# $C$ dependent steps — fine for 16 rows, slow for 64. Cut $A$ and $\mathcal T$ into 16×16 blocks
# $A_{im}$, $\mathcal T_{mj}$ ($i, m, j$ number sub-chunks). Both are block lower triangular, and
# reading block $(i, j)$ of $(I+A)\,\mathcal T = I$ gives
#
# $$\mathcal T_{ii} = (I + A_{ii})^{-1},\qquad
#   \mathcal T_{ij} = -\,\mathcal T_{ii}\sum_{m=j}^{i-1} A_{im}\,\mathcal T_{mj}\quad (j < i).$$
#
# The diagonal blocks are independent of each other; a block below the diagonal needs only blocks
# of earlier block rows. The diagonal blocks themselves could be done by forward substitution — 15
# dependent row steps, each a sum across the threads that hold the block, then a row pasted back.
# The kernels use the same block formula once more, inside the block. Suppose $X$ inverts the
# diagonal blocks of side $s$ of $I + A$ (start: $s = 1$, $X = I$). Two neighbouring blocks of
# side $s$ form one of side $2s$; what joins them is $L$, the entries of $A$ with the row in the
# lower and the column in the upper neighbour. Then $LXL = 0$ ($XL$ maps the upper half into the
# lower one, and $L$ reads only the upper half), so
#
# $$(X^{-1} + L)^{-1} = X - XLX\qquad	ext{exactly.}$$
#
# Four joins, $s = 1 \to 2 \to 4 \to 8 \to 16$, invert a 16×16 block with 16×16 products on
# the tensor cores (the first join is just $I - L$, no product). With the four diagonal blocks
# done, the six blocks below are the formula above: ten register tiles in, sixteen out (zeros
# right of the diagonal), nothing moved inside a tile. In a few lines of PyTorch:

# %%
def doubling_inverse(A):
    """(I + A)⁻¹ for strictly lower-triangular A [n, n], n a power of two, as `_diag_inverse`."""
    n = A.shape[-1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    X, s = torch.eye(n, dtype=A.dtype), 1
    while s < n:                  # join neighbouring blocks of side s into blocks of side 2s
        L = torch.where((i // (2 * s) == j // (2 * s)) & (i // s != j // s), A, 0.0)
        X, s = X - X @ L @ X, 2 * s
    return X


def block_inverse(A, sub=16):
    """(I + A)⁻¹ for strictly lower-triangular A [C, C], by 16×16 blocks as `_invert`."""
    nb = A.shape[-1] // sub
    blk = lambda M, i, j: M[i * sub:(i + 1) * sub, j * sub:(j + 1) * sub]  # noqa: E731 (a view)
    Ti = torch.zeros_like(A)
    for i in range(nb):                                    # diagonal blocks: doubling
        blk(Ti, i, i)[:] = doubling_inverse(blk(A, i, i))
    for i in range(1, nb):                                 # then block rows, top to bottom
        for j in range(i):
            acc = sum(blk(A, i, m) @ blk(Ti, m, j) for m in range(j, i))
            blk(Ti, i, j)[:] = -blk(Ti, i, i) @ acc
    return Ti


kb = torch.nn.functional.normalize(torch.randn(64, 32, dtype=torch.float64), dim=-1)
A64 = (0.9 * kb @ kb.T).tril(-1)
exact = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A64)
err = testing.rel_err(block_inverse(A64), exact)
print(f"block inverse (doubling on the diagonal) vs torch.linalg.inv: {err:.2e}")
assert err < 1e-12

# %% [markdown]
# **What breaks if** a join skips a level — say from side 4 straight to 16, taking every entry
# between the four blocks of side 4 into one $L$? Then $L$ links block 1 to block 2 and block 2 to
# block 3, $LXL \ne 0$, and $X - XLX$ is only the first two terms of a longer series:

# %%
A16 = A64[:16, :16]
i16, j16 = torch.arange(16)[:, None], torch.arange(16)[None, :]
X4 = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + torch.where(i16 // 4 == j16 // 4, A16, 0.0))
L = torch.where(i16 // 4 != j16 // 4, A16, 0.0)              # all joins at once
skip = X4 - X4 @ L @ X4
print(f"skipping a level: rel err {testing.rel_err(skip, exact[:16, :16]):.1e}; "
      f"‖LXL‖ = {(L @ X4 @ L).norm():.2f} (0 for a join of two neighbours)")
assert testing.rel_err(skip, exact[:16, :16]) > 1e-3

# %% [markdown]
# The kernels compute in float32. On the GPU each 16×16 product runs on the tensor cores with
# the precision its result needs: for float32 inputs as three tf32 products
# (`input_precision="tf32x3"`, about float32 accuracy), for bf16 or fp16 inputs as one tf32
# product (10-bit mantissa) — the $W$/$U$ dots round $\mathcal T$ to the 8 bits of bf16 anyway,
# so a third of the tensor-core work buys nothing there. Under the interpreter they are exact
# float32. When only the forward reads $\mathcal T$, it is stored in the tile dtype; the backward
# gets float32. Then $W = \mathcal T(\beta\,K\odot e^{G})$ — for KDA in the factor kernel, for
# the others in `_wu_kernel` — and $U = \mathcal T(\beta V)$ in `_wu_kernel`, one program per
# $[C, K]$ or $[C, B_V]$ output tile. Run KDA's stage 1, once with the gates of this chapter and
# once with strong ones (every chunk redone by the exact kernel), and compare what it wrote with
# the chunk level (`linattn.chunk.delta`, float64 here): $\mathcal T$, then the factors $W$, $U$
# and $A_{qk}$. ($A$ itself never leaves the registers.)

# %%
def stage_one(g):
    """KDA's stage 1 and the float64 chunk level's factors for gates g: (wy, f, {name: rel err})."""
    wy = tdelta.wy_stage(*(t.contiguous() for t in (q, k, v, g, beta)), tdelta.plan(q, g, d, C))
    d64 = check_inputs(q.double(), k.double(), v.double(), g=g, beta=beta, gate=True, delta=True)
    f = cdelta.factors(*testing.to_float64(dict(q=q, k=k, v=v, g=g, beta=beta)).values(), d64, C,
                       delta=True)
    kc, gc = cdelta.to_chunks(k.double(), C), cdelta.chunk_gates(g.double(), d64, C, k.device)
    A_ref = cdelta.to_chunks(beta.double()[..., None], C) * cdelta.decayed_scores(kc, kc, gc, strict=True)
    refs = {"𝒯": cdelta.unit_lower_inverse(A_ref), "W": f.W, "U": f.U, "Aqk": f.Aqk * d.scale}
    ours = {"𝒯": wy["ai"], "W": wy["w"], "U": wy["u"], "Aqk": wy["aqk"]}
    return wy, f, {n: testing.rel_err(ours[n], cdelta.from_chunks(refs[n], T)) for n in refs}


def report(label, wy, errs):
    print(f"{label:21s}: chunks redone exactly {int(wy['exact'].sum())} of {wy['exact'].numel()}; "
          "rel err " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) < testing.tolerance(torch.float32)


wy, f, errs = stage_one(g)               # the factors the next sections go on with
report("this chapter's gates", wy, errs)
report("strong gates", *stage_one(testing.log_gates(g.shape, "strong").to(DEV))[::2])

# %% [markdown]
# ## 4. Stage 2: the affine pass over chunks
#
# With the factors in hand, a chunk acts on its entering state by an *affine map*
# (chapters 07–08): $S' = M S + B$ with $M = \mathrm{diag}(e^{b_C}) - \tilde K^\top W$ and
# $B = \tilde K^\top U$, $\tilde K = K\odot e^{b_C-G}$. The kernel never forms the $K\times K$
# matrix $M$; it applies it through $\tilde V$:
#
# $$\tilde V = U - W S \quad(\texttt{tl.dot}: [C,K]\times[K,B_V]),\qquad
#   S \leftarrow e^{b_C}\odot S + \tilde K^\top \tilde V \quad(\texttt{tl.dot}: [K,C]\times[C,B_V]).$$
#
# Columns of $S$ (value dimensions) never mix, so one program owns a block of $B_V$ columns of
# one head's state and walks all chunks in order; the grid is (V-blocks, heads). That is the
# parallelism problem of this stage: a single sequence of 16 heads with $V=128$ gives only
# 16·128/$B_V$ programs for an H200's 132 SMs, each walking 512 chunks at $T=32$k. The library
# picks the widest $B_V$ of 64, 32, 16 that still gives every SM a program:

# %%
for Bn, Tn in [(32, 1024), (8, 4096), (2, 16384), (1, 32768)]:
    bv = tdelta.state_block(128, Bn * 16, sms=132)          # as on an H200
    print(f"B={Bn:2d} T={Tn:5d}: B·H={Bn * 16:4d} heads → B_V={bv:2d}, {Bn * 16 * 128 // bv:4d} "
          f"state-pass programs, {Tn // 64} chunks each")

# %% [markdown]
# Stage 2 stores each chunk's entering state and $\tilde V$. Check both against the same walk
# written with the chunk level's float64 factors:

# %%
hs, vnew, ht = tdelta.state_stage(wy, S0.float().contiguous(), p, True)
S = S0.double()
ref_states, ref_vt = [], []
for n in range(p.NT):
    ref_states.append(S)
    Vt = f.U[:, :, n] - f.W[:, :, n] @ S                   # [B, H, C, V]
    ref_vt.append(Vt)
    S = f.last[:, :, n] * S + f.Kdec[:, :, n].transpose(-1, -2) @ Vt
e_states = testing.rel_err(hs, torch.stack(ref_states, 2))
e_vt = testing.rel_err(vnew, cdelta.from_chunks(torch.stack(ref_vt, 2), T))
e_final = testing.rel_err(ht, S)
print(f"stage 2: entering states {e_states:.1e}, Ṽ {e_vt:.1e}, final state {e_final:.1e}")
assert max(e_states, e_vt, e_final) < testing.tolerance(torch.float32)

# %% [markdown]
# ## 5. Stage 3: the outputs, and the whole kernel against the recurrence
#
# Every (V-block, chunk, head) is independent now: two dots,
# $\text{scale}\,(Q\odot e^{G})\,S_{[n]}$ with the stored entering state and $\text{scale}\,A_{qk}\tilde V$
# with the stored scores. Run it, then compare with the float64 token-by-token recurrence — the ground
# truth of the whole book:

# %%
o = tdelta.output_stage(q.contiguous(), wy, hs, vnew, p, v.dtype)
o_ref, S_ref = naive.kda(**testing.to_float64(args), output_final_state=True)
print(f"KDA, 3 stages vs naive float64: output {testing.rel_err(o, o_ref):.1e}, "
      f"final state {testing.rel_err(ht, S_ref):.1e}")
assert testing.rel_err(o, o_ref) < testing.tolerance(torch.float32)
assert testing.rel_err(ht, S_ref) < testing.tolerance(torch.float32)

# %% [markdown]
# ## 6. Gated DeltaNet and DeltaNet are special cases
#
# A gate of shape $[B,T,H]$ (one log-decay per head) is Gated DeltaNet: the kernel takes the
# scalar path, where every decay is a $C\times C$ factor on a plain $KK^\top$ dot. No gate at all
# is DeltaNet (`delta_rule`): every decay factor is 1. Through the dispatcher, with strong gates
# where the factorised form above broke down:

# %%
for name, kw in [("KDA", dict(gate="per_dim")), ("Gated DeltaNet", dict(gate="per_head"))]:
    a = testing.make_inputs("kda", B=1, T=T, H=H, K=K, V=V, strength="strong", device=DEV, seed=5, **kw)
    out, _ = linattn.kda(**a, impl="triton", chunk_size=C)
    ref, _ = naive.kda(**testing.to_float64(a))
    print(f"{name:15s} (log-gates to −20): {testing.rel_err(out, ref):.1e}  ran {linattn.which('kda')}")
    assert testing.rel_err(out, ref) < testing.tolerance(torch.float32)
a = testing.make_inputs("delta_rule", B=1, T=T, H=H, K=K, V=V, device=DEV, seed=6)
out, _ = linattn.delta_rule(**a, impl="triton", chunk_size=C)
ref, _ = naive.delta_rule(**testing.to_float64(a))
print(f"{'DeltaNet':15s}: {testing.rel_err(out, ref):.1e}  ran {linattn.which('delta_rule')}")
assert testing.rel_err(out, ref) < testing.tolerance(torch.float32)

# %% [markdown]
# ## 7. Precision
#
# With bf16 or fp16 inputs the big dots ($KK^\top$ blocks, $W$ and $U$, $WS$, $\tilde K^\top\tilde V$,
# $QS$, $A_{qk}\tilde V$) read half-precision tiles and accumulate in float32; the gates, the
# diagonal blocks and the inverse stay float32. The tolerance each dtype must meet against the
# float64 reference is the book's usual one. (Under the interpreter every tile is upcast after
# its load, so on a CPU the half-precision rows measure input and output rounding only; on a GPU
# they include the tensor cores' rounding.)

# %%
for dt in (torch.float32, torch.bfloat16, torch.float16):
    a = testing.make_inputs("kda", B=1, T=T, H=1, K=K, V=V, dtype=dt, device=DEV, seed=7)
    out, _ = linattn.kda(**a, impl="triton", chunk_size=C)
    e = testing.rel_err(out, naive.kda(**testing.to_float64(a))[0])
    print(f"{str(dt):15s} rel err {e:.1e}  (tolerance {testing.tolerance(dt):.0e})")
    assert e <= testing.tolerance(dt)

# %% [markdown]
# ## 8. Speed against flash-linear-attention
#
# The benchmark setting: bf16, 16 heads, $K=V=128$, $B\cdot T = 32768$ tokens, forward only, gates
# $\log\sigma(x)/16$, flash-linear-attention (FLA) timed in the same run on the same inputs. On a
# CPU this section shows the recorded run of `tools/bench.py --suite anchors`
# (`book/data/bench.json`, the run of chapters 09 and 10; the caption names device, date and
# versions); on a GPU it also times our kernels live at one length (and FLA, if it is installed).

# %%
caption = bench.run_label          # device, date, software versions of a recorded run


NAMES = {"delta_rule": "delta", "gated_delta_rule": "gdn", "kda": "kda"}
LABELS = {"delta": "DeltaNet", "gdn": "Gated DeltaNet", "kda": "KDA"}
rec = bench.recorded_run("bench.json")
NO_RECORD = ("No recorded GPU run next to this notebook: book/data/ comes with a clone of the repository, "
             "not with the wheel (on Colab, upload its .json files into a folder data/ beside the notebook).")
got = {}
for r in rec["anchors"]["rows"] if rec else []:
    if r["op"] in NAMES:
        row = got.setdefault(r["T"], {"T": r["T"]})
        row[NAMES[r["op"]]], row[NAMES[r["op"]] + "_fla"] = r["triton"], r["fla"]
        row[NAMES[r["op"]] + "_floor"], row[NAMES[r["op"]] + "_err"] = r.get("floor"), r.get("rel_err_triton")
rows = sorted(got.values(), key=lambda r: r["T"])
Ts = [r["T"] for r in rows]
if not rows:
    print(NO_RECORD)
else:
    print("Recorded run:", caption(rec["env"]))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for op, color in [("delta", "C0"), ("gdn", "C1"), ("kda", "C2")]:
        ax.plot(Ts, [r[op] for r in rows], "o-", color=color, label=f"{LABELS[op]}: linattn")
        ax.plot(Ts, [r[op + "_fla"] for r in rows], "s--", color=color, alpha=0.6, label=f"{LABELS[op]}: FLA")
    kda_init = {r["T"]: r["triton"] for r in rec["anchors"]["by_gates"].get("mamba", []) if r["op"] == "kda"}
    ax.plot(Ts, [kda_init.get(T_) for T_ in Ts], "^:", color="C2", label="KDA: linattn, its own gate init")
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ts, [f"{t // 1024}k" for t in Ts])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_xlabel("sequence length T (B = 32768 / T)")
    ax.set_ylabel("forward time (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"bf16, H = 16, K = V = 128, gates logσ(x)/16 unless named — {caption(rec['env'])}", fontsize=8)
    ax.legend(fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(0, 0.8))   # in the gap above 2.5 ms
    fig.tight_layout()
    plt.show()
    print("linattn / FLA, ms (ratio):")
    print(" T      " + "  ".join(f"{LABELS[o]:>26s}" for o in LABELS))
    for r in rows:
        print(f"{r['T']:6d}  " + "  ".join(f"{r[o]:6.3f} / {r[o + '_fla']:5.3f} ms ({r[o] / r[o + '_fla']:4.2f}×)"
                                           for o in LABELS))

# %% [markdown]
# The facts, read from the recorded numbers:

# %%
if rows:
    for o in LABELS:
        ratio = [r[o] / r[o + "_fla"] for r in rows]
        floor = [r[o] / r[o + "_floor"] for r in rows if r[o + "_floor"]]
        errs = [r[o + "_err"] for r in rows if r[o + "_err"] is not None]
        worst = max(rows, key=lambda r: r[o] / r[o + "_fla"])["T"]
        print(f"{LABELS[o]:15s} linattn/FLA {min(ratio):.2f}–{max(ratio):.2f}× (largest at T = {worst}); "
              f"{min(floor):.1f}–{max(floor):.1f}× the memory floor; "
              f"bf16 rel err vs the float32 chunk level ≤ {max(errs):.1e}")
    # what the text below says: DeltaNet ahead everywhere, the gated two ahead at the longest T
    # and at most a fifth behind anywhere
    assert max(r["delta"] / r["delta_fla"] for r in rows) < 1
    assert all(rows[-1][o] < rows[-1][o + "_fla"] and max(r[o] / r[o + "_fla"] for r in rows) < 1.2
               for o in ("kda", "gdn"))

# %% [markdown]
# Read plainly, in the recorded run, with the benchmark's mild gates: **our delta-rule kernels are
# correct; DeltaNet is ahead of FLA at every length; KDA and Gated DeltaNet are ahead at long $T$
# and level with it or a little behind at the shortest lengths.** The gap is widest at long $T$,
# where FLA's sequential state pass is slower than ours (below). Against the memory floor (every
# input read once and the output written once at the copy bandwidth measured in the same run) all
# three are still several times away (printed above): stage 1 does many small dense products per
# chunk, far more work than the bytes it moves. The relative errors are within the bf16 tolerance
# ($10^{-2}$).
#
# **Gates as layers produce them.** The mild gates decay a 64-token chunk by at most $e^{-5}$, so
# every chunk takes the factorised split of §2. The same run timed the gates models start from
# ($\log\sigma(x)$, and KDA's own initialisation $-e^{A_{\log}}\,\mathrm{softplus}(x + b)$), whose
# chunks decay far past the split's bound (chapter 10, §3b, counts them):

# %%
if rows:
    strong = {}
    for gates, rows_g in rec["anchors"]["by_gates"].items():
        for op in ("kda", "gated_delta_rule"):
            strong[gates, op] = [r["triton"] / r["fla"] for r in rows_g if r["op"] == op]
            print(f"{LABELS[NAMES[op]]:15s} gates {gates:10s} linattn/FLA {min(strong[gates, op]):.2f}–"
                  f"{max(strong[gates, op]):.2f}×")
    # what the text says: KDA's forward takes twice FLA's time or more at short T with these gates,
    # Gated DeltaNet's (one decay per head, nothing to split) stays near FLA's
    assert all(max(v) > 2 for (g, op), v in strong.items() if op == "kda")
    assert all(max(v) < 1.2 for (g, op), v in strong.items() if op == "gated_delta_rule")

# %% [markdown]
# KDA's time does not survive them: the chunks past the bound are flagged by the split kernel and
# redone by the exact kernel, so they pay for both, and its forward takes twice FLA's time or more
# up to 8k tokens (FLA's time does not move with the gates). Gated DeltaNet has one decay per head,
# a $C\times C$ factor with nothing to split, and its times stay where the mild gates put them. The
# backward shows the same dependence (chapter 13, §10). A kernel whose speed holds at every gate
# strength is still to be found; `docs/performance.md` lists the candidates.
#
# **Five designs of stage 1.** How the same algebra is laid out in registers decides the speed,
# and only a GPU shows it. Five designs of stage 1, each correct in the interpreter:
#
# 1. **One kernel on rank-3 and rank-4 register tensors** (`[C/16, 16, K]`, pulling row $j$ of a
#    block out with a masked sum) — natural in NumPy. Natively it faulted in bf16, and the scores
#    took most of KDA's time (the table below, recorded on an H200).
# 2. **One kernel on 2-D tiles only**, blocks moved in and out of the $C\times C$ matrix by exact
#    dots with 0/1 matrices and a serial inverse. No fault, but slower still for DeltaNet and not
#    much faster for KDA; a per-kernel profile (`tools/profile_ops.py`) put nearly all of the time
#    in that one kernel, in the placement dots and the serial inverse.
# 3. **Three plain kernels** (scores, block inverse, $W$/$U$), every block moved through memory
#    by pointer, the diagonal blocks inverted by forward substitution with their rows read from
#    memory. Correct and several times faster than design 1 for KDA; for DeltaNet and Gated
#    DeltaNet $A$ still went to memory and back in float32 between the scores and the inverse.
# 4. **Blocks as separate variables** (sections 1–3, the kernels this chapter runs, and the
#    recorded run above): a 16×16 block is computed or loaded at that size and stays its own
#    register tile, so nothing is ever cut out; the diagonal blocks are inverted by doubling on
#    the tensor cores. For DeltaNet and Gated DeltaNet the scores and the inverse are one kernel
#    and $A$ never leaves the chip: their scores and inverse take about half the time of design
#    3's (the table below). For KDA, design 4 kept design 3's split at every sub-chunk boundary: a
#    scores kernel with one program per sub-chunk, re-reading the chunk's earlier rows, writing
#    $A$, then the register inverse.
# 5. **KDA split at the chunk start, checked per chunk** (section 2, the kernels this chapter
#    runs): where the chunk's gates decay by less than 60, its scores are the factorised form,
#    computed as design 4 computes Gated DeltaNet's, with $W$ and the decays in the same program;
#    the chunks past the bound (few with mild gates, most with KDA's own initialisation: the
#    measurement above) are redone by the exact kernel, which returns at once for the others. This cuts KDA's stage 1 to well under half of design 4's. Putting every chunk
#    through the exact kernel's 16-row decays in one program instead (no flag) is slower than
#    design 4: its per-pair decays and diagonal-block products spill registers.
#
# The recorded stage-1 times of designs 3–5 (`book/data/11_kda_triton.json`, $T = 1$k):

# %%
old = bench.recorded_run("11_kda_triton.json")
OPS = {"delta_rule": "DeltaNet", "gated_delta_rule": "Gated DeltaNet", "kda": "KDA"}
if not old:
    print(NO_RECORD)
else:
    dz = old["designs"]
    print(f"{caption({**old['env'], 'date': dz['date']})}; {dz['setting']}")
    print(bench.markdown_table(["op", "design", "stage 1, ms", "of which", "forward, ms"],
                               [[OPS[r["op"]], r["design"], sum(r["stage1"].values()),
                                 ", ".join(f"{n} {v}" for n, v in r["stage1"].items()), r["forward"]]
                                for r in dz["rows"]]))

# %% [markdown]
# Design 1, recorded on its own (same file), against the kernels the library runs (design 4; for
# KDA design 5):

# %%
if not old:
    print(NO_RECORD)
else:
    print("Design 1:", caption(old["env"]), "·", old["env"]["kernel"], "·", old["env"]["setting"])
    lib = {r["T"]: r for r in rows}
    print("ms, design 1 → the library's kernels (their ratio):")
    print(" T      " + "  ".join(f"{LABELS[o]:>28s}" for o in LABELS))
    for r in old["base"]:
        if r["T"] in lib:
            print(f"{r['T']:6d}  " + "  ".join(f"{r[o]:6.3f} → {lib[r['T']][o]:6.3f} ms ({lib[r['T']][o] / r[o]:4.2f}×)"
                                               for o in LABELS))
    for st in old.get("stages", []):
        print(f"design 1, {LABELS[st['op']]} T = {st['T']}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in st["ms"].items()))

# %% [markdown]
# For KDA, design 5 is several times faster than design 1, whose one stage-1 kernel
# (`_wy_kernel`) took almost all of KDA's time. For DeltaNet and Gated DeltaNet, whose scores
# carry no per-dimension decay, design 1 was faster than design 3: its one kernel kept the
# chunk's blocks on chip, where design 3 wrote $A$ and read it back between kernels. Design 4
# keeps $A$ on chip as design 1 did, without moving blocks inside register tiles: in the recorded
# runs it is faster than design 1 at all or all but one of the lengths (the printout above says
# which; where it is not, the two are within a few per cent and the state pass is most of the
# time).

# %%
if DEV == "cuda":  # live: our kernels, FLA beside them if it is installed
    from linattn.validate import value_checks

    Tl = 4096
    la = bench.anchor_inputs("kda", Tl)
    with value_checks(False):
        ms = bench.median_ms(lambda: linattn.kda(**la, impl="triton"))
    fla = bench.fla_call("kda", la)
    fla_ms = bench.median_ms(fla) if fla else float("nan")
    print(f"live at T={Tl}: linattn.triton.kda {ms:.3f} ms, FLA {fla_ms:.3f} ms")

# %% [markdown]
# **Where the time goes.** A per-kernel profile (`tools/profile_ops.py`, which times every kernel
# of ours and of FLA on the same inputs) splits each forward into stage 1 (for DeltaNet and Gated
# DeltaNet the factor kernel and $W$/$U$; for KDA the split kernel with $W$, the exact kernel and
# $U$; for FLA its scores, inverse, $W$/$U$ and gate-cumsum kernels and the elementwise kernels
# it launches), the state pass and the output:

# %%
def stages(kernels, prof):
    """(stage 1, state pass, output, total) ms of one profiled forward."""
    state = sum(ms for n, ms in kernels.items() if n in prof["state_kernels"])
    out = sum(ms for n, ms in kernels.items() if n in prof["output_kernels"])
    total = sum(kernels.values())
    return total - state - out, state, out, total


if not old or "profile" not in old:
    print(NO_RECORD)
else:
    prof = old["profile"]
    print(f"{caption({**old['env'], 'date': prof['date']})}; {prof['setting']}\n`{prof['command']}`")
    table, split = [], {}
    for r in prof["rows"]:
        ours, fla = stages(r["ours"], prof), stages(r["fla"], prof)
        split[r["op"], r["T"]] = ours, fla
        table.append([OPS[r["op"]], r["T"], *ours, *fla])
    print(bench.markdown_table(["op", "T", "stage 1", "state pass", "output", "total",
                                "FLA stage 1", "FLA state pass", "FLA output", "FLA total"], table))
    for op in OPS:
        (o1, _, _, ot), (f1, _, _, ft) = split[op, 1024]
        (_, o2, _, _), (_, f2, _, _) = split[op, 32768]
        print(f"{OPS[op]:15s} T = 1k: stage 1 {o1:.2f} against FLA's {f1:.2f} ms, forward {ot:.2f} against {ft:.2f}; "
              f"T = 32k: state pass {o2:.2f} against {f2:.2f}")

# %% [markdown]
# DeltaNet's stage 1 is well under FLA's, most of whose time goes to its inverse. For Gated
# DeltaNet at $T = 1$k the two forwards are level: our stage 1 is slower — it also writes
# $A_{qk}$, which FLA's output kernel recomputes, and the decayed keys $\tilde K$, which FLA's
# state pass forms itself — and our output kernel makes up the difference. KDA's stage 1 is
# faster than FLA's: one split kernel does what FLA spreads over four (a token-parallel kernel
# for the diagonal blocks, one for the blocks below and the inverse, $W$/$U$, and a cumulative
# sum of the gates). At $T = 32$k, with one sequence of 16 heads, the sequential state pass is the
# largest kernel, and ours is ahead of FLA's for all three: every load in its chunk loop is
# software-pipelined (chapter 10, §4 — here the keys stay in bf16 and the chunk's decay is loaded
# one chunk ahead).
#
# One cost can be seen on a CPU without a GPU: Triton compiles for a GPU it does not have
# (`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`), and
# `cuobjdump --dump-resource-usage` on the cubin reports registers and spill stack. That is how
# the IEEE float32 products of the inverse show their cost — an 81 KB spill stack and minutes of
# compilation (they run on the FMA units with operand tiles copied across threads) — and why the
# kernels use `tf32x3` tensor-core products there. The CPU sees spills and compile time, not
# speed: the slowness of design 2 shows only on a GPU, and only a GPU profile says which kernel it
# is in.

# %% [markdown]
# ## Summary
#
# * The delta rule's chunk form is three stages: a fully parallel **WY/UT** stage (plain kernels:
#   factors, scores and inverse in one kernel, then $W$ and $U$), a sequential **affine state
#   pass** that keeps $S$
#   on chip and applies $S' = MS + B$ through $\tilde V = U - WS$, and a fully parallel **output**
#   stage.
# * KDA's scores are the factorised form $(K\odot e^{G})(K\odot e^{-G})^\top$ in chunks whose gates
#   decay by less than 60 — every measured chunk of GLA-style gates, a part of KDA's own gates
#   as initialised (chapter 10 §3b) — and nothing can overflow
#   there; the kernel flags the other chunks, and an exact kernel redoes them with every
#   exponent $\le 0$ (decays split at 16-row block boundaries, diagonal blocks column by column
#   with factors $e^{g}\le 1$ where they decay fast). Log-gates of $-20$ per token give no NaN.
# * $(I+A)^{-1}$ comes from ten 16×16 register tiles: the diagonal blocks by doubling
#   ($X \leftarrow X - XLX$, exact because $LXL = 0$), the blocks below by
#   $\mathcal T_{ij} = -\mathcal T_{ii}\sum_m A_{im}\mathcal T_{mj}$, on the tensor cores (one tf32
#   pass for bf16 inputs, three for float32).
# * Gated DeltaNet (one gate per head) and DeltaNet (no gate) are the same kernels with the decay
#   reduced to a $C\times C$ factor or removed.
# * The state pass is the only sequential stage; its V-block width is chosen so that long
#   sequences with few heads still occupy every SM.
# * Measured on an H200 (the recorded run of section 8): correct; with mild gates DeltaNet ahead
#   of FLA at every length, KDA and Gated DeltaNet ahead at long $T$ and level or a little behind
#   at short $T$; with the gates models produce KDA's forward takes twice FLA's time or more, its
#   strongly decaying chunks paying for both kernels. How stage 1 is laid
#   out in registers decides the speed: blocks kept as separate tiles and inverted where they
#   were computed beat both one kernel on rank-3 register tensors and blocks moved through
#   memory; for KDA, taking the cheap factorised form where it is safe and checking where it is
#   not beat splitting every block exactly.
#
# **Workbook:** [`exercises/11_kda_triton.py`](../exercises/11_kda_triton.py) — write the
# stage-1 kernels and the state pass yourself, checked against the library's. The kernels' own
# tests are `tests/test_triton_delta.py`.
