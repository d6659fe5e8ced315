"""linattn.triton.linear_attn against the float64 recurrence (interpreter on CPU, native on CUDA)."""
import pytest
import torch

import linattn
from linattn import device, naive, support, testing
from linattn import triton as lt
from linattn.triton import gated
from linattn.validate import InputError

DEV = device.default_device()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# B, T, H, K, V, chunk_size: T not a multiple of C, K != V; bigger on a GPU.
SHAPES = device.pick(
    # K = 20: not a power of two; C = 128, 256: the output in row blocks of 64
    cpu=[(1, 83, 2, 32, 48, 32), (2, 20, 1, 20, 16, 16), (1, 150, 1, 16, 24, 128)],
    gpu=[(2, 300, 3, 128, 96, 64), (1, 1000, 2, 64, 128, 128), (3, 77, 2, 16, 32, 16),
         (1, 700, 2, 128, 128, 256)],
)
# K, V up to 256: on the GPU only, the interpreter takes minutes at that width.
WIDE = device.pick(cpu=(1, 40, 1, 64, 80, 32), gpu=(1, 500, 2, 256, 256, 64))


def run(args, **kw):
    with testing.poisoned():
        return lt.linear_attn(**args, output_final_state=True, **kw)


def assert_close(args, o, S):
    o_ref, S_ref = naive.linear_attn(**testing.to_float64(args), output_final_state=True)
    dtype = args["q"].dtype
    assert o.dtype == dtype and o.shape == o_ref.shape and S.dtype == torch.float32
    err_o, err_S = testing.rel_err(o, o_ref), testing.rel_err(S, S_ref)
    assert err_o <= testing.tolerance(dtype), f"o: rel err {err_o:.2e} at {testing.worst_position(o, o_ref)}"
    assert err_S <= testing.tolerance(torch.float32), f"final state: rel err {err_S:.2e}"


@pytest.mark.parametrize("mode", ["fused", "states"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_float64_recurrence(shape, dtype, mode):
    B, T, H, K, V, C = shape
    args = testing.make_inputs("linear_attn", B=B, T=T, H=H, K=K, V=V, dtype=dtype, device=DEV,
                               initial_state=True, seed=T)
    if C > support.max_triton_chunk("linear_attn", dtype):   # outside the range: refused before any launch
        with pytest.raises(InputError, match="chunk_size must be at most"):
            run(args, chunk_size=C, mode=mode)
        return
    o, S = run(args, chunk_size=C, mode=mode)
    assert_close(args, o, S)


@pytest.mark.parametrize("mode", ["fused", "states"])
def test_wide_heads(mode):
    B, T, H, K, V, C = WIDE
    args = testing.make_inputs("linear_attn", B=B, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, device=DEV)
    assert_close(args, *run(args, chunk_size=C, mode=mode))


@pytest.mark.parametrize("mode", ["fused", "states"])
def test_value_and_state_blocks(monkeypatch, mode):
    """V over two output blocks (V > 128) and the state pass over several K and V blocks."""
    monkeypatch.setattr(gated, "STATE_BLOCK", 16)
    args = testing.make_inputs("linear_attn", B=1, T=50, H=2, K=40, V=144, device=DEV, initial_state=True)
    assert_close(args, *run(args, chunk_size=32, mode=mode))


@pytest.mark.parametrize("T", [1, 5, 16])
def test_short_sequences_and_no_initial_state(T):
    args = testing.make_inputs("linear_attn", B=1, T=T, H=2, K=16, V=32, device=DEV)
    assert_close(args, *run(args, chunk_size=16, mode="auto"))


def test_final_state_only_when_asked_and_dispatch():
    args = testing.make_inputs("linear_attn", B=1, T=20, H=1, K=16, V=16, device=DEV)
    o, S = linattn.linear_attn(**args, impl="triton")
    assert S is None and linattn.which("linear_attn") == "linattn.triton.linear_attn (reference)"
    assert testing.rel_err(o, naive.linear_attn(**testing.to_float64(args))[0]) <= 1e-5


def test_non_contiguous_inputs():
    args = testing.make_inputs("linear_attn", B=1, T=40, H=2, K=16, V=16, device=DEV)
    # the same values, laid out [B, H, T, D] in memory and viewed back as [B, T, H, D]
    strided = {n: a.transpose(1, 2).contiguous().transpose(1, 2) for n, a in args.items()}
    assert not strided["q"].is_contiguous()
    assert_close(args, *run(strided, chunk_size=16))


@pytest.mark.parametrize("bad,match", [
    ({"chunk_size": 24}, "chunk_size"),
    ({"chunk_size": 8}, "chunk_size"),
    ({"chunk_size": 512}, "chunk_size must be an int ≥ 16 and ≤ 256"),
    ({"mode": "parallel"}, "mode"),
])
def test_bad_arguments(bad, match):
    args = testing.make_inputs("linear_attn", B=1, T=8, H=1, K=16, V=16, device=DEV)
    with pytest.raises(InputError, match=match):
        lt.linear_attn(**args, **bad)


def test_bad_inputs():
    args = testing.make_inputs("linear_attn", B=1, T=8, H=1, K=16, V=16, device=DEV, dtype=torch.float64)
    with pytest.raises(InputError, match="q has dtype torch.float64"):
        lt.linear_attn(**args)
    args = testing.make_inputs("linear_attn", B=1, T=8, H=1, K=16, V=16, device=DEV)
    with pytest.raises(InputError, match="initial_state"):
        lt.linear_attn(**args, initial_state=torch.zeros(1, 1, 16, 8, device=DEV))
    with pytest.raises(InputError, match="v"):
        lt.linear_attn(args["q"], args["k"], args["v"][:, :4])


def test_device_rule():
    """CPU tensors run through the interpreter on a CPU machine; natively they are refused clearly."""
    args = testing.make_inputs("linear_attn", B=1, T=8, H=1, K=16, V=16)
    if device.triton_mode() == "native":
        with pytest.raises(InputError, match="q is on cpu"):
            lt.linear_attn(**args)
    else:
        assert_close(args, *run(args, chunk_size=16))


def test_import_order_is_explained():
    """triton imported before linattn on a CPU machine: a clear ImportError, not a failure deep in a kernel."""
    import os
    import subprocess
    import sys

    env = {n: x for n, x in os.environ.items() if n != "TRITON_INTERPRET"}
    code = "import triton.language\nimport linattn.triton\nprint('imported')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if device.has_cuda():
        assert r.returncode == 0 and "imported" in r.stdout, r.stderr
    else:
        assert r.returncode != 0 and "Import linattn first" in r.stderr
