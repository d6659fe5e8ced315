"""Linear attention at the naive and chunk levels against the float64 recurrence."""
import pytest
import torch

from linattn import chunk, naive, testing

CASES = [  # B, T, H, K, V, chunk_size
    (1, 1, 1, 4, 4, 16),
    (2, 37, 2, 16, 24, 16),     # T not a multiple of C, K != V
    (1, 64, 3, 32, 8, 64),      # exactly one chunk
    (2, 130, 1, 8, 40, 32),     # partial last chunk
]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def reference(args):
    return naive.linear_attn(**testing.to_float64(args), output_final_state=True)


@pytest.mark.parametrize("fn", [naive.linear_attn, naive.linear_attn_parallel, chunk.linear_attn],
                         ids=["naive", "parallel", "chunk"])
@pytest.mark.parametrize("B,T,H,K,V,C", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("init", [False, True], ids=["zero", "init"])
def test_matches_float64_recurrence(fn, B, T, H, K, V, C, dtype, init):
    args = testing.make_inputs("linear_attn", B=B, T=T, H=H, K=K, V=V, dtype=dtype,
                               initial_state=init, seed=T + K)
    extra = {"chunk_size": C} if fn is chunk.linear_attn else {}
    with testing.poisoned():
        o, S = fn(**args, output_final_state=True, **extra)
    o_ref, S_ref = reference(args)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert S.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(torch.float32 if dtype != torch.float64 else dtype)


def test_final_state_only_when_asked():
    args = testing.make_inputs("linear_attn", T=10)
    assert chunk.linear_attn(**args)[1] is None
    assert naive.linear_attn(**args)[1] is None


def test_splitting_a_sequence_through_the_state():
    args = testing.make_inputs("linear_attn", T=90, dtype=torch.float64)
    o, S = chunk.linear_attn(**args, output_final_state=True, chunk_size=16)
    first = {n: a[:, :50] for n, a in args.items()}
    rest = {n: a[:, 50:] for n, a in args.items()}
    o1, S1 = chunk.linear_attn(**first, output_final_state=True, chunk_size=16)
    o2, S2 = naive.linear_attn(**rest, initial_state=S1, output_final_state=True)
    assert testing.rel_err(torch.cat([o1, o2], 1), o) < 1e-12
    assert testing.rel_err(S2, S) < 1e-12


def test_scale_is_applied():
    args = testing.make_inputs("linear_attn", T=20, dtype=torch.float64)
    o1, _ = chunk.linear_attn(**args, scale=1.0)
    o2, _ = chunk.linear_attn(**args, scale=0.5)
    assert testing.rel_err(o2, 0.5 * o1) < 1e-12
