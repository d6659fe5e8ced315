"""The chunkwise backward of chunk.delta_rule / chunk.kda against float64 autograd through the naive
recurrence, and torch.autograd.gradcheck in float64."""
import pytest
import torch

from linattn import chunk, naive, testing
from linattn.chunk.delta import unit_lower_inverse

# Gradient tolerances of the project (relative error vs float64 autograd through linattn.naive).
GRAD_TOL = testing.GRAD_TOLERANCE   # one place for gradient tolerances
OPS = [("delta_rule", None), ("kda", "per_head"), ("kda", "per_dim")]
OP_IDS = ["deltanet", "gated_deltanet", "kda"]


def inputs(op, gate, *, B, T, H, K, V, dtype, strength="normal", beta_max=1.0, seed=0):
    """Library inputs with an initial state; β ∈ (0, beta_max), unit keys so β‖k‖² ≤ beta_max ≤ 2."""
    a = testing.make_inputs(op, B=B, T=T, H=H, K=K, V=V, dtype=dtype, gate=gate or "per_dim",
                            strength=strength, initial_state=True, seed=seed)
    a["beta"] = a["beta"] * beta_max
    a["initial_state"] = a["initial_state"].to(dtype)
    return a


def names(a):
    return [n for n in ("q", "k", "v", "g", "beta", "initial_state") if n in a]


def grads(fn, a, dO, dS, **extra):
    """Gradients of Σ o·dO + Σ S_final·dS with respect to every tensor input (fresh leaves)."""
    leaves = {n: a[n].detach().clone().requires_grad_(True) for n in names(a)}
    o, S = fn(**{**a, **leaves}, output_final_state=True, **extra)
    ((o.double() * dO).sum() + (S.double() * dS).sum()).backward()
    return {n: x.grad for n, x in leaves.items()}, o


