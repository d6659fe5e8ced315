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
# # 08 — Affine chunks as a scan, and context parallelism
#
# **Goal.** Chapter 07 turned a KDA chunk into an affine map of the state entering it,
# $S' = MS + B$, with outputs $O = PS + O_0$. Here we take that seriously. Every operation of the
# book — linear attention, Mamba-2-style decay, GLA, DeltaNet, Gated DeltaNet, KDA — has this form
# per token and per chunk; maps compose associatively (a product of block matrices); so the states
# entering all chunks can come from a **parallel prefix scan** instead of a sequential loop. The
# same algebra splits one long sequence across processes (**context parallelism**, each rank
# sending two small matrices) or across the SMs of one GPU (**SM parallelism**). We build all of
# it with `linattn.affine` and `linattn.context`, and check every result against the float64
# recurrences.
#
# Sources: `seeds/004` (the blocked-matrix view, associative scans, multi-step updates) and the
# last part of `seeds/003` (context and SM parallelism).

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import linattn
from linattn import affine, chunk, context, naive, testing
from linattn.device import pick

print(linattn.device.describe())
torch.manual_seed(0)

# %% [markdown]
# ## 1. One token, one affine map — translated into our convention
#
# `seeds/004` writes states as $V\times K$ matrices updated on the right, $S_i = S_{i-1}A_i + B_i$,
# and stacks $[S_i\ \ I] = [S_{i-1}\ \ I]\begin{bmatrix}A_i & 0\\ B_i & I\end{bmatrix}$. Our state is
# its transpose ($K\times V$, transitions on the left), so transpose everything: $M_i = A_i^\top$,
# $B^{\text{ours}}_i = B_i^\top$, and
#
# $$\begin{bmatrix} S_i \\ I_V\end{bmatrix} = \begin{bmatrix} M_i & B_i \\ 0 & I_V\end{bmatrix}
#   \begin{bmatrix} S_{i-1} \\ I_V\end{bmatrix}, \qquad \text{a } (K+V)\times(K+V) \text{ matrix acting on the left.}$$
#
# The per-token maps in our convention ($D_i = \operatorname{diag}(e^{g_i})$, $\alpha_i = e^{g_i}$ scalar):
#
# | model | $M_i$ ($K\times K$) | $B_i$ ($K\times V$) |
# |---|---|---|
# | linear attention | $I$ | $k_i^\top v_i$ |
# | Mamba-2 / RetNet (scalar decay) | $\alpha_i I$ | $k_i^\top v_i$ |
# | GLA (per-dimension decay) | $D_i$ | $k_i^\top v_i$ |
# | DeltaNet | $I - \beta_i k_i^\top k_i$ | $\beta_i k_i^\top v_i$ |
# | Gated DeltaNet | $\alpha_i (I - \beta_i k_i^\top k_i)$ | $\beta_i k_i^\top v_i$ |
# | KDA | $(I - \beta_i k_i^\top k_i)\, D_i$ — decay first (chapter 06) | $\beta_i k_i^\top v_i$ |
#
# (For KDA the order matters: in the seed's right-multiplied convention the same matrix reads
# $D_i(I - \beta_i k_i k_i^\top)$.) Let the product of the block matrices run a whole sequence and
# compare with the library's recurrences:

# %%
def token_maps(op, k, v, g=None, beta=None):
    """Per-token (M_i, B_i) for one head: k [T, K], v [T, V] → [T, K, K], [T, K, V]."""
    T, K = k.shape
    eye = torch.eye(K, dtype=k.dtype).expand(T, K, K)
    D = torch.diag_embed(g.exp().expand(T, K)) if g is not None else eye
    kk = k[:, :, None] * k[:, None, :]                               # k_iᵀ k_i, [T, K, K]
    kv = k[:, :, None] * v[:, None, :]                               # k_iᵀ v_i, [T, K, V]
    if beta is None:
        return D.clone(), kv
    b = beta[:, None, None]
    return (eye - b * kk) @ D, b * kv


