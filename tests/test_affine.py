"""Affine chunk maps: each chunk is S' = M S + B, maps compose associatively, and the scan of the
maps (parallel prefix or sequential fold) reproduces every operation."""
import math

import pytest
import torch

from linattn import InputError, affine, chunk, naive, testing

OPS = affine.OPS
NAMES = {"linear_attn": ("q", "k", "v"), "gla": ("q", "k", "v", "g"),
         "delta_rule": ("q", "k", "v", "beta"), "kda": ("q", "k", "v", "g", "beta")}


def problem(op, dtype=torch.float32, T=77, gate="per_dim", strength="normal", seed=0):
    a = testing.make_inputs(op, B=2, T=T, H=2, K=16, V=12, dtype=dtype, gate=gate,
                            strength=strength, initial_state=True, seed=seed)
    return tuple(a[n] for n in NAMES[op]), a["initial_state"]


def reference(op, args, S0):
    return getattr(naive, op)(*(x.double() for x in args), initial_state=S0.double(),
                              output_final_state=True)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("method", ["scan", "fold"])
@pytest.mark.parametrize("gate,strength", [("per_dim", "normal"), ("per_head", "strong")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_run_matches_float64(op, method, gate, strength, dtype):
    args, S0 = problem(op, dtype, gate=gate, strength=strength)
    with testing.poisoned():
        o, S = affine.run(op, *args, initial_state=S0, output_final_state=True, chunk_size=16,
                          method=method)
    o_ref, S_ref = reference(op, args, S0)
    assert o.dtype == dtype
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert S.dtype == acc and testing.rel_err(S, S_ref) <= testing.tolerance(acc)


@pytest.mark.parametrize("op", ["delta_rule", "kda"])
def test_each_chunk_is_its_map(op):
    """Chunk n of the sequence, started from any state S, ends in M_n S + B_n and outputs P_n S + O0_n."""
    args, _ = problem(op, torch.float64, T=48)
    maps, _ = affine.chunk_maps(op, *args, chunk_size=16)
    S = torch.randn(2, 2, 16, 12, dtype=torch.float64)
    for n in range(3):
        piece = tuple(x[:, 16 * n:16 * (n + 1)] for x in args)
        o, S_end = getattr(naive, op)(*piece, initial_state=S, output_final_state=True)
        assert testing.rel_err(affine.apply(maps.M[:, :, n], maps.B[:, :, n], S), S_end) < 1e-12
        o_map = (maps.P[:, :, n] @ S + maps.O0[:, :, n]).transpose(1, 2)
        assert testing.rel_err(o_map, o) < 1e-12


def random_maps(N, K=5, V=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    M = torch.randn(2, 1, N, K, K, generator=gen, dtype=torch.float64) / math.sqrt(K)
    B = torch.randn(2, 1, N, K, V, generator=gen, dtype=torch.float64)
    return M, B


def test_composition_is_associative_and_ordered():
    M, B = random_maps(3)
    m = [(M[:, :, i], B[:, :, i]) for i in range(3)]
    left = affine.compose(m[2], affine.compose(m[1], m[0]))
    right = affine.compose(affine.compose(m[2], m[1]), m[0])
    assert all(testing.rel_err(a, b) < 1e-13 for a, b in zip(left, right))
    S = torch.randn(2, 1, 5, 3, dtype=torch.float64)
    step = affine.apply(*m[1], affine.apply(*m[0], S))
    assert testing.rel_err(affine.apply(*affine.compose(m[1], m[0]), S), step) < 1e-13
    assert testing.rel_err(affine.apply(*affine.compose(m[0], m[1]), S), step) > 1e-3   # order matters


def test_blocked_matrix_product_is_composition():
    M, B = random_maps(2)
    m0, m1 = (M[:, :, 0], B[:, :, 0]), (M[:, :, 1], B[:, :, 1])
    product = affine.augmented(*m1) @ affine.augmented(*m0)
    assert testing.rel_err(product, affine.augmented(*affine.compose(m1, m0))) < 1e-13
    S = torch.randn(2, 1, 5, 3, dtype=torch.float64)
    stacked = torch.cat([S, torch.eye(3, dtype=S.dtype).expand(2, 1, 3, 3)], -2)  # [S; I]
    assert testing.rel_err((affine.augmented(*m0) @ stacked)[..., :5, :], affine.apply(*m0, S)) < 1e-13


@pytest.mark.parametrize("N", [1, 2, 3, 7, 8, 13])
def test_prefix_scan_equals_fold(N):
    M, B = random_maps(N, seed=N)
    S0 = torch.randn(2, 1, 5, 3, dtype=torch.float64)
    M_pre, B_pre, rounds = affine.prefix_scan(M, B)
    assert rounds == math.ceil(math.log2(N))
    entering, final = affine.entering_states(M_pre, B_pre, S0)
    entering_f, final_f = affine.fold(M, B, S0)
    assert testing.rel_err(entering, entering_f) < 1e-12
    assert testing.rel_err(final, final_f) < 1e-12


def test_maps_of_linear_attention_and_gla_have_the_expected_transition():
    args, _ = problem("linear_attn", torch.float64)
    maps, _ = affine.chunk_maps("linear_attn", *args, chunk_size=16)
    assert torch.equal(maps.M, torch.eye(16, dtype=torch.float64).expand_as(maps.M))
    args, _ = problem("gla", torch.float64)
    maps, _ = affine.chunk_maps("gla", *args, chunk_size=16)
    assert torch.equal(maps.M, torch.diag_embed(torch.diagonal(maps.M, dim1=-2, dim2=-1)))


def test_bad_calls():
    args, S0 = problem("kda")
    with pytest.raises(InputError, match="op"):
        affine.run("softmax", *args)
    with pytest.raises(InputError, match="kda takes 5"):
        affine.run("kda", *args[:4])
    with pytest.raises(InputError, match="method"):
        affine.run("kda", *args, method="blelloch")
    with pytest.raises(InputError, match="initial_state"):
        affine.run("kda", *args, initial_state=S0[:, :1])
    with pytest.raises(InputError, match="chunk_size"):
        affine.chunk_maps("kda", *args, chunk_size=0)


def test_chunk_level_and_maps_agree():
    args, S0 = problem("kda", torch.float64, gate="per_head")
    o1, S1 = chunk.kda(*args, initial_state=S0.double(), output_final_state=True, chunk_size=16)
    o2, S2 = affine.run("kda", *args, initial_state=S0.double(), output_final_state=True,
                        chunk_size=16)
    assert testing.rel_err(o2, o1) < 1e-12 and testing.rel_err(S2, S1) < 1e-12
