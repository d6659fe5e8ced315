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
# # Workbook 13 — the backward pass in Triton
#
# Companion of `book/13_backward_triton.py`. You write, as Triton kernels, the pieces of GLA's
# backward that chapter 13 walks through, in the order the library runs them, then put them
# together:
#
# 1. `ch13.dstates` — the reverse pass over the state gradients (the backward's one sequential kernel);
# 2. `ch13.offdiag_dq` — an intra-chunk gradient tile: $dq$ from the off-diagonal sub-chunk tiles;
# 3. `ch13.diag_dk` — the row walk that sums $dk$ over a diagonal sub-chunk tile in float32;
# 4. `ch13.gate_scan` — the gate gradient's chunk-local scan;
# 5. `ch13.gla_backward` — the whole GLA backward. Passing it unlocks
#    `linattn.gla(..., impl="mine")` *with gradients*: training runs through your backward.
#
# Notation as in chapters 10, 12 and 13: inside a chunk of $C$ tokens (32 here) $b_t$ is the log-gate
# summed from the chunk start, $b_C$ its value at the chunk's last token, $S_{[n-1]}$ the state
# entering chunk $n$, $dS_{[n]}$ the gradient of the state after it, and
# $dA_{ts} = \text{scale}\cdot dO_t\cdot v_s$ ($s \le t$) the gradient of the chunk's score matrix
# (the kernels' `dA`, stored `[B, T, H, C]`: row $t$, column $s$ counted from $t$'s chunk start).
# Tensors have the library's layout: `q`, `k`, `g`, `b` `[B, T, H, K]`, `do` `[B, T, H, V]`.
#
# Grading works as in workbooks 09–11: each kernel runs under the Triton interpreter on a CPU
# (natively on a GPU) on small fresh cases — lengths that are not multiples of the chunk, strong
# gates down to −20 per token — against float64 PyTorch; `torch.empty` is NaN-filled and every
# `tl.load` / `tl.store` bounds-checked while graded; and a wrong answer that matches a known
# mistake is told which. `spec(name)` prints the PyTorch code a kernel must match.

# %%
import linattn  # first: on a machine without a GPU it switches Triton's interpreter on
import torch
import triton
import triton.language as tl

from linattn.grade import check, spec

# %% [markdown]
# ## Exercise 1 — `ch13.dstates`: the reverse pass
#
# `reverse_state_pass(q, do, b, dfinal_state, *, scale, chunk_size=32) -> (dh, dinitial_state)`.
# `b` is float32; `dfinal_state` `[B, H, K, V]` float32 or `None` (zeros). Return `dh`
# `[B, H, NT, K, V]` float32 with `dh[:, :, n]` $= dS_{[n]}$, the gradient of the state *after*
# chunk $n$, and `dinitial_state` $= dS_{[0]}$ before the first chunk. Walking the chunks from the
# last to the first:
#
# $$dS_{[n-1]} = \operatorname{diag}(e^{b_C})\,dS_{[n]} + \text{scale}\,(Q_{[n]}\odot e^{G_{[n]}})^\top dO_{[n]},$$
#
# where $b_C$ is $b$ at the chunk's last token *before $T$* (the last chunk may be partial). Store
# $dS_{[n]}$ first, then update: chunk $n$'s outputs read the state before the chunk, not after.
# The rows and columns of $dS$ never mix, so a program may own a K-block × V-block of it; one
# program per (batch·head) holding all of $K \times V$ is enough here (K, V ≤ 40).

# %%
spec("ch13.dstates");

# %% exercise="ch13.dstates"
@triton.jit
def dstates_kernel(q, do, b, dh, dsT, ds0, T, H, K, V, NT, scale, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, HAS_DST: tl.constexpr):
    pass  # your kernel here


def reverse_state_pass(q, do, b, dfinal_state, *, scale, chunk_size=32):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch13.dstates", reverse_state_pass);