T, K, V = 40, 8, 5
ops = {"linear_attn": "qkv", "gla": "qkvg", "delta_rule": "qkvb", "kda": "qkvgb"}
for op, names in ops.items():
    a = testing.to_float64(testing.make_inputs(op, B=1, T=T, H=1, K=K, V=V, initial_state=True, seed=1))
    arg = {n: a[{"q": "q", "k": "k", "v": "v", "g": "g", "b": "beta"}[n]] for n in names}
    one = {n: x[0, :, 0] for n, x in arg.items()}                    # batch element 0, head 0
    M_t, B_t = token_maps(op, one["k"], one["v"], one.get("g"), one.get("b"))
    X = torch.eye(K + V, dtype=torch.float64)
    for i in range(T):                                               # later tokens multiply on the left
        X = affine.augmented(M_t[i], B_t[i]) @ X
    S_blocks = (X @ torch.cat([a["initial_state"][0, 0], torch.eye(V, dtype=torch.float64)]))[:K]
    _, S_ref = getattr(naive, op)(*arg.values(), initial_state=a["initial_state"], output_final_state=True)
    err = testing.rel_err(S_blocks, S_ref[0, 0])
    print(f"{op:12s} product of {T} block matrices vs recurrence: {err:.1e}")
    assert err < 1e-12

# %% [markdown]
# Mamba-2 is the per-head case of `gla` (`g` of shape `[B, T, H]`), Gated DeltaNet the per-head
# case of `kda`; the table's other rows ran above. **RWKV-7** has a diagonal-plus-low-rank
# transition. `seeds/004` writes it as $A_i = \operatorname{diag}(w_i) - \hat\kappa_i^\top (a_i\odot\hat\kappa_i)$
# (in row vectors) acting on the right; by the rule above ours is its transpose,
#
# $$M_i = A_i^\top = \operatorname{diag}(w_i) - (a_i\odot\hat\kappa_i)^\top\hat\kappa_i, \qquad B_i = k_i^\top v_i:$$
#
# the state is read at $\hat\kappa_i$ ($\hat\kappa_i S_{i-1}$) and what was read is removed along
# $a_i\odot\hat\kappa_i$. Taken over untransposed, $A_i$ is a different recurrence — the cell below
# runs both maps against a token loop of RWKV-7 for six tokens. Writing these maps is exercise
# `ch08.rwkv7_maps` in `exercises/08_affine_scan.py`, graded against the same token loop. The observation of
# `seeds/004` on **multi-step updates** (DeltaProduct) needs no new code: $n_h$ gradient steps per
# token are $n_h$ maps multiplied together — the composition below, applied inside a token.

# %%
from linattn.grade.catalog.ch08 import rwkv7_inputs, rwkv7_loop   # RWKV-7-like inputs, its token loop

w, kap, a_, k_, v_ = rwkv7_inputs(torch.Generator().manual_seed(0), 1, 1, 6, 5, 3, torch.float64)  # T=6, K=5, V=3
S0_ = torch.randn(1, 1, 5, 3, dtype=torch.float64)
loop = rwkv7_loop(w, kap, a_, k_, v_, S0_)                          # states after each token, [1, 1, T, K, V]
rwkv_err = {}
for label, M_ in [("diag(w) − (a⊙κ̂)ᵀκ̂  (ours)", torch.diag_embed(w) - (a_ * kap)[..., :, None] * kap[..., None, :]),
                  ("diag(w) − κ̂ᵀ(a⊙κ̂)  (untransposed)", torch.diag_embed(w) - kap[..., :, None] * (a_ * kap)[..., None, :])]:
    S_, states = S0_, []
    for i in range(w.shape[2]):
        S_ = M_[:, :, i] @ S_ + k_[:, :, i, :, None] * v_[:, :, i, None, :]
        states.append(S_)
    rwkv_err[label] = testing.rel_err(torch.stack(states, 2), loop)
    print(f"M_i = {label}: relative error against the RWKV-7 token loop {rwkv_err[label]:.1e}")
