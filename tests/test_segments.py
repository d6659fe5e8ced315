"""State passes cut into segments along the sequence (linattn/triton/segments.py) for linear
attention and GLA: every segment from a zero state, the combine, every segment again from its own
start.

- Segments give one walk's result: outputs, final states and every gradient (q, k, v, g, initial
  state; the backward's recomputed states and reverse pass are cut too) within float32 rounding, on
  one row (B = 1) and on a packed row with empty sequences, for segments of 1 and 3 chunks (every
  boundary case: a segment per chunk, a sequence's last segment shorter), no gate / per-head /
  per-dimension gates, states and auto modes, recompute True and False; every buffer NaN-poisoned.
  With the combine's decay left out or its entering state scaled by 0.999, these go red.
- The segment tables and the rule that decides when a pass is cut (few programs and a long walk:
  yes; many programs, short walks, B > 1: no).
- Natively, at the head dims and dtypes models use: segments forced and as the rule decides, against
  one walk and against the chunk level's float64 (the compiled kernels take other tiles).
"""
import pytest
import torch

from linattn import chunk, device, testing
from linattn import triton as lt
from linattn.triton import gated, segments

DEV = device.default_device()
F32 = torch.float32
GATES = [("linear_attn", None), ("gla", "per_head"), ("gla", "per_dim")]
GATE_IDS = ["linear", "per_head", "per_dim"]


def make(op, gate, lengths, *, dims=(2, 16, 16), dtype=F32, seed=0):
    """A packed row of `lengths` (one sequence: B = 1 without cu_seqlens), an initial state per
    sequence, incoming gradients on the outputs and final states."""
    H, K, V = dims
    T, N = sum(lengths), len(lengths)
    args = testing.make_inputs(op, B=1, T=T, H=H, K=K, V=V, gate=gate or "per_dim", seed=seed, device=DEV)
    gen = torch.Generator().manual_seed(seed + 1)
    args["initial_state"] = torch.randn(N, H, K, V, generator=gen).to(DEV)
    w_o = torch.randn(1, T, H, V, generator=gen).to(DEV, dtype)
    w_S = torch.randn(N, H, K, V, generator=gen).to(DEV)
    args.update({n: args[n].to(dtype) for n in ("q", "k", "v")})
    return args, w_o, w_S


def call(fn, args, lengths, w_o, w_S, **kw):
    """(o, final states, gradients) of fn on the row, packed when there is more than one sequence."""
    if len(lengths) == 1:
        x = testing.leaves(args)
        with testing.poisoned():
            o, S = fn(**x, output_final_state=True, **kw)
            ((o * w_o.to(o.dtype)).sum() + (S * w_S).sum()).backward()
        return o.detach(), S.detach(), {n: a.grad for n, a in x.items()}
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64, device=DEV)
    return testing.packed_call(fn, args, cu, w_o, w_S, **kw)


def knobs(op, C, **kw):
    return dict(chunk_size=C, sub_chunk_size=16, **kw) if op == "gla" else dict(chunk_size=C, **kw)


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("lengths,mode,recompute", [([100], "auto", True), ([100], "states", False),
                                                    ([0, 37, 0, 130, 20], "auto", False),
                                                    ([0, 37, 0, 130, 20], "states", True)],
                         ids=["one-row-auto", "one-row-states", "packed-auto", "packed-states"])
@pytest.mark.parametrize("op,gate", GATES, ids=GATE_IDS)
def test_segments_equal_one_walk(op, gate, lengths, mode, recompute, L):
    """mode="states" runs the forward's state pass in segments too; "auto" picks the fused forward
    for linear attention and per-head gates here (its walk is never cut), the states mode for
    per-dimension gates."""
    args, w_o, w_S = make(op, gate, lengths)
    fn, kw = getattr(lt, op), knobs(op, 16, mode=mode, recompute=recompute)
    with segments.fixed(0):
        want = call(fn, args, lengths, w_o, w_S, **kw)
    with segments.fixed(L):
        got = call(fn, args, lengths, w_o, w_S, **kw)
    testing.assert_same_results(got, want, 1e-5, f"{op} {gate} {lengths} L={L}")


def test_segment_tables():
    s = segments._tables([0, 5, 40], 16, 2, "cpu")        # chunks: 0, 1, 3 → segments 1, 1, 2
    assert s.cu_seqlens.tolist() == [0, 0, 5, 37, 45]
    assert s.chunk_offsets.tolist() == [0, 0, 1, 3, 4]
    assert s.first.tolist() == [0, 1, 2, 4] and (s.N, s.S, s.L) == (3, 4, 2)


