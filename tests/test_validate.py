"""Bad input fails early with an error that names the argument and what was expected."""
import pytest
import torch

import linattn
from linattn import chunk, naive, testing
from linattn.validate import InputError, check_inputs, value_checks

FNS = [naive.linear_attn, chunk.linear_attn, linattn.linear_attn]


def good(**kw):
    return testing.make_inputs("linear_attn", T=8, **kw)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"][0]), r"q must have 4 dimensions"),
    (lambda a: a.update(k=a["k"][..., :-1]), r"k must have q's shape"),
    (lambda a: a.update(v=a["v"][:, :-1]), r"v must have shape \[B, T, H, V\]"),
    (lambda a: a.update(k=a["k"].double()), r"k has dtype torch.float64 but q has torch.float32"),
    (lambda a: a.update(q=a["q"].int()), r"q must be float16, bfloat16, float32 or float64"),
    (lambda a: a.update(v=a["v"].tolist()), r"v must be a torch.Tensor"),
    (lambda a: a.update(initial_state=torch.zeros(2, 2, 32, 47)), r"initial_state must have shape \[B, H, K, V\]"),
    (lambda a: a.update(scale=-1.0), r"scale must be a positive finite number"),
    (lambda a: a.update(q=a["q"][:, :0], k=a["k"][:, :0], v=a["v"][:, :0]), r"every dimension must be ≥ 1"),
])
def test_bad_inputs_name_the_argument(fn, change, match):
    args = good()
    change(args)
    with pytest.raises(InputError, match=match):
        fn(**args)


@pytest.mark.parametrize("size,match", [(0, "chunk_size must be an int ≥ 1"), (2.5, "chunk_size"),
                                         (True, "chunk_size")])
def test_bad_chunk_size(size, match):
    with pytest.raises(InputError, match=match):
        chunk.linear_attn(**good(), chunk_size=size)


def test_gate_checks():
    args = testing.make_inputs("gla", T=8)
    check_inputs(args["q"], args["k"], args["v"], g=args["g"], gate=True)
    for bad, match in [(args["g"].abs() + 0.1, "log-decays ≤ 0"),
                       (torch.full_like(args["g"], float("nan")), "NaN"),
                       (torch.full_like(args["g"], -float("inf")), "-inf"),
                       (args["g"][..., :3], r"g must have shape \[B, T, H\]")]:
        with pytest.raises(InputError, match=match):
            check_inputs(args["q"], args["k"], args["v"], g=bad, gate=True)
    with value_checks(False):  # benchmarks skip the data-dependent checks, shapes still checked
        check_inputs(args["q"], args["k"], args["v"], g=args["g"].abs() + 0.1, gate=True)


def test_beta_checks():
    args = testing.make_inputs("delta_rule", T=8)
    q, k, v = args["q"], args["k"], args["v"]
    check_inputs(q, k, v, beta=args["beta"], delta=True)
    with pytest.raises(InputError, match=r"beta must lie in \[0.0, 2.0\]"):
        check_inputs(q, k, v, beta=args["beta"] + 2.5, delta=True)
    with pytest.raises(InputError, match=r"beta must have shape \[B, T, H\]"):
        check_inputs(q, k, v, beta=args["beta"][..., None], delta=True)


def test_dispatcher_rejects_unknown_impl():
    with pytest.raises(InputError, match="impl must be one of"):
        linattn.linear_attn(**good(), impl="fast")


def test_value_checks_by_device(monkeypatch):
    # Default: on for CPU tensors (cheap, and where readers learn), off for GPU tensors (a pass over
    # the input and a host sync per check); forced either way by value_checks() or the environment.
    from linattn.validate import checking_values
    cpu = torch.zeros(1)
    meta = torch.zeros(1, device="meta")                  # stands in for a GPU tensor: not the CPU
    assert checking_values(cpu) and not checking_values(meta)
    with value_checks(True):
        assert checking_values(meta)
    with value_checks(False):
        assert not checking_values(cpu)
    monkeypatch.setenv("LINATTN_CHECK_VALUES", "1")
    assert checking_values(meta)
    monkeypatch.setenv("LINATTN_CHECK_VALUES", "0")
    assert not checking_values(cpu)
    monkeypatch.setenv("LINATTN_CHECK_VALUES", "yes")
    with pytest.raises(InputError, match="LINATTN_CHECK_VALUES"):
        checking_values(cpu)


@pytest.mark.parametrize("impl", ["naive", "chunk"])
@pytest.mark.parametrize("typo,meant", [("initial_sate", "initial_state"),
                                        ("output_final_sate", "output_final_state"),
                                        ("scal", "scale"), ("chunk_sise", "chunk_size")])
