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
# # 00 — How to use this book
#
# This book walks from plain linear attention to the chunked algorithms behind GLA and KDA, and
# ends with Triton kernels. Every step is code you can run, check, and then write yourself in a
# graded workbook. This chapter shows where things are, how to run them on a CPU or a GPU, and
# how grading and progress work — by doing each once.
#
# ## What is where
#
# | path | what it holds |
# |---|---|
# | `book/NN_topic.py` | the chapters, in reading order. They are [jupytext](https://jupytext.readthedocs.io) "py:percent" files: plain Python that Jupyter opens as a notebook |
# | `linattn/` | the library the chapters build and use, in three **levels** with identical signatures |
# | `linattn/naive/` | level 1: token-by-token recurrences and quadratic forms; run in float64 it is the ground truth |
# | `linattn/chunk/` | level 2: chunkwise PyTorch — the algorithms, written with matrix products |
# | `linattn/triton/` | level 3: Triton kernels — native on a GPU, through Triton's interpreter on a CPU |
# | `linattn/grade/` | the grader: exercises, their random test cases, progress |
# | `exercises/NN_topic.py` | the workbooks: one per chapter with exercises, stubs for you to fill in |
# | `tests/` | the test suite (pytest): library, graders, and every chapter and workbook |
#
# Two commands from the README do everything, including creating a virtual environment in
# `.venv` with the pinned requirements:
#
# ```bash
# make book    # execute every chapter; the executed notebooks land in _build/book/
# make test    # the test suite: library, graders, and all chapters/workbooks run as tests
# ```
#
# More ways to read it:
#
# * `make lab` opens the book in JupyterLab; a double click on a `.py` chapter opens it as a
#   notebook (jupytext reads and writes the `.py` file: no `.ipynb` appears beside it).
# * `make site` (after `make book`) builds the executed book as a website in
#   `_build/site/_build/html/`: chapters and workbooks in order, math, figures, the recorded GPU
#   tables, and a link from every chapter to its workbook and its notebook.
# * On **Colab**, upload a chapter's notebook (from `_build/book/`, or the site's "Download the
#   notebook") and run its first cell: on Colab — and only there — it installs the library. Until
#   the book has a public package, it asks you to upload the library's wheel, which `make wheel`
#   builds as `dist/linattn-*.whl`. Colab offers GPU runtimes: there the chapters run at full
#   size with native Triton kernels. (The recorded GPU tables of chapters 09–11 read
#   `book/data/`; upload those files into a folder `data/` beside the notebook to see them.)

# %%
import os
import tempfile
from pathlib import Path

import torch

import linattn
from linattn import naive, testing
from linattn.device import pick

print(linattn.device.describe())

# %% [markdown]
# ## CPU or GPU
#
# The book runs everywhere; only the sizes change. `linattn.device` decides once:
#
# * **Triton mode.** Without CUDA, Triton kernels run in its *interpreter* (NumPy on the CPU:
#   slow, but exact and debuggable); with CUDA they compile natively. Triton fixes this choice
#   when a kernel is first defined, so `import linattn` makes it *before* any kernel module is
#   imported. `linattn.device.triton_mode()` says which.
# * **Sizes.** Chapters never test for a GPU themselves; they ask `pick(cpu=..., gpu=...)` for a
#   size. On a CPU you get small problems that run in seconds, on a GPU realistic ones. The
#   environment variable `LINATTN_SIZE=small|full` overrides the choice, e.g. to run full sizes
#   on a big CPU machine, or small ones on a GPU for a quick pass.

# %%
print("triton runs as:", linattn.device.triton_mode())
print("size mode:", linattn.device.size_mode(), "(LINATTN_SIZE =", repr(os.environ.get("LINATTN_SIZE")), ")")
T = pick(cpu=256, gpu=8192)
print("a chapter asking pick(cpu=256, gpu=8192) gets T =", T)

