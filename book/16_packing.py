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
# # 16 — Packing sequences
#
# **Goal.** Train on documents of very different lengths without paying for padding, and without
# letting one document leak into the next. Padding every document of a batch to the longest wastes
# work, and for a recurrent state it is also *wrong* unless masked. Packing puts the documents back
# to back in one row and carries their boundaries beside it in `cu_seqlens`. We follow the
# boundary through every level of the book: in the token loop it is a reset of the state; in the
# chunked form it is a rule — no chunk holds tokens of two sequences; in a kernel it is the loop
# bound and the mask of each program. Then we measure packed against padded on this device as the
# spread of lengths grows, and check the one piece of a layer that also looks back across a
# boundary: the short convolution.
#
# Every computation here is linear attention, $S_t = S_{t-1} + k_t^\top v_t$,
# $o_t = \text{scale}\cdot q_t S_t$, so that only the boundary is new; the workbook does the same
# for GLA with per-head gates and initial states, and the library does it for all four operations.

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import linattn  # first: without a GPU it switches Triton to its interpreter, before triton is imported
import triton
import triton.language as tl
from linattn import bench, chunk, naive, testing
from linattn.device import pick
from linattn.nn.conv import ShortConv

torch.manual_seed(0)  # the same random inputs at every run
DEVICE = linattn.device.default_device()
print(linattn.device.describe())
TOL = testing.tolerance(torch.float32)

# %% [markdown]
# ## 1. Why padding wastes work — and, for a state, is wrong
#
# A batch of $N$ documents with lengths $L_1, \dots, L_N$, padded on the right to the longest,
# is a tensor of $N \cdot \max_n L_n$ tokens of which $\sum_n L_n$ are real. The wasted fraction is
#
# $$w = 1 - \frac{\sum_n L_n}{N \max_n L_n}.$$
#
# How large it is depends on how spread the lengths are. Document lengths in text corpora are
# heavy-tailed: many short documents, a few long ones. We take a log-normal model — $\log L$
# normal with standard deviation $\sigma$ around a median, cut at a context length (both set in
# the cell below). It is a model chosen for illustration, not a measured corpus, and $\sigma$ is
# its one knob: at $\sigma = 0$ all documents have the same length, and the cell prints what a
# larger $\sigma$ means in tokens.

# %%
def doc_lengths(n, sigma, *, median=512, cap=4096, seed=0):
    """n lengths, log-normal around `median` with log-space spread sigma, in 1 … cap."""
    gen = torch.Generator().manual_seed(seed)
    L = (median * torch.exp(sigma * torch.randn(n, generator=gen, dtype=torch.float64))).round()
    return L.clamp(1, cap).long()


def waste(lengths):
    """Fraction of a right-padded batch [N, max L] that is padding."""
    return 1 - lengths.sum().item() / (len(lengths) * lengths.max().item())


def mean_waste(batch, sigma, draws=200):
    return sum(waste(doc_lengths(batch, sigma, seed=s)) for s in range(draws)) / draws


batches, sigmas = [1, 2, 4, 8, 16, 32, 64], [0.25, 0.5, 0.75, 1.0]
for s in sigmas:
    L = doc_lengths(10_000, s)
    print(f"σ = {s:4}: a tenth of the documents are shorter than {L.double().quantile(0.1):.0f} tokens, "
          f"a tenth longer than {L.double().quantile(0.9):.0f}")
W = {s: [mean_waste(b, s) for b in batches] for s in sigmas}
for s in sigmas:
    print(f"σ = {s:4}: padded tokens that are padding, by batch size "
          + ", ".join(f"{b}: {w:.0%}" for b, w in zip(batches, W[s])))
assert all(W[s][0] == 0 for s in sigmas)                             # one document: nothing padded
assert all(W[s][i] < W[s][i + 1] for s in sigmas for i in range(len(batches) - 1))   # grows with N
assert all(W[a][i] < W[c][i] for a, c in zip(sigmas, sigmas[1:]) for i in range(1, len(batches)))

example = doc_lengths(8, 1.0, seed=3)
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
a1.barh(range(8), [example.max().item()] * 8, color="#ddd", label="padding")
a1.barh(range(8), example.tolist(), color="tab:blue", label="real tokens")
a1.set(xlabel="token position", ylabel="document", yticks=range(8),
       title=f"one batch of 8 (σ = 1): {waste(example):.0%} padding")
a1.invert_yaxis()
a1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8)    # below the bars
for s, marker in zip(sigmas, "os^D"):
    a2.plot(batches, [100 * w for w in W[s]], marker + "-", label=f"σ = {s}")
a2.set(xscale="log", xlabel="documents per batch", ylabel="padding (% of the batch)", ylim=(0, 100),
       title="mean over 200 batches")
a2.set_xticks(batches, [str(b) for b in batches])
a2.legend(loc="upper left", fontsize=8)
plt.tight_layout(); plt.show()

