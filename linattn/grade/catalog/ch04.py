"""Chapter 04 — gated linear attention (GLA): the recurrence and the chunkwise form."""
import torch

from ... import chunk, naive
from ..exercise import Exercise
from .ch03 import gated_cases

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16

# Mostly per-dimension gates (GLA), one per-head set (the same function must take both shapes).
# The strong float32 per-dimension case is the one where absorbing relative to the chunk start
# overflows (exp(−b) with b ≈ −20 · 16); float64 would survive it.
GLA_SHAPES = [
    (1, 37, 2, 16, 16, F32, "per_dim", "normal", False),
    (2, 100, 2, 32, 24, F32, "per_dim", "strong", True),
    (1, 150, 1, 16, 32, F32, "per_dim", "weak", True),
    (2, 64, 3, 24, 16, F64, "per_dim", "strong", False),
    (1, 90, 2, 32, 32, BF16, "per_dim", "normal", True),
    (1, 70, 2, 8, 8, F32, "per_head", "normal", True),
    (1, 7, 1, 8, 8, F32, "per_dim", "normal", True),
]

SIG = ("(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False{}) "
       "-> (o, final_state)  # g [B, T, H] or [B, T, H, K]")

EXERCISES = [
    Exercise(
        name="ch04.recurrent",
        chapter=4,
        title="GLA, token by token",
        signature="recurrent_gla" + SIG.format(""),
        reference=naive.gla,
        cases=lambda seed: gated_cases(seed, shapes=GLA_SHAPES),
        unlocks=("gla", "naive"),
        outputs=("o", "final_state"),
        hint="S_t = diag(exp g_t) S_{t-1} + k_tᵀ v_t: exp(g_t) scales the *rows* of S (key "
             "dimensions); a g of shape [B, T, H] is one decay for all rows (unsqueeze it).",
    ),
    Exercise(
        name="ch04.chunkwise",
        chapter=4,
        title="Chunkwise GLA with Λ/Γ absorption and a log-space intra-chunk matrix",
        signature="chunk_gla" + SIG.format(", chunk_size=64"),
        reference=chunk.gla,
        truth=naive.gla,
        cases=lambda seed: gated_cases(seed, shapes=GLA_SHAPES, chunk_size=16),
        unlocks=("gla", "chunk"),
        outputs=("o", "final_state"),
        hint="Λ = exp(b) on the query side for Q S, Γ = exp(b_last − b) on the key side for the "
             "state, S ← diag(exp b_last) S + (K ⊙ Γ)ᵀ V; inside the chunk use exp(b_i − b_j) per "
             "dimension (i ≥ j), never exp(−b) on its own.",
    ),
]
