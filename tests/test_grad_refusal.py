"""A function without a backward refuses inputs that require grad, by name: it never returns a
result silently detached from the graph (a model trained through it would leave q, k, v untrained).

Each entry here is a Triton function whose backward is not written yet; remove it when it is.
Every Triton operation now has one (linear_attn and gla: tests/test_triton_backward_gated.py;
delta_rule and kda: tests/test_triton_backward_delta.py), so the list is empty and the test is
reported as skipped until a function without a backward is added.
"""
import pytest
import torch

from linattn import testing
from linattn import triton as lt
from linattn.validate import InputError

NO_BACKWARD = []


@pytest.mark.parametrize("op,kw", NO_BACKWARD, ids=lambda x: x if isinstance(x, str) else x.get("gate", ""))
def test_triton_refuses_grad(op, kw):
    args = testing.make_inputs(op, B=1, T=20, H=1, K=16, V=16, **kw)
    args["v"].requires_grad_(True)
    with pytest.raises(InputError, match=rf"linattn.triton.{op} has no backward.*\bv\b"):
        getattr(lt, op)(**args)
    with torch.no_grad():                                # inference still runs
        o, _ = getattr(lt, op)(**args)
    assert not o.requires_grad
