"""Chapter 01 — linear attention: the recurrent and the parallel form."""
from ... import naive
from ..cases import op_cases
from ..exercise import Exercise

SIG = "(q, k, v, *, scale=None, initial_state=None, output_final_state=False) -> (o, final_state)"


def linear_cases(seed, **kwargs):
    """op_cases for linear attention, plus one case with an explicit scale and one without the state.

    op_cases always leaves scale at its default and asks for the final state, so a function that
    ignored `scale` or always returned the state would pass them; these two cases catch that.
    """
    cases = op_cases("linear_attn", seed, **kwargs)
    cases[0].kwargs["output_final_state"] = False
    cases[0].note += ", output_final_state=False"
    cases[2].kwargs["scale"] = 1.0
    cases[2].note += ", scale=1.0"
    return cases


EXERCISES = [
    Exercise(
        name="ch01.recurrent",
        chapter=1,
        title="Linear attention, token by token",
        signature="recurrent_linear_attn" + SIG,
        reference=naive.linear_attn,
        cases=linear_cases,
        unlocks=("linear_attn", "naive"),
        outputs=("o", "final_state"),
        hint="start from initial_state (or zeros), add k_tᵀ v_t to S *before* reading it with q_t, "
             "o_t = scale · q_t S_t with scale = K^-0.5 when None; compute in float32/64, "
             "return o in v's dtype and the state in the compute dtype.",
    ),
    Exercise(
        name="ch01.parallel",
        chapter=1,
        title="Linear attention as one masked matrix product",
        signature="parallel_linear_attn" + SIG,
        reference=naive.linear_attn_parallel,
        truth=naive.linear_attn,
        cases=linear_cases,
        outputs=("o", "final_state"),
        hint="mask Q Kᵀ with the lower triangle *including* the diagonal (torch.tril), add "
             "scale · Q S_0 for the initial state; the final state is S_0 + Kᵀ V.",
    ),
]
