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
# # Workbook 16 — packed sequences
#
# Companion of `book/16_packing.py`. Documents of different lengths travel back to back in one
# row, $B = 1$, and `cu_seqlens` (int64, `[N+1]`) holds their boundaries
# $0 = c_0 \le c_1 \le \dots \le c_N = T$: sequence $n$ is the tokens $c_n \dots c_{n+1} - 1$. Its
# initial state is `initial_state[n]` and its final state `final_state[n]`, both `[N, H, K, V]`.
# The answer is always that of each sequence run alone. Three steps, all on GLA with one log-gate
# per head, $S_t = e^{g_t} S_{t-1} + k_t^\top v_t$, $o_t = \text{scale}\cdot q_t S_t$:
#
# 1. `ch16.packed_loop` — the token loop over a packed row;
# 2. `ch16.packed_chunk` — the chunk level over a packed row;
# 3. `ch16.packed_states` — a Triton kernel that reads its boundaries from `cu_seqlens`.
#
# Each check runs your function on fresh random rows (lengths that are rarely multiples of the
# chunk size, an empty sequence, single tokens, initial states) against every sequence run alone
# in float64; a wrong answer that matches a known mistake is told which. Grade the whole workbook
# from a shell with `python -m linattn.grade exercises/16_packing.py`.

# %%
import linattn  # first: on a machine without a GPU it switches Triton's interpreter on
import torch
import triton
import triton.language as tl

from linattn.grade import check, spec

# %% [markdown]
# ## Exercise 1 — `ch16.packed_loop`: the state restarts at every boundary
#
# `packed_loop(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None, output_final_state=False)`
# with `q`, `k` `[1, T, H, K]`, `v` `[1, T, H, V]`, `g` `[1, T, H]` (log-gates, $\le 0$),
# `scale` $= K^{-1/2}$ when `None`. Return `(o, final_state)`: `o` `[1, T, H, V]` and, when
# `output_final_state`, the final states `[N, H, K, V]` **in the order of `cu_seqlens`** (else
# `None`). Sequence $n$ starts from `initial_state[n]`, or from zeros when `initial_state` is
# `None`; an empty sequence ($c_n = c_{n+1}$) has no outputs and its final state is its initial
# state. Write the token loop yourself (`torch` operations on one token at a time).

# %% exercise="ch16.packed_loop"
def packed_loop(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None, output_final_state=False):
    raise NotImplementedError("not written yet")


# %%
check("ch16.packed_loop", packed_loop);

# %% [markdown]
# ## Exercise 2 — `ch16.packed_chunk`: every sequence chunked from its own start
#
# The same function with `chunk_size=16` added, computed chunk by chunk. For a chunk of tokens
# with cumulative gates $b_t$ (summed from the chunk's start), queries $Q$, keys $K$, values $V$
# and the state $S$ entering it:
#
# $$o_t = \text{scale}\cdot\Big(e^{b_t} q_t S + \sum_{s \le t} (q_t\cdot k_s)\, e^{b_t - b_s} v_s\Big),
#   \qquad S \leftarrow e^{b_C} S + \big(K \odot e^{b_C - b}\big)^\top V,$$
#
# $b_C$ the chunk's last cumulative gate. Make a table of chunks first — for each sequence $n$,
# the chunks $[s, \min(s + C, c_{n+1}))$ for $s = c_n, c_n + C, \dots$ — so that no chunk holds
# tokens of two sequences, then walk it, resetting $S$ at each sequence's first chunk.

# %% exercise="ch16.packed_chunk"
def packed_chunk(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
                 chunk_size=16):
    raise NotImplementedError("not written yet")


# %%
check("ch16.packed_chunk", packed_chunk);

# %% [markdown]
# ## Exercise 3 — `ch16.packed_states`: the boundary in a Triton kernel
#
# `packed_states(k, v, g, cu_seqlens, initial_state, chunk_size=16)` returns the final state of
# every sequence, `[N, H, K, V]` float32, from `k` `[1, T, H, K]` and `v` `[1, T, H, V]` (float32
# or bf16: upcast after the load), `g` `[1, T, H]` float32 and `initial_state` `[N, H, K, V]`
# float32 (always given). Launch one program per (sequence, head), grid `(N, H)`, as chapter 16's
# `packed_state_kernel` does, and add what it leaves out: the decay and the initial state. Per
# chunk, with $b$ the cumulative gate inside it and $b_C$ its sum,
# $S \leftarrow e^{b_C} S + (K \odot e^{b_C - b})^\top V$ (`tl.cumsum`, `tl.sum`, one `tl.dot`
# with `input_precision="ieee"`).
#
# The program reads its own boundaries, `bos = tl.load(cu + n)` and `eos = tl.load(cu + n + 1)`,
# and walks only its own chunks, masking every load at `eos` (gates past it load as 0: no decay).
# $K$ and $V$ need not be powers of two: blocks of `max(16, next_power_of_2(·))`, masked. Under
# the interpreter every load is bounds-checked while grading.

# %%
spec("ch16.packed_states");

# %% exercise="ch16.packed_states"
@triton.jit
def packed_states_kernel(k, v, g, h0, out, cu, H, K, V, C: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr):
    pass  # your kernel here


def packed_states(k, v, g, cu_seqlens, initial_state, chunk_size=16):
    raise NotImplementedError("not written yet: write the launcher (and the kernel above)")


# %%
check("ch16.packed_states", packed_states);

# %% [markdown]
# ## Using what you wrote
#
# `linattn.naive.gla(..., cu_seqlens=cu)` and `linattn.chunk.gla(..., cu_seqlens=cu)` are the
# library's forms of exercises 1 and 2 (all four operations take `cu_seqlens` at those levels;
# `docs/packed_sequences.md` lists what each level supports). The library's Triton level does not
# take `cu_seqlens` yet and refuses it by name: exercise 3 is the state pass such a kernel starts
# from.

# %%
from linattn.grade import progress_text; print(progress_text())