def test_when_a_pass_is_cut_into_segments():
    """132 SMs, K = V = 128: a pass is cut where the rows of its longest sequence give at most 66
    programs and the walk has at least min_chunks chunks (gated.SEGMENT_MIN_CHUNKS)."""
    def L(counts, per_head=4, H=16, min_chunks=256):
        return segments.length(counts, per_head, H, min_chunks, sms=132)
    assert L([512]) == 16 and L([2048]) == 32             # one row of 32k / 128k tokens, 64 programs
    assert L([512], per_head=8) == 0                      # 128 programs (linear attention's 64×32 blocks)
    assert L([512], per_head=8, H=4) == 16                # 32 programs
    assert L([512], per_head=8, H=4, min_chunks=1024) == 0 and L([2048], per_head=8, H=4, min_chunks=1024) == 32
    assert L([256, 128, 64, 32, 16, 8, 4, 4]) == 0        # a packed row: two rows of its longest, 128
    assert L([256, 128, 64, 32, 16, 8, 4, 4], H=8) == 16  # … 64 with eight heads
    assert L([64] * 8) == 0 and L([128]) == 0             # eight rows of 4k; 8k tokens: too short
    assert segments.plan(2, 32768, 64, 16, 4, "cpu", sms=132) is None     # B > 1: B·H programs already
    with segments.fixed(5):
        assert L([64] * 8) == 5
    D = gated.SEGMENT_MIN_CHUNKS
    assert D[gated.DIM_GATE] < D[gated.HEAD_GATE] == D[gated.NO_GATE]


# Natively: the compiled passes in segments at the head dims and dtypes models use, forced (segments of
# 1 and 16 chunks of 64) and as the rule decides (a row one chunk past its shortest walk, in chunks of
# 16: 4k or 16k tokens), against one walk and against float64.
NATIVE = [(64, 128, torch.bfloat16), (128, 128, torch.bfloat16), (128, 128, torch.float16),
          (128, 256, torch.bfloat16), (256, 128, torch.bfloat16), (128, 128, F32)]
SAME = {F32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 1e-3}


@pytest.mark.skipif(DEV != "cuda", reason="compiled kernels: a GPU only")
@pytest.mark.parametrize("L", [1, 16, None])
@pytest.mark.parametrize("K,V,dtype", NATIVE, ids=[f"K{k}-V{v}-{str(d)[6:]}" for k, v, d in NATIVE])
@pytest.mark.parametrize("op,gate", GATES, ids=GATE_IDS)
def test_native_segments(op, gate, K, V, dtype, L):
    kind = {None: gated.NO_GATE, "per_head": gated.HEAD_GATE, "per_dim": gated.DIM_GATE}[gate]
    C = 64 if L is not None else 16                     # the rule counts chunks: short chunks, fewer tokens
    T = C * gated.SEGMENT_MIN_CHUNKS[kind] + 16         # one chunk past the rule's shortest walk
    lengths = [T] if L is None else [1, 1500, 0, 2100, 65]
    args, w_o, w_S = make(op, gate, lengths, dims=(2, K, V), dtype=dtype, seed=3)
    fn, kw = getattr(lt, op), knobs(op, C)
    if L is None:
        assert gated.segment_plan(1, T, C, 2, K, V, (64, 64), DEV, gate=kind) is not None   # the rule cuts it
        got = call(fn, args, lengths, w_o, w_S, **kw)
    else:
        with segments.fixed(L):
            got = call(fn, args, lengths, w_o, w_S, **kw)
    with segments.fixed(0):
        testing.assert_same_results(got, call(fn, args, lengths, w_o, w_S, **kw), SAME[dtype], f"{op} {gate}")
    ref = call(getattr(chunk, op), testing.to_float64(args), lengths, w_o.double(), w_S.double(), chunk_size=C)
    testing.assert_within_tolerance(got, ref, dtype)


def test_long_sequence_benchmark_runs_both_walks():
    """linattn.bench_long at its small size: ours (segments forced to two chunks) beside one walk,
    FLA recorded as absent or refused; the report names every column. Times are not checked."""
    from linattn import bench_long
    r = bench_long.measure("small", only=["linear_attn"], modes=("forward",), progress=lambda line: None)
    (row,) = r["rows"]
    assert row["ours"] > 0 and row["one_walk"] > 0 and (row["fla"] is not None or "error_fla" in row)
    assert "ours ÷ one walk" in bench_long.report(r) and r["setting"]["chunks"] == 2