assert min(rwkv_err.values()) < 1e-12 and max(rwkv_err.values()) > 1e-2

# %% [markdown]
# ## 2. Composition is associative
#
# Apply $(M_1, B_1)$, then $(M_2, B_2)$: $M_2(M_1S + B_1) + B_2$, so
#
# $$(M_2, B_2)\circ(M_1, B_1) = (M_2M_1,\ M_2B_1 + B_2),$$
#
# which is exactly the product of the two block matrices. Matrix products are associative, hence
# so is $\circ$: $(f_3\circ f_2)\circ f_1 = f_3\circ(f_2\circ f_1)$ — any bracketing of a chain of maps
# gives the same map. They do **not** commute: the order of the chunks matters.

# %%
k3 = F.normalize(torch.randn(3, 6, dtype=torch.float64), dim=-1)     # three KDA tokens, K = 6, V = 4
M_t, B_t = token_maps("kda", k3, torch.randn(3, 4, dtype=torch.float64),
                      -torch.rand(3, 6, dtype=torch.float64), torch.rand(3, dtype=torch.float64))
f = [(M_t[i], B_t[i]) for i in range(3)]
left = affine.compose(f[2], affine.compose(f[1], f[0]))
right = affine.compose(affine.compose(f[2], f[1]), f[0])
swapped = affine.compose(f[0], affine.compose(f[1], f[2]))
print("associative:", max(testing.rel_err(x, y) for x, y in zip(left, right)),
      "· reversed order differs by", f"{testing.rel_err(swapped[1], left[1]):.2f}")
assert max(testing.rel_err(x, y) for x, y in zip(left, right)) < 1e-13

# %% [markdown]
# ## 3. Chunk maps and two ways to get every entering state
#
# `affine.chunk_maps(op, *args, chunk_size=C)` computes, for every chunk and all at once, the
# map $(M_n, B_n)$ and the output map $O_n = Q^{\text{eff}}_n S_n + O_{0,n}$ of chapter 07 (the library
# calls $Q^{\text{eff}}$ `P`) — for all four operations ($W = 0$ without the delta rule, so
# $M_n = \operatorname{diag}(e^{b_C})$ and $Q^{\text{eff}}_n = \text{scale}\,Q\odot e^G$).
# Chunks and their maps are numbered from 0 here, as in the arrays. The state entering chunk $n$
# is $S_n = (f_{n-1}\circ\dots\circ f_0)(S_0)$:
#
# * **fold** — one map after another, $N$ sequential steps (what `chunk.kda` does);
# * **prefix scan** — Hillis–Steele: in round $r$ every position $n \ge 2^r$ composes its map with
#   the one $2^r$ places earlier. After $\lceil\log_2 N\rceil$ rounds position $n$ holds
#   $f_n\circ\dots\circ f_0$; every round is one batched matmul over all positions.

# %%
a = testing.make_inputs("kda", B=2, T=pick(cpu=333, gpu=8192), H=2, K=16, V=16, initial_state=True, seed=2)
args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
maps, d = affine.chunk_maps("kda", *args, chunk_size=16)
print("maps:", {n: tuple(getattr(maps, n).shape) for n in ("M", "B", "P", "O0")})
S0 = a["initial_state"]
entering_fold, final_fold = affine.fold(maps.M, maps.B, S0)
M_pre, B_pre, rounds = affine.prefix_scan(maps.M, maps.B)
entering_scan, final_scan = affine.entering_states(M_pre, B_pre, S0)
N = maps.M.shape[2]
print(f"N = {N} chunks: scan in {rounds} rounds (⌈log₂ N⌉ = {math.ceil(math.log2(N))}); "
      f"scan vs fold {testing.rel_err(entering_scan, entering_fold):.1e}")
