"""Chapter 01 — linear attention: the recurrent and the parallel form."""
import torch

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


# ---- Known mistakes, written out, so a wrong answer can be told which one it made -------------

MASKS = {
    "causal": lambda n: torch.ones(n, n).tril(),
    "strict": lambda n: torch.ones(n, n).tril(-1),     # misses each token's own k_tᵀ v_t
    "future": lambda n: torch.ones(n, n).triu(),       # sees the tokens after it instead
    "none": lambda n: torch.ones(n, n),
}


def masked_linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                       mask="causal", final_without_s0=False, **_):
    """The parallel form with a chosen mask; the mistakes below are variants of it."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qa, ka, va = (x.to(acc).transpose(1, 2) for x in (q, k, v))         # [B, H, T, *]
    S0 = (torch.zeros(ka.shape[:2] + (ka.shape[-1], va.shape[-1]), dtype=acc) if initial_state is None
          else initial_state.to(acc))                                    # [B, H, K, V]
    M = MASKS[mask](q.shape[1]).to(acc)                                  # [T, T]
    o = scale * ((qa @ ka.transpose(-1, -2)) * M @ va + qa @ S0)        # [B, H, T, V]
    S = ka.transpose(-1, -2) @ va + (0 if final_without_s0 else S0)
    return o.transpose(1, 2).to(v.dtype), (S if output_final_state else None)


def _with(**changes):
    def mistake(q, k, v, **kwargs):
        return masked_linear_attn(q, k, v, **{**kwargs, **changes})
    return mistake


def _no_scale(q, k, v, **kwargs):
    return masked_linear_attn(q, k, v, **{**kwargs, "scale": 1.0})


LINEAR_MISTAKES = (
    ("read the state before adding k_tᵀ v_t (a strict triangle, without the diagonal)",
     _with(mask="strict")),
    ("let each token see the later ones (the upper triangle)", _with(mask="future")),
    ("leave out the causal mask (every token sees the whole sequence)", _with(mask="none")),
    ("forget the scale (multiply by 1 instead of K^-0.5)", _no_scale),
    ("ignore the `scale` argument (always use K^-0.5)", _with(scale=None)),
    ("ignore `initial_state` (start from zeros)", _with(initial_state=None)),
    ("leave S_0 out of the final state", _with(final_without_s0=True)),
)

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
        diagnoses=LINEAR_MISTAKES,
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
        diagnoses=LINEAR_MISTAKES,
    ),
]
