"""The Triton backward of linattn.triton.gla (per-head and per-dimension gates) and linear_attn.

Gradients of q, k, v, g and the initial state for an incoming gradient on the output and on the
final state, against float64 autograd through the token loop linattn.naive (and against the chunk
level's own backward); recompute=True and False; log-gates down to −20 per step; every output and
gradient buffer poisoned with NaN. Small sizes through the Triton interpreter on a CPU, larger
natively (K = V = 256, chunks of 128 and 256) on a GPU.
"""
import pytest
import torch

import linattn
from linattn import chunk, device, naive, support, testing
from linattn import triton as lt
from linattn.triton import gated_backward
from linattn.validate import InputError

DEV = device.default_device()
# Relative error of a gradient against float64 autograd: float32 ≤ 1e-4, half precision ≤ 2e-2.
GRAD_TOLERANCE = testing.GRAD_TOLERANCE   # one place for gradient tolerances
# B, T, H, K, V, chunk_size, sub_chunk_size: T not a multiple of C nor c, K != V.
SHAPE = device.pick(cpu=(1, 45, 2, 32, 48, 32, 16), gpu=(2, 500, 3, 128, 96, 64, 16))
# Several K- and V-blocks of the gradient kernels (blocks of 64): K, V not powers of two on the CPU.
WIDE = device.pick(cpu=(1, 40, 1, 80, 72, 32, 16), gpu=(1, 300, 2, 256, 256, 64, 16))
# Chunks over the 64-row block: every kernel works in row blocks.
LONG = device.pick(cpu=[(1, 150, 1, 32, 16, 128, 32)],
                   gpu=[(1, 600, 2, 128, 128, 128, 16), (1, 600, 2, 128, 128, 256, 16)])
OPS = [("linear_attn", None), ("gla", "per_head"), ("gla", "per_dim")]
OP_IDS = ["linear", "per_head", "per_dim"]


def inputs(op, gate, B, T, H, K, V, *, dtype=torch.float32, strength="normal", seed=0,
           gate_dtype=torch.float32):
    kw = {"gate": gate, "strength": strength, "gate_dtype": gate_dtype} if op == "gla" else {}
    return testing.make_inputs(op, B=B, T=T, H=H, K=K, V=V, dtype=dtype, device=DEV, initial_state=True,
                               seed=seed, **kw)


def names_of(args):
    return [n for n in ("q", "k", "v", "g", "initial_state") if n in args]