# %% [markdown]
# ## Exercise 2 — `ch13.offdiag_dq`: an intra-chunk gradient tile
#
# `offdiag_dq(q, k, b, dA, *, chunk_size=32, sub_chunk_size=16) -> dq` `[B, T, H, K]` float32: the
# part of $dq$ that the **off-diagonal** sub-chunk tiles give. For a query $t$ in sub-chunk $i$
# of its chunk, summing over the keys $s$ of the earlier sub-chunks $j < i$ of the same chunk:
#
# $$dq_t = \sum_{s} dA_{ts}\,k_s\odot e^{\,b_t - b_s}.$$
#
# Split the decay at $r$, $b$ just before sub-chunk $i$ (row `i*16 - 1` of the chunk):
# $dq_{[i]} = e^{G_{[i]} - r}\odot\sum_{j<i} dA_{[i][j]}\,(K_{[j]}\odot e^{r-G_{[j]}})$, a `tl.dot`
# per tile with both exponents $\le 0$ — the forward's split of chapter 10, with $dA$ in place of
# $Q$ and $K$ in place of $V$. Sub-chunk 0 gets zeros. (`q` is passed for the signature's
# symmetry with the library's kernel; $dq$ does not read it.) The diagonal tiles $j = i$ are not
# part of this exercise: exercise 3 and its mirror image for $dq$ handle them.

# %%
spec("ch13.offdiag_dq");

# %% exercise="ch13.offdiag_dq"
@triton.jit
def offdiag_dq_kernel(k, b, dA, dq, T, H, K, C: tl.constexpr, c: tl.constexpr, BK: tl.constexpr):
    pass  # your kernel here


def offdiag_dq(q, k, b, dA, *, chunk_size=32, sub_chunk_size=16):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch13.offdiag_dq", offdiag_dq);

# %% [markdown]
# ## Exercise 3 — `ch13.diag_dk`: the row walk of a diagonal tile
#
# `diag_dk(q, g, dA, *, chunk_size=32, sub_chunk_size=16) -> dk` `[B, T, H, K]` float32, from the
# raw log-gates `g`: inside each sub-chunk, for every key $s$,
#
# $$dk_s = \sum_{t \ge s} dA_{ts}\,q_t\odot e^{\,b_t - b_s}\qquad(t \text{ in } s\text{'s sub-chunk, } s \text{ itself included}).$$
#
# There is no point between a query and its key to split at, so build the decay tile one gate
# factor $e^{g_t} \le 1$ at a time. Walk the rows $t$ from first to last with a `[c, BK]` float32
# tile $F$, $F_t[s] = e^{b_t - b_s}$ for $s \le t$ and 0 for $s > t$:
#
# $$F_t = \begin{cases}1 & \text{row } s = t\\ F_{t-1}[s]\,e^{g_t} & s < t\end{cases},
#   \qquad dk \mathrel{+}= dA_{t,\cdot}\otimes q_t\odot F_t .$$
#
# Each row adds one rank-one tile to all of $dk$ at once; walking the columns instead would need a
# sum across rows and a write into one row per column. Rows past $T$: load $g = 0$ and $q = 0$.

# %%
spec("ch13.diag_dk");

# %% exercise="ch13.diag_dk"
@triton.jit
def diag_dk_kernel(q, g, dA, dk, T, H, K, C: tl.constexpr, c: tl.constexpr, BK: tl.constexpr):
    pass  # your kernel here


def diag_dk(q, g, dA, *, chunk_size=32, sub_chunk_size=16):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch13.diag_dk", diag_dk);