o_scan = affine.chunk_outputs(maps, entering_scan)
o_ref, S_ref = naive.kda(*(x.double() for x in args), initial_state=S0.double(), output_final_state=True)
print(f"outputs from the scanned states vs float64 recurrence: {testing.rel_err(o_scan, o_ref):.1e}")
assert rounds == math.ceil(math.log2(N))
assert testing.rel_err(o_scan, o_ref) <= testing.tolerance(torch.float32)
assert testing.rel_err(final_scan, S_ref) <= testing.tolerance(torch.float32)

# %% [markdown]
# `affine.run(op, …, method="scan" | "fold")` packages this for every operation; it agrees with
# the chunk level of each (chapters 02, 04, 07):

# %%
for op, lib in [("linear_attn", chunk.linear_attn), ("gla", chunk.gla), ("delta_rule", chunk.delta_rule), ("kda", chunk.kda)]:
    b = testing.make_inputs(op, B=1, T=pick(cpu=200, gpu=4096), H=2, K=16, V=16, initial_state=True, seed=3)
    pos = tuple(b[n] for n in context.ARG_NAMES[op])
    o1, S1 = affine.run(op, *pos, initial_state=b["initial_state"], output_final_state=True, chunk_size=32)
    o2, S2 = lib(*pos, initial_state=b["initial_state"], output_final_state=True, chunk_size=32)
    print(f"{op:12s} scan vs chunk level: outputs {testing.rel_err(o1, o2):.1e}, state {testing.rel_err(S1, S2):.1e}")
    assert testing.rel_err(o1, o2) < 1e-5 and testing.rel_err(S1, S2) < 1e-5

# %% [markdown]
# ## 4. Work and depth
#
# The fold does $N-1$ compositions, one after another: work $N$, depth $N$. Hillis–Steele does
# $\sum_r (N - 2^r) \approx N\log_2 N - N$ compositions in $\lceil\log_2 N\rceil$ rounds: more work,
# logarithmic depth. Blelloch's scan (an up-sweep and a down-sweep over a tree) gets work back to
# about $2N$ at depth $2\log_2 N$. A composition costs a $K\times K$ by $K\times(K+V)$ matmul, which is
# more than the fold's $K\times K$ by $K\times V$ "apply" and far more than chapter 07's
# $\tilde V = U - WS$ pass — so in total work the sequential chunk loop is the cheapest, and the
# scan pays off only when the *depth* is what hurts: very long sequences with few heads (too
# little parallel work per step to fill a GPU), or chunks spread over devices (§5). Counting the compositions our `prefix_scan` performs:

# %%
Ns = [2 ** p for p in range(1, 13)]


def hs_work(N):
    return sum(N - s for s in (2 ** r for r in range(math.ceil(math.log2(N)))))


Mi, Bi = torch.eye(2).expand(1, 1, 5, 2, 2), torch.zeros(1, 1, 5, 2, 1)
assert affine.prefix_scan(Mi, Bi)[2] == 3 and hs_work(5) == 4 + 3 + 1
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
ax1.loglog(Ns, [N - 1 for N in Ns], "o-", label="fold")
ax1.loglog(Ns, [hs_work(N) for N in Ns], "s-", label="Hillis–Steele")
ax1.loglog(Ns, [2 * (N - 1) for N in Ns], "^-", label="Blelloch")
ax1.set(xlabel="number of maps N", ylabel="compositions (work)"); ax1.legend()
ax2.semilogx(Ns, [N - 1 for N in Ns], "o-", label="fold")
ax2.semilogx(Ns, [math.ceil(math.log2(N)) for N in Ns], "s-", label="Hillis–Steele")
ax2.semilogx(Ns, [2 * math.ceil(math.log2(N)) for N in Ns], "^-", label="Blelloch")
ax2.set(xlabel="number of maps N", ylabel="sequential rounds (depth)", yscale="log"); ax2.legend()
plt.show()