# %% [markdown]
# The waste grows with the batch (a larger batch is more likely to hold one very long document)
# and with the spread. Sorting documents into buckets of similar length lowers it, at the price of
# batches that are no longer random samples; packing removes it.
#
# For a recurrence, padding is also a correctness problem. Causality keeps the *outputs* of the
# real tokens right — the padding comes after them — but the recurrence runs on over the padding,
# and the final state, which a later call continues from, is the state after the padded length.
# With zeros as padding, linear attention's $k_t^\top v_t = 0$ adds nothing; a gate does not stop
# there: GLA's $e^{g_t}$ decays the state at every padded token. Chapter 15, section 4, shows the
# same for KDA and the mask that fixes it: $g = 0$ and $k = 0$ (or $\beta = 0$) on the padding.

# %%
lens = [pick(cpu=9, gpu=300), pick(cpu=30, gpu=900), pick(cpu=21, gpu=517)]
Tpad = max(lens)
a = testing.make_inputs("gla", B=len(lens), T=Tpad, H=2, K=16, V=16, gate="per_head", seed=1,
                        device=DEVICE)
real = (torch.arange(Tpad, device=DEVICE)[None, :] < torch.tensor(lens, device=DEVICE)[:, None])
# padding tokens embed to zeros, so q, k, v are 0 there; the gate of a zero input is not
zero_pad = dict(a, **{n: a[n] * real[..., None, None].to(a[n].dtype) for n in ("q", "k", "v")})
o_pad, S_pad = chunk.gla(**zero_pad, output_final_state=True)
for i, L in enumerate(lens):
    o1, S1 = chunk.gla(**{n: x[i:i + 1, :L] for n, x in a.items()}, output_final_state=True)
    e_o, e_S = testing.rel_err(o_pad[i:i + 1, :L], o1), testing.rel_err(S_pad[i:i + 1], S1)
    print(f"GLA, document of {L:3d} tokens zero-padded to {Tpad}: outputs {e_o:.1e}, final state {e_S:.1e}")
    assert e_o < TOL and ((e_S > 0.01) if L < Tpad else (e_S < TOL))

# %% [markdown]
# ## 2. The packed row
#
# Packing concatenates the $N$ documents into one row of $T = \sum_n L_n$ tokens, batch size 1,
# and records where each one starts: `cu_seqlens` $= [c_0, c_1, \dots, c_N]$ with $c_0 = 0$,
# $c_{n+1} = c_n + L_n$ (cumulative lengths, int64), so sequence $n$ is the tokens
# $c_n \le t < c_{n+1}$. This is the convention of flash-linear-attention (flash-attention's
# variable-length API uses the same cumulative lengths in int32). Initial and final states are
# one per sequence, `[N, H, K, V]`.
#
# ### The token loop: a boundary is a reset
#
# The recurrence of a packed row is the recurrence of each sequence, with the state restarting at
# every $c_n$:
#
# $$S_t = \begin{cases} S^{(n)}_0 + k_t^\top v_t & t = c_n \\ S_{t-1} + k_t^\top v_t & c_n < t < c_{n+1}
#   \end{cases}, \qquad \text{final}_n = S_{c_{n+1}-1},$$
#
# with $S^{(n)}_0$ sequence $n$'s initial state (zeros here). An empty sequence ($c_n = c_{n+1}$)
# has no tokens; its final state is its initial state.

# %%
def packed_loop(q, k, v, cu_seqlens, *, reset=True):
    """Linear attention over a packed row, token by token; final states [N, H, K, V].
    reset=False carries the state across boundaries (the mistake, for comparison)."""
    _, T, H, K = q.shape
    b = cu_seqlens.tolist()
    o = torch.zeros(1, T, H, v.shape[-1], dtype=q.dtype, device=q.device)
    S = torch.zeros(H, K, v.shape[-1], dtype=q.dtype, device=q.device)
    finals = []
    for n in range(len(b) - 1):
        if reset:
            S = torch.zeros_like(S)                       # the boundary: sequence n starts afresh
        for t in range(b[n], b[n + 1]):
            S = S + k[0, t, :, :, None] * v[0, t, :, None, :]          # [H, K, V]
            o[0, t] = K ** -0.5 * torch.einsum("hk,hkv->hv", q[0, t], S)
        finals.append(S)
    return o, torch.stack(finals)


seq_lens = [pick(cpu=23, gpu=200), pick(cpu=5, gpu=37), 0, pick(cpu=40, gpu=330), 1,
            pick(cpu=17, gpu=120)]
cu = torch.tensor([0] + seq_lens, device=DEVICE).cumsum(0)
p = testing.make_inputs("linear_attn", B=1, T=sum(seq_lens), H=2, K=16, V=16, seed=2, device=DEVICE)
q, k, v = p["q"], p["k"], p["v"]
print("lengths", seq_lens, "→ cu_seqlens", cu.tolist())

o_loop, S_loop = packed_loop(q.double(), k.double(), v.double(), cu)
o_lib, S_lib = naive.linear_attn(q.double(), k.double(), v.double(), cu_seqlens=cu, output_final_state=True)
print(f"packed token loop vs linattn.naive (cu_seqlens=): outputs {testing.rel_err(o_loop, o_lib):.1e}, "
      f"final states {testing.rel_err(S_loop, S_lib):.1e}")
assert testing.rel_err(o_loop, o_lib) < 1e-12 and testing.rel_err(S_loop, S_lib) < 1e-12


