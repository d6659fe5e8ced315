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
# # 07 — The WY representation, the UT transform and chunkwise KDA
#
# **Goal.** Chapter 06 ended with a triangular system: inside a chunk, each residual of the delta
# rule depends on the residuals before it. Here we write that system down, solve it once per chunk
# (forward substitution; or a Neumann series with doubling), and split the solution into a part
# that does not depend on the state entering the chunk and a part linear in it:
# $\tilde V = U - WS$ — the **WY representation**. With it a chunk is matmuls again, its action on
# the state is an affine map $S' = MS + B$, and the decays of Gated DeltaNet and KDA fit in with
# every exponent $\le 0$. The result is `linattn.chunk.kda`, checked against `naive.kda`.
#
# Source: the KDA derivation in `seeds/003` (its notation is ours: $S$ is $K\times V$, keys are
# rows, transitions on the left). We depart from it in one bookkeeping choice, explained in §2.

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import linattn
from linattn import affine, chunk, decay, naive, testing
from linattn.chunk.delta import unit_lower_inverse, wy_factors
from linattn.device import pick

print(linattn.device.describe())
torch.manual_seed(0)

# %% [markdown]
# ## 1. One chunk, unrolled
#
# Take a chunk of $C$ tokens, the state $S$ at its start, and cumulative log-decays from the chunk
# start $b_i = g_1 + \dots + g_i$ (per key dimension, positions $i = 1, \dots, C$; $b = 0$ for
# DeltaNet), stacked into the $C\times K$ matrix $G$ whose row $i$ is $b_i$. Define the
# **β-weighted residual** of token $i$,
#
# $$\tilde v_i = \beta_i\big(v_i - k_i D_i s_{i-1}\big), \qquad s_i = D_i s_{i-1} + k_i^\top \tilde v_i .$$
#
# Unrolling $s_{i-1}$ back to the chunk start,
# $D_i s_{i-1} = \operatorname{diag}(e^{b_i}) S + \sum_{j<i} \operatorname{diag}(e^{b_i - b_j})\, k_j^\top \tilde v_j$, so
#
# $$\tilde v_i = \beta_i v_i - \beta_i (k_i \odot e^{b_i})\, S
#   - \sum_{j < i} \underbrace{\beta_i \sum_d k_{id} k_{jd}\, e^{b_{id} - b_{jd}}}_{A_{ij}}\ \tilde v_j .$$
#
# Stack the rows: with $A$ **strictly** lower triangular ($A_{ij}$ for $i > j$, zero on and above
# the diagonal — token $i$ is corrected by the writes *before* it, not by its own),
#
# $$\boxed{(I + A)\,\tilde V = \operatorname{diag}(\beta)\,V - \operatorname{diag}(\beta)\,(K\odot e^{G})\,S}$$
#
# Check it on one chunk against the recurrence: run the tokens one by one, record
# $\tilde v_i$, and compare with the solution of the system.

# %%
C, K, V = 16, 8, 6
gen = torch.Generator().manual_seed(1)
k = F.normalize(torch.randn(C, K, generator=gen, dtype=torch.float64), dim=-1)
v = torch.randn(C, V, generator=gen, dtype=torch.float64)
g = testing.log_gates((C, K), "normal", generator=gen).double()
beta = torch.rand(C, generator=gen, dtype=torch.float64)
S = torch.randn(K, V, generator=gen, dtype=torch.float64)


def chunk_by_tokens(k, v, g, beta, S):
    """The recurrence inside one chunk: β-weighted residuals [C, V] and the end state."""
    res = []
    for i in range(k.shape[0]):
        S = g[i].exp()[:, None] * S                                  # decay first
        r = beta[i] * (v[i] - k[i] @ S)
        S = S + torch.outer(k[i], r)
        res.append(r)
    return torch.stack(res), S


Vt_tokens, S_end = chunk_by_tokens(k, v, g, beta, S)
G = g.cumsum(0)                                                      # [C, K]
E = (G[:, None, :] - G[None, :, :]).masked_fill(~torch.ones(C, C, dtype=torch.bool).tril(-1)[..., None],
                                                 float("-inf")).exp()  # e^{G_i − G_j}, i > j
