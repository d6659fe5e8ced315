"""linattn.triton.gla against the float64 recurrence (interpreter on CPU, native on CUDA)."""
import pytest
import torch

import linattn
from linattn import device, naive, support, testing
from linattn import triton as lt
from linattn.chunk import gated as cgated
from linattn.triton import gated
from linattn.validate import InputError, check_inputs, value_checks

DEV = device.default_device()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# B, T, H, K, V, chunk_size, sub_chunk_size: T not a multiple of C nor c, K != V; bigger on a GPU.
SHAPE = device.pick(cpu=(1, 83, 2, 32, 48, 32, 16), gpu=(2, 500, 3, 128, 96, 64, 16))
CHUNKINGS = device.pick(  # (T, C, c): one sub-chunk per chunk, many sub-chunks, C = c = 16
    cpu=[(45, 16, 16), (70, 64, 16), (40, 32, 32)],
    gpu=[(300, 16, 16), (700, 128, 16), (300, 64, 32), (600, 256, 64)],
)
WIDE = device.pick(cpu=(1, 40, 1, 64, 80, 32, 16), gpu=(1, 400, 2, 256, 256, 64, 16))


def run(args, **kw):
    with testing.poisoned():
        return lt.gla(**args, output_final_state=True, **kw)


def assert_close(args, o, S):
    o_ref, S_ref = naive.gla(**testing.to_float64(args), output_final_state=True)
    dtype = args["q"].dtype
    assert o.dtype == dtype and o.shape == o_ref.shape and S.dtype == torch.float32
    err_o, err_S = testing.rel_err(o, o_ref), testing.rel_err(S, S_ref)
    assert err_o <= testing.tolerance(dtype), f"o: rel err {err_o:.2e} at {testing.worst_position(o, o_ref)}"
    # The state is float32, but its update (K ⊙ Γ)ᵀ V multiplies tiles rounded to the input dtype on
    # the tensor cores (the interpreter upcasts, so only a GPU shows it): input-dtype tolerance.
    assert err_S <= testing.tolerance(dtype), f"final state: rel err {err_S:.2e}"


def inputs(B, T, H, K, V, *, dtype=torch.float32, gate="per_dim", strength="normal", init=True, seed=0,
           gate_dtype=torch.float32):
    return testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, dtype=dtype, device=DEV, gate=gate,
                               strength=strength, initial_state=init, seed=seed, gate_dtype=gate_dtype)