# %% [markdown]
# ## Which GPUs
#
# The Triton kernels are written for NVIDIA GPUs of compute capability 7.5 to 9.0: Colab's T4
# (sm_75), L4 (sm_89) and A100 (sm_80), desktop RTX 30 (sm_86) and RTX 40 (sm_89) cards, and the
# H100/H200 (sm_90). They are checked in two ways:
#
# * **Run natively** on H100 and H200 GPUs: the test suite, every chapter and the conformance
#   matrix, against float64 references.
# * **Compiled offline** for all five architectures, on a CPU with no GPU: `tools/arch_check.py`
#   runs the library's own wrappers (every operation, forward, backward and decode step, every head
#   dimension, dtype and chunk size) with a launch that records what would run instead of running
#   it, compiles each recorded kernel configuration with Triton for each architecture, and compares
#   its shared memory with that GPU's limit per block; the largest tiles of every kernel also go
#   through NVIDIA's assembler (ptxas) for their registers and spills. CI does the same for the
#   largest tiles of every kernel (`tests/test_architectures.py`). The T4, A100, L4 and RTX cards are compiled for,
#   not run on: no numerical result of this book comes from them.
#
# A kernel whose software pipeline (several stages of tiles in flight) needs more shared memory
# than the GPU has is launched with fewer stages — the same result, a little less overlap — and where
# even one stage does not fit, the call raises an `InputError` that names the GPU. On a T4 (sm_75)
# Triton compiles every tile product to ordinary fused multiply-adds on the CUDA cores, in every
# dtype (its tensor-core path starts at sm_80; seen in the compiled PTX, which has no `mma`
# instruction for sm_75): products still accumulate in float32, only slower. The table, read from
# the recorded offline run:

# %%
from linattn import bench

arch = bench.recorded_run("architectures.json")
if arch is None:
    print("book/data/architectures.json not found (e.g. on Colab without the data/ folder)")
else:
    print(f"offline compile, triton {arch['versions']['triton']}: {len(arch['configs'])} kernel "
          f"configurations, each for every architecture")
    for name, lim in arch["limits"].items():
        rows = [row["archs"][name] for row in arch["configs"]]
        fit = sum(r["fits"] for r in rows)
        refused = sum("refused" in r for r in rows)
        fallback = sum("fallback" in r for r in rows)
        most = max(r["shared"] for r in rows if r["fits"]) / 1024
        print(f"{name}, {lim['gpus']}, {lim['shared_bytes'] // 1024} KB per block: {fit} fit (using up to "
              f"{most:.0f} KB), {fallback} fall back to another mode, {refused} refused with an InputError")
    for name in arch["limits"]:
        deep = [(row["archs"][name]["spill"], kernel) for kernel, row in arch["table"].items()
                if row["archs"][name].get("regs") is not None]
        if deep:   # registers: at most 255 per thread and 8 warps, within every SM's 64K; past that ptxas spills
            most, worst = max(deep)
            print(f"{name} through ptxas: {len(deep)} kernels' largest tiles, {sum(s > 0 for s, _ in deep)} spill "
                  f"registers to local memory (ptxas counts up to {most / 1024:.0f} KB of spill stores, {worst})")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"this GPU is sm_{major}{minor}:",
              "in the table" if f"sm_{major}{minor}" in arch["limits"] else "not among the checked architectures")

# %% [markdown]
# ## Three levels, one signature
#
# Every operation — `linear_attn`, `gla`, `delta_rule`, `kda` — exists at each level with the same
# arguments, `q, k: [B, T, H, K]`, `v: [B, T, H, V]`, and returns `(o, final_state)`. So each level
# can be checked against the previous one, and the chapters do exactly that: the error metric is
# the relative error $\lVert a-b\rVert/\lVert b\rVert$ against the float64 naive level, with a
# tolerance per input dtype.

# %%
x = testing.make_inputs("linear_attn", B=1, T=100, H=2, K=16, V=16,   # float32 inputs
                        device=linattn.device.default_device())