A = beta[:, None] * torch.einsum("ik,ijk,jk->ij", k, E, k)          # [C, C], strictly lower
rhs = beta[:, None] * (v - (k * G.exp()) @ S)
Vt_system = torch.linalg.solve_triangular(torch.eye(C, dtype=torch.float64) + A, rhs, upper=False)
print("residuals: system vs recurrence", testing.rel_err(Vt_system, Vt_tokens))
assert testing.rel_err(Vt_system, Vt_tokens) < 1e-13

# %% [markdown]
# ## 2. Where β goes (and a note on the source)
#
# We put $\beta_i$ into the unknown ($\tilde v_i$ is β-weighted) and therefore on the **rows** of
# $A$: $A_{ij} = \beta_i(\dots)$. `seeds/003` keeps the unweighted residual as the unknown; then
# $\beta_j$ multiplies the **columns**, $A_{ij} = \beta_j (k_i\odot e^{g_i})(k_j\odot e^{-g_j})^\top$.
# Both systems have the same solution up to that scaling — but mixing them (the seed's $A$ with our
# $\tilde V$) is wrong, and the workbook's grader rejects "β on the wrong side". Three places in the
# seed need care when translated: its state update
# $S' = \operatorname{diag}(e^{g_{\text{last}}})S + K_{\text{decayed}}^\top \tilde V$ is only right when
# $\tilde V$ carries β (as ours does), and its gated key $\hat k_i = k_i\odot e^{g_i}$ appears with
# both signs of the exponent in its Step 3 (the reading key has $e^{+g_i}$, the writing key
# $e^{-g_j}$: §5 shows why we never form either alone). And where its Step 4 solves the system it
# writes $\tilde V = (I + A_{kk})^{-1}\hat V - (I + A_{kk})^{-1}KS$: the gate is gone from the last
# term, although the system one line before has $K_{\text{gated}}$ (rows $k_i\odot e^{g_i}$) there.
# The entering state reaches token $i$ decayed, so the term is $(K\odot e^{G})S$, as in our boxed
# system. Our derivation in §1 is checked numerically; every claim below is too.

# %% [markdown]
# ## 3. Inverting $I + A$: forward substitution, Neumann series, doubling
#
# $L = I + A$ is **unit lower triangular**, and so is its inverse. Three ways to get
# $\mathcal T = L^{-1}$ (calligraphic: $T$ is the sequence length):
#
# * **Forward substitution**, row by row from $L\mathcal T = I$: $\mathcal T_i = e_i - \sum_{j<i} A_{ij} \mathcal T_j$ —
#   $C - 1$ steps, each a (row × block) product.
# * **Neumann series**: $A$ is nilpotent ($A^C = 0$: each power pushes the entries one diagonal
#   further down), so $(I + A)^{-1} = I - A + A^2 - \dots + (-A)^{C-1}$ exactly — $C - 2$ matrix
#   products.
# * **Doubling**: the same series factors as
#   $(I - A)(I + A^2)(I + A^4)\cdots(I + A^{2^{m-1}})$ with $2^m \ge C$ — about $2\log_2 C$ products,
#   all full $C\times C$ matmuls, which is what tensor cores like (chapter 11 builds a block
#   version of this idea).
# * **Joining halves**: split $L = \begin{pmatrix} L_{11} & 0 \\ L_{21} & L_{22}\end{pmatrix}$; then
#   $L^{-1} = \begin{pmatrix} X_{11} & 0 \\ -X_{22} L_{21} X_{11} & X_{22}\end{pmatrix}$ with
#   $X_{11} = L_{11}^{-1}$, $X_{22} = L_{22}^{-1}$ (multiply it out). Start from single tokens and
#   join neighbouring blocks, $1 \to 2 \to 4 \to \dots \to C$: $\log_2 C$ levels, each a batch of
#   small matmuls over all blocks of the level. This is `linattn.chunk.delta.unit_lower_inverse`
#   (inside blocks of 16 it does a level's joins as one product of whole 16×16 blocks, as
#   chapter 11's kernel does in registers).

# %%
def forward_substitution(A):
    """(I + A)⁻¹ row by row: 𝒯_i = e_i − Σ_{j<i} A_ij 𝒯_j; C − 1 steps."""
    C = A.shape[-1]
    rows = [torch.eye(C, dtype=A.dtype)[0]]
    for i in range(1, C):
        rows.append(torch.eye(C, dtype=A.dtype)[i] - A[i, :i] @ torch.stack(rows))
    return torch.stack(rows)