# %% [markdown]
# ## 5. Context parallelism
#
# Now spread one sequence over $R$ processes, rank $r$ holding a contiguous slice. Each slice is
# an affine map of the state entering it, and nothing else about the slice matters to the others.
# So (`linattn.context.context_parallel`, following `seeds/003`):
#
# 1. **local**: each rank computes its chunk maps and their prefix scan from a **zero** entering
#    state. The last prefix is the slice's own map $(M_r, B_r)$ — $B_r$ is the state the slice
#    would leave behind from zero — and the outputs from zero, $O^{\text{local}}$, are ready too;
# 2. **exchange**: `all_gather` of $(M_r, B_r)$: two tensors of $K\times K$ and $K\times V$ per head,
#    whatever the slice length;
# 3. **fold**: rank $r$ composes the maps of ranks $0..r-1$ and applies them to $S_0$:
#    $S_r = \sum_{j<r} M_{r-1}M_{r-2}\cdots M_{j+1}\,B_j + M_{r-1}\cdots M_0\,S_0$ — later ranks'
#    maps on the left, an empty product being $I$;
# 4. **correct**: outputs are affine in the entering state. Within the slice, chunk $n$ is entered by
#    $M^{\text{pre}}_{n-1}S_r$ plus what the slice's earlier chunks wrote from zero (already in
#    $O^{\text{local}}$), with $M^{\text{pre}}_{n-1}$ the slice's chunk maps $0..n-1$ composed
#    ($I$ for its first chunk), so $O_n = O^{\text{local}}_n + Q^{\text{eff}}_n\,M^{\text{pre}}_{n-1}\,S_r$
#    chunk by chunk, with chapter 07's effective queries
#    $Q^{\text{eff}}_n = \text{scale}\,(Q\odot e^{G} - A_{qk}W)$ — no second pass over the keys and values.
#
# **Where the sources differ.** `seeds/003` states the correction for one chunk per rank and
# without the query decay, $O_r = O_r^{\text{local}} + Q_r S_r - \operatorname{mask}(A_{qk})W_rS_r$, and its
# fold leaves out $S_0$. With a gate, the entering state reaches token $i$ of the chunk decayed by
# $e^{b_i}$, so the first term must read $(Q_r\odot e^{G})S_r$, as in $Q^{\text{eff}}_n$; with several chunks per
# rank each chunk also needs the slice's earlier maps, $M^{\text{pre}}_{n-1}$. The cells below check
# the book's form, initial state included, against the float64 recurrence.
#
# First the algebra, with the ranks simulated in this process (the same functions the real thing
# calls):

# %%
R = 4
b = testing.make_inputs("kda", B=1, T=pick(cpu=203, gpu=8192), H=2, K=16, V=16, initial_state=True, seed=4)
pos = tuple(b[n] for n in context.ARG_NAMES["kda"])
T_ = pos[0].shape[1]
slices = [context.slice_bounds(T_, R, r) for r in range(R)]
locals_ = [context.local_pass("kda", tuple(x[:, s:e] for x in pos), scale=None, chunk_size=16)[0]
           for s, e in slices]                                       # step 1, "on every rank"
Ms, Bs = zip(*(loc.total for loc in locals_))                        # step 2: what all_gather collects
entering, final = context.fold_maps(Ms, Bs, b["initial_state"])      # step 3
o_cp = torch.cat([context.corrected(loc, S_r) for loc, S_r in zip(locals_, entering)], 1)  # step 4
o_ref, S_ref = naive.kda(*(x.double() for x in pos), initial_state=b["initial_state"].double(),
                         output_final_state=True)
print("slices:", slices)
print(f"simulated {R} ranks vs float64 recurrence: outputs {testing.rel_err(o_cp, o_ref):.1e}, "
      f"final state {testing.rel_err(final, S_ref):.1e}")