@pytest.mark.parametrize("mode", ["fused", "states"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gate", ["per_dim", "per_head"])
def test_matches_float64_recurrence(gate, dtype, mode):
    B, T, H, K, V, C, c = SHAPE
    args = inputs(B, T, H, K, V, dtype=dtype, gate=gate, seed=T)
    assert_close(args, *run(args, chunk_size=C, sub_chunk_size=c, mode=mode))


@pytest.mark.parametrize("mode", ["fused", "states"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gate", ["per_dim", "per_head"])
def test_strong_gates_stay_finite(gate, dtype, mode):
    # log-gates down to −20 per step: e^{b} of a whole chunk is far below float32's range
    B, T, H, K, V, C, c = SHAPE
    args = inputs(B, T, H, K, V, dtype=dtype, gate=gate, strength="strong", seed=1)
    assert_close(args, *run(args, chunk_size=C, sub_chunk_size=c, mode=mode))


@pytest.mark.parametrize("mode", ["fused", "states"])
@pytest.mark.parametrize("T,C,c", CHUNKINGS, ids=str)
def test_chunk_and_sub_chunk_sizes(T, C, c, mode):
    args = inputs(1, T, 2, 24, 16, dtype=torch.bfloat16, seed=C + c)     # K = 24: masked to a block of 32
    assert_close(args, *run(args, chunk_size=C, sub_chunk_size=c, mode=mode))


# Chunks over the 64-row output block at full width (chapter 10's chunk sweep): the output in row
# blocks, the state pass with fewer pipeline stages where 3 do not fit (common.launch).
LONG_CHUNKS = device.pick(cpu=[(1, 150, 1, 32, 16, 128, 32)],
                          gpu=[(1, 600, 2, 128, 128, 128, 16), (1, 600, 2, 128, 128, 256, 16)])


@pytest.mark.parametrize("dtype", device.pick(cpu=[torch.float32], gpu=[torch.float32, torch.bfloat16]), ids=str)
@pytest.mark.parametrize("mode", ["fused", "states"])
@pytest.mark.parametrize("gate", ["per_dim", "per_head"])
@pytest.mark.parametrize("shape", LONG_CHUNKS, ids=str)
def test_long_chunks(shape, gate, mode, dtype):
    B, T, H, K, V, C, c = shape
    args = inputs(B, T, H, K, V, dtype=dtype, gate=gate, seed=C)
    if C > support.max_triton_chunk("gla", dtype):      # outside the range: refused before any launch
        with pytest.raises(InputError, match="chunk_size must be at most"):
            run(args, chunk_size=C, sub_chunk_size=c, mode=mode)
        return
    assert_close(args, *run(args, chunk_size=C, sub_chunk_size=c, mode=mode))


@pytest.mark.parametrize("mode", ["fused", "states"])
@pytest.mark.parametrize("shape", LONG_CHUNKS, ids=str)
def test_long_chunks_strong_per_head_gates(shape, mode):
    """Per-head gates' chunk sums (b across row blocks, the state step's key decay b_last − b) under
    log-gates down to −20 per step, with an initial and a final state and a short last chunk."""
    B, T, H, K, V, C, c = shape
    # float32 where the range takes it, else bf16 (float32 stops at support.max_triton_chunk)
    dtype = torch.float32 if C <= support.max_triton_chunk("gla", torch.float32) else torch.bfloat16
    args = inputs(B, T, H + 1, K, V, dtype=dtype, gate="per_head", strength="strong", seed=C + 1)   # several heads
    assert_close(args, *run(args, chunk_size=C, sub_chunk_size=c, mode=mode))


@pytest.mark.parametrize("gate", ["per_dim", "per_head"])
def test_wide_heads(gate):
    B, T, H, K, V, C, c = WIDE
    args = inputs(B, T, H, K, V, dtype=torch.bfloat16, gate=gate, init=False)
    assert_close(args, *run(args, chunk_size=C, sub_chunk_size=c))


@pytest.mark.parametrize("strength", ["normal", "strong"])
def test_intra_chunk_tiles_match_float64(strength):
    """The tiles the output kernel multiplies away (off-diagonal by absorption, diagonal by the
    multiplicative column walk), written out by intra_attention, against chapter 05's float64 A."""
    T, C, c = 45, 32, 16                                     # the last chunk is short, its last sub-chunk too
    args = inputs(1, T, 2, 24, 16, strength=strength, init=False, seed=7)
    q, k, g = args["q"], args["k"], args["g"]
    A = gated.intra_attention(q, k, g, check_inputs(q, k, args["v"], g=g, gate=True), C, c)   # [B, T, H, C]
    for t0 in range(0, T, C):
        L = min(C, T - t0)
        ref = cgated.intra_chunk_matrix(*(x[:, t0:t0 + L].transpose(1, 2).double() for x in (q, k, g)),
                                        sub_chunk_size=c if L % c == 0 else L)          # [B, H, L, L]
        mine = A[:, t0:t0 + L, :, :L].transpose(1, 2).tril()
        assert mine.isfinite().all()
        assert testing.rel_err(mine, ref) <= testing.tolerance(torch.float32), (t0, testing.rel_err(mine, ref))


# Per-dimension gates in states mode: a chunk whose gates decay by less than e^60 builds its intra
# matrix in the output kernel (the split); the others read the secondary-chunked A.
SPLIT_SHAPE = device.pick(cpu=(2, 150, 2, 32, 24, 32, 16), gpu=(2, 700, 3, 128, 96, 64, 16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_and_exact_chunks_in_one_call(dtype):
    """Gates strong (−20 per step) from a token inside a chunk on, and in the last head throughout:
    chunks of both kinds side by side, under poisoned buffers (A is unwritten where a chunk splits)."""
    B, T, H, K, V, C, c = SPLIT_SHAPE
    args = inputs(B, T, H, K, V, dtype=dtype, seed=11)
    strong = testing.log_gates(tuple(args["g"].shape), "strong", device=DEV,
                               generator=torch.Generator(device=DEV).manual_seed(2))
    cut = T // 2 + 5
    strong = strong.to(args["g"].dtype)
    args["g"] = torch.cat([args["g"][:, :cut], strong[:, cut:]], 1)
    args["g"][:, :, -1] = strong[:, :, -1]
    assert_close(args, *run(args, chunk_size=C, sub_chunk_size=c, mode="states"))


@pytest.mark.parametrize("mode", ["fused", "states"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("gate", ["per_dim", "per_head"])
def test_half_precision_gates(gate, dtype, mode):
    """Gates in the inputs' half precision, as a bf16 model produces them (the other tests pass
    float32 gates). Natively every kernel that reads raw gates must compile for them: Triton's exp
    takes float32/float64 only. The reference sees the same rounded gates."""
    B, T, H, K, V, C, c = SHAPE
    args = inputs(B, T, H, K, V, dtype=dtype, gate=gate, seed=5, gate_dtype=dtype)
    assert_close(args, *run(args, chunk_size=C, sub_chunk_size=c, mode=mode))


@pytest.mark.parametrize("per_token", [-0.92, -0.9296875, -0.9453125, -0.97])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_bound(per_token, dtype):
    """Every gate decaying by about 58.9 or by 59.5 over a chunk of 64 (the split, factors e^{−b} up
    to e^59.5, fp16 widened to bf16), by 60.5 (just past the bound: the output reads the A that the
    intra kernel must have written) or by 62.1 (secondary chunking). 59.5 and 60.5 are exact in every
    dtype, so both kernels see the same side of the bound at 60."""
    args = inputs(1, 150, 2, 32, 32, dtype=dtype, seed=4)
    args["g"] = torch.full_like(args["g"], per_token)
    assert_close(args, *run(args, chunk_size=64, sub_chunk_size=16, mode="states"))


@pytest.mark.parametrize("gate", ["per_dim", "per_head"])
@pytest.mark.parametrize("mode", ["fused", "states"])
def test_value_and_state_blocks(monkeypatch, mode, gate):
    """V split over several output blocks, the state pass over several K and V blocks (the last
    K block masked), a short last chunk."""
    monkeypatch.setattr(gated, "STATE_BLOCK", 16)
    args = inputs(1, 83, 1, 40, 144, gate=gate, seed=5)     # K = 40: three 16-wide K blocks
    assert_close(args, *run(args, chunk_size=64, sub_chunk_size=16, mode=mode))   # last chunk: 19 rows


def test_block_and_mode_rules(monkeypatch):
    """The launch rules say what the measurements said (comments in gated.py); an H200 has 132 SMs."""
    assert gated.output_blocks(128, 128, gated.NO_GATE, ieee=False) == (128, 128)
    assert gated.output_blocks(128, 128, gated.HEAD_GATE, ieee=True) == (128, 64)
    assert gated.output_blocks(256, 256, gated.NO_GATE, ieee=False) == (256, 64)
    assert gated.output_blocks(128, 128, gated.DIM_GATE, ieee=False) == (128, 64)           # reads A
    assert gated.output_blocks(128, 128, gated.DIM_GATE, ieee=False, split=True) == (128, 128)
    monkeypatch.setattr(gated, "num_sms", lambda: 132)
    assert gated.choose_mode("auto", gated.NO_GATE, 4, 16, 128, 128) == "fused"     # T = 8k: 128 programs
    assert gated.choose_mode("auto", gated.NO_GATE, 2, 16, 128, 128) == "states"    # T = 16k: 64 programs
    assert gated.choose_mode("auto", gated.HEAD_GATE, 8, 16, 128, 128) == "fused"    # T = 4k: 128 programs
    assert gated.choose_mode("auto", gated.HEAD_GATE, 4, 16, 128, 128) == "states"   # T = 8k: 64 programs
    assert gated.choose_mode("auto", gated.HEAD_GATE, 32, 16, 128, 128, ieee=True) == "states"
    assert gated.choose_mode("auto", gated.DIM_GATE, 32, 16, 128, 128) == "states"
    # state pass: narrower blocks only while 64×64 blocks leave half the SMs idle
    assert gated.state_config(128, 128, 16, gated.HEAD_GATE, sms=132) == (32, 64, 4)    # T = 32k
    assert gated.state_config(128, 128, 16, gated.NO_GATE, sms=132) == (64, 32, 4)
    assert gated.state_config(128, 128, 32, gated.HEAD_GATE, sms=132) == (64, 64, 4)    # T = 16k
    assert gated.state_config(128, 128, 32, gated.NO_GATE, sms=132) == (64, 64, 3)
    assert gated.state_config(128, 128, 16, gated.DIM_GATE, sms=132) == (32, 128, 3)    # never < MIN_TILE
    assert gated.state_config(128, 128, 32, gated.DIM_GATE, sms=132) == (32, 128, 3)
    assert gated.state_config(16, 16, 1, gated.DIM_GATE, sms=132) == (32, 32, 3)      # K, V padded to MIN_TILE


def test_zero_gate_is_linear_attention():
    args = inputs(1, 50, 2, 16, 32, seed=3)
    args["g"] = torch.zeros_like(args["g"])
    o, S = run(args, chunk_size=16)
    o_lin, S_lin = lt.linear_attn(**{n: a for n, a in args.items() if n != "g"}, output_final_state=True,
                                  chunk_size=16)
    assert testing.rel_err(o, o_lin) <= 1e-6 and testing.rel_err(S, S_lin) <= 1e-6


def test_dispatch_reaches_triton():
    args = inputs(1, 20, 1, 16, 16, init=False)
    o, S = linattn.gla(**args, impl="triton", chunk_size=16, sub_chunk_size=16)
    assert S is None and linattn.which("gla") == "linattn.triton.gla (reference)"
    assert testing.rel_err(o, naive.gla(**testing.to_float64(args))[0]) <= 1e-5


@pytest.mark.parametrize("bad,match", [
    ({"sub_chunk_size": 8}, "sub_chunk_size"),
    ({"sub_chunk_size": 64, "chunk_size": 32}, "sub_chunk_size"),
    ({"chunk_size": 48}, "chunk_size"),
    ({"chunk_size": 512}, "≤ 256"),
    ({"mode": "both"}, "mode"),
])
def test_bad_arguments(bad, match):
    args = inputs(1, 8, 1, 16, 16, init=False)
    with pytest.raises(InputError, match=match):
        lt.gla(**args, **bad)


def test_bad_gates():
    args = inputs(1, 8, 1, 16, 16, init=False)
    with value_checks(True), pytest.raises(InputError, match="g must hold log-decays"):
        lt.gla(**{**args, "g": -args["g"] + 0.1})           # value checks are opt-in on a GPU
    with pytest.raises(InputError, match="g must have shape"):
        lt.gla(**{**args, "g": args["g"][..., :4]})
    with pytest.raises(InputError, match="q has dtype torch.float64"):
        lt.gla(**{n: a.double() for n, a in args.items()})


def test_bench_script_checks_what_it_times(tmp_path):
    """tools/bench.py end to end at toy size: every row timed and checked against the chunk level."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    size = device.pick(cpu=["--tokens", "64", "--heads", "1", "--dim", "16", "--T", "32", "64"],
                       gpu=["--tokens", "4096", "--heads", "2", "--dim", "64", "--T", "1024", "2048"])
    r = subprocess.run([sys.executable, str(root / "tools" / "bench.py"), "--suite", "anchors", "--ops",
                        "linear_attn", "gla", "simple_gla", "--out", str(tmp_path), *size],
                       capture_output=True, text=True, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    rows = res["anchors"]["rows"]
    assert {(row["op"], row["T"]) for row in rows} == {(op, int(T)) for op in ("linear_attn", "gla", "simple_gla")
                                                         for T in size[-2:]}
    for row in rows:
        assert not any(k.startswith("error_") for k in row), row
        assert all(row[lv] > 0 for lv in ("triton", "triton:fused", "triton:states", "sdpa"))
        errs = [v for k, v in row.items() if k.startswith("rel_err_")]
        assert len(errs) == 3 and max(errs) <= testing.tolerance(torch.bfloat16), row
    assert (tmp_path / "bench.md").exists() and (tmp_path / "bench.png").exists()


@pytest.mark.parametrize("shape", [(2, 45, 3), (2, 45, 3, 16)])
def test_gate_sums_of_a_strided_view(shape):
    # the chunk-local sums read g with plain strides: a transposed view (a grader's or a caller's
    # tensor) must give the sums of its values, not of its memory order
    g = testing.log_gates(shape, "normal", generator=torch.Generator().manual_seed(1)).to(DEV)
    view = g.transpose(0, 1).contiguous().transpose(0, 1)
    assert not view.is_contiguous()
    ref = torch.cat([c.double().cumsum(1) for c in g.split(32, dim=1)], dim=1)
    assert testing.rel_err(gated.local_cumsum(view, 32), ref) <= testing.tolerance(torch.float32)
