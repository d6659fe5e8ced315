"""Context parallelism over gloo processes and SM parallelism on one device, against the float64
single-process result (naive level)."""
import pytest
import torch

from linattn import InputError, context, naive, testing


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_processes_match_single_process(world):
    errors = context.selfcheck(world, "gloo")              # every op, T = 203 split unevenly
    assert set(errors) == set(context.OPS)
    for op, e in errors.items():
        assert e["ref"] == f"naive.{op}"
        assert e["o"] <= testing.tolerance(torch.float32), (op, e)
        assert e["final_state"] <= testing.tolerance(torch.float32), (op, e)


@pytest.mark.parametrize("op", context.OPS)
@pytest.mark.parametrize("splits,strength", [(1, "normal"), (2, "normal"), (3, "strong"), (5, "normal")])
def test_sm_parallel_matches_float64(op, splits, strength):
    a = testing.make_inputs(op, B=2, T=101, H=2, K=16, V=8, strength=strength,
                            initial_state=True, seed=splits)
    args = tuple(a[n] for n in context.ARG_NAMES[op])
    with testing.poisoned():
        o, S = context.sm_parallel(op, *args, splits=splits, initial_state=a["initial_state"],
                                   output_final_state=True, chunk_size=16)
    o_ref, S_ref = getattr(naive, op)(*(x.double() for x in args),
                                      initial_state=a["initial_state"].double(),
                                      output_final_state=True)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(torch.float32)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(torch.float32)


def test_slices_cover_the_sequence():
    for T, world in [(203, 2), (203, 4), (5, 4), (3, 4)]:
        bounds = [context.slice_bounds(T, world, r) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == T
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


def test_clear_errors():
    args, S0 = context.problem("kda", 0)
    with pytest.raises(InputError, match="group"):
        context.context_parallel("kda", *args)            # no process group in this process
    with pytest.raises(InputError, match="splits"):
        context.sm_parallel("kda", *args, splits=0)
    with pytest.raises(InputError, match="op"):
        context.sm_parallel("rwkv7", *args, splits=2)
