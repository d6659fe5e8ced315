"""Chapter 07 — the WY representation: triangular inverse, U and W, the chunk as an affine map,
and chunkwise KDA.

The per-chunk exercises are graded against float64 ground truths computed another way: the
inverse by torch.linalg.solve_triangular, and U, W, M, B by running the token recurrence on
well-chosen entering states (U: the residuals from S = 0; W: minus those from S = I with v = 0;
M: the final state from S = I with v = 0; B: the final state from S = 0).
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from ... import affine, chunk, naive, testing
from ...chunk.delta import unit_lower_inverse, wy_factors
from ..cases import op_cases
from ..exercise import Case, Exercise


def solve_inverse(A):
    eye = torch.eye(A.shape[-1], dtype=A.dtype).expand(A.shape)
    return torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)


def chunk_recurrence(k, v, g, beta, S):
    """Token loop over one chunk from state S: the β-weighted residuals [.., C, V] and the end state."""
    res = []
    for i in range(k.shape[-2]):
        S = g[..., i, :, None].exp() * S                              # decay first
        r = beta[..., i, None] * (v[..., i, :] - (k[..., i, None, :] @ S)[..., 0, :])
        S = S + k[..., i, :, None] * r[..., None, :]
        res.append(r)
    return torch.stack(res, -2), S


def probe_states(k):
    """S = 0 and S = I (K×K), in k's dtype and leading dims."""
    K = k.shape[-1]
    lead = k.shape[:-2]
    zero = torch.zeros(lead + (K, K), dtype=k.dtype)
    return zero, torch.eye(K, dtype=k.dtype).expand(lead + (K, K)).clone()


def wy_truth(k, v, g, beta):
    zero, eye = probe_states(k)
    U, _ = chunk_recurrence(k, v, g, beta, torch.zeros(k.shape[:-2] + (k.shape[-1], v.shape[-1]),
                                                       dtype=k.dtype))
    minus_W, _ = chunk_recurrence(k, torch.zeros_like(k), g, beta, eye)
    return U, -minus_W


def map_truth(k, v, g, beta):
    _, eye = probe_states(k)
    _, M = chunk_recurrence(k, torch.zeros_like(k), g, beta, eye)
    _, B = chunk_recurrence(k, v, g, beta, torch.zeros(k.shape[:-2] + (k.shape[-1], v.shape[-1]),
                                                       dtype=k.dtype))
    return M, B


# (C, K, V, strength, dtype)
_CHUNKS = [(1, 4, 3, "normal", torch.float32), (5, 8, 6, "weak", torch.float32),
           (16, 16, 8, "normal", torch.float32), (16, 8, 8, "strong", torch.float64),
           (32, 16, 24, "normal", torch.float32)]


def chunk_cases(seed, with_v=True):
    rng = random.Random(seed)
    cases = []
    for i, (C, K, V, strength, dtype) in enumerate(_CHUNKS):
        gen = torch.Generator().manual_seed(seed * 131 + i)
        lead = (2, rng.randint(1, 3))                                  # [B, H]
        k = F.normalize(torch.randn(lead + (C, K), generator=gen), dim=-1).to(dtype)
        v = torch.randn(lead + (C, V), generator=gen).to(dtype)
        g = testing.log_gates(lead + (C, K), strength, generator=gen).to(dtype)
        beta = torch.rand(lead + (C,), generator=gen).to(dtype)
        note = f"[B,H]={list(lead)} C={C} K={K} V={V} {str(dtype).replace('torch.', '')}, {strength} gates"
        cases.append(Case(args=(k, v, g, beta), note=note))
    return cases


def inverse_cases(seed):
    cases = []
    for i, (C, dtype) in enumerate([(1, torch.float32), (4, torch.float32), (16, torch.float32),
                                    (64, torch.float32), (33, torch.float64)]):
        gen = torch.Generator().manual_seed(seed * 17 + i)
        # entries of the size the delta rule produces: β_i k_i·k_j with unit keys, β < 1
        A = (torch.randn(3, C, C, generator=gen) / max(C, 1) ** 0.5).tril(-1).to(dtype)
        cases.append(Case(args=(A,), note=f"C={C} {str(dtype).replace('torch.', '')}"))
    return cases


EXERCISES = [
    Exercise(
        name="ch07.unit_lower_inverse",
        chapter=7,
        title="(I + A)⁻¹ for strictly lower-triangular A, by forward substitution",
        signature="unit_lower_inverse(A) -> X   # A [..., C, C] strictly lower; X = (I + A)^-1",
        reference=unit_lower_inverse,
        truth=solve_inverse,
        cases=inverse_cases,
        outputs=("X",),
        hint="row i of X is e_i − Σ_{j<i} A_ij X_j; build the rows top to bottom.",
    ),
    Exercise(
        name="ch07.wy_factors",
        chapter=7,
        title="The WY factors U and W of one chunk",
        signature="wy_factors(k, v, g, beta) -> (U, W)   # k [..,C,K], v [..,C,V], g [..,C,K], beta [..,C]",
        reference=wy_factors,
        truth=wy_truth,
        cases=chunk_cases,
        outputs=("U", "W"),
        hint="A_ij = β_i Σ_d k_id k_jd e^{G_id − G_jd} for i > j only (strictly lower); "
             "U = (I + A)⁻¹ diag(β) V, W = (I + A)⁻¹ diag(β) (K ⊙ e^G), G the cumulative gates.",
    ),
    Exercise(
        name="ch07.chunk_map",
        chapter=7,
        title="One KDA chunk as an affine map S' = M S + B",
        signature="kda_chunk_map(k, v, g, beta) -> (M, B)   # M [..,K,K], B [..,K,V]",
        reference=affine.kda_chunk_map,
        truth=map_truth,
        cases=chunk_cases,
        outputs=("M", "B"),
        hint="M = diag(e^{G_C}) − (K ⊙ e^{G_C − G})ᵀ W and B = (K ⊙ e^{G_C − G})ᵀ U; W carries "
             "the keys decayed *before* the residual, K ⊙ e^{G}.",
    ),
    Exercise(
        name="ch07.chunk_kda",
        chapter=7,
        title="Chunkwise KDA / Gated DeltaNet with the WY representation",
        signature="chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, "
                  "output_final_state=False, chunk_size=64) -> (o, final_state)",
        reference=chunk.kda,
        truth=naive.kda,
        cases=lambda seed: op_cases("kda", seed, chunk_size=16),
        unlocks=("kda", "chunk"),
        outputs=("o", "final_state"),
        hint="per chunk: Ṽ = U − W S, O = scale((Q ⊙ e^G) S + tril(A_qk) Ṽ), "
             "S' = diag(e^{G_C}) S + (K ⊙ e^{G_C − G})ᵀ Ṽ; keep the last partial chunk.",
    ),
]