def per_sequence_errors(o, S, ref_o, ref_S):
    """(error of its outputs, error of its final state) for each non-empty sequence."""
    b = cu.tolist()
    return [(n, testing.rel_err(o[:, s:e], ref_o[:, s:e]), testing.rel_err(S[n], ref_S[n]))
            for n, (s, e) in enumerate(zip(b, b[1:])) if e > s]


o_carry, S_carry = packed_loop(q.double(), k.double(), v.double(), cu, reset=False)
for n, e_o, e_S in per_sequence_errors(o_carry, S_carry, o_lib, S_lib):
    print(f"no reset, sequence {n} ({seq_lens[n]:3d} tokens): outputs {e_o:.1e}, final state {e_S:.1e}")
errs = per_sequence_errors(o_carry, S_carry, o_lib, S_lib)
assert errs[0][1] < 1e-12 and all(e_o > 0.01 for _, e_o, _ in errs[1:])

# %% [markdown]
# Without the reset the first sequence is right and every later one reads its predecessors'
# tokens: the error is not a rounding effect but the wrong function.
#
# ### The chunked form: no chunk straddles a boundary
#
# The chunked form of chapter 02 cuts a sequence into chunks of $C$ tokens, computes each chunk's
# outputs from the state entering it plus a causal product inside it, and passes the state on.
# On a packed row the chunks are cut **per sequence, from its own start**: sequence $n$ has the
# chunks $[c_n + iC,\ \min(c_n + (i+1)C,\ c_{n+1}))$ for $i = 0, \dots, \lceil L_n / C\rceil - 1$,
# and its first chunk starts from its initial state. The list of all of them, sequence by
# sequence, is a **chunk table**; the chunked form walks it.

# %%
def chunk_table(cu_seqlens, C):
    """(sequence, start, end) of every chunk, each sequence chunked from its own start."""
    b = cu_seqlens.tolist()
    return [(n, s, min(s + C, b[n + 1])) for n in range(len(b) - 1) for s in range(b[n], b[n + 1], C)]


def row_table(cu_seqlens, C):
    """The mistake: chunks cut at multiples of C from the start of the row, blind to boundaries;
    each labelled with the sequence of its first token."""
    b, T = cu_seqlens.tolist(), cu_seqlens[-1].item()
    owner = lambda t: max(n for n in range(len(b) - 1) if b[n] <= t < b[n + 1])  # noqa: E731
    return [(owner(s), s, min(s + C, T)) for s in range(0, T, C)]


def chunk_step(S, q, k, v, scale):
    """Chapter 02's chunk: o = scale · (Q S + (Q Kᵀ ⊙ M) V), then S + Kᵀ V. q, k [c, H, K], v [c, H, V]."""
    causal = torch.ones(len(q), len(q), dtype=torch.bool, device=q.device).tril()
    P = torch.einsum("thk,shk->hts", q, k).masked_fill(~causal, 0.0)
    o = scale * (torch.einsum("thk,hkv->thv", q, S) + torch.einsum("hts,shv->thv", P, v))
    return o, S + torch.einsum("thk,thv->hkv", k, v)


def packed_chunked(q, k, v, cu_seqlens, table):
    """Walk a chunk table: reset the state at the first chunk of each sequence, record it after
    the last one. Final states [N, H, K, V] (an empty sequence keeps zeros)."""
    _, T, H, K = q.shape
    b = cu_seqlens.tolist()
    o = torch.zeros(1, T, H, v.shape[-1], dtype=q.dtype, device=q.device)
    finals = torch.zeros(len(b) - 1, H, K, v.shape[-1], dtype=q.dtype, device=q.device)
    S = finals[0]
    for n, s, e in table:
        if s == b[n]:
            S = torch.zeros_like(S)                       # sequence n's first chunk
        o[0, s:e], S = chunk_step(S, q[0, s:e], k[0, s:e], v[0, s:e], K ** -0.5)
        if e == b[n + 1]:
            finals[n] = S
    return o, finals


C = 16
table = chunk_table(cu, C)
print(f"C = {C}: {len(table)} chunks", [(n, s, e) for n, s, e in table])
o_ch, S_ch = packed_chunked(q, k, v, cu, table)
o_loop32, S_loop32 = packed_loop(q, k, v, cu)
o_cl, S_cl = chunk.linear_attn(q, k, v, cu_seqlens=cu, chunk_size=C, output_final_state=True)
print(f"chunked vs token loop: outputs {testing.rel_err(o_ch, o_loop32):.1e}, final states "
      f"{testing.rel_err(S_ch, S_loop32):.1e}; vs linattn.chunk (cu_seqlens=): "
      f"{testing.rel_err(o_ch, o_cl):.1e}, {testing.rel_err(S_ch, S_cl):.1e}")
assert max(testing.rel_err(o_ch, o_loop32), testing.rel_err(S_ch, S_loop32)) < TOL
assert max(testing.rel_err(o_ch, o_cl), testing.rel_err(S_ch, S_cl)) < TOL

