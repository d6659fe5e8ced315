"""The chunkwise backward of linattn.chunk.gla and linattn.chunk.linear_attn.

Gradients of q, k, v, g (per head and per dimension) and the initial state, for an incoming
gradient on the output and on the final state, against float64 autograd through the token loop
linattn.naive; float64 gradcheck of the Function itself; recompute=True and False; strong gates
(−20 per step); every gradient buffer poisoned with NaN.
"""
import pytest
import torch

import linattn
from linattn import chunk, naive, testing
from linattn.chunk import gla_tiles
from linattn.naive.gated import attention_matrix

SHAPES = [  # B, T, H, K, V, chunk_size, sub_chunk_size
    (1, 1, 1, 8, 8, 16, 4),       # a single token
    (2, 37, 2, 16, 24, 16, 4),    # T not a multiple of C or c, K != V
    (1, 64, 2, 32, 8, 32, 8),     # exactly two chunks
    (1, 150, 1, 8, 16, 64, 16),   # default sizes, partial last chunk
    (1, 100, 1, 8, 8, 48, 16),    # a chunk that is not a power of two
]
GRAD_TOLERANCE = testing.GRAD_TOLERANCE   # one place for gradient tolerances


def weights(args, op, seed=1):
    """Random incoming gradients for o and the final state, exactly representable in their dtypes
    (the reference then sees the very numbers the level receives)."""
    gen = torch.Generator().manual_seed(seed)
    q, v = args["q"], args["v"]
    B, T, H, K = q.shape
    w_o = torch.randn(B, T, H, v.shape[-1], generator=gen).to(v.dtype)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    w_S = torch.randn(B, H, K, v.shape[-1], generator=gen).to(acc)
    return w_o, w_S


def grads(fn, args, names, w_o, w_S, **kw):
    """Gradients of <o, w_o> + <S_final, w_S> for the inputs in `names`, run poisoned."""
    args = {n: a.detach().clone().requires_grad_(n in names) if isinstance(a, torch.Tensor) else a
            for n, a in args.items()}
    with testing.poisoned():
        o, S = fn(**args, output_final_state=True, **kw)
        loss = (o * w_o.to(o.dtype)).sum() + (S * w_S.to(S.dtype)).sum()
        loss.backward()
    return {n: args[n].grad for n in names}


def reference(op, args, names, w_o, w_S):
    return grads(getattr(naive, op), testing.to_float64(args), names, w_o.double(), w_S.double())


def differentiable(op, args):
    return [n for n in ("q", "k", "v", "g", "initial_state") if n in args and
            (n != "g" or op == "gla")]


def check(op, args, extra, tol):
    names = differentiable(op, args)
    w_o, w_S = weights(args, op)
    ref = reference(op, args, names, w_o, w_S)
    got = grads(getattr(chunk, op), args, names, w_o, w_S, **extra)
    for n in names:
        assert got[n].dtype == args[n].dtype and got[n].shape == args[n].shape, n
        err = testing.rel_err(got[n], ref[n])
        assert err <= tol, f"d{n}: rel_err {err:.2e} > {tol:.0e}"
    return got


