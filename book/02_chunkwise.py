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
# # 02 — Chunkwise linear attention
#
# **Goal.** Chapter 01 left us with two exact forms: a recurrence that does little work but in
# $T$ tiny sequential steps, and a parallel form made of large matrix products but $O(T^2)$ work.
# The chunkwise form takes the best of both: cut the sequence into chunks of $C$ tokens, use the
# parallel form *inside* each chunk, and pass the $K\times V$ state *between* chunks. We draw
# which part of the attention matrix each piece computes, prove that the result equals the
# recurrence, count flops and memory, measure the chunk-size trade-off on your device, and use
# the initial and final state to split work across calls — the way inference does prefill and
# decode. Every later chapter (decay, GLA, delta rule, the Triton kernels) is a variation of this
# one.

# %%
import matplotlib.pyplot as plt
import torch

import linattn
from linattn import bench, chunk, naive, testing
from linattn.device import pick

torch.manual_seed(0)  # the same random inputs at every run
print(linattn.device.describe())

# %% [markdown]
# ## 1. Two kinds of contributions
#
# Per head, split the $T$ tokens into chunks of $C$ (the last one may be shorter) and write
# $Q_{[n]}, K_{[n]}, V_{[n]}$ for the rows of chunk $n = 1, 2, \dots$ Let $S_{[n]}$ be the state after
# $n$ chunks, i.e. the recurrence's $S_{nC}$, with $S_{[0]} = S_0$ the initial state. Then
#
# $$\boxed{O_{[n]} = \text{scale}\cdot\Big(\underbrace{Q_{[n]}\,S_{[n-1]}}_{\text{inter: earlier chunks}}
#    + \underbrace{\big(Q_{[n]}K_{[n]}^\top \odot M\big)\,V_{[n]}}_{\text{intra: this chunk}}\Big),
#    \qquad S_{[n]} = S_{[n-1]} + K_{[n]}^\top V_{[n]}}$$
#
# with $M$ the lower triangle including the diagonal, now only $C\times C$. (The GLA paper, §2.1,
# numbers chunks from 0: $Q_{[i]}$ holds rows $iC+1, \dots, (i+1)C$ and $S_{[i]} := S_{iC}$, so its
# Eq. 4, $S_{[i+1]} = S_{[i]} + K_{[i]}^\top V_{[i]}$, is our state update. Its Eq. 5,
# $O_{[i+1]} = Q_{[i+1]}S_{[i]} + \big((Q_{[i+1]}K_{[i+1]}^\top)\odot M\big)V_{[i+1]}$, then pairs the
# queries of rows $(i+1)C+1, \dots$ with the state one chunk too early; it is right read with
# chunks numbered from 1, as here. A cell below checks both readings.)
#
# In the $T\times T$ matrix $P = \text{scale}\cdot(QK^\top)\odot M$ of the parallel form, the
# diagonal $C\times C$ blocks are the *intra* part, computed as small masked matmuls; everything
# below the diagonal blocks never gets built: it reaches the outputs through the state
# $S_{[n-1]} = S_0 + \sum_{m<n} K_{[m]}^\top V_{[m]}$.

# %%
Tf, Cf, Kf = 44, 8, 16                       # a small picture; the last chunk has 4 tokens
qf, kf = torch.randn(Tf, Kf, dtype=torch.float64), torch.randn(Tf, Kf, dtype=torch.float64)
chunk_of = torch.arange(Tf) // Cf
tri = torch.ones(Tf, Tf, dtype=torch.bool).tril()
intra = tri & (chunk_of[:, None] == chunk_of[None, :])      # diagonal blocks
inter = tri & (chunk_of[:, None] > chunk_of[None, :])       # below them: through the state
P = (qf @ kf.T * Kf ** -0.5) * tri

fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.6))
a1.imshow(P.abs(), cmap="Greys")
a1.set_title("|P| = |scale · (QKᵀ) ⊙ M|")
role = intra * 2 + inter * 1                                 # 0 future, 1 inter, 2 intra
a2.imshow(role, cmap=plt.matplotlib.colors.ListedColormap(["white", "#7fb3d5", "#f0a35e"]))
a2.set_title("orange: intra (C×C matmuls) · blue: via S[n−1]")
for a in (a1, a2):
    for b in range(Cf, Tf, Cf):
        a.axhline(b - 0.5, color="k", lw=0.6)
        a.axvline(b - 0.5, color="k", lw=0.6)
    a.set(xlabel="key position i", ylabel="query position t")
for n in range(1, (Tf + Cf - 1) // Cf):
    a2.text(n * Cf / 2 - 0.5, n * Cf + min(Cf, Tf - n * Cf) / 2 - 0.5, f"Q[{n + 1}] S[{n}]",
            ha="center", va="center", fontsize=7)
plt.show()

# %% [markdown]
# The picture is a claim we can check: multiplying $V$ by only the blue part of $P$ must give
# exactly $\text{scale}\cdot Q_{[n]} S_{[n-1]}$ for every chunk (here $S_0 = 0$).

# %%
vf = torch.randn(Tf, 12, dtype=torch.float64)
through_state = (P * inter) @ vf                             # blue blocks only
for n, s in enumerate(range(0, Tf, Cf), start=1):
    S_before = kf[:s].T @ vf[:s]                              # S[n-1] = Σ_{m<n} K[m]ᵀ V[m]
    err = testing.rel_err(Kf ** -0.5 * qf[s:s + Cf] @ S_before, through_state[s:s + Cf]) if s else 0.0
    assert err < testing.tolerance(torch.float64), (n, err)
print("blue blocks of P·V == scale · Q[n] S[n-1] for every chunk")

# %% [markdown]
# The GLA paper's Eq. 5 under its own numbering (chunk $i$ = rows $iC+1, \dots, (i+1)C$,
# $S_{[i]} = S_{iC}$), against the same equation with chunks numbered from 1 as in the box above,
# on the full chunks of this example (no scale, $S_0 = 0$):

# %%
def rows(X, i):                                               # chunk i, numbered from 0: rows iC+1…(i+1)C
    return X[i * Cf:(i + 1) * Cf]


def S_at(i):                                                  # S_[i] = S_{iC}
    return kf[:i * Cf].T @ vf[:i * Cf]


Mf = torch.ones(Cf, Cf, dtype=torch.bool).tril()
truth = ((qf @ kf.T) * tri) @ vf                              # the parallel form, row by row
n_full = Tf // Cf
for name, state in (("Eq. 5 as printed, Q_[i+1] S_[i]", S_at), ("with S_[i+1]", lambda i: S_at(i + 1))):
    eq5 = torch.cat([rows(qf, i + 1) @ state(i) + ((rows(qf, i + 1) @ rows(kf, i + 1).T) * Mf) @ rows(vf, i + 1)
                     for i in range(n_full - 1)])
    print(f"{name:32s} vs the parallel form: rel err {testing.rel_err(eq5, truth[Cf:n_full * Cf]):.1e}")
assert testing.rel_err(eq5, truth[Cf:n_full * Cf]) < testing.tolerance(torch.float64)

# %% [markdown]
# ## 2. The algorithm in a few lines
#
# One head, `[T, K]` tensors: a loop over chunks, two small products per chunk, one state update.

# %%
def chunkwise(q, k, v, scale, C, S0=None):
    T = len(q)
    S = torch.zeros(q.shape[1], v.shape[1], dtype=q.dtype) if S0 is None else S0.clone()  # K×V
    mask = torch.ones(C, C, dtype=torch.bool).tril()
    out = []
    for s in range(0, T, C):
        qc, kc, vc = q[s:s + C], k[s:s + C], v[s:s + C]       # [c, K], [c, K], [c, V]; c ≤ C
        c = len(qc)
        inter = qc @ S                                         # [c, V]: all earlier chunks
        intra = ((qc @ kc.T) * mask[:c, :c]) @ vc              # [c, V]: this chunk, causal
        out.append(scale * (inter + intra))
        S = S + kc.T @ vc                                      # S[n] = S[n-1] + K[n]ᵀ V[n]
    return torch.cat(out), S


# %% [markdown]
# Checked against the previous level — the float64 recurrence of chapter 01 in the library —
# with a length that is not a multiple of $C$, an initial state, and several chunk sizes, then
# against the library's chunkwise level `linattn.chunk.linear_attn`:

# %%
T, K, V = pick(cpu=300, gpu=3000), 32, 48
q, k, v = torch.randn(T, K, dtype=torch.float64), torch.randn(T, K, dtype=torch.float64), \
    torch.randn(T, V, dtype=torch.float64)
S0 = torch.randn(K, V, dtype=torch.float64)


def batched(x):                                                  # [T, D] -> [1, T, 1, D]
    return x[None, :, None, :]


o_ref, S_ref = naive.linear_attn(batched(q), batched(k), batched(v), initial_state=S0[None, None],
                                 output_final_state=True)
for C in (1, 16, 64, T, 2 * T):                                  # C=1 is the recurrence itself
    o, S = chunkwise(q, k, v, K ** -0.5, C, S0)
    e_o, e_S = testing.rel_err(o, o_ref[0, :, 0]), testing.rel_err(S, S_ref[0, 0])
    print(f"C={C:>4}: output vs recurrence {e_o:.1e}, final state {e_S:.1e}")
    assert max(e_o, e_S) < testing.tolerance(torch.float64)

o_lib, S_lib = chunk.linear_attn(batched(q), batched(k), batched(v), initial_state=S0[None, None],
                                 output_final_state=True, chunk_size=16)
assert testing.rel_err(o_lib, o_ref) < testing.tolerance(torch.float64)
assert testing.rel_err(S_lib, S_ref) < testing.tolerance(torch.float64)

# %% [markdown]
# ## 3. Why it is exact: induction on chunks
#
# **Claim.** For every $n$, $S_{[n]}$ equals the recurrence's state after the last token of chunk
# $n$, and $O_{[n]}$ equals the recurrence's outputs for the tokens of chunk $n$.
#
# **Base.** $S_{[0]} = S_0$, the state before any token, by definition.
#
# **Step.** Assume $S_{[n-1]} = S_{t_0}$, where $t_0$ is the last token before chunk $n$. For a
# token $t$ of chunk $n$, unrolling the recurrence from $t_0$ gives
# $S_t = S_{t_0} + \sum_{t_0 < i \le t} k_i^\top v_i$, so
#
# $$o_t = \text{scale}\cdot q_t S_t = \text{scale}\cdot\Big(q_t S_{[n-1]}
#   + \sum_{t_0 < i \le t} (q_t k_i^\top)\, v_i\Big).$$
#
# The first term is row $t$ of $Q_{[n]} S_{[n-1]}$; the second is row $t$ of
# $(Q_{[n]}K_{[n]}^\top \odot M) V_{[n]}$, because $M$ keeps exactly the keys $i \le t$ of the chunk.
# At the chunk's last token the same unrolling gives $S_{[n-1]} + K_{[n]}^\top V_{[n]} = S_{[n]}$.
# Nothing used that the chunk is full, so a shorter last chunk is covered too. $\blacksquare$
#
# The proof also says what may be reordered: the intra-chunk terms of all chunks are
# independent of each other (parallel over $n$); only the state pass is sequential, $T/C$ steps
# instead of $T$. And $C=1$ is the recurrence, $C \ge T$ the parallel form — both checked above.

# %% [markdown]
# ## 4. Flops and memory per form
#
# Per head, counting a multiply–add as 2 flops:
#
# * **intra**: per chunk $QK^\top$ ($2C^2K$) and $PV$ ($2C^2V$); over $T/C$ chunks $2TC(K+V)$;
# * **inter**: $Q_{[n]} S_{[n-1]}$ and $K_{[n]}^\top V_{[n]}$, $2CKV$ each per chunk, $4TKV$ in all —
#   the same as the whole recurrence, but as $C$-row matmuls;
# * **memory**: a $C\times C$ score block per chunk instead of $T\times T$; and the states between
#   chunks, $(T/C)\cdot K\cdot V$ numbers if they are all materialised (as kernels that
#   parallelise over chunks, and the backward pass, do) instead of $T\cdot K\cdot V$.
#
# A table for model-sized numbers (one head, float32 numbers):

# %%
def costs(T, C, K, V):
    """(flops, numbers held besides q, k, v, o, longest chain of dependent steps) per head."""
    return {
        "recurrent": (4 * T * K * V, K * V, T),
        "recurrent, all states kept": (4 * T * K * V, T * K * V, T),
        "parallel": (2 * T * T * (K + V), T * T, 1),
        f"chunkwise C={C}": (2 * T * C * (K + V) + 4 * T * K * V, C * C + -(-T // C) * K * V, -(-T // C)),
    }


Tt, Ct, Kt, Vt = 8192, 64, 128, 128
print(f"T={Tt}, C={Ct}, K={Kt}, V={Vt}, per head")
print(f"{'form':<28}{'GFLOP':>9}{'extra memory':>15}{'sequential steps':>18}")
for form, (fl, mem, steps) in costs(Tt, Ct, Kt, Vt).items():
    print(f"{form:<28}{fl / 1e9:>9.2f}{mem * 4 / 2**20:>12.1f} MiB{steps:>18}")

# %% [markdown]
# The chunkwise form does $1 + C(K+V)/(2KV)$ times the recurrence's flops — 1.5× for
# $C = 64$, $K = V = 128$ — instead of the parallel form's $T(K+V)/(2KV) = 64\times$, holds
# 8 MiB instead of 256, and has $T/C = 128$ sequential steps instead of 8192 (the table's
# columns).
#
# ## 5. The chunk size, measured
#
# Small chunks mean many sequential steps of small matmuls (overhead, poor use of the
# hardware); large chunks mean intra-chunk flops growing like $2TC(K+V)$. Somewhere in between is
# a best $C$, and where it lies depends on the device. Measured here with the library's chunkwise
# level:

# %%
Tm, Bm, Hm, Km = pick(cpu=2048, gpu=16384), 1, pick(cpu=2, gpu=16), 64
sizes = [16, 32, 64, 128, 256, 512, 1024]
dev = linattn.device.default_device()
args = testing.make_inputs("linear_attn", B=Bm, T=Tm, H=Hm, K=Km, V=Km, device=dev)


ms = [bench.fastest_ms(lambda: chunk.linear_attn(**args, chunk_size=C)) for C in sizes]
fl = [costs(Tm, C, Km, Km)[f"chunkwise C={C}"][0] * Bm * Hm for C in sizes]
best = sizes[min(range(len(sizes)), key=ms.__getitem__)]
for C, t in zip(sizes, ms):
    print(f"C={C:>5}: {t:8.2f} ms" + ("   ← fastest here" if C == best else ""))

fig, ax = plt.subplots(figsize=(7, 3.4))
ax.plot(sizes, ms, "o-", color="C0", label="measured time")
ax.set(xscale="log", xlabel="chunk size C", ylabel="ms (fastest of 5)", ylim=(0, 1.1 * max(ms)),
       title=f"chunk.linear_attn, T={Tm}, H={Hm}, K=V={Km} on {'GPU' if linattn.device.has_cuda() else 'CPU'}")
ax.set_xticks(sizes, [str(c) for c in sizes])
ax.minorticks_off()
ax2 = ax.twinx()
ax2.plot(sizes, [f / 1e9 for f in fl], "s--", color="C1", label="flops (right axis)")
ax2.set(yscale="log", ylabel="GFLOP")
fig.legend(loc="upper center", bbox_to_anchor=(0.45, 0.88), fontsize=8)
plt.show()

# %% [markdown]
# Flops rise steadily with $C$ (right axis): the intra term takes over once $C > 2KV/(K+V) = K$.
# The time first falls — fewer, larger steps — and rises again once the $C\times C$ blocks
# dominate. Where the minimum lies is a property of the device *and* of the implementation (the
# printout above says where it is on yours). On a GPU expect it at larger chunks than on a CPU:
# each chunk's step of the state pass costs a few kernel launches, which are expensive next to
# the GPU's arithmetic (the same cell prints it there). The Triton kernels of later chapters do a
# chunk's work inside one kernel; there $C = 64$ is the usual choice, a chunk being one tile of
# tensor-core work. (The
# GLA paper measures the same trade-off for its kernels in Figure 2, right: the time of the
# intra- and the inter-chunk parts as $C$ grows from 16 to 256, best at $C = 128$; chapter 10
# reproduces it.)

# %% [markdown]
# ## 6. Initial and final state: splitting the work
#
# The state is everything the future needs to know about the past. So a long sequence can be
# processed in pieces, handing the final state of one call to the next as `initial_state`.
# This is how generation works: **prefill** the prompt with the chunkwise form (fast, parallel),
# then **decode** one token at a time with the recurrence, starting from the prompt's final state.
# The result must equal one pass over everything.

# %%
B, H, K, V = 1, 2, 32, 32
prompt, generated = pick(cpu=200, gpu=2000), 20
x = testing.make_inputs("linear_attn", B=B, T=prompt + generated, H=H, K=K, V=V, seed=3)
q, k, v = x["q"], x["k"], x["v"]                              # [B, T, H, *], float32
o_all, S_all = naive.linear_attn(q.double(), k.double(), v.double(), output_final_state=True)

o_prompt, S = chunk.linear_attn(q[:, :prompt], k[:, :prompt], v[:, :prompt],
                                output_final_state=True, chunk_size=64)      # prefill
decoded = []
for t in range(prompt, prompt + generated):                    # decode: one token, one state
    o_t, S = naive.linear_attn(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                               initial_state=S, output_final_state=True)
    decoded.append(o_t)
o_split = torch.cat([o_prompt] + decoded, dim=1)
print(f"prefill + decode vs one pass: outputs {testing.rel_err(o_split, o_all):.1e}, "
      f"final state {testing.rel_err(S, S_all):.1e}")
assert testing.rel_err(o_split, o_all) < testing.tolerance(torch.float32)
assert testing.rel_err(S, S_all) < testing.tolerance(torch.float32)

# %% [markdown]
# Two chunkwise calls split at an arbitrary point (not a chunk boundary) are just as exact — and
# forgetting to pass the state is not a small error, it drops the whole past:

# %%
cut = prompt // 3 + 5
first, S_cut = chunk.linear_attn(q[:, :cut], k[:, :cut], v[:, :cut], output_final_state=True)
second, S_end = chunk.linear_attn(q[:, cut:], k[:, cut:], v[:, cut:], initial_state=S_cut,
                                  output_final_state=True)
forgot, _ = chunk.linear_attn(q[:, cut:], k[:, cut:], v[:, cut:])
e_split = testing.rel_err(torch.cat([first, second], 1), o_all)
e_forgot = testing.rel_err(torch.cat([first, forgot], 1), o_all)
print(f"split at t={cut}: {e_split:.1e};  without initial_state in the second call: {e_forgot:.2f}")
assert e_split < testing.tolerance(torch.float32) < e_forgot

# %% [markdown]
# The same property is what later chapters build on: a chunk's effect on the state is a map
# $S \mapsto S + K_{[n]}^\top V_{[n]}$ (with decay and the delta rule it becomes an affine map
# $S \mapsto M_{[n]} S + B_{[n]}$ with a $K\times K$ transition $M_{[n]}$, chapters 06–08 — not
# this chapter's mask), and maps compose — so chunks, and even whole sequence pieces on different
# devices, can be processed in parallel and stitched together afterwards (context parallelism).
#
# In a model you call the dispatcher rather than a level. It picks Triton on a GPU and the
# chunkwise level on a CPU, and says which one ran:

# %%
o_auto, _ = linattn.linear_attn(q.to(dev), k.to(dev), v.to(dev))
print("ran:", linattn.which("linear_attn"))
assert testing.rel_err(o_auto, o_all) < testing.tolerance(torch.float32)

# %% [markdown]
# ### What breaks if the state is kept in low precision
#
# The state is a running sum over the whole past. Kernels keep it in float32 even when
# $q, k, v$ are bfloat16, and so does the library (`final_state` comes back in float32). Storing
# it in bfloat16 instead — tempting during decoding, where it is the only memory that persists —
# rounds every update to 8 bits of mantissa, and the rounding errors pile up token after token:

# %%
Tb = pick(cpu=1024, gpu=8192)
xb = testing.make_inputs("linear_attn", B=1, T=Tb, H=2, K=32, V=32, dtype=torch.bfloat16, seed=4)
ref, _ = naive.linear_attn(**testing.to_float64(xb))                 # float64 truth
o_f32, _ = naive.linear_attn(**xb)                                   # float32 state (library)
S_b, rows = torch.zeros(1, 2, 32, 32, dtype=torch.bfloat16), []
for t in range(Tb):                                                  # decode with a bf16 state
    S_b = S_b + xb["k"][:, t, :, :, None] * xb["v"][:, t, :, None, :]
    rows.append(32 ** -0.5 * torch.einsum("bhk,bhkv->bhv", xb["q"][:, t], S_b))
o_b16 = torch.stack(rows, 1)


def error_along_t(o, window=64):          # relative error per window of tokens
    d = (o.double() - ref).square().sum((0, 2, 3)).reshape(-1, window).sum(1)
    return (d / ref.square().sum((0, 2, 3)).reshape(-1, window).sum(1)).sqrt()


fig, ax = plt.subplots(figsize=(7, 3))
for label, o in [("float32 state", o_f32), ("bfloat16 state", o_b16)]:
    ax.plot(torch.arange(Tb // 64) * 64 + 32, error_along_t(o), "o-", ms=3, label=label)
ax.axhline(testing.tolerance(torch.bfloat16), color="gray", ls=":", label="bf16 tolerance")
ax.set(xlabel="token t", ylabel="relative error of o", yscale="log", title="bf16 inputs, decoded token by token")
ax.legend(fontsize=8)
plt.show()
e32, e16 = testing.rel_err(o_f32, ref), testing.rel_err(o_b16, ref)
print(f"whole sequence: float32 state {e32:.1e}, bfloat16 state {e16:.1e} "
      f"(tolerance {testing.tolerance(torch.bfloat16):.0e})")
assert e32 < testing.tolerance(torch.bfloat16) < e16

# %% [markdown]
# With a float32 state the error stays at the level of rounding the outputs to bfloat16; with a
# bfloat16 state it grows along the sequence, roughly like $\sqrt t$, and soon exceeds what
# bfloat16 inputs justify.

# %% [markdown]
# ## Summary
#
# * Chunkwise = inter-chunk state passing + intra-chunk masked matmuls:
#   $O_{[n]} = \text{scale}\,(Q_{[n]}S_{[n-1]} + (Q_{[n]}K_{[n]}^\top\odot M)V_{[n]})$,
#   $S_{[n]} = S_{[n-1]} + K_{[n]}^\top V_{[n]}$. It is exact (induction on chunks), for any $C$ and
#   any $T$, including a short last chunk.
# * Work $2TC(K+V) + 4TKV$, memory $C^2$ per chunk plus $T/C$ states, $T/C$ sequential steps.
#   The best $C$ is a property of the device: measure it.
# * `initial_state` / `output_final_state` make the state a handle on the past: prefill then
#   decode, or split a sequence anywhere, with the same result as one pass. Keep it in float32:
#   a bfloat16 state accumulates rounding errors token after token.
#
# **Your turn:** `exercises/02_chunkwise.py` — write the chunkwise form with the library's
# signature. Once it passes, `linattn.set_impl("linear_attn", "mine")` runs the library through
# your chunkwise code. Next, chapter 03 adds decay: the state forgets, and the chunk algebra has
# to carry the forgetting across chunk boundaries.
