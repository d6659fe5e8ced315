"""GLA and scalar decay at the naive and chunk levels against the float64 recurrence.

The matrix covers: per-head and per-dimension gates; weak, normal and strong decay (down to −20
per step); T not a multiple of the chunk or sub-chunk size, shorter than one sub-chunk, and long;
K ≠ V; every dtype; zero and given initial state. Outputs are poisoned with NaN.
"""
import pytest
import torch

import linattn
from linattn import chunk, naive, testing
from linattn.chunk.gated import intra_chunk_matrix
from linattn.naive.gated import attention_matrix
from linattn.validate import InputError

SHAPES = [  # B, T, H, K, V, chunk_size, sub_chunk_size
    (1, 1, 1, 8, 8, 16, 4),       # a single token
    (2, 37, 2, 16, 24, 16, 4),    # T not a multiple of C or c, K != V
    (1, 64, 2, 32, 8, 32, 8),     # exactly two chunks
    (1, 150, 1, 8, 16, 64, 16),   # default sizes, partial last chunk
]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def reference(args):
    return naive.gla(**testing.to_float64(args), output_final_state=True)


def state_tolerance(dtype):
    # the state is accumulated in float32, but its matmul operands are rounded to the input dtype
    return testing.tolerance(dtype)


@pytest.mark.parametrize("B,T,H,K,V,C,c", SHAPES)
@pytest.mark.parametrize("gate", ["per_head", "per_dim"])
@pytest.mark.parametrize("strength", ["weak", "normal", "strong"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunk_matches_float64_recurrence(B, T, H, K, V, C, c, gate, strength, dtype):
    args = testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, dtype=dtype, gate=gate,
                               strength=strength, initial_state=T % 2 == 1, seed=T + K)
    with testing.poisoned():
        o, S = chunk.gla(**args, output_final_state=True, chunk_size=C, sub_chunk_size=c)
    o_ref, S_ref = reference(args)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert S.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    assert testing.rel_err(S, S_ref) <= state_tolerance(dtype)


@pytest.mark.parametrize("fn", [naive.gla, naive.gla_parallel], ids=["recurrent", "parallel"])
@pytest.mark.parametrize("B,T,H,K,V,C,c", SHAPES[:3])
@pytest.mark.parametrize("gate", ["per_head", "per_dim"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_naive_forms(fn, B, T, H, K, V, C, c, gate, dtype):
    args = testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, dtype=dtype, gate=gate,
                               strength="normal", initial_state=True, seed=T)
    with testing.poisoned():
        o, S = fn(**args, output_final_state=True)
    o_ref, S_ref = reference(args)
    assert o.dtype == dtype
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(torch.float64 if dtype == torch.float64 else torch.float32)


def test_parallel_strong_gates_float64():
    args = testing.make_inputs("gla", B=1, T=90, H=2, K=8, V=8, dtype=torch.float64,
                               strength="strong", initial_state=True, seed=5)
    o, S = naive.gla_parallel(**args, output_final_state=True)
    o_ref, S_ref = reference(args)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(torch.float64)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(torch.float64)


@pytest.mark.parametrize("gate", ["per_head", "per_dim"])
def test_long_sequence_strong_gates(gate):
    args = testing.make_inputs("gla", B=1, T=1000, H=1, K=16, V=16, gate=gate, strength="strong",
                               initial_state=True, seed=11)
    with testing.poisoned():
        o, S = chunk.gla(**args, output_final_state=True)
    o_ref, S_ref = reference(args)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(torch.float32)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [-1e4, -20.0, 0.0])
def test_extreme_constant_gates(value, dtype):
    """−1e4 forgets everything at once; 0 is plain linear attention (checked against it too)."""
    args = testing.make_inputs("gla", B=1, T=45, H=2, K=8, V=4, dtype=dtype, initial_state=True, seed=2)
    args["g"] = torch.full_like(args["g"], value)
    with testing.poisoned():
        o, S = chunk.gla(**args, output_final_state=True, chunk_size=16, sub_chunk_size=4)
    o_ref, S_ref = reference(args)
    tol = testing.tolerance(dtype)
    assert testing.rel_err(o, o_ref) <= tol and testing.rel_err(S, S_ref) <= tol
    if value == 0.0 and dtype == torch.float32:
        lin = chunk.linear_attn(args["q"], args["k"], args["v"], initial_state=args["initial_state"],
                                output_final_state=True, chunk_size=16)
        assert testing.rel_err(o, lin[0]) <= 1e-5 and testing.rel_err(S, lin[1]) <= 1e-5


def test_inter_dtype_float32_keeps_bf16_state_exact():
    """bf16 inputs with inter_dtype=float32: no operand is rounded, so the float32 state is as
    accurate as with float32 inputs; with the default (bf16 tiles) it is not."""
    args = testing.make_inputs("gla", B=1, T=100, H=2, K=16, V=16, dtype=torch.bfloat16, seed=4)
    _, S_ref = reference(args)
    _, S32 = chunk.gla(**args, output_final_state=True, inter_dtype=torch.float32)
    _, S16 = chunk.gla(**args, output_final_state=True)
    assert testing.rel_err(S32, S_ref) <= testing.tolerance(torch.float32)
    assert testing.rel_err(S16, S_ref) > testing.tolerance(torch.float32)


@pytest.mark.parametrize("strength", ["normal", "strong"])
@pytest.mark.parametrize("gate", ["per_head", "per_dim"])
def test_intra_chunk_matrix(strength, gate):
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 64, 16, generator=gen), torch.randn(2, 64, 16, generator=gen)
    g = testing.log_gates((2, 64) if gate == "per_head" else (2, 64, 16), strength, generator=gen)
    truth = attention_matrix(q.double(), k.double(), g.double())
    P = intra_chunk_matrix(q, k, g, sub_chunk_size=16)
    assert P.shape == (2, 64, 64) and (P.triu(1) == 0).all()
    assert testing.rel_err(P, truth) <= testing.tolerance(torch.float32)
    Pb = intra_chunk_matrix(q, k, g, sub_chunk_size=16, inter_dtype=torch.bfloat16)
    assert testing.rel_err(Pb, truth) <= testing.tolerance(torch.bfloat16)