truth, _ = naive.linear_attn(**testing.to_float64(x))
for level in ("naive", "chunk", "triton"):
    o, _ = linattn.linear_attn(**x, impl=level)
    err = testing.rel_err(o, truth)
    print(f"{linattn.which('linear_attn'):<40} relative error {err:.1e}")
    assert err < testing.tolerance(torch.float32)
print("tolerances:", {str(d).replace("torch.", ""): t for d, t in testing.TOLERANCE.items()})

# %% [markdown]
# Called without `impl=`, the top-level functions pick the Triton level for CUDA tensors and the
# chunkwise level on the CPU. `linattn.which(op)` always says what ran, and chapters print it
# whenever they go through this dispatcher.

# %%
linattn.linear_attn(**x)
print("impl='auto' ran:", linattn.which("linear_attn"))

# %% [markdown]
# ## Workbooks and grading
#
# Each workbook (`exercises/NN_topic.py`) has, per exercise: a description with the math and the
# shapes, a stub function that raises `NotImplementedError("write me")`, and a check cell:
#
# ```python
# check("ch01.recurrent", recurrent_linear_attn);
# ```
#
# `check` calls your function on fresh random inputs every time (several shapes, lengths that
# change, an initial state, low-precision inputs, …), compares with the float64 ground truth, and
# prints a verdict. It never crashes the notebook: an exception, a wrong shape or dtype, a NaN or
# a too-large error all become a message that says which case, where, and a hint. When your
# result reproduces one of the usual mistakes (a mask off by one, a forgotten scale, an ignored
# initial state, …), the verdict names it as a *diagnosis*. Outputs that your function never
# writes are filled with NaN in the grader, so they cannot pass by luck.
#
# So that this demonstration does not touch *your* progress, it uses a temporary progress
# directory (more on `LINATTN_HOME` below).

# %%
from linattn.grade import check, dashboard, exercises, progress_text

reader_home = os.environ.get("LINATTN_HOME")
os.environ["LINATTN_HOME"] = demo_home = tempfile.mkdtemp(prefix="linattn-demo-")
print("exercises in the book:", ", ".join(exercises()))

# %% [markdown]
# A deliberately wrong answer first: linear attention that forgets the scale $K^{-1/2}$.

# %%
def forgot_the_scale(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
    return naive.linear_attn(q, k, v, scale=1.0, initial_state=initial_state,
                                     output_final_state=output_final_state)


verdict = check("ch01.recurrent", forgot_the_scale)
assert not verdict.passed and "diagnosis" in verdict.message

# %% [markdown]
# And the library's reference, which passes (the seed changes every time; the verdict names it
# so that a failure can be reproduced with `check(..., seed=...)`):

# %%
verdict = check("ch01.recurrent", naive.linear_attn, record=False)
assert verdict.passed

# %% [markdown]
# From a shell, `python -m linattn.grade exercises/01_linear_attention.py` runs a whole workbook
# and prints a score table — here on the untouched workbook, so every exercise fails with
# "not written yet":

# %%
root = next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "exercises").is_dir()), None)
if root is None:
    print("no exercises/ folder next to this notebook (e.g. on Colab): clone the repository to get the workbooks")
else:
    run = subprocess.run([sys.executable, "-m", "linattn.grade", "exercises/01_linear_attention.py"],
                         cwd=root, capture_output=True, text=True)
    table = run.stdout[run.stdout.index("exercises/01"):]
    print(table)
    assert run.returncode == 1 and "score: 0/" in table

# %% [markdown]
# ## Progress and unlocking
#
# A passed exercise is recorded under `$LINATTN_HOME` (default `~/.linattn`): a small
# `progress.json`, and the source of the function that passed (with the helpers it calls). Set
# `LINATTN_HOME` to keep separate progress, e.g. per course. `progress_text()` prints the table;
# in Jupyter `dashboard()` shows the same as a widget with a refresh button.
#
# Passing is useful, not just a tick: an exercise that implements a whole operation *unlocks* it,
# and `linattn.set_impl(op, "mine")` then routes the library through your passed code for the
# rest of the book — every later chapter that calls `linattn.linear_attn` runs *your* function,
# and `linattn.which` says so. (`"auto"` switches back.)
#
# To show it without spoiling workbook 01, our "solution" here borrows the library's parallel
# form; yours will be your own recurrence.