def neumann(A):
    """(I + A)⁻¹ = Σ (−A)^n, n < C; returns (inverse, matrix products used)."""
    C = A.shape[-1]
    term = torch.eye(C, dtype=A.dtype)
    total, products = term.clone(), 0
    for _ in range(1, C):
        term = -term @ A
        products += 1
        total = total + term
    return total, products - 1                       # the first product is −I·A: free


def doubling(A):
    """(I − A)(I + A²)(I + A⁴)… : ⌈log₂ C⌉ factors; returns (inverse, matrix products used)."""
    C = A.shape[-1]
    eye = torch.eye(C, dtype=A.dtype)
    X, P, products = eye - A, A @ A, 1
    span = 2
    while span < C:
        X, products = X @ (eye + P), products + 1
        span *= 2
        if span < C:
            P, products = P @ P, products + 1
    return X, products


exact = torch.linalg.solve_triangular(torch.eye(C, dtype=torch.float64) + A,
                                      torch.eye(C, dtype=torch.float64), upper=False)
levels = math.ceil(math.log2(C))
for name, X, n, unit in [("forward substitution", forward_substitution(A), C - 1, "row steps"),
                         ("Neumann series", *neumann(A), "matrix products"),
                         ("doubling", *doubling(A), "matrix products"),
                         ("joining halves", unit_lower_inverse(A), levels, "levels of joins")]:
    err = testing.rel_err(X, exact)
    print(f"{name:22s} error {err:.1e}   ({n} {unit})")
    assert err < 1e-12

# %% [markdown]
# How the counts grow with the chunk size (the inverse is computed once per chunk, so this is
# independent of the sequence length):

# %%
Cs = [4, 8, 16, 32, 64, 128]
counts = {"Neumann": [], "doubling": []}
for c in Cs:
    Ac = (torch.randn(c, c, dtype=torch.float64) / c).tril(-1)
    counts["Neumann"].append(neumann(Ac)[1])
    counts["doubling"].append(doubling(Ac)[1])
plt.figure(figsize=(6, 3.2))
plt.plot(Cs, [c - 1 for c in Cs], "o-", label="forward substitution: C − 1 sequential row steps")
plt.plot(Cs, counts["Neumann"], "s-", label="Neumann series: C − 2 C×C products")
plt.plot(Cs, counts["doubling"], "^-", label="doubling: ≈ 2 log₂ C C×C products")
plt.plot(Cs, [math.log2(c) for c in Cs], "d-", label="joining halves: log₂ C levels of small products")
plt.xscale("log", base=2); plt.yscale("log"); plt.xticks(Cs, [str(c) for c in Cs]); plt.minorticks_off()
plt.xlabel("chunk size C (tokens)"); plt.ylabel("sequential steps (log scale)")
plt.title("inverting (I + A): steps that must run one after another")
plt.legend(fontsize=8); plt.tight_layout(); plt.show()
assert counts["doubling"][-1] <= 2 * math.ceil(math.log2(Cs[-1]))

# %% [markdown]
# ## 4. The WY representation: $\tilde V = U - WS$
#
# Multiply the boxed system by $\mathcal T = (I + A)^{-1}$:
#
# $$\tilde V = \underbrace{\mathcal T \operatorname{diag}(\beta)\, V}_{U\ [C\times V]}
#   \;-\; \underbrace{\mathcal T \operatorname{diag}(\beta)\,(K \odot e^{G})}_{W\ [C\times K]}\; S .$$
#
# $U$ and $W$ depend only on the chunk's own keys, values, gates and β — **not on $S$**. They can be
# computed for every chunk at once, in parallel, before any state is known; only the cheap
# $\tilde V = U - WS$ waits for the state. (The name comes from numerical linear algebra: a
# product of Householder matrices $H_1 \cdots H_C$ can be written $I - Y^\top W$ with two thin
# matrices — Bischof & Van Loan's WY form; building $W$ by a triangular solve is the "UT
# transform". Chapter 06 showed our transitions are Householder-like.)
#
# Check the separation: $U - WS$ equals the recurrence's residuals for *any* entering state.

# %%
U, W = wy_factors(k, v, g, beta)                                     # the library, one chunk
for trial in range(3):
    S_any = torch.randn(K, V, dtype=torch.float64) * 10 ** trial
    Vt_tokens, _ = chunk_by_tokens(k, v, g, beta, S_any)
    err = testing.rel_err(U - W @ S_any, Vt_tokens)
    print(f"‖S‖ ≈ {S_any.norm():8.1f}: U − W S vs recurrence {err:.1e}")
    assert err < 1e-12