o_uncorrected = torch.cat([loc.o_local for loc in locals_], 1)
print(f"without step 4 (every slice from a zero state): {testing.rel_err(o_uncorrected, o_ref):.1e}")
assert testing.rel_err(o_cp, o_ref) <= testing.tolerance(torch.float32)
assert testing.rel_err(o_uncorrected, o_ref) > 1e-3

# %% [markdown]
# And for real: two processes on this machine talking through `torch.distributed` with the gloo
# backend (on 127.0.0.1), each computing only its slice. `context.selfcheck` starts them with
# `torch.multiprocessing`, runs all four operations and compares the concatenated outputs and the
# final state with the float64 single-process recurrence. The tests run the same with 2 and 4
# processes (`tests/test_context_parallel.py`), and `tools/cp_nccl.py` runs it across GPUs with NCCL.

# %%
errors = context.selfcheck(2, "gloo")
for op, e in errors.items():
    print(f"{op:12s} 2 gloo processes vs {e['ref']} (float64): outputs {e['o']:.1e}, final state {e['final_state']:.1e}")
    assert e["o"] <= testing.tolerance(torch.float32) and e["final_state"] <= testing.tolerance(torch.float32)

# %% [markdown]
# What is communicated does not grow with the sequence: $R$ pairs of $K\times K$ and $K\times V$
# per head. What *is* extra is step 1's prefix scan of $K\times K$ maps (the ordinary chunk loop
# only needs $\tilde V = U - WS$ per chunk) — the price of not knowing $S_r$ in advance. For linear
# attention and GLA $M$ is diagonal, so that price could be small (our implementation keeps every
# $M$ dense, for one code path); for the delta rule $M$ is dense.

# %% [markdown]
# ## 6. SM parallelism: the same algebra on one device
#
# On a single GPU a long sequence with few heads has few independent chunk loops — $B\cdot H$ of
# them — and most SMs idle during the sequential state pass. Cut the sequence into sub-sequences
# and run them *side by side as extra batch entries*: each computes its map from zero, a short
# scan over the sub-sequences gives the entering states, and the outputs are corrected as in §5.
# `context.sm_parallel(op, …, splits=m)` does exactly that (`seeds/003`'s intra-card
# pre-scan and merge):

# %%
for splits in (1, 2, 4, 7):
    o_sm, S_sm = context.sm_parallel("kda", *pos, splits=splits, initial_state=b["initial_state"],
                                     output_final_state=True, chunk_size=16)
    print(f"{splits} sub-sequences: outputs {testing.rel_err(o_sm, o_ref):.1e}, final state {testing.rel_err(S_sm, S_ref):.1e}")
    assert testing.rel_err(o_sm, o_ref) <= testing.tolerance(torch.float32)

# %% [markdown]
# ### The same cut inside the library's kernels
#
# For linear attention and GLA the chunk map is diagonal: $M_c = \operatorname{diag}(a_c)$ with
# $a_c = e^{b_{\text{last}}}$ per key dimension (per head, or $1$ without a gate). Composing two maps
# multiplies two vectors, so a stretch of $L$ chunks is summed up by its **log-decay**
# $\sum_c \log a_c$ and its state from zero $F$, and no $K\times K$ matrix is ever formed. Chapter
# 10's state pass (`gated._states_kernel`, one program per sequence, head and block walking all the
# chunks) can therefore run in three launches (`linattn/triton/segments.py`):
#
# 1. every segment of $L$ chunks from a **zero** state, all at once: its $F_j$ and log-decay;
# 2. `_combine_kernel` walks the segments, $S_j = a_{j-1} \odot S_{j-1} + F_{j-1}$ from the initial
#    state — $N_T/L$ cheap steps instead of $N_T$ chunk steps;
# 3. every segment again from its $S_j$, all at once, writing the state before each of its chunks.
#
# The critical path falls from $N_T$ chunk steps to about $2L + N_T/L$ (least at $L=\sqrt{N_T/2}$),
# for twice the chunk steps in all. The backward's reverse pass over the state gradients is the same
# map walked from the end. Segments reuse the packed-sequence tables of chapter 16: a segment is a
# "sequence" with its own initial state. First the algebra through the real kernels (on a CPU under
# Triton's interpreter, tiny), cut into segments of two chunks:

