"""Chapter 02 — chunkwise linear attention with state passing."""
from ... import chunk, naive
from ..exercise import Exercise
from .ch01 import linear_cases

EXERCISES = [
    Exercise(
        name="ch02.chunkwise",
        chapter=2,
        title="Chunkwise linear attention (inter-chunk state + intra-chunk mask)",
        signature="chunk_linear_attn(q, k, v, *, scale=None, initial_state=None, "
                  "output_final_state=False, chunk_size=64) -> (o, final_state)",
        reference=chunk.linear_attn,
        truth=naive.linear_attn,
        # chunk_size=16: most cases then span several chunks and, by their random lengths, end
        # in a partial chunk; the T≈7 case is shorter than a single chunk.
        cases=lambda seed: linear_cases(seed, chunk_size=16),
        unlocks=("linear_attn", "chunk"),
        outputs=("o", "final_state"),
        hint="read the state S_[n-1] *before* adding the chunk's Kᵀ V; mask the chunk's Q Kᵀ with "
             "the lower triangle including the diagonal; the last chunk may be shorter than chunk_size.",
    ),
]
