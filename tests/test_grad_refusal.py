"""No result is ever silently detached from the graph: every level and every implementation either
carries the gradient or refuses inputs that require grad by name (a model trained through a detached
result would leave its q, k, v projections untrained without any error)."""
import pytest
import torch

import linattn
from linattn import device, testing
from linattn.validate import InputError, refuse_grad

DEV = device.default_device()
CASES = [("linear_attn", {}), ("gla", {"gate": "per_dim"}), ("gla", {"gate": "per_head"}),
         ("delta_rule", {}), ("kda", {"gate": "per_dim"}), ("kda", {"gate": "per_head"})]


@pytest.mark.parametrize("impl", ["naive", "chunk", "triton"])
@pytest.mark.parametrize("op,kw", CASES, ids=[f"{op}-{kw.get('gate', '')}" for op, kw in CASES])
def test_every_level_stays_on_the_graph(op, kw, impl):
    args = testing.make_inputs(op, B=1, T=20, H=1, K=16, V=16, device=DEV, **kw)
    args["v"].requires_grad_(True)
    o, _ = getattr(linattn, op)(**args, impl=impl, **({"chunk_size": 16} if impl != "naive" else {}))
    assert o.requires_grad and o.grad_fn is not None
    o.sum().backward()
    assert args["v"].grad is not None and torch.isfinite(args["v"].grad).all()


def test_refuse_grad_names_the_inputs():
    x, y = torch.zeros(2, requires_grad=True), torch.zeros(2)
    with pytest.raises(InputError, match=r"f has no backward pass, but x require"):
        refuse_grad("f", x=x, y=y)
    refuse_grad("f", y=y)                                  # nothing requires grad: fine
    with torch.no_grad():
        refuse_grad("f", x=x)                              # inference: fine


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("impl", ["chunk", "triton"])
@pytest.mark.parametrize("op,kw", CASES, ids=[f"{op}-{kw.get('gate', '')}" for op, kw in CASES])
def test_hand_written_backwards_refuse_double_backward(op, kw, impl, recompute):
    # The hand-written backwards are first-order: a second derivative through them must be refused
    # with a message naming the alternative, never returned wrong (or silently missing terms).
    from linattn.validate import DoubleBackwardError
    args = testing.make_inputs(op, B=1, T=20, H=1, K=16, V=16, device=DEV, **kw)
    q = args["q"].requires_grad_(True)
    o, _ = getattr(linattn, op)(**args, impl=impl, chunk_size=16, recompute=recompute)
    w = torch.randn_like(o)                                # an incoming gradient without a graph
    dq, = torch.autograd.grad((o * w).sum(), q, create_graph=True)
    with pytest.raises(DoubleBackwardError, match="impl='naive'"):
        torch.autograd.grad(dq.square().sum() + q.square().sum(), q)


def test_naive_level_is_differentiable_twice():
    args = testing.make_inputs("gla", B=1, T=6, H=1, K=4, V=4, dtype=torch.float64)
    q = args["q"].requires_grad_(True)
    fn = lambda x: linattn.gla(**dict(args, q=x), impl="naive")[0].square().sum()  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, (q,))


@pytest.mark.parametrize("impl", ["naive", "chunk", "triton"])
def test_torch_func_transforms(impl):
    # torch.func.grad works at the naive level; the hand-written autograd.Functions have no functorch
    # rules, so grad is refused there by name, and vmap (no level supports it) everywhere.
    args = testing.make_inputs("gla", B=1, T=20, H=1, K=8, V=8)
    kw = {} if impl == "naive" else {"chunk_size": 16}
    f = lambda q: linattn.gla(**dict(args, q=q), impl=impl, **kw)[0].sum()  # noqa: E731
    if impl == "naive":
        dq = torch.func.grad(f)(args["q"])
        q = args["q"].clone().requires_grad_(True)
        assert torch.allclose(dq, torch.autograd.grad(f(q), q)[0])
    else:
        with pytest.raises(InputError, match=rf"linattn.{impl}.gla does not support torch.func"):
            torch.func.grad(f)(args["q"])
        level = getattr(linattn, impl)                                 # called directly, too
        with pytest.raises(InputError, match=rf"linattn.{impl}.gla does not support torch.func"):
            torch.func.grad(lambda q: level.gla(**dict(args, q=q), **kw)[0].sum())(args["q"])
    one = lambda q: linattn.gla(**dict(args, q=q[None]), impl=impl, **kw)[0][0]  # noqa: E731
    with pytest.raises(InputError, match="vmap"):
        torch.func.vmap(one)(args["q"].expand(3, -1, -1, -1).contiguous())
