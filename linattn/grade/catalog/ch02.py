"""Chapter 02 — chunkwise linear attention with state passing."""
from ... import chunk, naive
from ..cases import op_cases
from ..exercise import Exercise

EXERCISES = [
    Exercise(
        name="ch02.chunkwise",
        chapter=2,
        title="Chunkwise linear attention (inter-chunk state + intra-chunk mask)",
        signature="chunk_linear_attn(q, k, v, *, scale=None, initial_state=None, "
                  "output_final_state=False, chunk_size=64) -> (o, final_state)",
        reference=chunk.linear_attn,
        truth=naive.linear_attn,
        cases=lambda seed: op_cases("linear_attn", seed, chunk_size=16),
        unlocks=("linear_attn", "chunk"),
        outputs=("o", "final_state"),
        hint="the last chunk may be shorter than chunk_size; read the state before adding the chunk's KᵀV.",
    ),
]