# %%
from linattn import triton as lt
from linattn.triton import segments

g_in = testing.make_inputs("gla", B=1, T=pick(cpu=96, gpu=4096), H=2, K=32, V=32, initial_state=True, seed=5)
g_in = {n: x.to(linattn.device.default_device()) for n, x in g_in.items()}
runs = {}
for L in (0, 2):                                   # 0: one walk; 2: segments of two chunks
    with segments.fixed(L):
        runs[L] = lt.gla(**g_in, output_final_state=True, chunk_size=16, mode="states")
o_ref, S_ref = chunk.gla(**{n: x.double() for n, x in g_in.items()}, output_final_state=True, chunk_size=16)
for L, (o_, S_) in runs.items():
    print(f"{'one walk' if L == 0 else f'segments of {L} chunks':22s} outputs {testing.rel_err(o_, o_ref):.1e}, "
          f"final state {testing.rel_err(S_, S_ref):.1e} against float64")
    assert testing.rel_err(o_, o_ref) <= testing.tolerance(torch.float32)
print(f"segments against one walk: {testing.rel_err(runs[2][0], runs[0][0]):.1e} (float32 rounding order)")

# %% [markdown]
# Whether the cut pays is a measurement, not a theorem. It reads $k$ and $v$ twice and launches three
# kernels for one. On an H200 a pass whose launch already gives more than half the SMs a program
# runs near its memory bandwidth and gained nothing; with fewer programs the walk's latency is
# what costs, and the cut took 10–60 % off the pass's GPU time. And every launch costs the host
# about a tenth of a millisecond, so a short call that the host already limits got slower. The
# rule (`segments.length`): cut a pass only where its walks give at most half the SMs a program and
# are long — at least 1024 chunks, 256 with per-dimension gates, whose chunk step costs more
# (`docs/performance.md` has the measurements behind it). The recorded run, one sequence ($B = 1$),
# the default call beside the same call kept to one walk and beside flash-linear-attention:

# %%
from linattn import bench, bench_long

rec = bench.recorded_run("long_sequence.json")
print(bench_long.report(rec))
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
for ax, mode, title in zip(axes, ("forward", "train"), ("forward", "forward + backward")):
    for op, color in (("linear_attn", "C0"), ("simple_gla", "C1"), ("gla", "C2")):
        for H, style in ((4, "o-"), (16, "s--")):       # one colour per op: solid H = 4, dashed H = 16
            rows_ = [r for r in rec["rows"] if r["op"] == op and r["mode"] == mode and r["H"] == H]
            ax.plot([r["T"] for r in rows_], [r["one_walk"] / r["ours"] for r in rows_], style, color=color,
                    label=f"{op}, H = {H}")
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    Ts_ = rec["setting"]["Ts"]
    ax.set_xticks(Ts_, [f"{t // 1024}k" for t in Ts_])
    ax.set(xlabel="tokens in the one sequence T", title=title)
axes[0].set_ylabel("one walk ÷ default (speed-up)")
axes[1].legend(fontsize=7)
fig.suptitle(f"B = 1, {rec['setting']['dtype']}, K = V = {rec['setting']['K']} — {bench.run_label(rec['env'])}",
             fontsize=9)
plt.tight_layout(); plt.show()

# %% [markdown]
# Read the figure with the rule in mind; the next cell prints the numbers it rests on.

# %%
def rows_of(op, mode, H, long_only=False):
    return [r for r in rec["rows"] if (r["op"], r["mode"], r["H"]) == (op, mode, H)
            and (not long_only or r["T"] >= 65536)]