def test_dispatcher_routes_gla():
    args = testing.make_inputs("gla", B=1, T=20, H=1, K=8, V=8)
    o, _ = linattn.gla(**args, impl="chunk", chunk_size=16, sub_chunk_size=8)
    assert linattn.which("gla") == "linattn.chunk.gla (reference)"
    o_n, _ = linattn.gla(**args, impl="naive", chunk_size=16)
    assert testing.rel_err(o, o_n) <= 1e-5


def test_final_state_only_when_asked():
    args = testing.make_inputs("gla", T=10)
    assert chunk.gla(**args)[1] is None and naive.gla(**args)[1] is None
    assert naive.gla_parallel(**args)[1] is None


@pytest.mark.parametrize("fn", [naive.gla, naive.gla_parallel, chunk.gla],
                         ids=["recurrent", "parallel", "chunk"])
@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(g=a["g"].abs() + 0.1), "g must hold log-decays"),
    (lambda a: a["g"].view(-1).__setitem__(3, float("nan")), "g contains NaN"),
    (lambda a: a.update(g=a["g"][..., :3]), "g must have shape"),
    (lambda a: a.update(g=a["g"].tolist()), "g must be a torch.Tensor"),
    (lambda a: a.update(initial_state=torch.zeros(1, 2, 3, 4)), "initial_state"),
    (lambda a: a.update(v=a["v"][:, :5]), "v must have shape"),
])
def test_bad_inputs(fn, change, match):
    args = testing.make_inputs("gla", B=1, T=12, H=2, K=8, V=8)
    change(args)
    with pytest.raises(InputError, match=match):
        fn(**args)


@pytest.mark.parametrize("kw,match", [
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": 16.0}, "chunk_size"),
    ({"chunk_size": 16, "sub_chunk_size": 5}, "sub_chunk_size"),
    ({"chunk_size": 16, "sub_chunk_size": 32}, "sub_chunk_size"),
    ({"inter_dtype": torch.int8}, "inter_dtype"),
    ({"inter_dtype": "bf16"}, "inter_dtype"),
])
def test_bad_chunking(kw, match):
    args = testing.make_inputs("gla", B=1, T=12, H=2, K=8, V=8)
    with pytest.raises(InputError, match=match):
        chunk.gla(**args, **kw)


def test_decay_shortcut_is_exact_for_scalar_gates():
    """Per-head gates take the decay-mask path; the same decays spelled per dimension take the
    secondary-chunking path. Both must agree."""
    args = testing.make_inputs("gla", B=1, T=70, H=2, K=8, V=8, gate="per_head", seed=9)
    o1, S1 = chunk.gla(**args, output_final_state=True, chunk_size=32, sub_chunk_size=8)
    args["g"] = args["g"][..., None].expand(-1, -1, -1, 8).contiguous()
    o2, S2 = chunk.gla(**args, output_final_state=True, chunk_size=32, sub_chunk_size=8)
    assert testing.rel_err(o1, o2) <= 1e-6 and testing.rel_err(S1, S2) <= 1e-6


@pytest.mark.parametrize("change,match", [
    (lambda q, k, g: (q, k[..., :3], g), "q and k must have one shape"),
    (lambda q, k, g: (q, k, g[..., :3]), "g must have shape"),
    (lambda q, k, g: (q, k, g.long()), "g must be a floating-point"),
    (lambda q, k, g: (q.tolist(), k, g), "q must be a floating-point"),
])
def test_intra_chunk_matrix_bad_inputs(change, match):
    q, k, g = torch.randn(2, 32, 8), torch.randn(2, 32, 8), -torch.rand(2, 32, 8)
    with pytest.raises(InputError, match=match):
        intra_chunk_matrix(*change(q, k, g), sub_chunk_size=8)
    with pytest.raises(InputError, match="sub_chunk_size"):
        intra_chunk_matrix(q, k, g, sub_chunk_size=5)