# %% [markdown]
# **What breaks if a chunk straddles a boundary.** Cut the row at multiples of $C$ from its start
# instead. A sequence that begins inside a chunk shares that chunk with the end of the one before:
# the causal product lets its tokens read the earlier sequence's keys and values, and the state
# entering its next chunk carries them on. The reset above catches only sequences that happen to
# start on a multiple of $C$.

# %%
o_row, _ = packed_chunked(q, k, v, cu, row_table(cu, C))
b = cu.tolist()
for n, (s, e) in enumerate(zip(b, b[1:])):
    if e > s:
        print(f"row-aligned chunks, sequence {n} (tokens {s:3d}–{e - 1:3d}, starts on a chunk start: "
              f"{s % C == 0}): outputs {testing.rel_err(o_row[:, s:e], o_loop32[:, s:e]):.1e}")
leaky = [n for n, (s, e) in enumerate(zip(b, b[1:])) if e > s and s % C]
assert leaky and all(testing.rel_err(o_row[:, b[n]:b[n + 1]], o_loop32[:, b[n]:b[n + 1]]) > 0.01
                     for n in leaky)

fig, ax = plt.subplots(figsize=(11, 2.6))
colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
          "tab:cyan"]                                    # no red: red marks a straddling chunk
for n, (s, e) in enumerate(zip(b, b[1:])):
    ax.barh(2, e - s, left=s, color=colors[n % len(colors)], edgecolor="k", height=0.6)
for row, tab, label in ((1, table, "chunks per sequence"), (0, row_table(cu, C), "chunks of the row")):
    for n, s, e in tab:
        mixed = any(s < c < e for c in b)
        ax.barh(row, e - s, left=s, color="tab:red" if mixed else colors[n % len(colors)],
                edgecolor="k", height=0.6, alpha=0.9 if mixed else 0.5, hatch="//" if mixed else None)
ax.set(yticks=[0, 1, 2], yticklabels=["chunks of the row\n(red: straddles)", "chunks per sequence",
                                      "packed sequences"],
       xlabel="token position in the packed row", xlim=(0, b[-1]))
ax.set_title(f"C = {C}: each sequence chunked from its own start, against the row cut blindly")
plt.tight_layout(); plt.show()

# %% [markdown]
# Chunks per sequence cost a few more chunks than the row has (one partial chunk per sequence
# instead of one per row); the work inside them is the same.
#
# ## 3. What changes in a kernel
#
# Chapter 09's kernel ran one program per (batch, head) and walked the chunks $0, C, 2C, \dots$ up
# to $T$. With packing the grid is one program per **(sequence, head)**; each program reads its own
# boundaries from `cu_seqlens` and walks only its chunks:
#
# * `bos = tl.load(cu + n)`, `eos = tl.load(cu + n + 1)` — two loads, on the device, no host copy;
# * the chunk loop runs `for s in range(bos, eos, C)`: its bound is this sequence's, so a short
#   sequence does not wait for the longest;
# * every load of the last chunk is masked at `eos`, not at $T$: past `eos` are the *next*
#   sequence's tokens, in bounds of the tensor, so nothing but the mask keeps them out;
# * the state is written to `final[n, h]`.
#
# The state pass of linear attention, which produces every sequence's final state:

# %%
@triton.jit
def packed_state_kernel(k, v, final, cu, H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr):
    n, h = tl.program_id(0), tl.program_id(1)             # one program per (sequence, head)
    bos = tl.load(cu + n)                                 # this sequence: tokens bos … eos − 1
    eos = tl.load(cu + n + 1)
    dk, dv, idx = tl.arange(0, K), tl.arange(0, V), tl.arange(0, C)
    S = tl.zeros([K, V], dtype=tl.float32)
    for s in range(bos, eos, C):                          # its own chunks only
        rows = s + idx
        m = (rows < eos)[:, None]                         # not T: past eos is the next sequence
        kc = tl.load(k + (rows[:, None] * H + h) * K + dk[None, :], mask=m, other=0.0)   # [C, K]
        vc = tl.load(v + (rows[:, None] * H + h) * V + dv[None, :], mask=m, other=0.0)   # [C, V]
        S += tl.dot(tl.trans(kc), vc, input_precision="ieee")
    tl.store(final + ((n * H + h) * K + dk[:, None]) * V + dv[None, :], S)


def packed_final_states(k, v, cu_seqlens, chunk_size=16):
    _, T, H, K = k.shape
    N, V = len(cu_seqlens) - 1, v.shape[-1]
    final = torch.full((N, H, K, V), float("nan"), device=k.device)   # an unwritten state shows as NaN
    packed_state_kernel[(N, H)](k, v, final, cu_seqlens, H, K, V, chunk_size)
    return final


S_kernel = packed_final_states(k, v, cu, C)
print(f"packed state kernel vs linattn.chunk (cu_seqlens=): final states {testing.rel_err(S_kernel, S_cl):.1e}")
assert testing.rel_err(S_kernel, S_cl) < TOL
for n, (s, e) in enumerate(zip(b, b[1:])):              # and sequence by sequence, each run alone
    if e > s:
        S_alone = chunk.linear_attn(q[:, s:e], k[:, s:e], v[:, s:e], chunk_size=C,
                                    output_final_state=True)[1]
        print(f"  sequence {n} ({e - s:3d} tokens) vs itself alone: {testing.rel_err(S_kernel[n:n + 1], S_alone):.1e}")
        assert testing.rel_err(S_kernel[n:n + 1], S_alone) < TOL
    else:
        assert S_kernel[n].abs().max() == 0               # empty: no chunk ran, the zero state stored

