"""Chapter 03 — decay: the causal decay mask in log space, and chunkwise scalar (per-head) decay."""
from __future__ import annotations

import random

import torch

from ... import chunk, decay, naive, testing
from ..cases import op_cases
from ..exercise import Case, Exercise

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

# (B, T, H, K, V, dtype, gate, strength, initial_state): one decay per head and step, as in
# RetNet / Mamba-2 / Lightning-2. Strong gates (down to −20 per step) make a bare cumulative
# product underflow within a few tokens; the float64 case must match to 1e-10.
SCALAR_SHAPES = [
    (1, 37, 2, 16, 16, F32, "per_head", "normal", False),
    (2, 100, 2, 32, 24, F32, "per_head", "strong", True),
    (1, 150, 1, 16, 32, F32, "per_head", "weak", True),
    (2, 64, 3, 24, 16, F64, "per_head", "strong", False),
    (1, 90, 2, 32, 32, BF16, "per_head", "normal", True),
    (1, 7, 1, 8, 8, F32, "per_head", "normal", True),
]


def gated_cases(seed, *, shapes, chunk_size=None):
    """op_cases for gla on `shapes`, plus one case without the final state and one with a scale.

    op_cases always asks for the final state and leaves scale at its default; these two catch a
    function that always returns the state or ignores `scale`.
    """
    cases = op_cases("gla", seed, chunk_size=chunk_size, shapes=shapes)
    cases[0].kwargs["output_final_state"] = False
    cases[0].note += ", output_final_state=False"
    cases[2].kwargs["scale"] = 1.0
    cases[2].note += ", scale=1.0"
    return cases


def mask_cases(seed):
    """Scalar log-gates [..., L] of several lengths and strengths, one set in float64."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for L, strength, dtype in [(1, "normal", F32), (20, "weak", F32), (64, "strong", F32),
                               (100, "normal", F32), (48, "strong", F64)]:
        L = max(1, L + rng.randint(-2, 2))
        g = testing.log_gates((2, 3, L), strength, generator=gen).to(dtype)
        cases.append(Case(args=(g,), note=f"g [2, 3, {L}] {str(dtype)[6:]}, {strength} gates"))
    return cases


EXERCISES = [
    Exercise(
        name="ch03.decay_mask",
        chapter=3,
        title="The causal decay mask, in log space",
        signature="decay_mask(g) -> D  # g [..., L] log-decays; D [..., L, L], D_ij = exp(b_i − b_j) for i ≥ j, else 0",
        reference=decay.decay_mask,
        cases=mask_cases,
        outputs=("D",),
        hint="b = g.cumsum(-1); take exp of b_i − b_j only where i ≥ j (fill the rest with −inf "
             "*before* exp — exp of a large positive difference is inf, and inf · 0 is NaN); never "
             "divide cumulative products.",
    ),
    Exercise(
        name="ch03.scalar_chunkwise",
        chapter=3,
        title="Chunkwise attention with one decay per head (Λ, Γ, γ and the decay mask)",
        signature="chunk_decay_attn(q, k, v, g, *, scale=None, initial_state=None, "
                  "output_final_state=False, chunk_size=64) -> (o, final_state)  # g [B, T, H]",
        reference=chunk.gla,
        truth=naive.gla,
        # chunk_size=16: most cases span several chunks and end in a partial one.
        cases=lambda seed: gated_cases(seed, shapes=SCALAR_SHAPES, chunk_size=16),
        outputs=("o", "final_state"),
        hint="per chunk, with b the cumulative log-gate from the chunk start: inter = (Q ⊙ exp b) S, "
             "intra = (Q Kᵀ ⊙ D) V with D_ij = exp(b_i − b_j) (i ≥ j), then "
             "S ← exp(b_last) S + (K ⊙ exp(b_last − b))ᵀ V; the last chunk may be short.",
    ),
]