def test_chunk_larger_than_the_sequence():
    args = testing.make_inputs("gla", B=1, T=10, H=2, K=8, V=8, initial_state=True, seed=12)
    o, S = chunk.gla(**args, output_final_state=True, chunk_size=4096, sub_chunk_size=16)
    o_ref, S_ref = reference(args)
    assert testing.rel_err(o, o_ref) <= 1e-5 and testing.rel_err(S, S_ref) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dimensions_that_never_forget_beside_ones_that_forget_at_once(dtype):
    """Per-dimension gates mixing 0 (keep forever) and −20 (forget now) in one head: the decays
    span the whole float range inside a single chunk and sub-chunk."""
    args = testing.make_inputs("gla", B=1, T=100, H=2, K=16, V=8, dtype=dtype, initial_state=True, seed=13)
    gen = torch.Generator().manual_seed(13)
    keep = torch.rand(args["g"].shape, generator=gen) < 0.5
    args["g"] = torch.where(keep, torch.zeros(()), -20 * torch.rand(args["g"].shape, generator=gen))
    with testing.poisoned():
        o, S = chunk.gla(**args, output_final_state=True, chunk_size=32, sub_chunk_size=8)
    o_ref, S_ref = reference(args)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(dtype)


def mixed_gates(args, cut):
    """Log-gates strong (−20 per step at worst) from token `cut` on: chunks before it take the
    split, chunks after it the exact paths."""
    g = args["g"]
    strong = testing.log_gates(tuple(g.shape), "strong", generator=torch.Generator().manual_seed(1))
    args["g"] = torch.cat([g[:, :cut], strong[:, cut:].to(g.dtype)], 1)
    return args


@pytest.mark.parametrize("op,gate", [("linear_attn", None), ("gla", "per_head"), ("gla", "per_dim")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_groups_of_chunks(monkeypatch, op, gate, dtype):
    """Two chunks per group: the state handed from group to group, a short last group, and groups
    that split next to groups that run the exact paths, against the float64 recurrence."""
    monkeypatch.setattr(linattn.decay, "group_size", lambda *a: 2)
    kw = {"gate": gate} if gate else {}
    args = testing.make_inputs(op, B=2, T=150, H=2, K=16, V=24, dtype=dtype, initial_state=True,
                               seed=7, **kw)
    if gate:
        args = mixed_gates(args, 80)
    with testing.poisoned():
        o, S = getattr(chunk, op)(**args, output_final_state=True, chunk_size=16)
    o_ref, S_ref = getattr(naive, op)(**testing.to_float64(args), output_final_state=True)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    assert testing.rel_err(S, S_ref) <= state_tolerance(dtype)


@pytest.mark.parametrize("gate", ["per_head", "per_dim"])
@pytest.mark.parametrize("per_token", [-0.92, -0.97])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_bound(gate, per_token, dtype):
    """Every gate decaying by 58.9 over a chunk of 64 (the split, factors up to e^58.9) or by 62.1
    (past the bound: the exact paths)."""
    args = testing.make_inputs("gla", B=1, T=128, H=2, K=32, V=32, dtype=dtype, gate=gate, seed=4)
    args["g"] = torch.full_like(args["g"], per_token)
    with testing.poisoned():
        o, S = chunk.gla(**args, output_final_state=True, chunk_size=64)
    o_ref, S_ref = reference(args)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    assert testing.rel_err(S, S_ref) <= state_tolerance(dtype)


@pytest.mark.parametrize("gate", ["per_dim", "per_head"])
def test_huge_chunk_and_sub_chunk_sizes_are_clamped(gate):
    # Every chunk size gives the same result: 2**20 on 20 tokens runs one chunk of 32, not 2^20.
    args = testing.make_inputs("gla", B=1, T=20, H=2, K=16, V=16, gate=gate, dtype=torch.float64)
    ref, S_ref = naive.gla(**args, output_final_state=True)
    for C, c in [(2**20, 16), (2**20, 2**20), (64, 64)]:
        o, S = chunk.gla(**args, chunk_size=C, sub_chunk_size=c, output_final_state=True)
        assert testing.rel_err(o, ref) < testing.tolerance(torch.float64)
        assert testing.rel_err(S, S_ref) < testing.tolerance(torch.float64)
    o, _ = chunk.linear_attn(**{n: args[n] for n in "qkv"}, chunk_size=2**20)
    assert testing.rel_err(o, naive.linear_attn(**{n: args[n] for n in "qkv"})[0]) < 1e-10