@pytest.mark.parametrize("B,T,H,K,V,C,c", SHAPES)
@pytest.mark.parametrize("gate", ["per_head", "per_dim"])
@pytest.mark.parametrize("strength", ["weak", "normal", "strong"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gla_gradients_match_float64_autograd(B, T, H, K, V, C, c, gate, strength, dtype):
    args = testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, dtype=dtype, gate=gate,
                               strength=strength, initial_state=True, seed=T + K)
    check("gla", args, dict(chunk_size=C, sub_chunk_size=c), GRAD_TOLERANCE[dtype])


@pytest.mark.parametrize("B,T,H,K,V,C,c", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_linear_attn_gradients_match_float64_autograd(B, T, H, K, V, C, c, dtype):
    args = testing.make_inputs("linear_attn", B=B, T=T, H=H, K=K, V=V, dtype=dtype,
                               initial_state=True, seed=T)
    check("linear_attn", args, dict(chunk_size=C), GRAD_TOLERANCE[dtype])


@pytest.mark.parametrize("gate", ["per_head", "per_dim"])
def test_long_sequence_strong_gates(gate):
    """Per-step log-gates down to −20 over 12 chunks: finite and accurate gradients, the gate's
    included (a bare exp(−b) would be inf after a few steps)."""
    args = testing.make_inputs("gla", B=1, T=700, H=1, K=16, V=8, gate=gate, strength="strong",
                               initial_state=True, seed=3)
    check("gla", args, dict(chunk_size=64, sub_chunk_size=16), GRAD_TOLERANCE[torch.float32])


@pytest.mark.parametrize("op,gate", [("linear_attn", None), ("gla", "per_head"), ("gla", "per_dim")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_recompute_and_kept_states_give_one_gradient(op, gate, dtype):
    kw = {"gate": gate} if gate else {}
    args = testing.make_inputs(op, B=1, T=45, H=2, K=8, V=12, dtype=dtype, initial_state=True, **kw)
    names = differentiable(op, args)
    w_o, w_S = weights(args, op)
    extra = dict(chunk_size=16, sub_chunk_size=4) if op == "gla" else dict(chunk_size=16)
    a = grads(getattr(chunk, op), args, names, w_o, w_S, recompute=True, **extra)
    b = grads(getattr(chunk, op), args, names, w_o, w_S, recompute=False, **extra)
    for n in names:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("op,gate", [("linear_attn", None), ("gla", "per_head"), ("gla", "per_dim")])
@pytest.mark.parametrize("recompute", [True, False])
def test_gradcheck_float64(op, gate, recompute):
    """Finite differences of the Function itself: both outputs (o and the final state) get random
    incoming gradients; T = 11 is not a multiple of the chunk (8) or sub-chunk (4)."""
    kw = {"gate": gate} if gate else {}
    args = testing.make_inputs(op, B=1, T=11, H=1, K=4, V=3, dtype=torch.float64,
                               initial_state=True, seed=5, **kw)
    names = differentiable(op, args)
    extra = dict(chunk_size=8, sub_chunk_size=4) if op == "gla" else dict(chunk_size=8)
    if op == "gla":
        args["g"] = args["g"].double() - 0.01                    # stays ≤ 0 under the ±1e-6 probes
    args["initial_state"] = args["initial_state"].double()

    def f(*xs):
        kwargs = {**args, **dict(zip(names, xs))}
        return getattr(chunk, op)(**kwargs, output_final_state=True, recompute=recompute, **extra)

    inputs = tuple(args[n].detach().clone().requires_grad_(True) for n in names)
    o, _ = f(*inputs)
    assert o.grad_fn is not None and "ChunkwiseGated" in type(o.grad_fn).__name__
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_only_what_requires_grad_and_no_final_state_gradient():
    """Only v requires grad and the final state is not returned: dS starts at zero."""
    args = testing.make_inputs("gla", B=1, T=30, H=2, K=8, V=8, initial_state=True, seed=9)
    v = args["v"].clone().requires_grad_(True)
    with testing.poisoned():
        o, S = chunk.gla(**{**args, "v": v}, chunk_size=16, sub_chunk_size=4)
        o.sum().backward()
    assert S is None and args["q"].grad is None and args["g"].grad is None
    v64 = args["v"].double().requires_grad_(True)
    o_ref, _ = naive.gla(**{**testing.to_float64(args), "v": v64})
    o_ref.sum().backward()
    assert testing.rel_err(v.grad, v64.grad) <= GRAD_TOLERANCE[torch.float32]


def test_plain_forward_without_grad():
    """No input requires grad (or grad is disabled): no Function, no graph."""
    args = testing.make_inputs("gla", B=1, T=20, H=1, K=8, V=8)
    o, _ = chunk.gla(**args)
    assert o.grad_fn is None
    args["q"].requires_grad_(True)
    with torch.no_grad():
        o, _ = chunk.gla(**args)
    assert o.grad_fn is None


def test_dispatcher_passes_recompute():
    args = testing.make_inputs("gla", B=1, T=20, H=1, K=8, V=8)
    args["q"].requires_grad_(True)
    o, _ = linattn.gla(**args, impl="chunk", recompute=False, chunk_size=16, sub_chunk_size=8)
    assert "ChunkwiseGated" in type(o.grad_fn).__name__
    o, _ = linattn.gla(**args, impl="naive", recompute=False)   # a level without it drops the knob
    assert o.grad_fn is not None


@pytest.mark.parametrize("C,c", [(1, 1), (12, 4), (48, 16), (64, 16)])
@pytest.mark.parametrize("strength", ["normal", "strong"])
def test_halving_tiles_match_float64(C, c, strength):
    """gla_tiles (the split repeated inside the diagonal tiles) against the float64 attention
    matrix, and its gradient tiles against float64 autograd through it; C not a power of two too."""
    gen = torch.Generator().manual_seed(C)
    q, k = torch.randn(2, C, 16, generator=gen), torch.randn(2, C, 16, generator=gen)
    g = testing.log_gates((2, C, 16), strength, generator=gen)
    q64, k64 = q.double().requires_grad_(True), k.double().requires_grad_(True)
    truth = attention_matrix(q64, k64, g.double())
    P = gla_tiles.intra_matrix(q, k, gla_tiles.Sweep(g.exp()), c, torch.float32)
    assert P.shape == (2, C, C) and (P.triu(1) == 0).all()
    assert testing.rel_err(P, truth) <= testing.tolerance(torch.float32)
    Pb = gla_tiles.intra_matrix(q, k, gla_tiles.Sweep(g.exp()), c, torch.bfloat16)
    assert testing.rel_err(Pb, truth) <= testing.tolerance(torch.bfloat16)
    dP = torch.randn(2, C, C, generator=gen).tril(-1)
    (truth * dP.double()).sum().backward()
    P2, dq, dk = gla_tiles.intra_backward(dP, q, k, gla_tiles.Sweep(g.exp()))
    assert testing.rel_err(P2, truth) <= testing.tolerance(torch.float32)
    assert testing.rel_err(dq, q64.grad) <= GRAD_TOLERANCE[torch.float32]
    assert testing.rel_err(dk, k64.grad) <= GRAD_TOLERANCE[torch.float32]


@pytest.mark.parametrize("gate", ["per_head", "per_dim"])
def test_only_the_final_state_is_used(gate):
    """No gradient reaches the output (autograd passes None for it): the reverse pass starts from the
    final-state gradient alone."""
    args = testing.make_inputs("gla", B=1, T=40, H=2, K=8, V=4, gate=gate, initial_state=True, seed=4)
    names = differentiable("gla", args)
    got_args = {n: a.clone().requires_grad_(True) for n, a in args.items()}
    ref_args = {n: a.double().requires_grad_(True) for n, a in args.items()}
    with testing.poisoned():
        _, S = chunk.gla(**got_args, output_final_state=True, chunk_size=16, sub_chunk_size=4)
        (S ** 2).sum().backward()
    _, S_ref = naive.gla(**ref_args, output_final_state=True)
    (S_ref ** 2).sum().backward()
    assert ref_args["q"].grad is None and not got_args["q"].grad.any()   # q never reaches S
    for n in names[1:]:
        assert testing.rel_err(got_args[n].grad, ref_args[n].grad) <= GRAD_TOLERANCE[torch.float32], n
