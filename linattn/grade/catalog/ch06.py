"""Chapter 06 — the delta rule: DeltaNet, and its decayed forms token by token."""
from ... import naive
from ..cases import op_cases
from ..exercise import Exercise

SIG = "(q, k, v, {}beta, *, scale=None, initial_state=None, output_final_state=False) -> (o, final_state)"

EXERCISES = [
    Exercise(
        name="ch06.delta_rule",
        chapter=6,
        title="DeltaNet, token by token",
        signature="recurrent_delta_rule" + SIG.format(""),
        reference=naive.delta_rule,
        cases=lambda seed: op_cases("delta_rule", seed),
        unlocks=("delta_rule", "naive"),
        outputs=("o", "final_state"),
        hint="residual r_t = v_t − k_t S_{t−1} from the state *before* the write; "
             "S_t = S_{t−1} + β_t k_tᵀ r_t; read o_t = scale · q_t S_t *after* it.",
    ),
    Exercise(
        name="ch06.kda",
        chapter=6,
        title="Gated DeltaNet and KDA, token by token",
        signature="recurrent_kda" + SIG.format("g, "),
        reference=naive.kda,
        cases=lambda seed: op_cases("kda", seed),
        unlocks=("kda", "naive"),
        outputs=("o", "final_state"),
        hint="decay first (S ← diag(exp g_t) S), then the residual against the *decayed* state; "
             "g [B,T,H] is one decay per head.",
    ),
]