# %% [markdown]
# The empty sequence is handled by the loop bound alone: `range(bos, bos, C)` runs no chunk and the
# program stores the zero state.
#
# ### How a production kernel schedules long and short sequences
#
# One program per (sequence, head) is right for the state pass, which is serial along a sequence.
# Its cost is uneven: the program of the longest sequence walks the most chunks, and the pass ends
# when it does. For the batch of 8 documents drawn in section 1, compare the longest walk with
# the mean:

# %%
Cp = 64
walks = [math.ceil(L / Cp) for L in example.tolist()]
print(f"lengths {example.tolist()}: chunks of {Cp} per sequence {walks}; longest walk "
      f"{max(walks)} against a mean of {sum(walks) / len(walks):.1f} "
      f"({max(walks) / (sum(walks) / len(walks)):.1f}×)")

# %% [markdown]
# The output pass has no such chain: once the state entering every chunk is known, each chunk's
# outputs are independent (chapter 09's "states" mode). A production kernel (flash-linear-attention
# does this) therefore launches the output pass over a **chunk index table** instead of over
# sequences: row $j$ of the table is the pair (sequence $n$, chunk $i$ of that sequence), built
# once per batch from `cu_seqlens` — the `chunk_table` above, as a tensor (flash-linear-attention's
# `prepare_chunk_indices`). Program $j$ reads its
# pair, then `bos = cu[n]`, `start = bos + i·C`, `end = min(start + C, cu[n+1])`, and does chapter
# 09's chunk with the state the state pass stored for chunk $j$. The grid has one program per
# chunk of the batch, however the tokens are divided among sequences:
#
# ```python
# @triton.jit
# def packed_output_kernel(q, k, v, h, o, cu, chunk_index, H, K, V, C, ...):
#     j, i_h = tl.program_id(0), tl.program_id(1)        # chunk j of the whole batch, head i_h
#     n, i = tl.load(chunk_index + 2 * j), tl.load(chunk_index + 2 * j + 1)
#     bos, eos = tl.load(cu + n), tl.load(cu + n + 1)
#     rows = bos + i * C + tl.arange(0, C)
#     m = rows < eos                                     # the sequence's end, as in the state pass
#     S = load h[j, i_h]                                 # the state entering this chunk
#     ... o[rows] = scale · (Q S + (Q Kᵀ ⊙ M) V), stored under the mask m
# ```
#
# In PyTorch, the same schedule — first the state pass storing the state entering each row of the
# table, then every row independently — gives the outputs of the chunk level:

# %%
def chunk_index(cu_seqlens, C):
    """[chunks, 2] int64: (sequence, chunk within it) for every chunk of the batch."""
    return torch.tensor([(n, (s - cu_seqlens[n].item()) // C) for n, s, _ in chunk_table(cu_seqlens, C)],
                        dtype=torch.int64)


def states_entering(k, v, cu_seqlens, C):
    """The state pass: the state entering each chunk of the table, [chunks, H, K, V]."""
    b, out, S = cu_seqlens.tolist(), [], None
    for n, s, e in chunk_table(cu_seqlens, C):
        if s == b[n]:
            S = torch.zeros(k.shape[2], k.shape[3], v.shape[3], dtype=k.dtype, device=k.device)
        out.append(S)
        S = S + torch.einsum("thk,thv->hkv", k[0, s:e], v[0, s:e])
    return torch.stack(out)


idx = chunk_index(cu, C)
h = states_entering(k, v, cu, C)
o_sched = torch.zeros_like(o_cl)
for j in torch.randperm(len(idx)).tolist():              # any order: the rows are independent
    n, i = idx[j].tolist()
    s = b[n] + i * C
    e = min(s + C, b[n + 1])
    o_sched[0, s:e] = chunk_step(h[j], q[0, s:e], k[0, s:e], v[0, s:e], q.shape[-1] ** -0.5)[0]
print("chunk index table (sequence, chunk):", idx.tolist())
print(f"outputs from the table, rows in random order, vs linattn.chunk: {testing.rel_err(o_sched, o_cl):.1e}")
assert testing.rel_err(o_sched, o_cl) < TOL

# %% [markdown]
# The remaining imbalance is the state pass. Two ways out, both in this book: split a long
# sequence's walk with the affine scan of chapter 08 (each piece's map $S \mapsto S + \sum k^\top v$
# composes associatively), or accept the one long walk when it is short next to the output pass.
# The library's Triton kernels (linear attention, GLA, DeltaNet, Gated DeltaNet, KDA) index packed
# rows this way, one launch per kernel forward and backward: a table like `chunk_index` for the
# kernels parallel over chunks, one program per (sequence, head) over its own chunks for the state
# pass, and each sequence's first chunk to find its states (`linattn/triton/gated.py`,
# `linattn/triton/delta.py`); the naive and chunk levels run each sequence as its own call
# (`docs/packed_sequences.md`).
#
# ## 4. Packed against padded, measured
#
# A padded batch is one call on `[N, max L, H, K]`; the packed row is one call with
# `cu_seqlens=cu`. On a GPU we time the Triton level, whose kernels index the sequences in one
# launch each (section 3); on a CPU the chunk level, which runs each sequence as its own call
# (`linattn.packing.per_sequence`; the Triton interpreter would time Python). The count that
# matters is real tokens per second. We keep the mean length fixed and widen the spread:
# log-normal lengths as in section 1, scaled to the same total, $\sigma$ from 0 (all equal) upwards.

# %%
n_docs, mean_len = 8, pick(cpu=256, gpu=2048)
Hb, Kb = pick(cpu=2, gpu=16), pick(cpu=32, gpu=128)
spreads = [0.0, 0.5, 1.0, 1.5, 2.0]


def spread_lengths(sigma):
    L = doc_lengths(n_docs, sigma, median=mean_len, cap=10 ** 9, seed=7).double()
    return (L * (n_docs * mean_len / L.sum())).round().clamp(min=1).long().tolist()


level, level_name = (linattn.triton, "Triton level") if DEVICE == "cuda" else (chunk, "chunk level")
dtype_b = pick(cpu=torch.float32, gpu=torch.bfloat16)
speed = {"packed": [], "padded": []}
for sigma in spreads:
    Ls = spread_lengths(sigma)
    cu_b = torch.tensor([0] + Ls, device=DEVICE).cumsum(0)
    row = testing.make_inputs("linear_attn", B=1, T=sum(Ls), H=Hb, K=Kb, V=Kb, seed=3, device=DEVICE, dtype=dtype_b)
    pad = testing.make_inputs("linear_attn", B=n_docs, T=max(Ls), H=Hb, K=Kb, V=Kb, seed=3, device=DEVICE,
                              dtype=dtype_b)
    ms_packed = bench.fastest_ms(lambda: level.linear_attn(**row, cu_seqlens=cu_b, chunk_size=64))
    ms_padded = bench.fastest_ms(lambda: level.linear_attn(**pad, chunk_size=64))
    for name, ms in (("packed", ms_packed), ("padded", ms_padded)):
        speed[name].append(sum(Ls) / ms)                  # real tokens per millisecond
    print(f"σ = {sigma:4}: lengths {Ls} (padding {waste(torch.tensor(Ls)):.0%}); real tokens/s "
          f"packed {1e3 * speed['packed'][-1]:,.0f}, padded {1e3 * speed['padded'][-1]:,.0f}")

fig, ax = plt.subplots(figsize=(7, 3.8))
ax.plot(spreads, speed["packed"], "o-", label="packed (cu_seqlens)")
ax.plot(spreads, speed["padded"], "s--", label="padded to the longest")
ax.set(xlabel="spread of lengths σ (log-normal, same total)", ylabel="real tokens per ms",
       ylim=(0, 1.15 * max(speed["packed"] + speed["padded"])),
       title=f"{level_name}, {n_docs} documents of mean length {mean_len}, "
             f"H={Hb}, K=V={Kb}\n{linattn.device.describe().split(' · ')[0]}")
ax.legend(loc="best", fontsize=8)                      # where it covers no point
plt.tight_layout(); plt.show()
ratio = [p / d for p, d in zip(speed["packed"], speed["padded"])]
print(f"packed ÷ padded, in real tokens per second: {ratio[0]:.2f} at σ = {spreads[0]}, "
      f"{ratio[-1]:.2f} at σ = {spreads[-1]}")
ahead = [s for s, r in zip(spreads, ratio) if r > 1]
print(f"packed ahead from σ = {ahead[0]} on" if ahead else "packed not ahead at any spread measured here")
assert ratio[-1] > ratio[0]          # the wider the spread, the more padding costs

# %% [markdown]
# Read the figure by its two ends. At $\sigma = 0$ there is no padding, and the packed row pays
# only for its boundaries: at the chunk level $N$ calls instead of one, in the Triton kernels a
# table lookup per program. As the spread grows, the padded batch spends a growing share of its
# time on padding (section 1's $w$), while the packed row does the same work at every spread.
# Whether and where the lines cross (the last line printed) is a property of the device, the level
# and the sizes.
#
# ### The library's kernels on a GPU, every operation
#
# `tools/bench_packing.py` (`linattn.bench_packing`) times the default Triton call of every
# operation on one row of eight documents of 256 to 16,384 tokens, forward and forward + backward,
# against the same tokens laid out three other ways — eight equal rows, rows as long as the longest
# document, and every document padded to the longest — and against flash-linear-attention's
# `cu_seqlens` path on the same row. The recorded run (`book/data/packing_gpu.json`):

# %%
from linattn import bench_packing

rec = bench.recorded_run("packing_gpu.json")
print(bench_packing.report(rec))
by = {(r["op"], r["mode"]): r for r in rec["rows"]}
pad_gain = [by[k]["padded"] / by[k]["packed"] for k in by]
walk = [by[k]["packed"] / by[k]["longest"] for k in by]
fla = {k: by[k]["packed"] / by[k]["fla"] for k in by if by[k].get("fla")}
print(f"\npacked is {min(pad_gain):.1f}–{max(pad_gain):.1f}× faster than padding to the longest; "
      f"{min(walk):.2f}–{max(walk):.2f}× the time of rows as long as the longest document")
print("packed ÷ FLA's packed path: " + ", ".join(f"{op} {mode} {r:.2f}" for (op, mode), r in fla.items()))

fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
layouts = [("packed", "packed (cu_seqlens)"), ("equal", "8 equal rows"), ("longest", "rows of the longest"),
           ("padded", "padded to the longest"), ("fla", "FLA, packed")]
width = 0.16
for ax, mode, title in zip(axes, ("forward", "train"), ("forward", "forward + backward")):
    ops_ = [op for op, m in by if m == mode]
    for i, (lay, name) in enumerate(layouts):
        x = [j + (i - 2) * width for j in range(len(ops_))]
        tps = [bench_packing.tokens_per_ms(by[op, mode], lay, rec["setting"]) or 0 for op in ops_]
        ax.bar(x, tps, width, label=name)
        for xj, t in zip(x, tps):
            if t == 0:                                    # FLA refused this backward on this toolchain
                ax.text(xj, 0, "refused", rotation=90, fontsize=6, ha="center", va="bottom")
    ax.set_xticks(range(len(ops_)), ops_, fontsize=7)
    ax.set(ylabel="real tokens per ms", title=title)
axes[0].legend(fontsize=7)
fig.suptitle(f"{rec['setting']['dtype']}, H = {rec['setting']['H']}, K = V = {rec['setting']['K']}, eight documents "
             f"of 256…16,384 tokens — {bench.run_label(rec['env'])}", fontsize=9)
plt.tight_layout(); plt.show()

# %% [markdown]
# Three comparisons, three lessons (the numbers above are the recorded run's):
#
# * **Against padding** the packed row wins by about the share of padding it removes: the padded
#   batch computes $8 \times 16{,}384$ tokens for $32{,}768$ real ones.
# * **Against rows of the longest document** — the same tokens and the same longest serial walk,
#   with no boundary — the packed row pays for its boundaries alone. The kernels look up their
#   sequence in a table; reading `cu_seqlens` to the host and building the tables synchronises with
#   the GPU, so the library does it once per `cu_seqlens` tensor (a training step passes the same
#   one to every layer and to the backward), as flash-linear-attention does.
# * **Against eight equal rows** the packed row is slower, and no table removes that: the state
#   pass walks each sequence's chunks in order, so it lasts as long as the 16,384-token document's
#   256 chunks while the equal rows walk 64 each, and while it runs most of the GPU's programs have
#   finished their short documents. Cutting one long walk into pieces that run side by side is
#   chapter 08's scan over chunk transitions, and linear attention's and GLA's state passes do it
#   (chapter 08, "The same cut inside the library's kernels") — but only where the walks leave most
#   SMs idle. Here, at 16 heads, the row keeps more than half the SMs busy, so the cut measured no
#   gain and the library keeps one walk (`docs/performance.md`).
#
# Against flash-linear-attention's packed path (its last printed line; a ratio below 1 means ours
# is faster) the forwards of linear attention, both GLAs and DeltaNet are ahead, KDA's and Gated
# DeltaNet's a few per cent behind. Forward + backward follows the unpacked training benchmark
# (`book/data/bench_train.json`, recorded the same day on the same kind of GPU) only roughly:
# linear attention is ahead of FLA packed and ahead or level unpacked, KDA level packed and a
# little ahead unpacked; GLA, a little ahead unpacked, falls behind packed, and DeltaNet, about
# 1.25× FLA's time unpacked, takes 1.6× packed. Those two pay most for the boundaries: their packed
# row takes about a fifth longer than the rows of the longest document, which run the same kernels.
# Where inside the backward that time goes is not yet traced kernel by kernel
# (`docs/packed_sequences.md` has the measurements). FLA 0.6.0 refuses its own backward for
# per-head gates on this toolchain, so those rows have no FLA time.
#
# ## 5. The short convolution must not leak either
#
# The layers of chapter 14 mix each position with its $w - 1$ predecessors before the attention,
# $y_t = \sum_{i<w} W_i \odot x_{t-i}$ (a causal depthwise convolution, `linattn.nn.conv.ShortConv`).
# On a packed row, the first $w - 1$ tokens of a sequence would read the last tokens of the one
# before. The packed convolution keeps only the taps that stay inside the token's own sequence,
# $t - i \ge c_n$:

# %%
def packed_conv(conv, x, cu_seqlens):
    """SiLU(causal depthwise conv) of a packed row x [1, T, C]: tap i of token t only if t − i is
    in t's own sequence."""
    T, w = x.shape[1], conv.width
    start = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff())          # c_n of each token
    t = torch.arange(T, device=x.device)
    y = torch.zeros_like(x)
    for i in range(w):                                    # weight[:, 0, w − 1 − i] multiplies x_{t−i}
        keep = (t - i >= start).to(x.dtype)[None, :, None]
        shifted = F.pad(x, (0, 0, i, 0))[:, :T]           # x_{t−i}, zeros before the row
        y = y + conv.conv.weight[:, 0, w - 1 - i] * shifted * keep
    return F.silu(y)


torch.manual_seed(0)
conv = ShortConv(8, width=4).to(DEVICE)
x = torch.randn(1, sum(seq_lens), 8, device=DEVICE)
with torch.no_grad():
    alone = torch.cat([conv(x[:, s:e])[0] for s, e in zip(b, b[1:]) if e > s], dim=1)
    across = conv(x)[0]                                   # the row as one sequence
    packed = packed_conv(conv, x, cu)
print(f"packed convolution vs each sequence alone: {testing.rel_err(packed, alone):.1e}")
assert testing.rel_err(packed, alone) < TOL
for n, (s, e) in enumerate(zip(b, b[1:])):
    if e > s:
        head, rest = slice(s, min(s + 3, e)), slice(min(s + 3, e), e)   # first w − 1 tokens, the others
        e_head, e_rest = (testing.rel_err(across[:, r], alone[:, r]) if r.stop > r.start else 0.0
                          for r in (head, rest))
        print(f"row convolved as one sequence, sequence {n}: its first {head.stop - head.start} "
              f"token(s) {e_head:.1e}, the rest {e_rest:.1e}")
        assert (e_head > 0.01 if s > 0 else e_head < TOL) and e_rest < TOL

# %% [markdown]
# Only the first $w - 1$ tokens of each sequence after the first are wrong — and through them
# every later output, since the attention reads them. So a layer must cut its convolution where the
# operation beneath it cuts its state. The library's layers take `cu_seqlens` for both: the
# convolution keeps the taps inside each token's sequence (`ShortConv(x, cu_seqlens=…)`, built
# from one index per token so that it compiles into one graph), and the operation gets the same
# boundaries:

# %%
with torch.no_grad():
    library = conv(x, cu_seqlens=cu)[0]
print(f"ShortConv(x, cu_seqlens=cu) vs the packed convolution above: {testing.rel_err(library, packed):.1e}")
assert testing.rel_err(library, packed) < TOL
#
# ## 6. What breaks if…
#
# * **the state is not reset** at $c_n$ (section 2): every sequence after the first reads the
#   ones before it;
# * **a chunk straddles a boundary** (section 2): the sequences that do not start on a multiple
#   of $C$ read their predecessor's tail, inside the chunk and through the state after it;
# * **a kernel's loop runs to the longest sequence, or its mask is the row's end $T$** (section
#   3): the reads stay inside the tensor, so no bounds check fires, and the state takes in the next
#   sequence's tokens; only the mask at `eos` keeps them out;
# * **a boundary is off by one**: sequence $n$ is $c_n \le t < c_{n+1}$. Read every boundary one
#   token late and each final state holds the next sequence's first token (and the next sequence
#   starts without it):

# %%
o1, S_off = naive.linear_attn(q.double(), k.double(), v.double(), output_final_state=True,
                              cu_seqlens=torch.tensor([0] + [min(c + 1, b[-1]) for c in b[1:-1]] + [b[-1]],
                                                      device=DEVICE).cummax(0).values)
for n in range(len(seq_lens)):
    print(f"sequence {n} ({seq_lens[n]:2d} tokens): final state with the boundary one late "
          f"{testing.rel_err(S_off[n], S_lib[n]):.1e}")
assert testing.rel_err(S_off[0], S_lib[0]) > 0.01

# %% [markdown]
# * **the short convolution is not cut** (section 5): the first $w - 1$ tokens of every sequence
#   mix in the previous one.
#
# ## Summary
#
# * Padding to the longest wastes $1 - \sum L_n / (N \max L_n)$ of the batch, which grows with the
#   batch and the spread of lengths; for a gated recurrence it also leaves the final state wrong
#   unless the padding is masked (chapter 15).
# * Packing: one row, $B = 1$, `cu_seqlens` (int64, cumulative lengths), states `[N, H, K, V]`.
#   The result is each sequence run alone.
# * Token loop: the state restarts at each $c_n$. Chunked form: chunks cut per sequence from its
#   own start, listed in a chunk table; a chunk cut from the row's start straddles boundaries and
#   leaks.
# * Kernel: one program per (sequence, head) for the serial state pass, bounds `bos`, `eos` read
#   from `cu_seqlens`, loads masked at `eos`; the output pass runs over a chunk index table, one
#   program per chunk of the batch.
# * The short convolution needs the same cut; the library's layers make it (`cu_seqlens=`).
# * Measured on a GPU, packing beats padding by the share of padding it removes; what remains
#   between a packed row and the same tokens in equal rows is the longest document's serial walk.
#
# **Workbook:** [`exercises/16_packing.py`](../exercises/16_packing.py) — the packed token loop of
# GLA with initial states (`ch16.packed_loop`), its chunk level (`ch16.packed_chunk`) and a Triton
# state pass with the decay and initial states (`ch16.packed_states`); the graders name the usual
# mistakes (a state carried across a boundary, the wrong initial state, final states out of order,
# a straddling chunk, a boundary off by one, a loop bound or mask taken from the wrong sequence).