def test_dispatcher_refuses_misspelled_keywords(impl, typo, meant):
    # A dropped initial_sate= would run from a zero state: a silently wrong result.
    args = testing.make_inputs("gla", T=8)
    value = torch.zeros(2, 2, 32, 48) if "state" in typo and "final" not in typo else 1.0
    with pytest.raises(InputError, match=f"'{typo}'.*did you mean '{meant}'"):
        linattn.gla(**args, impl=impl, **{typo: value})
    with pytest.raises(TypeError, match=typo):                # what Python raises for a bad keyword
        linattn.gla(**args, impl=impl, **{typo: value})


def test_dispatcher_keyword_rule():
    # Tuning knobs (how, never what) are ignored by a level without them; a semantic keyword the
    # level lacks is refused by name.
    args = testing.make_inputs("gla", T=8)
    o, _ = linattn.gla(**args, impl="naive", chunk_size=16, sub_chunk_size=8, recompute=False,
                       mode="auto")
    ref, _ = naive.gla(**args)
    assert torch.equal(o, ref)
    with pytest.raises(InputError, match="naive.gla does not take the keyword argument 'inter_dtype'"):
        linattn.gla(**args, impl="naive", inter_dtype=torch.bfloat16)
    with pytest.raises(InputError, match="'bogus'"):
        linattn.linear_attn(**good(), bogus=1)


@pytest.mark.parametrize("fn", FNS + [chunk.gla])
@pytest.mark.parametrize("scale", [1e300, 1e5, float("nan"), float("inf"), 0.0, 1e-300, True])
def test_scale_range(fn, scale):
    # 1e300 was accepted and gave inf/NaN; 1e-300 rounds to 0 in float32 (all-zero outputs).
    args = testing.make_inputs("gla" if fn is chunk.gla else "linear_attn", T=8)
    with pytest.raises(InputError, match=r"scale must be a positive finite number in \[1e-30, 10000\]"):
        fn(**args, scale=scale)
    o, _ = fn(**args, scale=1e4)
    assert torch.isfinite(o).all()


def test_chunk_size_not_a_multiple_of_the_default_sub_chunk_size():
    # The caller passed only chunk_size: the error names it (not the default sub_chunk_size) and
    # says which values are accepted.
    args = testing.make_inputs("gla", T=8)
    with pytest.raises(InputError, match=r"^chunk_size must be a multiple of sub_chunk_size=16 \(e.g. 16, 32, 64\), got 8"):
        chunk.gla(**args, chunk_size=8)
    with pytest.raises(InputError, match=r"^sub_chunk_size must be an int ≥ 1"):
        chunk.gla(**args, sub_chunk_size=0)
    o, _ = chunk.gla(**args, chunk_size=8, sub_chunk_size=8)
    assert testing.rel_err(o, naive.gla(**args)[0]) < testing.tolerance(torch.float32)


def test_levels_reachable_after_import_linattn():
    # A fresh interpreter: `import linattn` alone must make the levels and layers reachable, without
    # importing Triton (kept fast; and Triton's mode must be fixed before a kernel module loads).
    import subprocess
    import sys
    code = ("import sys, linattn; assert 'triton' not in sys.modules; "
            "linattn.naive.gla, linattn.chunk.gla, linattn.nn.LinearAttention; "
            "import os; assert linattn.triton.gla and (os.environ.get('TRITON_INTERPRET') == '1') "
            "== (not linattn.device.has_cuda()); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("level", [naive, chunk, linattn])
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "initial_state"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_refused_by_name_and_position(level, name, bad):
    # At the chunk and Triton levels a NaN at token t makes its whole chunk NaN, earlier outputs
    # included: with the value checks on (CPU default) it is refused, naming where it is.
    op = "kda" if name in ("g", "beta") else "linear_attn"
    args = testing.make_inputs(op, B=2, T=9, H=2, K=8, V=8, initial_state=True)
    x = args[name].clone()
    at = {3: (1, 5, 1), 4: (1, 5, 1, 3)}[x.dim()] if name != "initial_state" else (1, 1, 5, 3)
    x[at] = -bad if name == "g" else bad                              # g = +inf is "> 0" instead
    args[name] = x
    where = rf"{name}\[{', '.join(map(str, at))}\] = -?{bad}"
    with pytest.raises(InputError, match=where):
        getattr(level, op)(**args)
    with value_checks(False):                                         # the GPU default: not read
        o, _ = getattr(chunk, op)(**args)
    assert not torch.isfinite(o).all()


def test_large_finite_inputs_pass_the_finite_check():
    # The fast test is a float32 sum, which a large finite input can overflow: then it looks again.
    args = good()
    args["v"] = torch.full_like(args["v"], 3e36, dtype=torch.bfloat16)
    from linattn.validate import check_finite
    assert not torch.isfinite(args["v"].sum(dtype=torch.float32))
    check_finite("v", args["v"])