def upstream(a, seed=0):
    """Random incoming gradients dO [B, T, H, V] and dS_final [B, H, K, V] in float64."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, V = a["v"].shape
    K = a["k"].shape[-1]
    return (torch.randn(B, T, H, V, generator=gen, dtype=torch.float64),
            torch.randn(B, H, K, V, generator=gen, dtype=torch.float64))


# ---------------------------------------------------------------- gradcheck in float64

@pytest.mark.parametrize("op,gate", OPS, ids=OP_IDS)
@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep"])
def test_gradcheck(op, gate, recompute):
    """T = 7 in chunks of 3 (partial last chunk), initial state, final-state gradient, β ≤ 1.9."""
    a = testing.to_float64(inputs(op, gate, B=1, T=7, H=2, K=3, V=2, dtype=torch.float64,
                                  beta_max=1.9, seed=11))
    fn = getattr(chunk, op)

    def f(*xs):
        return fn(**{**a, **dict(zip(names(a), xs))}, output_final_state=True, chunk_size=3,
                  recompute=recompute)

    xs = [a[n].clone().requires_grad_(True) for n in names(a)]
    assert torch.autograd.gradcheck(f, xs, atol=1e-8, rtol=1e-6)


def test_gradcheck_strong_gates_and_no_initial_state():
    a = testing.to_float64(inputs("kda", "per_dim", B=1, T=6, H=1, K=3, V=2, dtype=torch.float64,
                                  strength="strong", beta_max=1.5, seed=4))
    del a["initial_state"]

    def f(*xs):
        return chunk.kda(**{**a, **dict(zip(names(a), xs))}, output_final_state=True, chunk_size=4)

    assert torch.autograd.gradcheck(f, [a[n].clone().requires_grad_(True) for n in names(a)])


def test_unit_lower_inverse_is_differentiable():
    A = torch.randn(2, 5, 5, dtype=torch.float64).tril(-1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: unit_lower_inverse(x.tril(-1)), [A])
    A = torch.randn(1, 16, 16, dtype=torch.float64).tril(-1).requires_grad_(True)     # four levels of joins
    assert torch.autograd.gradcheck(lambda x: unit_lower_inverse(x.tril(-1)), [A])


# ---------------------------------------------------------------- against the float64 recurrence

CASES = [  # B, T, H, K, V, chunk_size
    (1, 1, 1, 4, 4, 16),
    (2, 37, 2, 16, 24, 16),     # T not a multiple of C, K != V
    (1, 64, 1, 32, 8, 64),      # exactly one chunk
    (1, 100, 2, 8, 20, 32),     # partial last chunk
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("strength", ["normal", "strong"])
@pytest.mark.parametrize("op,gate", OPS, ids=OP_IDS)
@pytest.mark.parametrize("B,T,H,K,V,C", CASES)
def test_gradients_match_float64_naive(op, gate, strength, B, T, H, K, V, C, dtype):
    if op == "delta_rule" and strength == "strong":
        pytest.skip("DeltaNet has no gates")
    a = inputs(op, gate, B=B, T=T, H=H, K=K, V=V, dtype=dtype, strength=strength, beta_max=2.0,
               seed=T + K)
    dO, dS = upstream(a, seed=T)
    with testing.poisoned():                           # outputs and gradient buffers NaN-filled
        got, o = grads(getattr(chunk, op), a, dO, dS, chunk_size=C)
    want, o_ref = grads(getattr(naive, op), testing.to_float64(a), dO, dS)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    for n in names(a):
        assert got[n].dtype == a[n].dtype and got[n].shape == a[n].shape, n
        err = testing.rel_err(got[n], want[n])
        where = testing.worst_position(got[n], want[n])
        assert err <= GRAD_TOL[dtype], f"d{n}: rel err {err:.2e}, worst at {where}"


@pytest.mark.parametrize("op,gate", OPS, ids=OP_IDS)
def test_recompute_and_kept_states_agree(op, gate):
    a = inputs(op, gate, B=2, T=50, H=2, K=8, V=6, dtype=torch.float32, seed=2)
    dO, dS = upstream(a)
    g1, _ = grads(getattr(chunk, op), a, dO, dS, chunk_size=16, recompute=True)
    g2, _ = grads(getattr(chunk, op), a, dO, dS, chunk_size=16, recompute=False)
    for n in names(a):
        assert testing.rel_err(g1[n], g2[n]) < 1e-6, n


def test_strong_gates_stay_finite_in_long_chunks():
    """−20 per token is −1280 over a chunk of 64: e^{−G} alone would overflow float32."""
    a = inputs("kda", "per_dim", B=1, T=150, H=1, K=16, V=8, dtype=torch.float32, beta_max=2.0,
               seed=5)
    a["g"] = torch.full_like(a["g"], -20.0)
    dO, dS = upstream(a)
    got, _ = grads(chunk.kda, a, dO, dS, chunk_size=64)
    want, _ = grads(naive.kda, testing.to_float64(a), dO, dS)
    for n in names(a):
        assert torch.isfinite(got[n]).all(), n
        assert testing.rel_err(got[n], want[n]) <= GRAD_TOL[torch.float32], n


def test_only_final_state_or_only_output_used():
    """A gradient reaching the backward through one output only (the other's is zero)."""
    a = inputs("kda", "per_dim", B=1, T=20, H=1, K=4, V=4, dtype=torch.float64, seed=6)
    for use in ("o", "S"):
        leaves = {n: a[n].clone().requires_grad_(True) for n in names(a)}
        ref = {n: a[n].clone().requires_grad_(True) for n in names(a)}
        o, S = chunk.kda(**{**a, **leaves}, output_final_state=True, chunk_size=8)
        o2, S2 = naive.kda(**{**a, **ref}, output_final_state=True)
        (o.sum() if use == "o" else S.sum()).backward()
        (o2.sum() if use == "o" else S2.sum()).backward()
        for n in names(a):                                             # q does not reach S: None
            want = torch.zeros_like(a[n]) if ref[n].grad is None else ref[n].grad
            assert testing.rel_err(leaves[n].grad, want) < 1e-10 or want.abs().max() == 0 == \
                leaves[n].grad.abs().max(), (use, n)


def test_grad_free_calls_run_the_plain_forward(monkeypatch):
    """The autograd.Function only when a gradient is wanted: otherwise no overhead, no saved inputs."""
    from linattn.chunk import delta_backward

    def used(*args):
        raise RuntimeError("DeltaChunkFunction used")

    a = inputs("kda", "per_head", B=1, T=10, H=1, K=4, V=4, dtype=torch.float32)
    o, _ = chunk.kda(**{**a, "q": a["q"].clone().requires_grad_(True)})
    assert type(o.grad_fn).__name__ == "DeltaChunkFunctionBackward"
    monkeypatch.setattr(delta_backward.DeltaChunkFunction, "apply", used)
    chunk.kda(**a)                                                     # nothing requires grad
    with torch.no_grad():
        chunk.kda(**{**a, "q": a["q"].clone().requires_grad_(True)})
    with pytest.raises(RuntimeError, match="used"):
        chunk.kda(**{**a, "q": a["q"].clone().requires_grad_(True)})


@pytest.mark.parametrize("C", [32, 64])
def test_steep_and_gentle_sub_chunks_together(C):
    """KDA's diagonal sub-chunk blocks go by one matmul where the gates decay gently and column by
    column where they decay by more than e^{-60}: both kinds in one call, forward and backward."""
    a = inputs("kda", "per_dim", B=1, T=90, H=2, K=8, V=8, dtype=torch.float32, beta_max=2.0, seed=9)
    a["g"][:, :, 0] = testing.log_gates(a["g"][:, :, 0].shape, "strong")   # head 0 steep
    a["g"][:, 40:50, 1] *= 200                                          # one steep stretch in head 1
    dO, dS = upstream(a)
    got, o = grads(chunk.kda, a, dO, dS, chunk_size=C)
    want, o_ref = grads(naive.kda, testing.to_float64(a), dO, dS)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(torch.float32)
    for n in names(a):
        assert testing.rel_err(got[n], want[n]) <= GRAD_TOL[torch.float32], n


def test_no_double_backward():
    """Second derivatives are refused, not computed wrongly through tensors kept without a graph."""
    a = testing.to_float64(inputs("kda", "per_dim", B=1, T=5, H=1, K=2, V=2, dtype=torch.float64))
    q = a["q"].clone().requires_grad_(True)
    o, _ = chunk.kda(**{**a, "q": q}, chunk_size=4)
    (dq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        dq.sum().backward()


def test_gates_without_grad():
    """Fixed gates (no grad wanted for g): the other gradients are unchanged and g gets none."""
    a = inputs("kda", "per_dim", B=1, T=20, H=1, K=4, V=4, dtype=torch.float64, seed=8)
    dO, dS = upstream(a)
    full, _ = grads(chunk.kda, a, dO, dS, chunk_size=8)
    leaves = {n: a[n].clone().requires_grad_(n != "g") for n in names(a)}
    o, S = chunk.kda(**leaves, output_final_state=True, chunk_size=8)
    ((o * dO).sum() + (S * dS).sum()).backward()
    assert leaves["g"].grad is None
    for n in names(a):
        if n != "g":
            assert testing.rel_err(leaves[n].grad, full[n]) < 1e-12, n