def ratios(rows_, num, den):
    return ", ".join(f"{r['T'] // 1024}k {r[num] / r[den]:.2f}" for r in rows_ if r.get(num) and r.get(den)) or "—"


for op in ("gla", "simple_gla", "linear_attn"):
    for mode in ("forward", "train"):
        rows_ = rows_of(op, mode, 4, long_only=True)
        print(f"H = 4  {op:11s} {mode:7s} one walk ÷ default: {ratios(rows_, 'one_walk', 'ours')};"
              f"  default ÷ FLA: {ratios(rows_, 'ours', 'fla')}")
# Linear attention's walks shorter than the rule's minimum are one walk in both columns: the same
# kernels, timed twice.
from linattn.triton import gated

C, shortest = 64, gated.SEGMENT_MIN_CHUNKS[gated.NO_GATE]
for r in rec["rows"]:
    if r["op"] == "linear_attn" and r["H"] == 4 and r["T"] // C < shortest:
        print(f"the same kernels twice ({r['T'] // C} chunks < {shortest}): linear_attn {r['mode']} H = 4, "
              f"{r['T'] // 1024}k: {r['ours']:.2f} against {r['one_walk']:.2f} ms")
gla_long = [r["one_walk"] / r["ours"] for m in ("forward", "train") for r in rows_of("gla", m, 4, True)]
assert min(gla_long) > 1.5                          # what the text below says
for T_, gained in ((131072, True), (65536, False)):   # linear attention and per-head GLA: 128k gains, 64k not
    assert all((r["one_walk"] > r["ours"]) == gained for op in ("simple_gla", "linear_attn")
               for m in ("forward", "train") for r in rows_of(op, m, 4) if r["T"] == T_)

# %% [markdown]
# * **$H = 4$, 64k tokens and more** — few heads and one very long sequence, as in long-context
#   training and prefill — is the regime the cut is for. GLA's forward and its forward + backward
#   ran more than 1.5× faster than one walk, which put them well ahead of flash-linear-attention's.
#   Linear attention and per-head GLA gained at 128k; at 64k, where their walks are just long
#   enough for the rule (1024 chunks), the cut columns read slower than one walk, at times that the
#   host's launches limit (next point), so this run cannot tell a real cost of the extra launches
#   from scatter.
# * **$H = 16$**: the GPU already has its programs. Linear attention and per-head GLA are left one
#   walk (the same kernels in both columns); GLA's forward, whose per-dimension pass has 64
#   programs, gains a little.
# * **Noise where the host limits.** Calls of a few tenths of a millisecond wait on Python launching
#   kernels, and their wall times scatter from one timing to the next: the last lines printed above
#   timed the same kernels twice.
#
# The delta rule's maps are dense ($K\times K$), so its passes would need this section's matrix
# scan, with more work per segment; the library does not cut them.

# %% [markdown]
# ## Summary
#
# * Every operation of the book is, per token and per chunk, an affine map $S' = MS + B$ — in block
#   form $\begin{bmatrix}M & B\\0 & I\end{bmatrix}$ acting on $\begin{bmatrix}S\\I\end{bmatrix}$; `seeds/004`'s
#   right-multiplied $V\times K$ convention is its transpose.
# * Composition $(M_2M_1, M_2B_1 + B_2)$ is associative, not commutative: fold, Hillis–Steele
#   ($\log_2 N$ rounds, $N\log N$ work) or Blelloch ($2\log_2N$ rounds, $2N$ work) all give the same
#   states.
# * Context parallelism: local maps from zero, `all_gather` of $(M_r, B_r)$, a fold, and an
#   output correction that is linear in the entering state. SM parallelism: the same, batched on
#   one device; the library's linear attention and GLA cut their state passes that way, where a
#   measurement says it pays.
#
# **Workbook:** `exercises/08_affine_scan.py` — composition, the prefix scan, and RWKV-7's
# per-token maps (its diagonal-plus-low-rank transition in our convention), graded against a
# token loop.