# %%
def my_recurrent(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
    return naive.linear_attn_parallel(q, k, v, scale=scale, initial_state=initial_state,
                                              output_final_state=output_final_state)


assert check("ch01.recurrent", my_recurrent).passed      # recorded in the demo LINATTN_HOME
print(progress_text())

# %%
linattn.set_impl("linear_attn", "mine")
o_mine, _ = linattn.linear_attn(**x)
print("ran:", linattn.which("linear_attn"))
assert linattn.which("linear_attn").startswith("your ch01.recurrent")
assert testing.rel_err(o_mine, truth) < testing.tolerance(torch.float32)

linattn.set_impl("linear_attn", "auto")                  # back to the library's own
linattn.linear_attn(**x)
print("ran:", linattn.which("linear_attn"))

# %%
dashboard()

# %% [markdown]
# Finally we put your own progress directory back (the demo one is left in the temp folder).

# %%
if reader_home is None:
    del os.environ["LINATTN_HOME"]
else:
    os.environ["LINATTN_HOME"] = reader_home
print("progress is kept in", linattn.grade.progress.home())

# %% [markdown]
# ## How to read
#
# Each chapter states its goal, develops the math, builds the idea in a few lines of code,
# checks it against the previous level with an `assert`, and shows figures where a picture says
# more than a table; "what breaks if…" sections break things on purpose. Read a chapter, run it,
# change the sizes, then open its workbook. Chapter 01 starts from softmax attention. The symbols
# are fixed once, for the whole book, in the next section; come back to it when a letter is
# unclear.

# %% [markdown]
# ## Notation
#
# Every chapter uses these symbols in these meanings. The source documents use others (each
# chapter translates them where it uses a source); where a symbol has a second meaning, the
# table says how to tell them apart. A letter with a token subscript is not a size: $H_t$ in
# chapter 06 is a transition, not the number of heads.
#
# **Sizes and layout.**
#
# | symbol | meaning |
# |---|---|
# | $B$, $T$, $H$ | batch size, sequence length (tokens), number of heads: tensors are `[B, T, H, …]` |
# | $K$, $V$ | head dimensions of queries/keys and of values: `q`, `k` are `[B, T, H, K]`, `v` is `[B, T, H, V]`. As matrices, $Q$, $K$, $V$ also stack a chunk's rows $q_i$, $k_i$, $v_i$; a size appears only in shapes ($K\times V$) and ranges |
# | $C$, $c$ | chunk size, sub-chunk size (secondary chunking); $N = \lceil T/C\rceil$ chunks |
# | $X_{[n]}$, $X_{[i]}$ | the rows of $X$ in chunk $n$, or in sub-chunk $i$ of a chunk; $P_{[i][j]}$ a tile of sub-chunks |
#
# **Positions.** The math counts from 1: tokens $t = 1, \dots, T$, positions inside a chunk
# $i, j = 1, \dots, C$ ($i$ usually a query, $j$ a key), chunks $n = 1, \dots, N$ with $S_{[n]}$ the
# state after chunk $n$ and $S_{[0]} = S_0$ the initial state. Indices that name array positions
# count from 0, as Python does, and the text says so where they appear: sub-chunks (sub-chunk $i$
# holds positions $ic+1, \dots, (i+1)c$, so $r = ic$ is the last position before it), the maps of a
# scan in chapter 08 and the ranks of context parallelism.
#
# **State and outputs.**
#
# | symbol | meaning |
# |---|---|
# | $S$ | the state, $K\times V$; rows belong to key dimensions. Vectors $q_t$, $k_t$, $v_t$ are **rows**, so $k_t^\top v_t$ is $K\times V$ and a transition acts on the **left**: $S_t = M_t S_{t-1} + B_t$ |
# | $o_t = \text{scale}\cdot q_t S_t$ | the output; `scale` $= K^{-1/2}$ by default. `scale` appears only here, on outputs: the score matrices $P$, $A_{qk}$ below do not contain it (a kernel that stores a scaled copy says so) |
# | $(M, B)$ | an affine map $S' = MS + B$ of a token, a chunk or a slice ($M$: $K\times K$, $B$: $K\times V$); next to $M$, or as $B_n$, $B_r$, $B$ is this bias, not the batch size |
# | $Q^{\text{eff}}$, $O_0$ | a chunk's outputs as an affine function of its entering state, $O = Q^{\text{eff}}S + O_0$ (chapters 07–08; the library's `ChunkMaps.P`) |
#
# **Gates and their sums.**
#
# | symbol | meaning |
# |---|---|
# | $g_t \le 0$ | the log-gate (log-decay) of token $t$: a vector in $\mathbb R^K$ (GLA, KDA) or one number per head (RetNet, Mamba-2, Gated DeltaNet); $\alpha_t = e^{g_t}$ the gate, $D_t = \operatorname{diag}(e^{g_t})$ |
# | $b_i$ | the cumulative log-gate $g_1 + \dots + g_i$ from the chunk start (restarted at every chunk; $b_0 = 0$, $b_C$ the whole chunk). In a whole-sequence formula (a parallel form) $b_t$ sums from the sequence start |
# | $G$ | the $C\times K$ matrix whose row $i$ is $b_i$ ($G_{[i]}$: the rows of sub-chunk $i$), so $Q\odot e^{G}$ has rows $q_i\odot e^{b_i}$ |
# | $\Lambda_i = e^{b_i}$, $\Gamma_j = e^{b_C - b_j}$, $\gamma = e^{b_C}$ | query-side decay (chunk start to $i$), key-side decay ($j$ to the chunk end), total decay of the chunk (`decay.query_decay`, `key_decay`, `total_decay`). RetNet's constant per-head decay carries a head subscript, $\gamma_h$ |
# | $D_{ij} = e^{b_i - b_j}$ | the causal decay mask ($i \ge j$, zero above) of a scalar gate |
# | $K\odot\Gamma$ | the chunk's keys decayed to its end, rows $k_j\odot e^{b_C - b_j}$ (chapter 07 names the matrix $K_{\text{dec}}$, chapter 11 $\tilde K$) |
# | $\beta_t$ | the delta rule's write strength, $\beta_t \in (0, 1)$ from a sigmoid ($(0, 2)$ in the negative-eigenvalue variant) |
#
# **Matrices inside a chunk.**
#
# | symbol | meaning |
# |---|---|
# | $P$ | (gated) linear attention's score matrix: $P_{ij} = \sum_\kappa q_{i\kappa}k_{j\kappa}e^{\,b_{i\kappa} - b_{j\kappa}}$ for $i \ge j$, 0 above (chapters 03–05, 10); no `scale` |
# | $A$ | the delta rule's strictly lower triangular matrix, $A_{ij} = \beta_i \sum_\kappa k_{i\kappa}k_{j\kappa}e^{\,b_{i\kappa} - b_{j\kappa}}$ for $i > j$ (chapters 07, 11, 12) |
# | $A_{qk}$ | the delta rule's query–key scores, $(A_{qk})_{ij} = \sum_\kappa q_{i\kappa}k_{j\kappa}e^{\,b_{i\kappa} - b_{j\kappa}}$ for $i \ge j$; no `scale` |
# | $\mathcal T = (I + A)^{-1}$ | unit lower triangular; calligraphic, because $T$ is the sequence length |
# | $U$, $W$, $\tilde V$ | the WY factors, $U = \mathcal T\operatorname{diag}(\beta)V$, $W = \mathcal T\operatorname{diag}(\beta)(K\odot e^{G})$, and the β-weighted residuals $\tilde V = U - WS$ |
