"""Decoding: the one-token steps (linattn.naive.step) and the fused Triton step (linattn.triton.step).

The Triton step runs in the interpreter here; natively on a GPU in the lead's GPU run.
Checked against the float64 naive recurrence: one step from a given state, and a whole decode loop
(token after token, the state carried) against the whole-sequence recurrence.
"""
import pytest
import torch

from linattn import device, naive, testing
from linattn.triton import step as fused
from linattn.validate import InputError, value_checks

OPS = [("linear_attn", "per_dim"), ("gla", "per_dim"), ("gla", "per_head"), ("delta_rule", "per_dim"),
       ("kda", "per_dim"), ("kda", "per_head")]
IDS = [f"{op}-{gate}" for op, gate in OPS]
DEV = device.default_device()   # the Triton step runs natively on a GPU, in the interpreter on a CPU


def one_token(args, t):
    """The step's arguments for token t of a make_inputs sequence."""
    return {n: a[:, t] for n, a in args.items() if n != "initial_state"}


@pytest.mark.parametrize("op,gate", OPS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_state", [True, False])
def test_fused_step_matches_naive(op, gate, dtype, with_state):
    # K = 20 (not a power of two), V = 70 (two column blocks, the second partial).
    args = testing.make_inputs(op, B=2, T=1, H=3, K=20, V=70, gate=gate, dtype=dtype,
                               initial_state=with_state, seed=4, device=DEV)
    state = args.get("initial_state")
    tok = one_token(args, 0)
    ref_o, ref_S = getattr(naive, op + "_step")(**testing.to_float64(tok),
                                                state=None if state is None else state.double())
    with testing.poisoned():
        o, S = getattr(fused, op + "_step")(**tok, state=state)
    assert o.dtype == dtype and S.dtype == torch.float32
    assert testing.rel_err(o, ref_o) <= testing.tolerance(dtype)
    assert testing.rel_err(S, ref_S) <= testing.tolerance(torch.float32)


@pytest.mark.parametrize("op,gate", OPS, ids=IDS)
@pytest.mark.parametrize("level", ["naive", "triton"])
def test_decode_loop_matches_whole_sequence(op, gate, level):
    args = testing.make_inputs(op, B=1, T=9, H=2, K=16, V=16, gate=gate, initial_state=True, seed=5, device=DEV)
    ref_o, ref_S = getattr(naive, op)(**testing.to_float64(args), output_final_state=True)
    step = getattr(naive if level == "naive" else fused, op + "_step")
    state, outs = args["initial_state"], []
    with testing.poisoned():
        for t in range(9):
            o, state = step(**one_token(args, t), state=state)
            outs.append(o)
    assert testing.rel_err(torch.stack(outs, 1), ref_o) <= testing.tolerance(torch.float32)
    assert testing.rel_err(state, ref_S) <= testing.tolerance(torch.float32)


def test_inplace_writes_over_the_state():
    args = testing.make_inputs("kda", B=1, T=1, H=2, K=16, V=16, initial_state=True, seed=6, device=DEV)
    state = args["initial_state"].clone()
    ref_o, ref_S = naive.kda_step(**one_token(args, 0), state=args["initial_state"])
    o, S = fused.kda_step(**one_token(args, 0), state=state, inplace=True)
    assert S.data_ptr() == state.data_ptr()
    assert testing.rel_err(state, ref_S) <= testing.tolerance(torch.float32)
    assert testing.rel_err(o, ref_o) <= testing.tolerance(torch.float32)
    with pytest.raises(InputError, match="state"):
        fused.kda_step(**one_token(args, 0), inplace=True)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "state"])
def test_fused_step_refuses_grad(name):
    args = testing.make_inputs("kda", B=1, T=1, H=1, K=16, V=16, initial_state=True, device=DEV)
    tok = one_token(args, 0)
    tok["state"] = args["initial_state"]
    tok[name] = tok[name].clone().requires_grad_(True)
    with pytest.raises(InputError, match=rf"has no backward.*\b{name}\b"):
        fused.kda_step(**tok)
    with torch.no_grad():
        o, S = fused.kda_step(**tok)
    assert not o.requires_grad and not S.requires_grad


@pytest.mark.parametrize("module", [naive, fused], ids=["naive", "triton"])
def test_step_bad_inputs_fail_by_name(module):
    args = testing.make_inputs("kda", B=2, T=1, H=2, K=16, V=16, initial_state=True, device=DEV)
    tok = one_token(args, 0)
    with pytest.raises(InputError, match="q must be one token"):
        module.kda_step(**{**tok, "q": args["q"]})                   # [B, T, H, K]: a sequence
    with pytest.raises(InputError, match="state must have shape"):
        module.kda_step(**tok, state=args["initial_state"][:1])       # another batch size
    with pytest.raises(InputError, match="beta"):
        module.kda_step(**{**tok, "beta": tok["beta"][:, :1]})
    with value_checks(True):                                          # opt-in for GPU tensors
        with pytest.raises(InputError, match="g must"):
            module.kda_step(**{**tok, "g": -tok["g"].abs() + 1.0})    # a decay above 1
        with pytest.raises(InputError, match="k"):
            module.kda_step(**{**tok, "k": 3 * tok["k"]})             # not L2-normalised


def test_fused_step_refuses_float64():
    args = testing.make_inputs("gla", B=1, T=1, H=1, K=16, V=16, dtype=torch.float64, device=DEV)
    with pytest.raises(InputError, match="q has dtype"):
        fused.gla_step(**one_token(args, 0))


@pytest.mark.parametrize("mixer", ["softmax", "gla", "kda"])
def test_generate_equals_rerunning_the_whole_sequence(mixer):
    """Greedy tokens from prefill + one-token steps are those the whole-sequence model predicts."""
    from linattn import mqar
    from linattn.nn import generate

    torch.manual_seed(0)
    model = mqar.RecallModel(mixer, 32, d_model=32, n_heads=2, layers=2).eval()
    prompt = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    with testing.poisoned():
        seq, states = generate(model, prompt, 6)
        with torch.no_grad():
            logits, whole = model(seq)
    assert torch.equal(seq[:, 7:], logits[:, 6:-1].argmax(-1))
    assert all(s.seen == 13 for s in states)       # the last token is fed too: ready to continue
    for s, w in zip(states, whole):
        assert testing.rel_err(s.memory, w.memory) <= testing.tolerance(torch.float32)
