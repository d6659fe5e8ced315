"""Chapter 08 — affine maps: composition and the parallel prefix scan."""
from __future__ import annotations

import random

import torch

from ... import affine
from ..exercise import Case, Exercise


def compose(M2, B2, M1, B1):
    """The map 'first (M1, B1), then (M2, B2)'."""
    return affine.compose((M2, B2), (M1, B1))


def prefix_scan(M, B):
    """Inclusive prefix maps along axis 2 ([B, H, N, ...]) by the library's Hillis–Steele scan."""
    M_pre, B_pre, _ = affine.prefix_scan(M, B)
    return M_pre, B_pre


def sequential_prefix(M, B):
    """Ground truth: compose the maps one after the other."""
    Ms, Bs = [M[:, :, 0]], [B[:, :, 0]]
    for n in range(1, M.shape[2]):
        m, b = affine.compose((M[:, :, n], B[:, :, n]), (Ms[-1], Bs[-1]))
        Ms.append(m)
        Bs.append(b)
    return torch.stack(Ms, 2), torch.stack(Bs, 2)


def _maps(gen, lead, K, V, dtype):
    M = (torch.randn(lead + (K, K), generator=gen) / K ** 0.5).to(dtype)
    B = torch.randn(lead + (K, V), generator=gen).to(dtype)
    return M, B


def compose_cases(seed):
    cases = []
    for i, (K, V, dtype) in enumerate([(3, 2, torch.float32), (8, 5, torch.float32),
                                       (16, 16, torch.float64)]):
        gen = torch.Generator().manual_seed(seed * 7 + i)
        (M2, B2), (M1, B1) = _maps(gen, (2, 2), K, V, dtype), _maps(gen, (2, 2), K, V, dtype)
        cases.append(Case(args=(M2, B2, M1, B1), note=f"K={K} V={V} {str(dtype).replace('torch.', '')}"))
    return cases


def scan_cases(seed):
    rng = random.Random(seed)
    cases = []
    # one short, one middling, one long scan: N = 1 or 2 tests the edges, N ≥ 5 needs 3+ rounds
    for i, (K, V, dtype, lengths) in enumerate([(4, 3, torch.float32, (1, 2)),
                                                (8, 8, torch.float32, (5, 7, 8)),
                                                (6, 10, torch.float64, (11, 13, 16))]):
        N = rng.choice(lengths)
        gen = torch.Generator().manual_seed(seed * 11 + i)
        M, B = _maps(gen, (2, 1, N), K, V, dtype)
        cases.append(Case(args=(M, B), note=f"N={N} maps, K={K} V={V} {str(dtype).replace('torch.', '')}"))
    return cases


EXERCISES = [
    Exercise(
        name="ch08.compose",
        chapter=8,
        title="Composing two affine maps",
        signature="compose(M2, B2, M1, B1) -> (M, B)   # apply (M1, B1) first, then (M2, B2)",
        reference=compose,
        cases=compose_cases,
        outputs=("M", "B"),
        hint="M2 (M1 S + B1) + B2 = (M2 M1) S + (M2 B1 + B2); matrix products do not commute.",
    ),
    Exercise(
        name="ch08.prefix_scan",
        chapter=8,
        title="All prefix maps with a parallel (log-depth) scan",
        signature="prefix_scan(M, B) -> (M_pre, B_pre)   # M [B,H,N,K,K], B [B,H,N,K,V]; "
                  "position n holds maps 0..n composed",
        reference=prefix_scan,
        truth=sequential_prefix,
        cases=scan_cases,
        outputs=("M_pre", "B_pre"),
        hint="inclusive: position 0 is map 0 itself; in round r combine n with n − 2^r as "
             "'earlier first, then later'.",
    ),
]


# ---------------------------------------------------------------- RWKV-7: the reader's own map
#
# RWKV-7 (seeds/004 writes it right-multiplied on a V×K state) updates, in the book's convention
# (state K×V, transitions on the left),
#     S_t = diag(w_t) S_{t-1} − (a_t ⊙ κ̂_t)ᵀ (κ̂_t S_{t-1}) + k_tᵀ v_t :
# it reads the state at κ̂_t and removes what it read along a_t ⊙ κ̂_t. The grader's truth does
# not use a formula for M_t: it runs this token step on probe states and reads the map off.

def rwkv7_step(S, w, kappa_hat, a, k, v):
    """One token of the RWKV-7 recurrence: S [..., K, n] → [..., K, n] (v [..., n]: the write)."""
    read = torch.einsum("...k,...kn->...n", kappa_hat, S)               # κ̂_t S, [..., n]
    return (w[..., :, None] * S - (a * kappa_hat)[..., :, None] * read[..., None, :]
            + k[..., :, None] * v[..., None, :])


