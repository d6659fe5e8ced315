"""The emulated mode (LINATTN_EMULATE=fp16 or bf16, `linattn.device`, `linattn.triton.emulate`):
Triton's interpreter runs the kernels with the native dtype decisions and rounds and multiplies as a
GPU does, so the native half-precision errors show on a CPU.

The mode is decided when linattn is imported, so the measurements run in a child process per dtype
(this file run as a script) and the tests read what it printed. Small cases against float64
autograd through `linattn.naive` (`linattn.conformance.case`), each with a precision rule of the
library that a bound below needs (each bound was seen to fail with its rule taken out):
- fp16 DeltaNet with an initial state, K = V = 128, whose scale K^-1/2 is not a power of two: the
  output kernel and the reverse state pass multiply Q S and Qᵀ dO by the scale after the product.
  With scale · q rounded into the fp16 operand first, d initial state comes out 2.73e-4 instead of
  1.53e-4 and o 4.13e-4 instead of 3.52e-4 (at K = 64 the scale 1/8 is exact and nothing shows).
- fp16 KDA with log-sigmoid gates, K = V = 64: the gate kernel's split score products take three
  tf32 products (`wy_backward.split_x3`). With one, dg comes out 1.63e-3 instead of 2.24e-4.
- fp16 GLA and linear attention, K = V = 128: the output step takes its computed operands in two
  parts against operands exact in fp16 (`common.dot_input`): q ⊙ e^b against the state, the
  intra-chunk matrix A against v (triton/gated.py). With both rounded to fp16 first, o comes out
  3.51e-4 instead of 2.78e-4 (GLA) and 2.94e-4 instead of 2.54e-4 (linear attention, A only).
  Per-head gates multiply q S by the decay e^{b_t} after the product (q stays the input): with
  q · e^{b_t} rounded into the operand, o comes out 3.04e-4 instead of 2.20e-4.
- bf16 DeltaNet at T = 2 (`CASES_BF16`): the score gradients as two bf16 parts against the keys
  (`wy_backward.mm_input`). With one bf16 operand, dq comes out 3.26e-3 instead of 2.18e-3.
- bf16 KDA with weak gates, an initial state and a final-state gradient, K = V = 128, T = 192: the
  reverse state pass takes dS and dṼ as two bf16 parts (`delta_backward.two_part_state_grads`).
  With one product each, d initial state comes out 2.53e-3 instead of 2.18e-3 and dv 3.65e-3
  instead of 3.22e-3.
- bf16 GLA with strong gates (the inputs of conformance case gla-length-039), whose intra-chunk
  matrix A spans many binades: A against v in two parts (triton/gated.py). With A rounded to bf16
  first, o comes out 2.51e-3 instead of 1.66e-3.
- bf16 linear attention on a single token (the inputs of conformance case linear_attn-extra-157),
  where the intra-chunk part is the whole of dq and dk: dA against the keys and queries in two
  parts (`gated_backward._intra_grad_kernel`). With dA rounded to bf16 first, dk comes out 2.88e-3
  instead of 1.65e-3 (FLA's 2.01e-3).
The plain interpreter computes the same cases with float32 tiles: the float32 results (final
state, d initial state, dg, dβ) are then below 1.5e-6 from float64, so an emulation that silently
fell back to float32 tiles fails `test_half_roundings_are_modelled`. How close the emulation comes
to a GPU: docs/native_correctness.md.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CASE = dict(B=1, T=128, H=2, dtype="float16", h0=False, final=False, dht=False, chunk_size=64,
            sub_chunk_size=None, seed=1)
CASES = {
    "delta_rule": dict(CASE, id="emulated-delta_rule", variant="delta_rule", K=128, V=128, strength=None,
                       h0=True, final=True),
    "kda": dict(CASE, id="emulated-kda", variant="kda", K=64, V=64, strength="logsigmoid"),
    "gla": dict(CASE, id="emulated-gla", variant="gla", K=128, V=128, strength="normal", sub_chunk_size=16,
                final=True),
    "linear_attn": dict(CASE, id="emulated-linear_attn", variant="linear_attn", K=128, V=128, strength=None,
                        final=True),
    "simple_gla": dict(CASE, id="emulated-simple_gla", variant="simple_gla", K=128, V=128, strength="normal",
                       final=True),
}
# bf16: DeltaNet at T = 2 (the inputs of conformance case delta_rule-length-038), whose dq and dk come
# from the intra-chunk scores alone (module doc)
CASES_BF16 = {
    "delta_rule_t2": dict(CASE, id="emulated-delta_rule-t2", variant="delta_rule", dtype="bfloat16", T=2,
                          H=1, K=128, V=128, strength=None, final=True, seed=38),
    "kda_weak": dict(CASE, id="emulated-kda-weak", variant="kda", dtype="bfloat16", T=192, K=128, V=128,
                     strength="weak", h0=True, final=True, dht=True),
    # GLA with strong gates (conformance case gla-length-039): A's entries span many binades
    "gla_strong": dict(CASE, id="emulated-gla-strong", variant="gla", dtype="bfloat16", B=2, T=15, H=3,
                       K=128, V=128, strength="strong", h0=True, sub_chunk_size=16, seed=39),
    # linear attention on one token (conformance case linear_attn-extra-157): dq, dk are intra-chunk alone
    "linear_attn_t1": dict(CASE, id="emulated-linear_attn-t1", variant="linear_attn", dtype="bfloat16", T=1,
                           H=3, K=128, V=128, strength=None, h0=True, seed=157),
}
# Results in float32 whatever the input dtype: under float32 tiles their errors are float32's
FLOAT32_RESULTS = {"delta_rule": ("S", "dh0"), "kda": ("dg", "dbeta"), "delta_rule_t2": ("S",), "gla": ("S",),
                   "linear_attn": (), "simple_gla": ("S",),  # linear attention: S is float32-exact
                   "kda_weak": ("dbeta", "dh0"), "gla_strong": (), "linear_attn_t1": ()}
HALF_LEVEL = 5e-5            # emulated: 1.5e-4 and up; float32 tiles: below 1.5e-6
BOUNDS = {                   # emulated as the code is / without the rule (module doc)
    "delta_rule": {"dh0": 2.2e-4,      # 1.53e-4 / 2.73e-4
                   "o": 3.9e-4},       # 3.52e-4 / 4.13e-4
    "kda": {"dg": 6e-4},               # 2.24e-4 / 1.63e-3
    "gla": {"o": 3.1e-4},              # 2.78e-4 / 3.51e-4
    "linear_attn": {"o": 2.75e-4},     # 2.54e-4 / 2.94e-4
    "simple_gla": {"o": 2.6e-4},       # 2.20e-4 / 3.04e-4
    "delta_rule_t2": {"dq": 2.7e-3},   # 2.18e-3 / 3.26e-3
    "kda_weak": {"dh0": 2.35e-3,       # 2.18e-3 / 2.53e-3
                 "dv": 3.45e-3},       # 3.22e-3 / 3.65e-3
    "gla_strong": {"o": 2.0e-3},       # 1.66e-3 / 2.51e-3 (A against v in two parts)
    "linear_attn_t1": {"dk": 2.2e-3},  # 1.65e-3 / 2.88e-3 (dA against q in two parts)
}


def measure() -> dict:
    """Run in the emulated mode: the mode, each case's errors, what other dtypes raise."""
    import linattn
    import linattn.triton as lt
    from linattn import testing
    from linattn.conformance import case as C
    from linattn.triton import common
    from linattn.validate import InputError

    half = linattn.device.emulated_dtype()
    out = {"mode": linattn.device.triton_mode(), "tiles": str(common.compute_dtype(half)),
           "errs": {}, "tols": {}, "guards": {}, "refused": {}}
    for name, c in (CASES if half == torch.float16 else CASES_BF16).items():
        args = C.make(c, "cpu")
        dO, dS = C.upstream(c, "cpu")
        o, S, g, guards = C.ours(c, args, dO, dS)
        errs, tols = {}, {}
        C.compare(c, errs, tols, o, S, g, *C.reference(c, args, dO, dS), args)
        out["errs"][name], out["tols"][name], out["guards"][name] = errs, tols, guards
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        if dtype == half:
            continue
        args = testing.make_inputs("delta_rule", B=1, T=16, H=1, K=32, V=32, dtype=dtype)
        try:
            lt.delta_rule(**args)
            out["refused"][str(dtype)] = None
        except InputError as e:
            out["refused"][str(dtype)] = str(e)
    return out


