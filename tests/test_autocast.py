"""CPU autocast (bf16): every chunk-level op and every layer runs forward and backward with the
documented dtypes. An op is one unit to autocast: it computes in its accumulation dtype whatever
region it is called in, so its numbers are those of the same call outside autocast."""
import pytest
import torch

from linattn import chunk, testing
from linattn import nn as lnn

CASES = [("linear_attn", None), ("gla", "per_dim"), ("gla", "per_head"), ("delta_rule", None),
         ("kda", "per_dim"), ("kda", "per_head")]


def _run(op, args, grad):
    args = {n: x.detach().clone().requires_grad_(grad) for n, x in args.items()}
    o, S = getattr(chunk, op)(**args, chunk_size=16, output_final_state=True)
    grads = None
    if grad:
        grads = torch.autograd.grad(o.float().square().sum() + S.sum(), list(args.values()))
    return o, S, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("op,gate", CASES, ids=[f"{op}-{g}" for op, g in CASES])
def test_chunk_ops_under_autocast(op, gate, grad, dtype):
    args = testing.make_inputs(op, B=1, T=40, H=2, K=16, V=16, dtype=dtype, initial_state=True,
                               **({"gate": gate} if gate else {}))
    o_ref, S_ref, g_ref = _run(op, args, grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, S, grads = _run(op, args, grad)
    assert o.dtype == dtype and S.dtype == torch.float32            # o in v's dtype, S in float32
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)
    if grad:
        for a, b, x in zip(grads, g_ref, args.values()):
            assert a.dtype == x.dtype and torch.equal(a, b)


@pytest.mark.parametrize("name", list(lnn.LAYERS))
def test_layers_under_autocast(name):
    torch.manual_seed(0)
    layer = lnn.LAYERS[name](32, 2)
    x = torch.randn(2, 40, 32)
    y32, _ = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = layer(x[:, :39])                                  # prefill
        y_last, _ = layer(x[:, 39:], state)                          # one decode step
        y = torch.cat([y, y_last], 1)
    assert y.dtype == torch.bfloat16
    assert testing.rel_err(y.float(), y32) < 3e-2                    # bf16 projections: ~1e-2
    y.float().square().sum().backward()
    for p in layer.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()
