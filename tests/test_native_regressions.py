"""The shapes at which compiled Triton kernels went wrong on an H200 (Triton 3.6) while the interpreter
was right, kept as cases of the conformance suite (linattn.conformance): natively they guard the rules
in linattn/triton/common.py (MIN_TILE, warps) and the reverse pass's 64-wide V-blocks; on a CPU the
interpreter runs the small ones (they pass there with or without the rules, which is the point of
running them natively). docs/native_correctness.md lists what each one caught."""
import pytest

from linattn import device
from linattn.conformance import case as C
from linattn.conformance import matrix, runner

DEV = device.default_device()
GPU = DEV == "cuda"


def regression(variant, K, V, T, dtype, *, B=1, H=2, chunk=(64, None), strength="normal", seed=0,
               flags=(True, True, True)):
    c = matrix._case(seed, "regression", variant, K=K, V=V, T=T, dtype=dtype, chunk=chunk,
                     strength=strength if matrix.gated(variant) else None, flags=flags, bh=(B, H))
    return {**c, "fla": False}


CASES = [
    # K = V = 16, one chunk: the per-chunk reductions (bf16, 8 warps) and the float32 reverse pass
    # (16-wide V-blocks) of the delta rules
    *[regression(v, 16, 16, T, dt) for v in ("delta_rule", "gated_delta_rule", "kda")
      for T in (2, 63) for dt in ("float32", "bfloat16")],
    regression("delta_rule", 16, 32, 63, "float32"),
]
if GPU:
    CASES += [
        # linear attention at K = 256: dv's 32-column V-blocks with 8 warps
        *[regression("linear_attn", 256, 256, T, dt) for T in (64, 257, 1000) for dt in ("bfloat16", "float16")],
        regression("linear_attn", 256, 64, 257, "bfloat16"),
        # K = V = 128 with few heads and short sequences: the reverse pass with the forward's narrow blocks
        *[regression(v, 128, 128, T, dt, B=1, H=3) for v in ("delta_rule", "gated_delta_rule", "kda")
          for T in (1, 16, 64) for dt in ("bfloat16", "float16")],
        # float32 at K = 16 with chunk 16: the reverse pass pipelined with a padded key tile (dstate_stages)
        regression("delta_rule", 16, 128, 538, "float32", H=3, chunk=(16, None), flags=(False, False, False)),
        regression("kda", 16, 128, 100, "float32", H=3, chunk=(16, None)),
        # one chunk at chunk 64, V = 16: the NT = 1 variant of the sequential passes faulted
        *[regression(v, 64, 16, 33, "bfloat16", B=3, H=2) for v in ("delta_rule", "kda")],
        # K = 256, V = 32, chunk 32 without an initial state: the pipelined state pass left states unwritten
        regression("kda", 256, 32, 33, "bfloat16", B=3, H=2, chunk=(32, None), strength="logsigmoid",
                   flags=(False, True, True)),
        # fp16 with strong gates and an initial state: the first token's decay (e^{-15}) alone makes
        # d initial state, beneath fp16's normal range (common.decayed_dtype)
        *[regression(v, 128, 128, 1077, "float16", H=1, strength="strong", seed=102, flags=(True, False, False))
          for v in ("simple_gla", "gla")],
        # the same for Gated DeltaNet, whose W = 𝒯 diag(β)(K ⊙ e^G) is stored in fp16 between stages
        # (d initial state 0.62 wrong natively): W and e^G now from each chunk's first token (wy.py)
        regression("gated_delta_rule", 128, 128, 1077, "float16", H=1, strength="strong", seed=102,
                   flags=(True, False, False)),
        # T = 1 without an initial state: the exact gate gradient is 0 (testing.rel_err's scale)
        regression("gla", 64, 16, 1, "float16", H=3, chunk=(256, 32), strength="reset", seed=120,
                   flags=(False, True, True)),
        # GLA behind a reset of −30 … −100: the gate floor must change no float32 product
        regression("gla", 256, 16, 466, "bfloat16", H=1, chunk=(64, 64), strength="reset", seed=127,
                   flags=(True, True, False)),
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: runner.describe(c).replace(" ", "-"))
def test_native_regression(case):
    row = C.run(case, DEV)
    assert row["status"] == "pass", (row.get("failed"), row.get("err"))