def child(code=None, **env):
    """A Python process in this worktree with the environment changed by env (None: removed)."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for n, x in env.items():
        if x is None:
            full.pop(n, None)
        else:
            full[n] = x
    cmd = [sys.executable, "-c", code] if code else [sys.executable, __file__]
    return subprocess.run(cmd, env=full, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def emulated(request):
    from linattn import device
    if device.interpreter_problem():    # this Triton's interpreter runs no kernel (Triton 3.6 + NumPy 2)
        pytest.skip(device.interpreter_problem())
    r = child(LINATTN_EMULATE=request.param, TRITON_INTERPRET="1")
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout.strip().splitlines()[-1]), half=request.param)


def test_mode_takes_native_dtype_decisions(emulated):
    assert emulated["mode"] == "emulated"
    assert emulated["tiles"] == emulated["half"]


def test_half_roundings_are_modelled(emulated):
    for op, errs in emulated["errs"].items():
        for name in FLOAT32_RESULTS[op]:
            assert errs[name] > HALF_LEVEL, (op, name, errs[name])


def test_within_tolerance(emulated):
    for op, errs in emulated["errs"].items():
        tols = emulated["tols"][op]
        assert all(errs[n] <= tols[n] for n in errs), (op, errs)
        assert not emulated["guards"][op]


def test_precision_bounds(emulated):
    """DeltaNet: the scale after the product (triton/delta.py, delta_backward.py); KDA: three tf32
    products for the split score products of fp16 inputs (wy_backward.split_x3); GLA and linear
    attention: the output step's two-part products (triton/gated.py); DeltaNet bf16 at
    T = 2: the score gradients as two parts against the keys (wy_backward.mm_input); KDA bf16: the
    reverse pass's state gradients as two parts (delta_backward.two_part_state_grads); linear
    attention bf16 on one token: dA against the keys and queries in two parts
    (gated_backward._intra_grad_kernel)."""
    assert set(emulated["errs"]) == set(CASES if emulated["half"] == "fp16" else CASES_BF16)
    for op, errs in emulated["errs"].items():
        for name, bound in BOUNDS[op].items():
            assert errs[name] <= bound, (op, name, f"{errs[name]:.3e}", bound)
    for name, bound in BOUNDS[op].items():
        assert errs[name] <= bound, (name, f"{errs[name]:.3e}", bound)


def test_other_dtypes_are_refused(emulated):
    others = {"fp16": ["torch.bfloat16", "torch.float32"], "bf16": ["torch.float16", "torch.float32"]}
    assert sorted(emulated["refused"]) == sorted(others[emulated["half"]])
    for dtype, msg in emulated["refused"].items():
        assert msg is not None and msg.startswith(f"q has dtype {dtype};") and "LINATTN_EMULATE" in msg


@pytest.mark.parametrize("env, words", [
    (dict(LINATTN_EMULATE="fp32"), "LINATTN_EMULATE must be one of ['bf16', 'fp16']"),
    (dict(LINATTN_EMULATE="fp16", TRITON_INTERPRET="0"), "TRITON_INTERPRET is '0'"),
])
def test_contradictory_settings_fail_on_import(env, words):
    r = child("import linattn", **env)
    assert r.returncode != 0 and words in r.stderr, r.stderr


def test_an_interpreter_that_cannot_run_the_kernels_is_named(monkeypatch):
    """Triton 3.6's interpreter with NumPy 2 stops every kernel with a chunk loop on a TypeError
    about one-element arrays: the Triton level says so, and what to install, before any launch."""
    import numpy as np
    from linattn import device
    from linattn.triton import common   # before triton: linattn switches the interpreter on without a GPU
    import triton
    refuses = True
    try:
        int(np.zeros(1))
        refuses = False
    except TypeError:
        pass
    monkeypatch.setattr(triton, "__version__", "3.7.1")
    assert device.interpreter_problem() is None
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    msg = device.interpreter_problem()
    assert (msg is not None) == refuses
    if refuses:
        assert "triton==3.7.1" in msg
        monkeypatch.setattr(common, "interpreting", lambda: True)   # on a GPU: as the interpreter would
        with pytest.raises(RuntimeError, match="interpreter cannot run these kernels"):
            common.check_kernel_inputs(torch.zeros(1, 1, 1, 16))


def test_default_interpreter_keeps_float32_tiles():
    """Without LINATTN_EMULATE the interpreter's decisions are the float32 ones it always took."""
    r = child("import torch, linattn; from linattn.triton import common, wy; "
              "print(linattn.device.triton_mode(), common.compute_dtype(torch.float16), "
              "common.decayed_dtype(torch.bfloat16), common.interpreting(), common.num_sms())",
              LINATTN_EMULATE=None, TRITON_INTERPRET="1")
    assert r.stdout.split() == ["interpreter", "fp32", "fp32", "True", "1"], r.stderr


if __name__ == "__main__":
    print(json.dumps(measure()))