def weights(args, seed=1):
    """Incoming gradients for o (in v's dtype, so the reference sees the same numbers) and the
    final state (float32)."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K = args["q"].shape
    V = args["v"].shape[-1]
    w_o = torch.randn(B, T, H, V, generator=gen).to(DEV, args["v"].dtype)
    w_S = torch.randn(B, H, K, V, generator=gen).to(DEV)
    return w_o, w_S


def grads(fn, args, names, w_o, w_S, *, final_state=True, **kw):
    """Gradients of <o, w_o> (+ <S_final, w_S>) for the inputs in `names`, run poisoned."""
    args = {n: a.detach().clone().requires_grad_(n in names) if isinstance(a, torch.Tensor) else a
            for n, a in args.items()}
    with testing.poisoned():
        o, S = fn(**args, output_final_state=final_state, **kw)
        loss = (o * w_o.to(o.dtype)).sum()
        if final_state:
            loss = loss + (S * w_S.to(S.dtype)).sum()
        loss.backward()
    return {n: args[n].grad for n in names}


def reference(op, args, names, w_o, w_S, **kw):
    return grads(getattr(naive, op), testing.to_float64(args), names, w_o.double(), w_S.double(), **kw)


def triton_kw(op, C, c, **kw):
    return dict(chunk_size=C, sub_chunk_size=c, **kw) if op == "gla" else dict(chunk_size=C, **kw)


def assert_grads(got, ref, args, tol):
    for n in ref:
        assert got[n] is not None, f"d{n} missing"
        assert got[n].dtype == args[n].dtype and got[n].shape == args[n].shape, n
        err = testing.rel_err(got[n], ref[n])
        assert err <= tol, f"d{n}: rel err {err:.2e} > {tol:.0e} at {testing.worst_position(got[n], ref[n])}"


def check(op, gate, shape, *, dtype=torch.float32, strength="normal", seed=0, **kw):
    B, T, H, K, V, C, c = shape
    args = inputs(op, gate, B, T, H, K, V, dtype=dtype, strength=strength, seed=seed)
    names = names_of(args)
    w_o, w_S = weights(args)
    got = grads(getattr(lt, op), args, names, w_o, w_S, **triton_kw(op, C, c, **kw))
    assert_grads(got, reference(op, args, names, w_o, w_S), args, GRAD_TOLERANCE[dtype])
    return args, got


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op,gate", OPS, ids=OP_IDS)
def test_gradients_match_float64_autograd(op, gate, dtype, recompute):
    check(op, gate, SHAPE, dtype=dtype, recompute=recompute, seed=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op,gate", OPS[1:], ids=OP_IDS[1:])
def test_half_precision_gates(op, gate, dtype):
    # g in the inputs' half precision, as a bf16 model trains with it (the other tests pass float32
    # gates): natively every backward kernel that reads raw gates must compile for them (Triton's
    # exp takes float32/float64 only; the interpreter does not check)
    B, T, H, K, V, C, c = SHAPE
    args = inputs(op, gate, B, T, H, K, V, dtype=dtype, seed=13, gate_dtype=dtype)
    names = names_of(args)
    w_o, w_S = weights(args)
    got = grads(getattr(lt, op), args, names, w_o, w_S, **triton_kw(op, C, c))
    assert_grads(got, reference(op, args, names, w_o, w_S), args, GRAD_TOLERANCE[dtype])


@pytest.mark.parametrize("strength", ["logsigmoid", "strong"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op,gate", OPS[:2], ids=OP_IDS[:2])
def test_fused_intra_parts_equal_the_separate_kernels(op, gate, dtype, strength, monkeypatch):
    # Half-precision inputs without per-dimension gates: _dqk_kernel computes dA and the intra-chunk
    # parts of dq, dk itself (`fused_intra`). They are the sums _dA_kernel and _intra_grad_kernel
    # take, with the same roundings, so the two paths agree far closer than either to float64
    # (natively a flipped last bit of a half-precision gradient here and there); a wrong mask or
    # decay does not.
    B, T, H, K, V, C, c = SHAPE
    args = inputs(op, gate, B, T, H, K, V, dtype=dtype, strength=strength, seed=21)
    names = names_of(args)
    w_o, w_S = weights(args)
    assert gated_backward.fused_intra(gated_backward.gate_kind(args.get("g")), C, dtype)
    fused = grads(getattr(lt, op), args, names, w_o, w_S, **triton_kw(op, C, c))
    monkeypatch.setattr(gated_backward, "fused_intra", lambda *a: False)
    separate = grads(getattr(lt, op), args, names, w_o, w_S, **triton_kw(op, C, c))
    for n in names:
        err = testing.rel_err(fused[n], separate[n])
        assert err <= 1e-4, f"d{n}: fused against separate kernels {err:.2e}"


@pytest.mark.parametrize("op,gate", OPS[1:], ids=OP_IDS[1:])
def test_strong_gates_stay_finite_and_accurate(op, gate):
    # log-gates down to −20 per step: e^{b} of a chunk is far below float32's range
    check(op, gate, SHAPE, strength="strong", seed=4)


@pytest.mark.parametrize("op,gate", OPS, ids=OP_IDS)
def test_several_k_and_v_blocks(op, gate):
    check(op, gate, WIDE, seed=5, recompute=False)


@pytest.mark.parametrize("shape", LONG, ids=str)
@pytest.mark.parametrize("op,gate", OPS, ids=OP_IDS)
def test_long_chunks(op, gate, shape):
    C = shape[5]       # float32 where the range takes it, else bf16 (support.max_triton_chunk)
    check(op, gate, shape, seed=6,
          dtype=torch.float32 if C <= support.max_triton_chunk(op, torch.float32) else torch.bfloat16)


@pytest.mark.parametrize("shape", [(1, 1, 1, 16, 16, 16, 16), (2, 17, 3, 16, 20, 16, 16)], ids=["T1", "B2H3"])
@pytest.mark.parametrize("op,gate", OPS, ids=OP_IDS)
def test_one_token_and_several_batches_and_heads(op, gate, shape):
    check(op, gate, shape, seed=12)


@pytest.mark.parametrize("op,gate", OPS, ids=OP_IDS)
def test_recompute_and_kept_states_agree(op, gate):
    # The forward differs (any mode vs materialised states); the backward runs the same kernels on
    # the same states, so the gradients agree to float32 rounding.
    B, T, H, K, V, C, c = SHAPE
    args = inputs(op, gate, B, T, H, K, V, seed=7)
    names, (w_o, w_S) = names_of(args), weights(args)
    a = grads(getattr(lt, op), args, names, w_o, w_S, **triton_kw(op, C, c, recompute=True, mode="fused"))
    b = grads(getattr(lt, op), args, names, w_o, w_S, **triton_kw(op, C, c, recompute=False))
    for n in names:
        assert testing.rel_err(a[n], b[n]) <= testing.tolerance(torch.float32), n


@pytest.mark.parametrize("op,gate", OPS, ids=OP_IDS)
def test_matches_chunk_level_backward(op, gate):
    B, T, H, K, V, C, c = SHAPE
    args = inputs(op, gate, B, T, H, K, V, seed=8)
    names, (w_o, w_S) = names_of(args), weights(args)
    got = grads(getattr(lt, op), args, names, w_o, w_S, **triton_kw(op, C, c))
    cpu = {n: a.cpu() if isinstance(a, torch.Tensor) else a for n, a in args.items()}
    ref = grads(getattr(chunk, op), cpu, names, w_o.cpu(), w_S.cpu(), **triton_kw(op, C, c))
    assert_grads(got, ref, args, GRAD_TOLERANCE[torch.float32])


def test_only_v_requires_grad_and_no_final_state():
    # dS starts at zero; q, k, g, initial_state get no gradient
    B, T, H, K, V, C, c = SHAPE
    args = inputs("gla", "per_dim", B, T, H, K, V, seed=9)
    w_o, w_S = weights(args)
    got = grads(lt.gla, args, ["v"], w_o, w_S, final_state=False, chunk_size=C, sub_chunk_size=c)
    ref = reference("gla", args, ["v"], w_o, w_S, final_state=False)
    assert_grads(got, ref, args, GRAD_TOLERANCE[torch.float32])


def test_only_the_final_state_receives_a_gradient():
    # o unused: its incoming gradient is None, the backward reads zeros
    B, T, H, K, V, C, c = SHAPE
    args = inputs("gla", "per_head", B, T, H, K, V, seed=10)
    names = names_of(args)
    x = {n: args[n].detach().clone().requires_grad_(True) for n in names}
    with testing.poisoned():
        _, S = lt.gla(**{**args, **x}, output_final_state=True, chunk_size=C, sub_chunk_size=c)
        S.sum().backward()
    x64 = {n: args[n].detach().double().requires_grad_(True) for n in names}
    _, S64 = naive.gla(**{**testing.to_float64(args), **x64}, output_final_state=True)
    S64.sum().backward()
    assert x64["q"].grad is None and torch.equal(x["q"].grad, torch.zeros_like(args["q"]))  # q never reaches S
    rest = names[1:]
    assert_grads({n: x[n].grad for n in rest}, {n: x64[n].grad for n in rest}, args, GRAD_TOLERANCE[torch.float32])


def test_plain_forward_without_grad():
    # no input requires grad, or grad mode is off: the forward alone, no graph
    args = inputs("gla", "per_dim", 1, 20, 1, 16, 16)
    o, _ = lt.gla(**args, chunk_size=16)
    assert o.grad_fn is None
    args["q"].requires_grad_(True)
    with torch.no_grad():
        o, _ = lt.gla(**args, chunk_size=16)
    assert o.grad_fn is None
    o, _ = lt.gla(**args, chunk_size=16)
    assert type(o.grad_fn).__name__.startswith("GatedAttention")


@pytest.mark.parametrize("op", ["linear_attn", "gla"])
def test_recompute_must_be_a_bool(op):
    args = inputs(op, "per_dim", 1, 20, 1, 16, 16)
    with pytest.raises(InputError, match="recompute"):
        getattr(lt, op)(**args, recompute="yes")


def test_dispatcher_passes_recompute():
    args = inputs("gla", "per_head", 1, 20, 1, 16, 16)
    args["v"].requires_grad_(True)
    o, _ = linattn.gla(**args, impl="triton", recompute=False, chunk_size=16)
    o.sum().backward()
    assert args["v"].grad is not None and torch.isfinite(args["v"].grad).all()


def test_kernels_write_every_gradient_entry():
    # the autograd path's buffers come from outputs.empty: NaN under poisoned() until written
    B, T, H, K, V, C, c = SHAPE
    args = inputs("gla", "per_dim", B, T, H, K, V, seed=11)
    from linattn.validate import check_inputs
    d = check_inputs(args["q"], args["k"], args["v"], g=args["g"], initial_state=args["initial_state"], gate=True)
    w_o, w_S = weights(args)
    with testing.poisoned():
        out = gated_backward.backward(w_o, w_S, args["q"], args["k"], args["v"], args["g"], args["initial_state"],
                                      d, chunk_size=C, sub_chunk_size=c)
    for x in out:
        assert torch.isfinite(x).all()


def bench_tool():
    """tools/bench.py as a module (it is a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "bench.py"
    spec = importlib.util.spec_from_file_location("bench_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


TOY = dict(tokens=32, H=1, K=16, V=16, device=DEV)       # the training benchmark at a size the interpreter runs


def test_train_benchmark_runs_at_toy_size(tmp_path):
    # tools/bench.py --suite train on the CPU (interpreter): rows, memory, the gradient check and the
    # backward stages come out; FLA is absent here and says so (the GPU run is the lead's)
    tool, size = bench_tool(), TOY
    res = tool.suite_train([32], lambda msg: None, size, only=["linear_attn"])
    (row,) = res["rows"]
    assert row["triton"] > 0 and row["triton:keep"] > 0 and row["sdpa"] > 0 and row["mem_triton"] > 0
    assert row["rel_err_grad"] < 2e-2                      # bf16 gradients against the chunk level
    # without per-dimension gates dA and the intra parts are computed inside "dq, dk" (`fused_intra`)
    assert set(res["stages"]["linear_attn"]["ms"]) == {"recompute states", "reverse pass dS", "dv", "dq, dk"}
    assert "fla" in row or "error_fla" in row
    md = tool.markdown({"env": {"device": "x", "date": "x", "torch": "x", "triton": "x", "fla": None},
                        "size": {n: x for n, x in size.items() if n != "device"}, "train": res})
    assert "Forward + backward" in md and "Backward stages of linear_attn" in md


def test_train_benchmark_resumes_a_cut_run(tmp_path, monkeypatch):
    # a device call's time limit cuts a long training benchmark: the rows it saved are kept by the
    # next call (--resume) and only the others are timed; --warm compiles and times nothing
    from linattn import bench

    tool, size = bench_tool(), TOY
    first = tool.suite_train([32], lambda msg: None, size, only=["linear_attn"])
    bench.save_json(tmp_path / "bench.json", {"train": first})
    done = tool.done_rows([tmp_path])
    assert set(done) == {("linear_attn", 32, None)}
    timed = []
    real = tool.train_row
    monkeypatch.setattr(tool, "train_row", lambda op, T, *a, **k: timed.append((op, T)) or real(op, T, *a, **k))
    again = tool.suite_train([32, 16], lambda msg: None, size, only=["linear_attn"], done=done)
    assert timed == [("linear_attn", 16)]                      # the saved row is not timed again
    assert again["rows"][0] == first["rows"][0] and any("--resume" in n for n in again["notes"])
    monkeypatch.setattr(bench, "median_ms", lambda fn: pytest.fail("--warm timed a call"))
    assert tool.suite_train([16], lambda msg: None, size, only=["linear_attn"], warm=True) == {"rows": [], "by_gates": {}}


def test_forward_benchmark_resumes_a_cut_run(tmp_path, monkeypatch):
    # the same for the forward suite (tools/bench.py --suite anchors --resume): a saved row is kept
    # as it is and not timed or compiled again, the SDPA anchor of a length with nothing left to time
    # is not measured either
    from linattn import bench

    tool, size = bench_tool(), TOY
    first = tool.suite_anchors([32], lambda msg: None, size, only=["linear_attn"])
    bench.save_json(tmp_path / "bench.json", {"anchors": dict(first, notes=[])})   # as a cut run saves it
    done = tool.done_rows([tmp_path], "anchors")
    assert set(done) == {("linear_attn", 32, None)} and tool.done_rows([tmp_path]) == {}
    timed = []
    real = tool.anchor_row
    monkeypatch.setattr(tool, "anchor_row", lambda op, T, *a, **k: timed.append((op, T)) or real(op, T, *a, **k))
    again = tool.suite_anchors([32, 16], lambda msg: None, size, only=["linear_attn"], done=done)
    assert timed == [("linear_attn", 16)]
    assert [r for r in again["rows"] if r["T"] == 32] == first["rows"]           # rows in T order
    assert any("--resume" in n for n in again["notes"])
    monkeypatch.setattr(tool, "warm_anchor", lambda *a: pytest.fail("a kept row was compiled again"))
    assert tool.suite_anchors([32], lambda msg: None, size, only=["linear_attn"], warm=True, done=done) == {}


def test_launch_rules_are_the_natively_timed_ones():
    """_dqk_kernel takes 4 warps and at most 2 stages only where gated half-precision inputs meet
    float32 states, _dv_kernel 4 warps for per-dimension gates (gated_backward's timing comment);
    elsewhere the 8-warp launches (4 for float32 tiles) stay."""
    gb = gated_backward
    assert gb.dqk_launch(gb.DIM_GATE, False, 64, 64) == (4, 2)
    assert gb.dqk_launch(gb.HEAD_GATE, False, 64, 64) == (4, 2)
    assert gb.dqk_launch(gb.NO_GATE, False, 64, 64) == (8, 3)      # bf16 states: the spill at 4
    assert gb.dqk_launch(gb.DIM_GATE, True, 64, 64) == (8, 3)      # float32 inputs: not timed
    assert gb.dqk_launch(gb.NO_GATE, False, 32, 64) == (4, 3)      # narrow tiles: common.warps
    assert gb.dv_warps(gb.DIM_GATE, False, 64) == 4
    assert gb.dv_warps(gb.HEAD_GATE, False, 64) == gb.dv_warps(gb.NO_GATE, False, 64) == 8
    assert gb.dv_warps(gb.NO_GATE, True, 64) == 4


def test_state_pass_launches_are_the_natively_timed_ones():
    """The backward's recomputed states and reverse pass (float32 states from half inputs) take the
    launches timed natively (gated_backward's comment above `state_launches`); float32 inputs and
    linear attention, and chunks over 64, keep the forward's state pass and 64×64 reverse blocks; 8
    warps never meet a 32-wide block (`common.warps`)."""
    gb, sl = gated_backward, gated_backward.state_launches
    assert sl(128, 128, 128, gb.DIM_GATE, False, sms=132) == ((32, 128, 4, 4), (32, 128, 2, 4))   # B = 8
    assert sl(128, 128, 16, gb.DIM_GATE, False, sms=132) == ((32, 64, 4, 4), (32, 64, 4, 4))      # B = 1
    assert sl(128, 128, 128, gb.HEAD_GATE, False, sms=132) == ((64, 128, 2, 8), (64, 128, 2, 8))
    assert sl(128, 128, 16, gb.HEAD_GATE, False, sms=132) == ((32, 64, 4, 4), (64, 64, 3, 4))     # not timed
    assert sl(128, 128, 128, gb.DIM_GATE, True, sms=132) == ((32, 128, 3, 4), (64, 64, 3, 4))
    assert sl(128, 128, 128, gb.NO_GATE, False, sms=132) == ((64, 64, 3, 4), (64, 64, 3, 4))
    assert sl(16, 16, 128, gb.HEAD_GATE, False, sms=132) == ((32, 32, 2, 4), (32, 32, 2, 4))      # padded, 4 warps
    assert sl(256, 256, 128, gb.HEAD_GATE, False, sms=132)[1] == (64, 128, 2, 8)
    for C in (128, 256):                     # not timed; 128-wide V-blocks at C = 256 do not fit a T4
        assert sl(128, 128, 128, gb.DIM_GATE, False, C, sms=132) == ((32, 128, 3, 4), (64, 64, 3, 4))
        assert sl(128, 128, 128, gb.HEAD_GATE, False, C, sms=132) == ((64, 64, 4, 4), (64, 64, 3, 4))
