"""Chapter 11 — the delta rule in Triton: (I + A)⁻¹ of one chunk, its WY factors U and W, and the
whole KDA forward kernel.

Per-chunk exercises take N chunks laid out [N, C, …] and are graded against float64 truths
computed another way (chapter 07's: torch.linalg.solve_triangular for the inverse, the token
recurrence for U and W). Their references are the kernels below (the library's kernels work on
[B, T, H, C] layouts inside a longer pipeline); the whole kernel's reference is linattn.triton.kda.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ... import chunk, naive, outputs, testing
from ... import triton as lt
from ..cases import op_cases
from ..exercise import Case, Exercise
from .ch07 import solve_inverse, wy_truth


def _block(n):
    return max(16, triton.next_power_of_2(n))


# ---------------------------------------------------------------- ch11.unit_lower_inverse
@triton.jit
def _inverse_tile(a, C, BC: tl.constexpr):
    r = tl.arange(0, BC)
    X = (r[:, None] == r[None, :]).to(tl.float32)                        # [BC, BC]: I
    for i in range(1, C):
        a_i = tl.load(a + i * C + r, mask=r < i, other=0.0).to(tl.float32)  # [BC]: A_ij, j < i
        x_i = tl.where(r == i, 1.0, 0.0) - tl.sum(a_i[:, None] * X, axis=0)  # rows j < i are final
        X = tl.where(r[:, None] == i, x_i[None, :], X)
    return X


@triton.jit
def _inverse_kernel(a, x, C, BC: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    X = _inverse_tile(a + n * C * C, C, BC)
    r = tl.arange(0, BC)
    tl.store(x + n * C * C + r[:, None] * C + r[None, :], X, mask=(r[:, None] < C) & (r[None, :] < C))


def unit_lower_inverse(A):
    N, C, _ = A.shape
    X = outputs.empty((N, C, C), dtype=torch.float32, device=A.device)
    _inverse_kernel[(N,)](A, X, C, BC=_block(C))
    return X


def forward_substitution(A):
    """X = (I + A)⁻¹ for strictly lower-triangular A [N, C, C], row by row from (I + A) X = I:
    x_i = e_i − Σ_{j<i} A_ij x_j, so rows j < i are final when row i needs them. float32."""
    N, C, _ = A.shape
    X = torch.eye(C, dtype=torch.float32, device=A.device).repeat(N, 1, 1)     # [N, C, C]
    for i in range(1, C):
        X[:, i] -= (A[:, i, :i, None].float() * X[:, :i]).sum(1)            # Σ_j A_ij x_j
    return X


def inverse_cases(seed):
    cases = []
    for i, C in enumerate((1, 5, 16, 33, 64)):
        gen = torch.Generator().manual_seed(seed * 23 + i)
        N = 1 + (seed + i) % 3
        # entries of the size the delta rule produces: β_i k_i·k_j with unit keys, β < 1
        A = (torch.randn(N, C, C, generator=gen) / max(C, 1) ** 0.5).tril(-1)
        cases.append(Case(args=(A,), note=f"N={N} C={C} float32"))
    return cases


INVERSE_MISTAKES = (
    ("return the transpose of (I + A)⁻¹ (rows and columns swapped: X is lower triangular, "
     "row i built from the rows above it)", lambda A: solve_inverse(A.float()).transpose(-1, -2)),
    ("invert I − A instead of I + A (a sign in X_i = e_i − Σ A_ij X_j)", lambda A: solve_inverse(-A.float())),
    ("stop after one step, I − A (the first-order approximation): substitute row after row, "
     "each using the finished rows above", lambda A: torch.eye(A.shape[-1]) - A.float()),
)


# ---------------------------------------------------------------- ch11.wy_factors
@triton.jit
def _wy_kernel(k, v, g, beta, u, w, C, K, V, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    t, dk, dv = tl.arange(0, BC), tl.arange(0, BK), tl.arange(0, BV)
    mk = (t[:, None] < C) & (dk[None, :] < K)
    mv = (t[:, None] < C) & (dv[None, :] < V)
    Kc = tl.load(k + n * C * K + t[:, None] * K + dk[None, :], mask=mk, other=0.0).to(tl.float32)
    Vc = tl.load(v + n * C * V + t[:, None] * V + dv[None, :], mask=mv, other=0.0).to(tl.float32)
    G = tl.cumsum(tl.load(g + n * C * K + t[:, None] * K + dk[None, :], mask=mk, other=0.0)
                  .to(tl.float32), axis=0)                               # [BC, BK] cumulative
    bt = tl.load(beta + n * C + t, mask=t < C, other=0.0).to(tl.float32)  # [BC]
    strict = t[:, None] > t[None, :]
    diff = tl.where(strict[:, :, None], G[:, None, :] - G[None, :, :], float("-inf"))
    A = bt[:, None] * tl.sum(Kc[:, None, :] * Kc[None, :, :] * tl.exp(diff), axis=2)  # [BC, BC]
    # X = (I + A)⁻¹ by forward substitution on the tile (A lives in registers here)
    X = (t[:, None] == t[None, :]).to(tl.float32)
    for i in range(1, C):
        a_i = tl.sum(tl.where(t[:, None] == i, A, 0.0), axis=0)         # row i of A
        x_i = tl.where(t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * X, axis=0)
        X = tl.where(t[:, None] == i, x_i[None, :], X)
    U = tl.dot(X, bt[:, None] * Vc, input_precision="ieee")             # [BC, BV]
    W = tl.dot(X, bt[:, None] * Kc * tl.exp(G), input_precision="ieee")  # [BC, BK]
    tl.store(u + n * C * V + t[:, None] * V + dv[None, :], U, mask=mv)
    tl.store(w + n * C * K + t[:, None] * K + dk[None, :], W, mask=mk)


def wy_factors(k, v, g, beta):
    N, C, K = k.shape
    V = v.shape[-1]
    U = outputs.empty((N, C, V), dtype=torch.float32, device=k.device)
    W = outputs.empty((N, C, K), dtype=torch.float32, device=k.device)
    _wy_kernel[(N,)](k, v, g, beta, U, W, C, K, V, BC=_block(C), BK=_block(K), BV=_block(V))
    return U, W


def _wy_variant(diagonal=False, beta_on_columns=False, transposed=False):
    def mistake(k, v, g, beta):
        k, v, g, beta = k.float(), v.float(), g.float(), beta.float()
        C = k.shape[-2]
        G = g.cumsum(-2)
        keep = torch.ones(C, C, dtype=torch.bool).tril(0 if diagonal else -1)
        diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~keep[..., None], float("-inf"))
        S = torch.einsum("...ik,...jk,...ijk->...ij", k, k, diff.exp())
        A = S * (beta[..., None, :] if beta_on_columns else beta[..., :, None])
        if diagonal:  # forward substitution (rows 1…C−1) run on A with its diagonal: A_ii e_i too
            X = torch.eye(C).expand(A.shape).clone()
            for i in range(1, C):
                X[..., i, :] = X[..., i, :] - (A[..., i:i + 1, :] @ X)[..., 0, :]
        else:
            X = solve_inverse(A)
        if transposed:
            X = X.transpose(-1, -2)
        b = beta[..., None]
        return X @ (b * v), X @ (b * k * G.exp())
    return mistake


WY_MISTAKES = (
    ("keep the diagonal in A (A_ii = β_i k_i·k_i): A is strictly lower triangular — a token's "
     "own write comes after its residual", _wy_variant(diagonal=True)),
    ("put β_j on column j instead of β_i on row i of A", _wy_variant(beta_on_columns=True)),
    ("use the transpose of (I + A)⁻¹", _wy_variant(transposed=True)),
)

# (N, C, K, V, dtype, strength)
_WY = [(2, 16, 16, 16, torch.float32, "normal"), (1, 13, 24, 16, torch.float32, "strong"),
       (2, 32, 16, 24, torch.bfloat16, "normal"), (1, 5, 16, 16, torch.float32, "weak")]


def wy_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (N, C, K, V, dtype, strength) in enumerate(_WY):
        gen = torch.Generator().manual_seed(seed * 29 + i)
        N += rng.randint(0, 1)
        k = F.normalize(torch.randn(N, C, K, generator=gen), dim=-1).to(dtype)
        v = torch.randn(N, C, V, generator=gen).to(dtype)
        g = testing.log_gates((N, C, K), strength, generator=gen)        # float32 raw log-gates
        beta = torch.rand(N, C, generator=gen).to(dtype)
        note = f"N={N} C={C} K={K} V={V} {str(dtype).replace('torch.', '')}, {strength} gates"
        cases.append(Case(args=(k, v, g, beta), note=note, dtype=torch.float32))
    return cases


# ---------------------------------------------------------------- ch11.kda
KERNEL_SHAPES = [
    (1, 37, 2, 16, 16, torch.float32, "per_dim", "normal", False),
    (2, 40, 1, 32, 24, torch.float32, "per_dim", "strong", True),
    (1, 35, 2, 16, 32, torch.bfloat16, "per_dim", "normal", True),
    (1, 9, 1, 16, 16, torch.float32, "per_head", "normal", True),
]


def kda_kernel_cases(seed):
    cases = op_cases("kda", seed, chunk_size=16, shapes=KERNEL_SHAPES)
    cases[0].kwargs["output_final_state"] = False
    cases[0].note += ", output_final_state=False"
    cases[1].kwargs["scale"] = 1.0
    cases[1].note += ", scale=1.0"
    return cases


def _kda_dropped_tail(q, k, v, g, beta, *, scale=None, initial_state=None,
                      output_final_state=False, chunk_size=16, **_):
    T = q.shape[1]
    full = T - T % chunk_size
    o = torch.full(v.shape, float("nan"), dtype=v.dtype)
    B, _, H, K = q.shape
    S = initial_state.float() if initial_state is not None else torch.zeros(B, H, K, v.shape[3])
    if full:
        o[:, :full], S = naive.kda(q[:, :full].float(), k[:, :full].float(), v[:, :full].float(),
                                   g[:, :full].float(), beta[:, :full].float(), scale=scale,
                                   initial_state=S, output_final_state=True)
    return o, (S if output_final_state else None)


KDA_MISTAKES = (
    ("drop the last partial chunk (loop over T // C chunks instead of cdiv(T, C))", _kda_dropped_tail),
)

EXERCISES = [
    Exercise(
        name="ch11.unit_lower_inverse",
        chapter=11,
        on_gpu=True,
        title="(I + A)⁻¹ of one chunk in a kernel, by forward substitution",
        signature="unit_lower_inverse(A) -> X   # A [N, C, C] strictly lower, float32; X float32",
        reference=unit_lower_inverse,
        truth=solve_inverse,
        spec=forward_substitution,
        cases=inverse_cases,
        outputs=("X",),
        hint="start from X = I (a [BC, BC] tile); for i in range(1, C): load row i of A (columns "
             "j < i), x_i = e_i − Σ_j A_ij X_j (tl.sum(a_i[:, None] * X, axis=0)), put it in row i "
             "with tl.where(r[:, None] == i, x_i[None, :], X).",
        diagnoses=INVERSE_MISTAKES,
    ),
    Exercise(
        name="ch11.wy_factors",
        chapter=11,
        on_gpu=True,
        title="The WY factors U and W of one chunk in a kernel",
        signature="wy_factors(k, v, g, beta) -> (U, W)   # k [N,C,K], v [N,C,V], g [N,C,K] raw "
                  "log-gates, beta [N,C]; U [N,C,V], W [N,C,K] float32",
        reference=wy_factors,
        truth=wy_truth,
        spec=chunk.delta.wy_factors,
        cases=wy_cases,
        outputs=("U", "W"),
        hint="G = tl.cumsum(g, axis=0); A_ij = β_i Σ_k k_ik k_jk e^{G_ik − G_jk} for i > j only "
             "(exponent masked before exp); X = (I + A)⁻¹ as in exercise 1; U = X (β V), "
             "W = X (β K ⊙ e^G), all float32.",
        diagnoses=WY_MISTAKES,
    ),
    Exercise(
        name="ch11.kda",
        chapter=11,
        on_gpu=True,
        title="The KDA forward kernel",
        signature="kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, "
                  "chunk_size=16) -> (o, final_state)   # g [B,T,H,K] or [B,T,H], beta [B,T,H]",
        reference=lt.kda,
        truth=naive.kda,
        spec=chunk.kda,
        cases=kda_kernel_cases,
        unlocks=("kda", "triton"),
        outputs=("o", "final_state"),
        hint="per chunk: U, W as in exercise 2; Ṽ = U − W S; O = scale·((Q ⊙ e^G) S + Aqk Ṽ) with "
             "(Aqk)_ij = Σ_k q_ik k_jk e^{G_ik − G_jk} for j ≤ i; S ← diag(e^{G_last}) S + "
             "(K ⊙ e^{G_last − G})ᵀ Ṽ; rows past T: k = v = β = g = 0 (identity tokens).",
        diagnoses=KDA_MISTAKES,
    ),
]