# %% [markdown]
# ## Exercise 4 — `ch13.gate_scan`: the gate gradient, chunk by chunk
#
# Chapter 12 derives the gate gradient's chunk-local form and chapter 13 measures why the library
# uses it. For token $u$ of chunk $n$:
#
# $$dg_u = \sum_{t \ge u} db_t + \sum_{j < u} w_j + \text{carried}_{[n]},$$
#
# both sums over chunk $n$ only, with $db_t = q_t\odot dq_t - k_t\odot dk^{\text{intra}}_t$,
# $w_j = k_j\odot dk^{\text{write}}_j$ (the part of $dk_j$ through the state after the chunk) and
# $\text{carried}_{[n]} = e^{b_C}\odot\sum_\nu S_{[n-1]}\odot dS_{[n]}$. Here you get `db`, `w`
# `[B, T, H, K]` and `carried` `[B, NT, H, K]` (float32) and return `dg` `[B, T, H, K]` float32:
# one program per (chunk, batch·head), `tl.cumsum(x, axis=0, reverse=True)` for the suffix and
# an *exclusive* prefix for the writes.

# %%
spec("ch13.gate_scan");

# %% exercise="ch13.gate_scan"
@triton.jit
def gate_scan_kernel(db, w, carried, dg, T, H, K, NT, C: tl.constexpr, BK: tl.constexpr):
    pass  # your kernel here


def gate_scan(db, w, carried, *, chunk_size=32):
    raise NotImplementedError("write the launcher (and the kernel above)")


# %%
check("ch13.gate_scan", gate_scan);

# %% [markdown]
# ## Exercise 5 — `ch13.gla_backward`: the whole backward
#
# `gla_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None,
# chunk_size=32, sub_chunk_size=16) -> (dq, dk, dv, dg, dinitial_state)`, every gradient in its
# input's shape and dtype (`dinitial_state` `None` without `initial_state`), graded against float64
# autograd through the token loop at relative error 1e-4. `g` is `[B, T, H, K]`, or `[B, T, H]`
# (one gate per head: expand it to `[B, T, H, K]` and sum `dg` over $K$ at the end). The steps,
# in chapter 13's order:
#
# 1. $b$ (chunk-local cumulative gates, float32) and the states $S_{[n-1]}$ entering each chunk:
#    a state pass like workbook 10's, or the library's `linattn.triton.gated.chunk_states`;
# 2. your reverse pass (exercise 1) from `dfinal_state`;
# 3. $dA = \text{scale}\cdot\operatorname{tril}(dO\,V^\top)$ per chunk, diagonal included;
# 4. the intra-chunk $dq$, $dk$: your off-diagonal $dq$ tiles and diagonal $dk$ walk, plus their
#    mirror images (off-diagonal $dk$ with $r = b$ at the last token of the key's sub-chunk,
#    diagonal $dq$ walking the columns);
# 5. $dv_j = (k_j\odot e^{b_C - b_j})\,dS_{[n]} + \text{scale}\sum_{t\ge j} P_{tj}\,dO_t$, with $P$
#    the forward's score matrix of the chunk;
# 6. the state parts $dq_t \mathrel{+}= \text{scale}\,(dO_t S_{[n-1]}^\top)\odot e^{b_t}$ and
#    $dk^{\text{write}}_t = (v_t\,dS_{[n]}^\top)\odot e^{b_C - b_t}$;
# 7. $dg$ by your scan (exercise 4).
#
# The grader checks results, not structure: glue between kernels may be PyTorch. Passing records
# your function, and `linattn.gla(..., impl="mine")` then differentiates through it (with your
# workbook-10 forward if you passed `ch10.gla`, else the library's Triton forward).

# %%
spec("ch13.gla_backward");

# %% exercise="ch13.gla_backward"
def gla_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None, chunk_size=32,
                 sub_chunk_size=16):
    raise NotImplementedError("write it from your kernels above")


# %%
check("ch13.gla_backward", gla_backward);

# %% [markdown]
# Passed? Train through your backward: `linattn.which("gla")` names it after a call with
# `impl="mine"` (uncomment):

# %%
# args = linattn.testing.make_inputs("gla", B=1, T=40, H=2, K=16, V=16, seed=0)
# x = {n: a.requires_grad_() for n, a in args.items()}
# o, _ = linattn.gla(**x, impl="mine")
# o.square().sum().backward()
# print(linattn.which("gla"), x["g"].grad.abs().max())

# %%
from linattn.grade import progress_text; print(progress_text())
