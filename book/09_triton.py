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
# # 09 — Triton in one sitting
#
# **Goal.** Chapter 02 wrote chunkwise linear attention with PyTorch matmuls: a Python loop over
# chunks, each step a handful of small matrix products. Every product is a separate GPU launch that
# reads its operands from memory and writes its result back. A *kernel* does the whole chunk —
# or the whole sequence — in one launch, keeping the state on chip. This chapter teaches just enough
# Triton to write that kernel:
#
# 1. programs and blocks: how a kernel is split over the GPU;
# 2. pointers and masks: how a block finds its data, and why sequence ends need masks;
# 3. `tl.dot`: matrix products on tensor cores, and what precision they compute in;
# 4. the interpreter: what running Triton on a CPU shows you, and what it cannot;
# 5. the compiler's resource report: registers, spills, shared memory;
# 6. a first real kernel — chunkwise linear attention forward — built from the chunk level,
#    checked against it, and then the library's version of it.
#
# On a CPU every kernel here runs in the Triton interpreter (slowly: small sizes); on a GPU the
# same cells compile them natively.

# %%
import matplotlib.pyplot as plt
import torch

import linattn  # first: without a GPU it switches Triton to its interpreter, before triton is imported
import triton
import triton.language as tl
from linattn import bench, chunk, naive, testing
from linattn.device import pick
from linattn.triton import common, gated

print(linattn.device.describe())
DEV = linattn.device.default_device()

# %% [markdown]
# ## 1. Programs and blocks
#
# A Triton kernel is a Python function decorated with `@triton.jit`. Launching it as
# `kernel[grid](args…)` runs one **program** for every point of `grid` (up to three dimensions).
# All programs run the same code; `tl.program_id(axis)` tells each which part of the problem is
# its own. The GPU runs as many programs at once as fit on its streaming multiprocessors (132 on
# an H200); the rest wait their turn.
#
# Inside a program the unit of work is a **block**: a whole tile of values, such as a
# $[C, K]$ slice of the keys. `tl.arange(0, 16)` is the vector $0, 1, \dots, 15$; arithmetic on
# blocks is elementwise, `tl.sum` reduces, `tl.dot` multiplies two tiles. Block shapes are fixed
# when the kernel is compiled (they are `tl.constexpr` arguments) and must be powers of two.
# You never see threads: the compiler spreads each block over the program's threads (`num_warps`
# groups of 32).
#
# The first kernel computes the state increment of one chunk of chapter 02, $K^\top V$, for
# every (batch, head) — one program each.

