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
