"""Chapter 01 — linear attention: the recurrent and the parallel form."""
from ... import naive
from ..cases import op_cases
from ..exercise import Exercise

SIG = "(q, k, v, *, scale=None, initial_state=None, output_final_state=False) -> (o, final_state)"

EXERCISES = [
    Exercise(
        name="ch01.recurrent",
        chapter=1,
        title="Linear attention, token by token",
        signature="recurrent_linear_attn" + SIG,
        reference=naive.linear_attn,
        cases=lambda seed: op_cases("linear_attn", seed),
        unlocks=("linear_attn", "naive"),
        outputs=("o", "final_state"),
        hint="update S with k_tᵀ v_t *before* reading it with q_t; o_t = scale · q_t S_t.",
    ),
    Exercise(
        name="ch01.parallel",
        chapter=1,
        title="Linear attention as one masked matrix product",
        signature="parallel_linear_attn" + SIG,
        reference=naive.linear_attn_parallel,
        truth=naive.linear_attn,
        cases=lambda seed: op_cases("linear_attn", seed),
        outputs=("o", "final_state"),
        hint="mask Q Kᵀ with the lower triangle *including* the diagonal; add scale · Q S_0.",
    ),
]