# %%
@triton.jit
def kv_kernel(k, v, out, T, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    i_bh = tl.program_id(0)                     # which (batch, head) this program owns
    i_b, i_h = i_bh // H, i_bh % H
    rows = tl.arange(0, BT)                     # token indices 0 … BT-1
    m = rows < T                                # real tokens (BT is T rounded up to a power of two)
    # k is [B, T, H, K] row-major: element (b, t, h, d) sits at ((b·T + t)·H + h)·K + d
    kt = tl.load(k + (i_b * T + rows[:, None]) * H * K + i_h * K + tl.arange(0, K)[None, :],
                 mask=m[:, None], other=0.0)   # [BT, K]
    vt = tl.load(v + (i_b * T + rows[:, None]) * H * V + i_h * V + tl.arange(0, V)[None, :],
                 mask=m[:, None], other=0.0)   # [BT, V]
    kv = tl.dot(tl.trans(kt), vt, input_precision="ieee")                     # [K, V]
    tl.store(out + i_bh * K * V + tl.arange(0, K)[:, None] * V + tl.arange(0, V)[None, :], kv)


B, T, H, K, V = 2, 40, 3, 16, 32
a = testing.make_inputs("linear_attn", B=B, T=T, H=H, K=K, V=V, device=DEV, seed=9)
out = torch.empty(B * H, K, V, device=DEV)
kv_kernel[(B * H,)](a["k"], a["v"], out, T, H, K, V, BT=triton.next_power_of_2(T))
ref = torch.einsum("bthk,bthv->bhkv", a["k"].double(), a["v"].double()).reshape(B * H, K, V)
print(f"grid = ({B * H},) programs · rel err vs PyTorch: {testing.rel_err(out, ref):.1e}")
assert testing.rel_err(out, ref) < testing.tolerance(torch.float32)

# %% [markdown]
# ## 2. Pointers and masks
#
# `k` inside the kernel is not a tensor but a **pointer** to its first element. Adding a block
# of offsets gives a block of pointers, and `tl.load` reads all of them at once. Nothing checks the
# offsets: reading past the end of a tensor reads whatever memory lies there (or faults). That is
# what the **mask** is for: `tl.load(p, mask=m, other=x)` reads only where `m` is true and puts `x`
# elsewhere; `tl.store(p, y, mask=m)` writes only there.
#
# Sequences rarely have a power-of-two length, so every tile that touches the end of the sequence
# is partly padding. The value chosen for `other` matters: padding rows must contribute nothing.
# Zero keys and values do that in $K^\top V$. **What breaks if** the padding is anything else? Give
# the loads `other=NaN` and look (the `pad` argument below is the only change):

# %%
@triton.jit
def kv_kernel_pad(k, v, out, T, H, pad, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    rows = tl.arange(0, BT)
    m = rows < T
    kt = tl.load(k + (i_b * T + rows[:, None]) * H * K + i_h * K + tl.arange(0, K)[None, :],
                 mask=m[:, None], other=pad)
    vt = tl.load(v + (i_b * T + rows[:, None]) * H * V + i_h * V + tl.arange(0, V)[None, :],
                 mask=m[:, None], other=pad)
    kv = tl.dot(tl.trans(kt), vt, input_precision="ieee")
    tl.store(out + i_bh * K * V + tl.arange(0, K)[:, None] * V + tl.arange(0, V)[None, :], kv)


for pad in (0.0, float("nan")):
    kv_kernel_pad[(B * H,)](a["k"], a["v"], out, T, H, pad, K, V, BT=triton.next_power_of_2(T))
    print(f"other={pad}: NaN in K^T V: {out.isnan().any().item()} · rel err {testing.rel_err(out, ref):.1e}")

# %% [markdown]
# The picture: the program's key tile is a block of 64 rows laid over a 40-token sequence. The
# mask marks the real rows; the other 24 are whatever `other` says.

# %%
BT = triton.next_power_of_2(T)
tile = torch.zeros(BT, K)
tile[:T] = a["k"][0, :, 0].abs()                     # |k| of (batch 0, head 0): the loaded values
fig, ax = plt.subplots(figsize=(6, 2.4))
ax.imshow(tile.T, aspect="auto", cmap="Blues")
ax.axvspan(T - 0.5, BT - 0.5, color="tab:red", alpha=0.25, label="masked: other=…")
ax.set_xlabel("row of the block (token)")
ax.set_ylabel("key dimension")
ax.set_title(f"one [{BT}, {K}] key tile over T = {T} tokens")
ax.legend(loc="upper right", fontsize=8)
plt.show()

# %% [markdown]
# With `other=NaN`, $24$ padding rows ($T = 40$ in a block of $64$) poison every entry of
# $K^\top V$. In a real kernel the padding is less visible (stale memory is usually finite), which
# is why the library's tests fill every output buffer with NaN before a kernel runs
# (`testing.poisoned()`) and compare against the float64 reference at lengths that are not a
# multiple of any block.

# %% [markdown]
# ## 3. `tl.dot` on tensor cores, and its precision
#
# `tl.dot(a, b)` multiplies an $[M, K]$ tile by a $[K, N]$ tile (every side ≥ 16) on the GPU's
# **tensor cores**. They take bf16 or fp16 operands and accumulate in float32 — that is the fast
# path, and what the library uses for bf16/fp16 inputs. For float32 operands Triton's default is
# **tf32**: each operand is rounded to a 10-bit mantissa first. That is fine for training and
# wrong for a float32 kernel checked at $10^{-5}$: the rounding alone costs about $2^{-11}$ per
# operand. The library passes `input_precision="ieee"` for float32 inputs (exact float32
# products, slower). We can see the size of the effect without a GPU by rounding operands to tf32 in
# PyTorch:

# %%
def to_tf32(x):
    """Round float32 to tf32 (10 mantissa bits): clear the 13 low bits, round to nearest."""
    bits = x.view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


x, y = torch.randn(64, 128), torch.randn(128, 64)
exact = x.double() @ y.double()
for name, (xx, yy) in {"float32 (ieee)": (x, y), "tf32 operands": (to_tf32(x), to_tf32(y)),
                       "bf16 operands": (x.bfloat16().float(), y.bfloat16().float())}.items():
    print(f"{name:15s} rel err {testing.rel_err(xx @ yy, exact):.1e}")
print("float32 tolerance:", testing.tolerance(torch.float32))

# %% [markdown]
# tf32 misses the float32 tolerance by an order of magnitude; bf16 operands are another ~10× worse,
# which is why the bf16 tolerance is $10^{-2}$. Two more facts about `tl.dot` shape the kernels:
# its accumulator is float32 whatever the operands (so the state $S$ lives in float32 and is cast
# to bf16 only as an operand), and every tile side must be at least 16 — the library rounds
# $K$, $V$ and the chunk size up to blocks of ≥ 16 (`common.block`) and masks the rest.

# %% [markdown]
# ## 4. The interpreter: Triton on a CPU
#
# With `TRITON_INTERPRET=1` in the environment *before* any `@triton.jit` function is defined,
# Triton does not compile: it runs each program one after another in NumPy, block operations as
# array operations. `linattn.device` sets the variable when no GPU is present, so this book's
# kernels run everywhere. The interpreter is the right tool for *logic*: indexing, masks, loop
# bounds, the algebra of a chunk. Every test of the Triton level runs through it on CPU machines.
#
# What it cannot tell you:
#
# * **bf16 arithmetic** is broken in the interpreter (NumPy has no bfloat16), so the library
#   upcasts every tile to float32 right after loading when interpreting — one constexpr,
#   `common.compute_dtype`. So on a CPU a bf16 run computes in float32 and only its output is
#   rounded to bf16; the tensor cores' bf16 operand rounding shows up natively only.
# * **performance**: programs run one at a time in Python, with nothing like the GPU's memory
#   hierarchy. Interpreter timings say nothing about kernels.
# * **resource limits**: registers, shared memory and spills do not exist there; a tile that is
#   far too big for a real GPU runs fine.
# * **races and miscompiles**: programs never overlap, and the compiler never runs. A kernel can be
#   right in the interpreter and wrong natively (`docs/performance.md` records one: a variant of
#   the delta rules' W/U kernel, exact under the interpreter, gave wrong W natively for bf16 at
#   head sizes 16 and 32) — so the
#   library's tests, and every chapter and workbook, also run natively on a GPU
#   (`tools/gpu_validate.sh`).

# %%
print("Triton mode:", linattn.device.triton_mode())
for dt in (torch.bfloat16, torch.float16, torch.float32):
    print(f"  {str(dt):15s} tiles computed as {common.compute_dtype(dt)}")

# %% [markdown]
# ## 5. Reading the compiler's resource report
#
# Natively, a launch returns the compiled kernel. Three of its numbers decide whether a kernel
# design is viable:
#
# * `kernel.n_regs` — registers per thread. A multiprocessor has 65 536 of them; a program of 4
#   warps (128 threads) using 255 registers each takes half of them, so at most two such programs
#   share a multiprocessor, and latency hiding suffers.
# * `kernel.n_spills` — values that did not fit in registers and went to (slow) local memory. A
#   float32 state of $128\times 64$ held by 128 threads is already 64 registers per thread.
# * `kernel.metadata.shared` — bytes of shared memory (used by `tl.dot` operand staging and
#   layout conversions); an H200 multiprocessor has 228 KB.
#
# The library records the last launch of each of its kernels in `gated.last_launch`. On a GPU
# the cell below prints the report for the linear-attention kernels at the benchmark's head size;
# in the interpreter nothing is compiled, and the cell says so.

# %%
Kr = pick(cpu=32, gpu=128)
ar = testing.make_inputs("linear_attn", B=1, T=pick(cpu=64, gpu=4096), H=2, K=Kr, V=Kr,
                         dtype=torch.bfloat16, device=DEV)
for mode in ("fused", "states"):
    gated.last_launch.clear()
    linattn.triton.linear_attn(**ar, mode=mode)
    for name, kern in gated.last_launch.items():
        if hasattr(kern, "n_regs"):
            print(f"{mode:6s} {name:7s} registers/thread {kern.n_regs:3d} · spills {kern.n_spills:3d} · "
                  f"shared {kern.metadata.shared:6d} B · warps {kern.metadata.num_warps}")
        else:
            print(f"{mode:6s} {name:7s} interpreted: no compiled kernel, no resource report")

# %% [markdown]
# ## 6. A first kernel: chunkwise linear attention forward
#
# Chapter 02's chunk form, with state $S \in \mathbb R^{K\times V}$ entering chunk $n$:
#
# $$O_{[n]} = \text{scale}\cdot\big(Q_{[n]} S + (Q_{[n]}K_{[n]}^\top \odot M)\,V_{[n]}\big),\qquad
#   S \leftarrow S + K_{[n]}^\top V_{[n]},$$
#
# with $M$ the causal mask inside the chunk. Translated to Triton:
#
# * one program per (batch, head) — it walks the chunks in order, so $S$ can stay in registers;
# * per chunk, three tiles are loaded ($Q, K$: $[C, K]$; $V$: $[C, V]$), masked at the end of the
#   sequence;
# * four `tl.dot`s: $P = QK^\top$ (then the causal mask by `tl.where`), $QS$ and $PV$, and $K^\top V$.
#
# This teaching version keeps $K$ and $V$ whole (powers of two ≥ 16) and computes in float32.

# %%
@triton.jit
def chunk_linear_attn_kernel(q, k, v, o, T, H, scale, K: tl.constexpr, V: tl.constexpr,
                             C: tl.constexpr):
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    q += (i_b * T * H + i_h) * K               # token 0 of this (batch, head); a token is H·K further
    k += (i_b * T * H + i_h) * K
    v += (i_b * T * H + i_h) * V
    o += (i_b * T * H + i_h) * V
    dk, dv, idx = tl.arange(0, K), tl.arange(0, V), tl.arange(0, C)
    S = tl.zeros([K, V], dtype=tl.float32)                                   # state, on chip
    for t0 in range(0, T, C):
        rows = t0 + idx
        m = (rows < T)[:, None]                                              # last chunk may be short
        qc = tl.load(q + rows[:, None] * H * K + dk[None, :], mask=m, other=0.0)   # [C, K]
        kc = tl.load(k + rows[:, None] * H * K + dk[None, :], mask=m, other=0.0)   # [C, K]
        vc = tl.load(v + rows[:, None] * H * V + dv[None, :], mask=m, other=0.0)   # [C, V]
        P = tl.dot(qc, tl.trans(kc), input_precision="ieee")                       # [C, C]
        P = tl.where(rows[:, None] >= rows[None, :], P, 0.0)                       # causal mask
        oc = tl.dot(qc, S, input_precision="ieee") + tl.dot(P, vc, input_precision="ieee")
        tl.store(o + rows[:, None] * H * V + dv[None, :], scale * oc, mask=m)
        S += tl.dot(tl.trans(kc), vc, input_precision="ieee")                      # [K, V]


def teaching_linear_attn(q, k, v, chunk_size=32):
    B, T, H, K = q.shape
    o = torch.empty_like(v)
    chunk_linear_attn_kernel[(B * H,)](q, k, v, o, T, H, K ** -0.5, K, v.shape[-1], chunk_size)
    return o


B, T, H, K, V = 2, pick(cpu=100, gpu=2000), 2, 32, 64
a = testing.make_inputs("linear_attn", B=B, T=T, H=H, K=K, V=V, device=DEV, seed=1)
o_kernel = teaching_linear_attn(a["q"], a["k"], a["v"])
o_chunk, _ = chunk.linear_attn(**a, chunk_size=32)
o_ref, _ = naive.linear_attn(**testing.to_float64(a))
print(f"T={T} (not a multiple of 32): vs chunk level {testing.rel_err(o_kernel, o_chunk):.1e}, "
      f"vs float64 recurrence {testing.rel_err(o_kernel, o_ref):.1e}")
assert testing.rel_err(o_kernel, o_chunk) < testing.tolerance(torch.float32)
assert testing.rel_err(o_kernel, o_ref) < testing.tolerance(torch.float32)

# %% [markdown]
# Twenty lines, one launch, and the same numbers as the chunk level. What is the kernel still
# missing to be a library function?
#
# * **Any head size and any dtype.** $K$ and $V$ are rounded up to blocks (≥ 16) with masks; bf16
#   and fp16 tiles go to the tensor cores as they are (float32 accumulation), float32 tiles with
#   `ieee` precision; in the interpreter everything is upcast (`common.compute_dtype`).
# * **An initial and a final state**, read and written in float32.
# * **Parallelism.** One program per (batch, head) is $B\cdot H$ programs: at $B=1$, $H=16$ that
#   is 16 programs on a 132-multiprocessor GPU. The library splits $V$ into blocks (each block of
#   columns of $S$ evolves independently: $S_{:,j} \leftarrow S_{:,j} + K^\top V_{:,j}$), and it
#   offers a second **mode**: a first kernel walks the chunks and writes the state entering each
#   chunk to memory, then a second kernel computes every chunk's output in parallel
#   ($B\cdot H\cdot N_T$ programs). Chapter 10 measures the two.
# * **Gates.** The library's kernel is the gated one of chapter 10 with the gate switched off by a
#   constexpr: with $g = 0$ every decay factor is 1 and the code above is what remains
#   (`linattn/triton/gated.py`, `_chunk_output` and `_state_step`).
#
# The library's `linattn.triton.linear_attn` has the signature of every other level, plus
# `mode="auto" | "fused" | "states"`:

# %%
for dt in (torch.float32, torch.bfloat16, torch.float16):
    a = testing.make_inputs("linear_attn", B=1, T=pick(cpu=70, gpu=3000), H=2, K=32, V=48, dtype=dt,
                            device=DEV, initial_state=True, seed=2)
    o_ref, S_ref = naive.linear_attn(**testing.to_float64(a), output_final_state=True)
    for mode in ("fused", "states"):
        with testing.poisoned():
            o, S = linattn.linear_attn(**a, impl="triton", chunk_size=32, mode=mode, output_final_state=True)
        e_o, e_S = testing.rel_err(o, o_ref), testing.rel_err(S, S_ref)
        print(f"{str(dt):15s} {mode:6s} o: {e_o:.1e} (tol {testing.tolerance(dt):.0e}) · final state: {e_S:.1e}")
        assert e_o <= testing.tolerance(dt) and e_S <= testing.tolerance(torch.float32)
print("ran:", linattn.which("linear_attn"))

# %% [markdown]
# ## 7. How fast, on a GPU
#
# On a CPU there is nothing to time (the interpreter's speed says nothing about kernels), so this
# section shows a recorded run of `tools/bench.py --suite anchors` (`book/data/bench.json`): bf16,
# $H = 16$, $K = V = 128$, $B\cdot T = 32\,768$ tokens, forward only, against
# flash-linear-attention (FLA) and causal softmax attention (PyTorch SDPA, which runs
# FlashAttention) on the same inputs. The `floor` column is the time to read every input once and
# write $o$ once at the copy bandwidth measured in the same run; `ours/floor` says how far a kernel
# is from that. The caption above the table names the device, the date and the software versions.
# On a GPU the cell after it also times the two modes live.

# %%
caption = bench.run_label          # device, date, software versions of a recorded run


rec = bench.recorded_run("bench.json")
NO_RECORD = ("No recorded GPU run next to this notebook: book/data/bench.json comes with a clone of the "
             "repository, not with the wheel (on Colab, upload it into a folder data/ beside the notebook).")
lin = [r for r in rec["anchors"]["rows"] if r["op"] == "linear_attn"] if rec else []
if not lin:
    print(NO_RECORD)
else:
    size = rec["size"]
    print(f"Recorded run: {caption(rec['env'])}; forward ms, bf16, H = {size['H']}, K = {size['K']}, "
          f"V = {size['V']}, B·T = {size['tokens']} tokens; copy bandwidth {rec['anchors']['bandwidth'] / 1e12:.2f} TB/s")
    print(bench.markdown_table(
        ["T", "B", "ours (auto)", "fused", "states", "chunk (PyTorch)", "FLA", "ours/FLA", "SDPA causal",
         "floor", "ours/floor"],
        [[r["T"], r["B"], r["triton"], r["triton:fused"], r["triton:states"], r.get("chunk"), r["fla"],
          r["ratio_fla"], r["sdpa"], r.get("floor"), r.get("ratio_floor")] for r in lin]))

# %%
def live_modes():
    rows = []
    for T in (1024, 8192, 32768):
        args = bench.anchor_inputs("linear_attn", T)
        rows.append([T, args["q"].shape[0]] + [bench.median_ms(bench.library_call("linear_attn", "triton", args,
                                                                                  mode=m)) for m in ("fused", "states")])
    print("live, ms:\n" + bench.markdown_table(["T", "B", "fused", "states"], rows))


pick(cpu=lambda: print("CPU: no live timing (see the recorded table above)"), gpu=live_modes)()

# %% [markdown]
# What the table shows, read from the recorded numbers (the next cell prints them, so a new
# recording updates them):

# %%
if lin:
    first, best = lin[0], min(lin, key=lambda r: r["triton"])
    ahead = [r["T"] for r in lin if r["triton"] <= r["fla"]]
    print(f"* T = {first['T']} (B = {first['B']}): fused {first['triton:fused']:.3f} ms, states "
          f"{first['triton:states']:.3f} ms, FLA {first['fla']:.3f} ms, the chunk level {first['chunk']:.2f} ms "
          f"({first['chunk'] / first['triton']:.0f}× the kernel).")
    for r in lin:
        faster = "fused" if r["triton:fused"] < r["triton:states"] else "states"
        print(f"* T = {r['T']:5d}: {r['B'] * 16 * 2:4d} fused programs, faster mode {faster:6s} "
              f"(fused {r['triton:fused']:.3f}, states {r['triton:states']:.3f} ms), ours/FLA {r['ratio_fla']:.2f}, "
              f"ours/floor {r['ratio_floor']:.1f}")
    print(f"* ours ≤ FLA at T = {', '.join(map(str, ahead)) or 'no length'}; "
          f"{len(ahead)} of {len(lin)} lengths.")
    print(f"* bf16 output against the float32 chunk level: relative error {first['rel_err_triton']:.1e}.")
    print(f"* SDPA: {lin[0]['sdpa']:.3f} ms at T = {lin[0]['T']}, {lin[-1]['sdpa']:.2f} ms at T = {lin[-1]['T']}; "
          f"linear attention faster at {sum(r['triton'] < r['sdpa'] for r in lin)} of {len(lin)} lengths.")

# %% [markdown]
# Why the numbers fall as they do:
#
# * **Many sequences: fused wins.** At short $T$ the batch is large ($B\cdot T$ is fixed), so
#   $B\cdot H$ (batch, head) pairs alone give the fused kernel enough programs to fill the GPU.
#   Extra parallelism then buys nothing, and materialising the states costs traffic: $N_T$ states
#   of $128\times128$ per head written and read back (chapter 10 works it out). The fused time is
#   flat in $T$ while its grid covers the GPU.
# * **Few long sequences: states wins.** Each halving of $B$ halves the fused grid; once it has
#   fewer programs than the GPU has multiprocessors, the fused time grows about as the grid
#   shrinks, the mark of idle multiprocessors. The states mode fills the GPU at every $T$.
# * **The chunk level** is chapter 02's loop of small PyTorch matmuls: one launch per small
#   product, an order of magnitude slower than one kernel.
# * **Against FLA** the fused kernel is ahead while its grid is full; at the longest lengths,
#   where the states mode takes over, the two are close and FLA can be ahead. **Against the
#   memory floor** the best mode stays within a small factor while the grid is full.
# * **Against softmax attention:** causal SDPA does $O(T)$ work per token, so its time doubles
#   with $T$ at a fixed number of tokens, while linear attention's stays nearly flat.
#
# `mode="auto"` picks fused while the fused grid has more programs than half the 132
# multiprocessors of an H200 (128 programs at $T = 8192$: fused; 64 at $T = 16384$: states), and
# runs the same kernels as the mode it picks. Chapter 10 works the trade-off out.
#
# ## Summary
#
# * A kernel is a grid of programs; each program works on power-of-two blocks, found by pointer
#   arithmetic and fenced by masks whose `other` value must be neutral.
# * `tl.dot` runs on tensor cores with float32 accumulation; float32 operands need
#   `input_precision="ieee"` to meet a float32 tolerance, bf16 operands cost ~$10^{-3}$.
# * The interpreter checks logic on a CPU; bf16 rounding, speed, resources and miscompiles show
#   only natively — read `n_regs`, `n_spills` and shared memory from the compiled kernel there.
# * Chunkwise linear attention is four `tl.dot`s per chunk with the state on chip; the library's
#   kernel adds blocks, dtypes, states, and a second mode that materialises chunk states.
# * On an H200 (the recorded run above) the fused kernel is fastest while its grid fills the GPU,
#   the states mode for few long sequences; the printed lines say where each is against FLA,
#   the memory floor and softmax attention.
#
# **Workbook:** [`exercises/09_triton.py`](../exercises/09_triton.py) — write the kernels of
# this chapter yourself and have them checked. A further exercise: change
# `chunk_linear_attn_kernel` to take an initial state and return the final one, and check it
# against `naive.linear_attn(..., initial_state=..., output_final_state=True)`.