# %% [markdown]
# ## 5. Decays without overflow: gated keys and queries relative to the chunk boundary
#
# The decays enter in three places, and in each we measure them from a point where the exponent
# is $\le 0$:
#
# | quantity | factor | exponent |
# |---|---|---|
# | $W$: keys reading the entering state | $k_i \odot e^{b_i}$ | $b_i \le 0$ (from the chunk start) |
# | $A$, $A_{qk}$: token $j$ seen from token $i \ge j$ | $e^{b_i - b_j}$ inside the dot product | $\le 0$ |
# | state update: keys decayed to the chunk end | $k_i \odot e^{b_C - b_i}$ | $\le 0$ |
# | queries reading the entering state | $q_i \odot e^{b_i}$ | $\le 0$ |
#
# The tempting shortcut for the middle row — Lemma 3 of `seeds/003`,
# $A = (K\odot e^{G})(K\odot e^{-G})^\top$, one matmul — multiplies $e^{b_i}$ by $e^{-b_j}$. With
# log-gates of $-20$ per token, $e^{-b_j}$ overflows float32 after about four tokens ($e^{88}$), and
# $0\cdot\infty$ is NaN. The library forms $e^{b_i - b_j}$ with the difference summed over the
# segment itself (`linattn.decay.pairwise_decay`, masked before `exp`); for one decay per head
# (Gated DeltaNet) it is a $C\times C$ factor on $KK^\top$, a plain matmul again. Chapter 11 shows
# how the Triton kernels keep tensor cores busy despite the $C\times C\times K$ factor for KDA.

# %%
gs = torch.full((C, K), -20.0, dtype=torch.float32)                  # strong gates, float32
kf = k.float()
Gs = gs.cumsum(0)
factorised = ((kf * Gs.exp()) @ (kf * (-Gs).exp()).T).tril(-1)
mask = torch.ones(C, C, dtype=torch.bool).tril(-1)
stable = torch.einsum("ik,ijk,jk->ij", kf, decay.pairwise_decay(gs) * mask[..., None], kf)
print("factorised: finite?", bool(torch.isfinite(factorised).all()),
      "· segment sums: finite?", bool(torch.isfinite(stable).all()))
assert not torch.isfinite(factorised).all() and torch.isfinite(stable).all()

# %% [markdown]
# A subtler trap hides in the third row. $b_C - b_i$ computed as the difference of two prefix sums
# carries the rounding error of $b_C$: with strong gates $b_C \approx -640$ over 64 tokens, where
# float32's spacing is $6\cdot 10^{-5}$, so a late token's $e^{b_C - b_i}$ is off by that much
# *relatively*. Summing the tail $g_{i+1} + \dots + g_C$ directly (`decay.key_decay`) keeps the
# error proportional to the tail itself (the same goes for the pairwise $b_i - b_j$, which
# `decay.pairwise_decay` sums over the segment). The first cell below shows the effect on the key
# factors alone; the second runs a short chunk loop for one head both ways — every decay as a
# difference of prefix sums, or by segment and tail sums — on strong gates ($C = 64$, $T = 256$,
# $K = V = 32$, float32, six seeds) and prints the worst error of the final state against the
# float64 recurrence, next to float32's tolerance of $10^{-5}$.

# %%
gl = testing.log_gates((64, K), "strong", generator=gen)           # float32, down to −20
diff = (gl.cumsum(0)[-1:] - gl.cumsum(0)).exp()                      # e^{G_C − G_i} by subtraction
tail = decay.key_decay(gl)                                           # by tail sums
truth = decay.key_decay(gl.double())
print(f"prefix difference: {testing.rel_err(diff, truth):.1e} · tail sums: {testing.rel_err(tail, truth):.1e}")
assert testing.rel_err(tail, truth) < testing.rel_err(diff, truth)


