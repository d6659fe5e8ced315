"""The reverse-time recurrences of linattn.naive.backward equal float64 autograd through the
naive forward, for every op, both gate shapes, an initial state, an incoming final-state
gradient, T = 1 and strong gates; the closed-form gate gradient equals the recurrence's."""
import pytest
import torch

from linattn import naive, testing
from linattn.naive import backward
from linattn.validate import InputError

TOL = testing.tolerance(torch.float64)
# (op, gate shape or None)
OPS = [("linear_attn", None), ("gla", "per_dim"), ("gla", "per_head"),
       ("delta_rule", None), ("kda", "per_dim"), ("kda", "per_head")]
FORWARD = {"linear_attn": naive.linear_attn, "gla": naive.gla, "delta_rule": naive.delta_rule,
           "kda": naive.kda}
BACKWARD = {"linear_attn": backward.linear_attn_backward, "gla": backward.gla_backward,
            "delta_rule": backward.delta_rule_backward, "kda": backward.kda_backward}
ORDER = ("q", "k", "v", "g", "beta")  # the positional order of every op's tensors


def setting(op, gate, *, T=13, strength="normal", init=True, dfinal=True, scale=None, seed=0):
    args = testing.to_float64(testing.make_inputs(op, B=2, T=T, H=2, K=5, V=3, gate=gate or "per_dim",
                                                  strength=strength, initial_state=init, seed=seed))
    gen = torch.Generator().manual_seed(seed + 100)
    do = torch.randn(2, T, 2, 3, generator=gen, dtype=torch.float64)
    dS = torch.randn(2, 2, 5, 3, generator=gen, dtype=torch.float64) if dfinal else None
    return args, do, dS, scale


def autograd_grads(op, args, do, dS, scale):
    leaves = {n: a.clone().requires_grad_() for n, a in args.items()}
    o, S = FORWARD[op](*(leaves[n] for n in ORDER if n in leaves),
                       scale=scale, initial_state=leaves.get("initial_state"), output_final_state=True)
    loss = (o * do).sum() + ((S * dS).sum() if dS is not None else 0)
    loss.backward()
    return {"d" + n: x.grad for n, x in leaves.items()}


def ours(op, args, do, dS, scale):
    with testing.poisoned():
        return BACKWARD[op](*(args[n] for n in ORDER if n in args), do, scale=scale,
                            initial_state=args.get("initial_state"), dfinal_state=dS)


@pytest.mark.parametrize("op,gate", OPS)
@pytest.mark.parametrize("T,strength,init,dfinal,scale", [
    (13, "normal", True, True, None),
    (13, "strong", True, True, 0.7),     # exp(−20) per step: the walk must not divide by a decay
    (1, "normal", True, True, None),
    (9, "weak", False, False, None),
    (9, "normal", False, True, None),
])
def test_recurrence_equals_autograd(op, gate, T, strength, init, dfinal, scale):
    args, do, dS, scale = setting(op, gate, T=T, strength=strength, init=init, dfinal=dfinal,
                                  scale=scale)
    want = autograd_grads(op, args, do, dS, scale)
    got = ours(op, args, do, dS, scale)
    for name, ref in want.items():
        err = testing.rel_err(got[name], ref)
        assert err <= TOL, f"{op} {gate}: {name} rel err {err:.3g}"
    if not init:
        assert got["dinitial_state"] is None


@pytest.mark.parametrize("op,gate", [o for o in OPS if o[1]])
@pytest.mark.parametrize("strength", ["normal", "strong"])
@pytest.mark.parametrize("dfinal", [True, False])
def test_closed_form_gate_gradient(op, gate, strength, dfinal):
    args, do, dS, scale = setting(op, gate, strength=strength, dfinal=dfinal, seed=3)
    got = ours(op, args, do, dS, scale)
    final = FORWARD[op](**args, output_final_state=True)[1] if dfinal else None
    dg = backward.gate_grad_closed_form(args["q"], args["k"], got["dq"], got["dk"], args["g"],
                                        dk_read=got.get("dk_read"), final_state=final,
                                        dfinal_state=dS)
    assert dg.shape == args["g"].shape
    assert testing.rel_err(dg, got["dg"]) <= TOL
    assert testing.rel_err(dg, autograd_grads(op, args, do, dS, scale)["dg"]) <= TOL


def test_closed_form_mistakes_are_far_off():
    # The sign and the direction of the sum matter: each mistake is far from the truth.
    args, do, dS, scale = setting("gla", "per_dim", seed=5)
    got = ours("gla", args, do, dS, scale)
    final = naive.gla(**args, output_final_state=True)[1]
    q, k, dq, dk = args["q"], args["k"], got["dq"], got["dk"]
    db = q * dq - k * dk
    db[:, -1] += (final * dS).sum(-1)
    assert testing.rel_err(-db.flip(1).cumsum(1).flip(1), got["dg"]) > 1.0      # sign flipped
    assert testing.rel_err(db.cumsum(1), got["dg"]) > 0.1                        # prefix sum
    no_final = backward.gate_grad_closed_form(q, k, dq, dk, args["g"])
    assert testing.rel_err(no_final, got["dg"]) > 1e-3                           # S_T term dropped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_come_back_in_each_inputs_dtype(dtype):
    args = testing.make_inputs("kda", B=1, T=5, H=1, K=4, V=4, dtype=dtype, initial_state=True)
    do = torch.randn(1, 5, 1, 4, dtype=dtype)
    got = backward.kda_backward(args["q"], args["k"], args["v"], args["g"], args["beta"], do,
                                initial_state=args["initial_state"])
    assert got["dq"].dtype == dtype and got["dv"].dtype == dtype
    assert got["dg"].dtype == args["g"].dtype and got["dbeta"].dtype == args["beta"].dtype
    assert got["dinitial_state"].dtype == args["initial_state"].dtype
    ref = autograd_grads("kda", testing.to_float64(args), do.double(), None, None)
    assert testing.rel_err(got["dv"], ref["dv"]) <= testing.tolerance(dtype)


def test_bad_inputs_name_the_argument():
    args, do, dS, _ = setting("gla", "per_dim", T=4)
    with pytest.raises(InputError, match="do"):
        backward.gla_backward(args["q"], args["k"], args["v"], args["g"], do[:, :3])
    with pytest.raises(InputError, match="dfinal_state"):
        backward.gla_backward(args["q"], args["k"], args["v"], args["g"], do, dfinal_state=dS[:, :1])
    with pytest.raises(InputError, match="g"):
        backward.gla_backward(args["q"], args["k"], args["v"], args["g"][..., :2], do)
    with pytest.raises(InputError, match="final_state"):
        backward.gate_grad_closed_form(args["q"], args["k"], args["q"], args["k"], args["g"],
                                       dfinal_state=dS)