def rwkv7_loop(w, kappa_hat, a, k, v, initial_state):
    """Every state of the token loop: [B, H, T, K, V] (state after token t at position t)."""
    S, states = initial_state, []
    for t in range(w.shape[2]):
        S = rwkv7_step(S, w[:, :, t], kappa_hat[:, :, t], a[:, :, t], k[:, :, t], v[:, :, t])
        states.append(S)
    return torch.stack(states, 2)


def rwkv7_maps(w, kappa_hat, a, k, v):
    """Per-token maps (M_t, B_t) with S_t = M_t S_{t-1} + B_t:
    M_t = diag(w_t) − (a_t ⊙ κ̂_t)ᵀ κ̂_t — the transpose of seeds/004's A_t — and B_t = k_tᵀ v_t."""
    M = torch.diag_embed(w) - (a * kappa_hat)[..., :, None] * kappa_hat[..., None, :]   # [B, H, T, K, K]
    return M, k[..., :, None] * v[..., None, :]                                        # [B, H, T, K, V]


def rwkv7_probed(w, kappa_hat, a, k, v):
    """Ground truth: B_t = step(0); column j of M_t = step(e_j) − B_t, with e_j the K×1 state
    that is 1 in row j (one probe per column, all at once as a K×K state with no write)."""
    K = w.shape[-1]
    no_write = torch.zeros(w.shape[:-1] + (K,), dtype=w.dtype)
    eye = torch.eye(K, dtype=w.dtype).expand(w.shape + (K,))
    B = rwkv7_step(torch.zeros(k.shape + (v.shape[-1],), dtype=w.dtype), w, kappa_hat, a, k, v)
    M = rwkv7_step(eye, w, kappa_hat, a, torch.zeros_like(k), no_write)
    return M, B


def rwkv7_maps_untransposed(w, kappa_hat, a, k, v):
    """The mistake: seeds/004's A_t = diag(w_t) − κ̂_tᵀ (a_t ⊙ κ̂_t) taken over as M_t."""
    M = torch.diag_embed(w) - kappa_hat[..., :, None] * (a * kappa_hat)[..., None, :]
    return M, k[..., :, None] * v[..., None, :]


def rwkv7_inputs(gen, B, H, T, K, V, dtype):
    """RWKV-7-like inputs: decays w ∈ (0.5, 1), unit κ̂, in-context rates a ∈ (0, 1)."""
    def rand(*shape):
        return torch.rand(shape, generator=gen, dtype=torch.float64)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    w = 0.5 + 0.5 * rand(B, H, T, K)
    kappa_hat = torch.nn.functional.normalize(randn(B, H, T, K), dim=-1)
    a = rand(B, H, T, K)
    k, v = randn(B, H, T, K) / K ** 0.5, randn(B, H, T, V)
    return tuple(x.to(dtype) for x in (w, kappa_hat, a, k, v))


def rwkv7_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (K, V, dtype) in enumerate([(4, 3, torch.float32), (8, 5, torch.float32),
                                       (16, 8, torch.float64)]):
        T = rng.choice((1, 3, 7, 12))
        gen = torch.Generator().manual_seed(seed * 13 + i)
        cases.append(Case(args=rwkv7_inputs(gen, 2, 2, T, K, V, dtype),
                          note=f"T={T} K={K} V={V} {str(dtype).replace('torch.', '')}"))
    return cases


EXERCISES.append(
    Exercise(
        name="ch08.rwkv7_maps",
        chapter=8,
        title="RWKV-7's per-token maps in the book's convention",
        signature="rwkv7_maps(w, kappa_hat, a, k, v) -> (M, B)   # inputs [B,H,T,K] (v [B,H,T,V]); "
                  "M [B,H,T,K,K], B [B,H,T,K,V]; S_t = M_t S_{t-1} + B_t",
        reference=rwkv7_maps,
        truth=rwkv7_probed,
        cases=rwkv7_cases,
        outputs=("M", "B"),
        hint="the state is read at κ̂_t (the row vector that multiplies S) and corrected along "
             "a_t ⊙ κ̂_t; seeds/004's A_t acts on the right of a V×K state, ours is its transpose.",
        diagnoses=(("take seeds/004's A_t = diag(w_t) − κ̂_tᵀ(a_t ⊙ κ̂_t) as M_t without transposing "
                    "it (in the book's convention M_t = diag(w_t) − (a_t ⊙ κ̂_t)ᵀ κ̂_t)",
                    rwkv7_maps_untransposed),),
    )
)
