"""Chapter 05 — secondary chunking: the intra-chunk matrix of GLA built from c × c tiles."""
from __future__ import annotations

import random

import torch

from ... import testing
from ...chunk.gated import intra_chunk_matrix
from ...naive.gated import attention_matrix
from ..exercise import Case, Exercise


def intra_cases(seed):
    """q, k [B, H, C, K] and per-dimension log-gates of one chunk; C and c vary, one float64 set."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cases = []
    spec = [(64, 16, 32, "normal", torch.float32), (64, 16, 16, "strong", torch.float32),
            (32, 8, 24, "weak", torch.float32), (64, 16, 16, "strong", torch.float64),
            (32, 4, 8, "normal", torch.bfloat16), (16, 16, 8, "strong", torch.float32)]
    for C, c, K, strength, dtype in spec:
        B, H = rng.randint(1, 2), rng.randint(1, 2)
        q = torch.randn(B, H, C, K, generator=gen).to(dtype)
        k = torch.randn(B, H, C, K, generator=gen).to(dtype)
        g = testing.log_gates((B, H, C, K), strength, generator=gen)
        cases.append(Case(args=(q, k, g), kwargs={"sub_chunk_size": c},
                          note=f"C={C}, c={c}, K={K}, {str(dtype)[6:]}, {strength} gates"))
    return cases


EXERCISES = [
    Exercise(
        name="ch05.intra_matrix",
        chapter=5,
        title="The intra-chunk matrix P by secondary chunking",
        signature="intra_chunk_matrix(q, k, g, *, sub_chunk_size=16) -> P  # q, k, g [B, H, C, K]; "
                  "P [B, H, C, C]",
        reference=intra_chunk_matrix,
        truth=attention_matrix,
        cases=intra_cases,
        outputs=("P",),
        hint="tiles below the diagonal: split exp(b_m − b_n) at the start r of the *query* "
             "sub-chunk, q ⊙ exp(b_m − b_{r−1}) and k ⊙ exp(b_{r−1} − b_n), both exponents ≤ 0; "
             "diagonal tiles: exp(b_m − b_n) per dimension in float32, masked before exp.",
    ),
]