# %%
def final_state(k, v, g, beta, S, C=64, sums="segment"):
    """Chunked KDA for one head (T a multiple of C), every decay formed one way: the final state."""
    causal, strict = (torch.ones(C, C, dtype=torch.bool).tril(d) for d in (0, -1))
    for n in range(len(k) // C):
        kc, vc, gc, bc = (x[n * C:(n + 1) * C] for x in (k, v, g, beta))
        G = gc.cumsum(0)                                             # [C, K], rows b_i
        if sums == "segment":                                        # segments and tails summed directly
            E, tail = decay.pairwise_decay(gc), decay.key_decay(gc)
        else:                                                        # differences of prefix sums
            E = (G[:, None] - G[None]).masked_fill(~causal[..., None], float("-inf")).exp()
            tail = (G[-1] - G).exp()
        A = bc[:, None] * torch.einsum("ik,ijk,jk->ij", kc, E, kc) * strict
        Vt = torch.linalg.solve_triangular(torch.eye(C) + A, bc[:, None] * (vc - (kc * G.exp()) @ S), upper=False)
        S = G[-1].exp()[:, None] * S + (kc * tail).T @ Vt
    return S


worst = {"prefix differences": 0.0, "segment and tail sums": 0.0}
for seed in range(6):
    a = testing.make_inputs("kda", B=1, T=256, H=1, K=32, V=32, strength="strong", initial_state=True, seed=seed)
    _, S_ref = naive.kda(**testing.to_float64(a), output_final_state=True)
    for how in worst:
        S_fin = final_state(*(a[n][0, :, 0] for n in ("k", "v", "g", "beta")), a["initial_state"][0, 0],
                            sums="prefix" if how.startswith("prefix") else "segment")
        worst[how] = max(worst[how], testing.rel_err(S_fin, S_ref[0, 0]))
for how, e in worst.items():
    print(f"decays by {how:22s} worst final-state error over six seeds: {e:.1e}")
assert worst["prefix differences"] > 10 * worst["segment and tail sums"]

# %% [markdown]
# ## 6. The chunk as an affine map: $S' = MS + B$
#
# The state after the chunk is the decayed entering state plus the writes, each decayed to the
# chunk end (Lemma 1 of the seed: a sum of outer products is $K^\top V$):
#
# $$S' = \operatorname{diag}(e^{b_C})\,S + K_{\text{dec}}^\top \tilde V, \qquad (K_{\text{dec}})_i = k_i\odot e^{b_C - b_i}.$$
#
# Substituting $\tilde V = U - WS$:
#
# $$\boxed{S' = \underbrace{\big(\operatorname{diag}(e^{b_C}) - K_{\text{dec}}^\top W\big)}_{M\ [K\times K]}\,S
#   + \underbrace{K_{\text{dec}}^\top U}_{B\ [K\times V]}}$$
#
# and the outputs of the chunk, with $(A_{qk})_{ij} = \sum_d q_{id}k_{jd}e^{b_{id}-b_{jd}}$ for
# $j \le i$ (diagonal included: token $i$ reads its own write; no `scale` inside — it multiplies
# the outputs),
#
# $$O = \text{scale}\cdot\big((Q\odot e^{G})\,S + A_{qk}\,\tilde V\big)
#     = \underbrace{\text{scale}\,\big(Q\odot e^{G} - A_{qk}W\big)}_{Q^{\text{eff}}}\,S + \underbrace{\text{scale}\,A_{qk}U}_{O_0}.$$
#
# $Q^{\text{eff}}$ ($C\times K$, `maps.P` in the library) are the *effective queries*: what reads the
# entering state once the chunk's own writes are accounted for.
#
# Both the state and the outputs are affine in the entering state. For Gated DeltaNet
# $\operatorname{diag}(e^{b_C})$ is $e^{b_C} I$; for DeltaNet, $I$. Verify with the library's
# per-chunk map against the recurrence started from random states:

# %%
M, Bm = affine.kda_chunk_map(k, v, g, beta)
for trial in range(3):
    S_any = torch.randn(K, V, dtype=torch.float64)
    _, S_end = chunk_by_tokens(k, v, g, beta, S_any)
    err = testing.rel_err(M @ S_any + Bm, S_end)
    print(f"M S + B vs recurrence: {err:.1e}")
    assert err < 1e-12
# the output formula O = Q_eff S + O₀, with Q_eff (maps.P) and O₀ from the library's chunk maps of this one chunk
q = torch.randn(C, K, generator=gen, dtype=torch.float64)
one = lambda x: x[None, :, None]                                     # [C, …] → [1, C, 1, …]
maps, _ = affine.chunk_maps("kda", one(q), one(k), one(v), one(g), beta[None, :, None], chunk_size=C)
S_any = torch.randn(K, V, dtype=torch.float64)
o_tok, _ = naive.kda(one(q), one(k), one(v), one(g), beta[None, :, None], initial_state=S_any[None, None])
err = testing.rel_err(maps.P[0, 0, 0] @ S_any + maps.O0[0, 0, 0], o_tok[0, :, 0])
print(f"O = Q_eff S + O₀ vs recurrence outputs: {err:.1e}")
assert err < 1e-12

# %% [markdown]
# **The chunk never amplifies the state.** $M$ is the product of the chunk's token maps
# $(I - \beta_i k_i^\top k_i)D_i$, so $\lVert M\rVert_2 \le \prod_i \lVert I - \beta_i k_i^\top k_i\rVert_2\,
# \lVert D_i\rVert_2 \le 1$: each first factor is symmetric with eigenvalues $1$ and
# $1 - \beta_i\lVert k_i\rVert^2 \in [-1, 1]$ when $\beta_i\lVert k_i\rVert^2 \le 2$, and each decay is
# at most 1. The spectral radius $\rho(M)$ would not do as the argument: $M$ is not a normal
# matrix, and for such a matrix $\rho$ bounds how $M^n$ behaves for large $n$, not the gain of one
# application, which can be far larger (the $2\times2$ example below).

# %%
rho, norm = torch.linalg.eigvals(M).abs().max().item(), torch.linalg.matrix_norm(M, 2).item()
print(f"this chunk's M: spectral radius {rho:.2f}, largest gain ‖M‖₂ = {norm:.2f}")
assert rho <= norm + 1e-12 and norm <= 1 + 1e-9
J = torch.tensor([[0.5, 10.0], [0.0, 0.5]], dtype=torch.float64)   # not normal: ρ says nothing about one step
print(f"a 2×2 example: spectral radius {torch.linalg.eigvals(J).abs().max().item():.2f}, "
      f"‖J‖₂ = {torch.linalg.matrix_norm(J, 2).item():.1f}")

# %% [markdown]
# ## 7. Chunkwise KDA, many chunks at once
#
# `linattn.chunk.kda` (and `chunk.delta_rule`, the same code with $G = 0$) does exactly this:
#
# 1. pad $T$ to whole chunks with identity tokens ($k = v = q = 0$, $\beta = 0$, $g = 0$: no write, no
#    decay), reshape to `[B, H, N, C, …]`;
# 2. for **many chunks in parallel**: $A$, $\mathcal T = (I + A)^{-1}$, $Q\odot e^G$, $A_{qk}$,
#    $K_{\text{dec}}$, $e^{b_C}$;
# 3. one sequential pass over those chunks: $\tilde V = \mathcal T\operatorname{diag}(\beta)\big(V - (K\odot e^G)S\big)$,
#    $O = \text{scale}((Q\odot e^G)S + A_{qk}\tilde V)$, $S \leftarrow e^{b_C}\odot S + K_{\text{dec}}^\top\tilde V$.
#
# Step 3 solves the boxed system with the chunk's $\mathcal T$ directly. That is $U - WS$ multiplied out:
# two products per chunk with $C$ rows ($(K\odot e^G)S$, then $\mathcal T$ times the result) where
# $U$, $W$ and $WS$ take three. The backward needs $U$ and $W$ themselves (chapter 12), so the
# forward that feeds it forms them (`linattn.chunk.delta.factors`); the plain forward does not.
# $\mathcal T$ comes from a triangular solve against $I$ (`linattn.chunk.delta.solve_unit_lower`:
# forward substitution in compiled LAPACK code): on a CPU one such call is faster than joining
# halves in a few dozen small PyTorch operations, although both do the same arithmetic.
#
# Only step 3 is sequential, and it is $N = T/C$ steps of small matmuls. Nothing in step 2 depends
# on another chunk, so the chunks may be taken in any batches: the library takes them in groups
# of a few hundred KB per tensor (`linattn.decay.group_size`: 8 chunks at $B = 1$, $H = 4$,
# $C = K = V = 64$) and hands the state from one group to the next, because on a CPU a group's
# matmuls and elementwise passes then run from the cache (a GPU takes all chunks at once).
#
# The decays in step 2 take a shortcut where it is safe: if every chunk of a group decays by less
# than $e^{60}$ in every key dimension — true of every measured chunk of GLA-style gates
# (temperature 16), but not of a large share of KDA's own gates as initialised (chapter 10 §3b) —
# $e^{b_i - b_j} = e^{b_i}\cdot e^{-b_j}$ with both factors inside float32's range, so $A$ and
# $A_{qk}$ are plain matmuls of $K\odot e^{G}$ or $Q\odot e^{G}$ with $K\odot e^{-G}$. Chapter 11
# builds its kernel on the same split and measures its cost in precision; stronger gates take
# §5's route, every exponent $\le 0$. The check below runs both (the strong row past the bound).
# Check against the float64 recurrence, for KDA, Gated DeltaNet, strong decays and bfloat16:

# %%
T_ = pick(cpu=300, gpu=4096)
rows = []
for gate, strength, dtype in [("per_dim", "normal", torch.float32), ("per_head", "normal", torch.float32),
                              ("per_dim", "strong", torch.float32), ("per_dim", "normal", torch.bfloat16)]:
    a = testing.make_inputs("kda", B=1, T=T_, H=2, K=32, V=32, dtype=dtype, gate=gate,
                            strength=strength, initial_state=True, seed=8)
    o_ref, S_ref = naive.kda(**testing.to_float64(a), output_final_state=True)
    o, S_fin = chunk.kda(**a, output_final_state=True, chunk_size=64)
    eo, es = testing.rel_err(o, o_ref), testing.rel_err(S_fin, S_ref)
    rows.append((gate, strength, str(dtype)[6:], eo, es))
    assert eo <= testing.tolerance(dtype) and es <= testing.tolerance(torch.float32)
for r in rows:
    print("{:9s} {:7s} {:9s} outputs {:.1e}  final state {:.1e}".format(*r))

# %% [markdown]
# The structure of one chunk's matrices, for intuition: $A$ is strictly lower triangular and
# decays away from the diagonal (strongly gated tokens forget their neighbours); its inverse
# $\mathcal T$ is unit lower triangular and mixes the whole past of the chunk.

# %%
fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
for ax, (name, Mx) in zip(axes, [("A (strictly lower)", A), ("𝒯 = (I + A)⁻¹", unit_lower_inverse(A)),
                                 ("M = diag(e^{b_C}) − K_decᵀ W", M)]):
    im = ax.imshow(Mx, cmap="RdBu", vmin=-1, vmax=1)
    ax.set_title(name)
plt.colorbar(im, ax=axes, shrink=0.8); plt.show()

# %% [markdown]
# **Through the dispatcher.** On this machine `linattn.kda` runs the chunkwise level (Triton on a
# GPU, chapter 11); a reader who passed `ch07.chunk_kda` can route it through their own code with
# `linattn.set_impl("kda", "mine")`.

# %%
a = testing.make_inputs("kda", B=1, T=pick(cpu=200, gpu=4096), H=2, K=32, V=32, seed=9)
o, _ = linattn.kda(**a)
print(linattn.which("kda"), "· error vs float64:",
      f"{testing.rel_err(o, naive.kda(**testing.to_float64(a))[0]):.1e}")

# %% [markdown]
# ## Summary
#
# * Inside a chunk the β-weighted residuals solve $(I + A)\tilde V = \operatorname{diag}(\beta)(V - (K\odot e^G)S)$
#   with $A$ strictly lower triangular, $A_{ij} = \beta_i\sum_d k_{id}k_{jd}e^{b_{id}-b_{jd}}$.
# * $(I + A)^{-1}$: forward substitution ($C-1$ row steps), Neumann series ($C-2$ products) or
#   doubling ($\approx 2\log_2 C$ products); all exact because $A$ is nilpotent.
# * WY: $\tilde V = U - WS$ with $U, W$ independent of the state — computed for all chunks in
#   parallel.
# * A chunk is an affine map: $S' = MS + B$, $O = Q^{\text{eff}}S + O_0$. Chapter 08 composes these maps,
#   scans them in parallel and spreads a sequence over several processes.
# * Every exponential is of a sum $\le 0$ measured from a chunk boundary or between two tokens
#   in causal order; sums over segments and tails are taken directly, not as differences.
#
# **Workbook:** `exercises/07_wy_kda.py` — the triangular inverse, $U$ and $W$, the chunk map
# $(M, B)$, and chunkwise KDA (unlocks `linattn.set_impl("kda", "mine")` at the chunk level).
