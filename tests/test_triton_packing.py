"""Packed sequences (cu_seqlens) at the Triton level: linattn.triton.linear_attn, gla, delta_rule
and kda.

One launch per kernel indexes the packed sequences (linattn/triton/gated.py and delta.py, "Packed
sequences"). The result must be that of each sequence run alone through the same Triton level:

- outputs, final states [N, H, K, V] and every gradient (q, k, v, g, initial state) for an incoming
  gradient on the outputs and on the final states, float32, for a row of lengths 0, 1, 37, 0, 64,
  17, 100, 0 (empty sequences at both ends and inside, one token, lengths on and across chunk
  boundaries), chunk sizes 16, 32 and 128, no gate / per-head / per-dimension gates, fused and
  states modes, recompute True and False; every buffer NaN-poisoned. An empty sequence's final
  state is its initial state and its initial state's gradient is its final state's, exactly;
- the same for the delta family (dβ too): DeltaNet, Gated DeltaNet (per-head gates: W and the
  decayed queries from each chunk's first token within its sequence) and KDA (per-dimension gates,
  also with strong gates, whose chunks the exact factor kernel and the gate backward's column
  walk redo), chunks of 16 and 64, recompute True and False (not every combination: the
  interpreter is slow);
- the forward without autograd, whose per-dimension path builds the intra matrix of most chunks
  inside the output kernel (the split) and the rest in _intra_kernel;
- against the chunk level with cu_seqlens in float64 (the Triton level has no float64), within
  float32's tolerances of linattn.testing.

Bad cu_seqlens is refused by name before any launch, the caller's cu_seqlens is never written, and
the dispatcher and the custom op pass cu_seqlens through. Tiny shapes: the interpreter is slow.
"""
import functools

import pytest
import torch

import linattn
from linattn import chunk, device, ops, testing
from linattn import triton as lt
from linattn.triton import gated
from linattn.validate import InputError, check_inputs

LENGTHS = [0, 1, 37, 0, 64, 17, 100, 0]
H, K, V = 2, 16, 16
F32 = torch.float32
DEV = device.default_device()      # compiled kernels on a GPU, the interpreter on a CPU
GATES = [("linear_attn", None), ("gla", "per_head"), ("gla", "per_dim")]
GATE_IDS = ["linear", "per_head", "per_dim"]
# (chunk size, mode, recompute) with autograd; recompute=False keeps the states mode's forward
# whatever the mode. Chunks of 32 hold two sub-chunks of 16 (off-diagonal tiles); chunks of 128 two
# row blocks of 64 (the gate gradient's carry between them).
RUNS = [(16, "fused", True), (16, "states", True), (16, "states", False), (32, "fused", True),
        (32, "states", False), (128, "states", False)]


def bounds(lengths=LENGTHS):
    return [0] + torch.tensor(lengths).cumsum(0).tolist()


def cu_of(lengths=LENGTHS):
    return torch.tensor(bounds(lengths), dtype=torch.int64, device=DEV)


def make(op, gate, lengths=LENGTHS, seed=0, dtype=F32, dims=(H, K, V)):
    """Packed inputs [1, T, ...], one initial state per sequence, incoming gradients w_o, w_S."""
    T, N = sum(lengths), len(lengths)
    H, K, V = dims
    args = testing.make_inputs(op, B=1, T=T, H=H, K=K, V=V, gate=gate or "per_dim", seed=seed, device=DEV)
    gen = torch.Generator().manual_seed(seed + 1)
    args["initial_state"] = torch.randn(N, H, K, V, generator=gen).to(DEV)
    w_o = torch.randn(1, T, H, V, generator=gen).to(DEV)
    w_S = torch.randn(N, H, K, V, generator=gen).to(DEV)
    args = {n: a.to(dtype) for n, a in args.items()}
    return args, w_o.to(dtype), w_S.to(dtype)


def fn_of(level, op):
    return getattr(level, op)


def knobs(op, C):
    return dict(chunk_size=C, sub_chunk_size=16) if op == "gla" else dict(chunk_size=C)



@functools.lru_cache(maxsize=None)
def reference(op, gate, C):
    """Each sequence alone through the Triton level (states mode, recomputed), for the inputs of
    `make(op, gate)`: computed once per worker, shared by the runs of every mode."""
    args, w_o, w_S = make(op, gate)
    return alone(fn_of(lt, op), args, LENGTHS, w_o, w_S, **knobs(op, C), mode="states", recompute=True)


def alone(fn, args, lengths, w_o, w_S, **kw):
    """The same, each sequence run alone through fn (no cu_seqlens); an empty one hands its initial
    state through as its final state."""
    x = testing.leaves(args)
    outs, finals, loss = [], [], 0
    b = bounds(lengths)
    with testing.poisoned():
        for n, (s, e) in enumerate(zip(b, b[1:])):
            h0 = x["initial_state"][n:n + 1]
            if s == e:
                S = h0
            else:
                o, S = fn(**{m: a[:, s:e] for m, a in x.items() if m != "initial_state"}, initial_state=h0,
                          output_final_state=True, **kw)
                outs.append(o)
                loss = loss + (o * w_o[:, s:e]).sum()
            finals.append(S)
            loss = loss + (S * w_S[n:n + 1]).sum()
        loss.backward()
    return torch.cat(outs, 1).detach(), torch.cat(finals).detach(), {n: a.grad for n, a in x.items()}



@pytest.mark.parametrize("C,mode,recompute", RUNS)
@pytest.mark.parametrize("op,gate", GATES, ids=GATE_IDS)
def test_packed_equals_each_sequence_alone(op, gate, C, mode, recompute):
    args, w_o, w_S = make(op, gate)
    got = testing.packed_call(fn_of(lt, op), args, cu_of(), w_o, w_S, **knobs(op, C), mode=mode, recompute=recompute)
    testing.assert_same_results(got, reference(op, gate, C), 1e-6, f"{op} {gate} C={C} {mode} recompute={recompute}")
    # empty sequences: final state = initial state, d initial state = d final state, exactly
    empty = [n for n, length in enumerate(LENGTHS) if length == 0]
    assert torch.equal(got[1][empty], args["initial_state"][empty])
    assert torch.equal(got[2]["initial_state"][empty], w_S[empty])


def check_forward_alone(fn, args, o, S, kw):
    """A packed forward's outputs and final states against each sequence run alone through fn."""
    b = bounds()
    for n, (s, e) in enumerate(zip(b, b[1:])):
        h0 = args["initial_state"][n:n + 1]
        if s == e:
            assert torch.equal(S[n:n + 1], h0)
            continue
        x = {m: a[:, s:e] for m, a in args.items() if m != "initial_state"}
        o_n, S_n = fn(**x, initial_state=h0, output_final_state=True, **kw)
        assert testing.rel_err(o[:, s:e], o_n) <= 1e-6 and testing.rel_err(S[n:n + 1], S_n) <= 1e-6, (n, s, e)


@pytest.mark.parametrize("mode", ["fused", "states"])
@pytest.mark.parametrize("C", [16, 32])
def test_packed_forward_without_autograd(C, mode):
    """The forward without autograd, per-dimension gates: most chunks' intra matrix is built inside
    the output kernel (the split), _intra_kernel skips them (without gates or with per-head gates this
    forward runs the kernels of the autograd forward above). Also a row without initial states or
    final states."""
    op, gate = "gla", "per_dim"
    args, _, _ = make(op, gate, seed=3)
    cu = cu_of()
    fn = fn_of(lt, op)
    kw = dict(knobs(op, C), mode=mode)
    with testing.poisoned():
        o, S = fn(**args, cu_seqlens=cu, output_final_state=True, **kw)
        o0, S0 = fn(**{n: a for n, a in args.items() if n != "initial_state"}, cu_seqlens=cu, **kw)
    check_forward_alone(fn, args, o, S, kw)
    b = bounds()
    for s, e in zip(b, b[1:]):                                 # without initial states: from zeros
        if e > s:
            x = {m: a[:, s:e] for m, a in args.items() if m != "initial_state"}
            assert testing.rel_err(o0[:, s:e], fn(**x, **kw)[0]) <= 1e-6, (s, e)
    assert S0 is None


@pytest.mark.parametrize("op,gate", GATES, ids=GATE_IDS)
def test_packed_against_the_chunk_level_in_float64(op, gate):
    """Triton float32 against linattn.chunk with cu_seqlens in float64: float32's tolerances."""
    args, w_o, w_S = make(op, gate, seed=5)
    cu = cu_of()
    got = testing.packed_call(fn_of(lt, op), args, cu, w_o, w_S, **knobs(op, 16), mode="fused")
    ref = testing.packed_call(fn_of(chunk, op), testing.to_float64(args), cu, w_o.double(), w_S.double(), chunk_size=16)
    testing.assert_within_tolerance(got, ref, F32)


def test_chunk_tables():
    """chunk_indices lists (sequence, chunk within it) of every chunk of the row, empty sequences
    having none; chunk_offsets the row's first chunk of each sequence."""
    p = gated.packed(cu_of(), bounds(), 32)
    counts = [0, 1, 2, 0, 2, 1, 4, 0]
    assert p.N == 8 and p.NT == sum(counts) == 10
    assert p.chunk_offsets.tolist() == [0, 0, 1, 3, 3, 5, 6, 10, 10]
    assert p.chunk_indices.tolist() == [[1, 0], [2, 0], [2, 1], [4, 0], [4, 1], [5, 0], [6, 0], [6, 1], [6, 2],
                                        [6, 3]]
    assert p.chunk_indices.dtype == torch.int32 and p.chunk_offsets.dtype == torch.int64
    # the grid heuristics count rows of the longest sequence (219 tokens, the longest 100), not N
    assert p.rows == 2 and gated.busy_rows(1, p) == 2 and gated.busy_rows(5) == 5
    assert gated.packed(cu_of([5, 5, 5]), bounds([5, 5, 5]), 16).rows == 3


@pytest.mark.parametrize("op", ["linear_attn", "gla", "delta_rule", "kda"])
def test_bad_cu_seqlens_is_refused_before_any_launch(op, monkeypatch):
    gate = "per_dim" if op in ("gla", "kda") else None
    args, _, _ = make(op, gate)
    fn = fn_of(lt, op)
    launched = []
    monkeypatch.setattr(gated, "packed", lambda *a, **k: launched.append(1))   # reached only past the checks
    cases = [(cu_of().int(), "cu_seqlens must have dtype torch.int64"),
             (torch.tensor([0, 5, 3, sum(LENGTHS)], device=DEV), r"cu_seqlens must be non-decreasing"),
             (torch.tensor([0, 5], device=DEV), r"cu_seqlens must end at T"),
             ([0, sum(LENGTHS)], "cu_seqlens must be a torch.Tensor")]
    for cu, match in cases:
        with pytest.raises(InputError, match=match):
            fn(**args, cu_seqlens=cu)
    with pytest.raises(InputError, match=r"initial_state must have shape \[N, H, K, V\]"):
        fn(**dict(args, initial_state=args["initial_state"][:3]), cu_seqlens=cu_of())
    B2 = {n: (torch.cat([a, a]) if n != "initial_state" else a) for n, a in args.items()}
    with pytest.raises(InputError, match="q must have B = 1"):
        fn(**B2, cu_seqlens=cu_of())
    assert not launched


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_cu_seqlens_and_inputs_are_not_written(op):
    lengths = [3, 0, 20]
    args, w_o, w_S = make(op, "per_head", lengths=lengths, seed=2)
    cu = cu_of(lengths)
    before = cu.clone(), {n: a.clone() for n, a in args.items()}
    testing.packed_call(fn_of(lt, op), args, cu, w_o, w_S, chunk_size=16)
    assert torch.equal(cu, before[0])
    assert all(torch.equal(args[n], before[1][n]) for n in args)


def test_dispatcher_and_custom_op_pass_cu_seqlens_to_triton():
    args, _, _ = make("gla", "per_dim", lengths=[3, 0, 20], seed=4)
    cu = cu_of([3, 0, 20])
    o, S = lt.gla(**args, cu_seqlens=cu, output_final_state=True, chunk_size=16)
    o_d, S_d = linattn.gla(**args, cu_seqlens=cu, output_final_state=True, chunk_size=16, impl="triton")
    assert "triton" in linattn.which("gla")
    assert torch.equal(o, o_d) and torch.equal(S, S_d)
    o_c, S_c = ops.call("gla", (args["q"], args["k"], args["v"], args["g"]), initial_state=args["initial_state"],
                        cu_seqlens=cu, level="triton", chunk_size=16)
    assert torch.equal(o, o_c) and torch.equal(S, S_c)
    args, _, _ = make("delta_rule", None, lengths=[3, 0, 20], seed=4)
    o, S = lt.delta_rule(**args, cu_seqlens=cu, output_final_state=True, chunk_size=16)
    o_d, S_d = linattn.delta_rule(**args, cu_seqlens=cu, output_final_state=True, chunk_size=16, impl="triton")
    assert torch.equal(o, o_d) and torch.equal(S, S_d)
    o_c, S_c = ops.call("delta_rule", (args["q"], args["k"], args["v"], args["beta"]),
                        initial_state=args["initial_state"], cu_seqlens=cu, level="triton", chunk_size=16)
    assert torch.equal(o, o_c) and torch.equal(S, S_c)


DELTAS = [("delta_rule", None), ("kda", "per_head"), ("kda", "per_dim")]
DELTA_IDS = ["delta", "gated_delta", "kda"]
# (variant, chunk size, recompute, gate strength): DeltaNet and Gated DeltaNet at chunks of 16 and
# 64, recompute True at one and False at the other; KDA at 64 with recompute=False, and with strong
# gates (down to −20 per token) at 16 with recompute=True, where every chunk takes the exact factor
# kernel and the gate backward's column walk. (Every combination would cost the interpreter
# several minutes.)
DELTA_RUNS = [(0, 16, True, "normal"), (0, 64, False, "normal"), (1, 16, False, "normal"),
              (1, 64, True, "normal"), (2, 64, False, "normal"), (2, 16, True, "strong")]


def make_delta(op, gate, strength="normal", seed=0):
    """`make`'s packed inputs for the delta family, gates of the given strength."""
    args, w_o, w_S = make(op, gate, seed=seed)
    if gate is not None:
        shape = args["g"].shape
        args["g"] = testing.log_gates(shape, strength, generator=torch.Generator().manual_seed(seed + 7)).to(DEV)
    return args, w_o, w_S


@functools.lru_cache(maxsize=None)
def delta_reference(op, gate, C, strength):
    """Each sequence alone through the Triton level (recomputed) for `make_delta`'s inputs."""
    args, w_o, w_S = make_delta(op, gate, strength)
    return alone(fn_of(lt, op), args, LENGTHS, w_o, w_S, chunk_size=C, recompute=True)


@pytest.mark.parametrize("variant,C,recompute,strength", DELTA_RUNS,
                         ids=[f"{DELTA_IDS[r[0]]}-{r[1]}-{r[2]}-{r[3]}" for r in DELTA_RUNS])
def test_delta_packed_equals_each_sequence_alone(variant, C, recompute, strength):
    op, gate = DELTAS[variant]
    args, w_o, w_S = make_delta(op, gate, strength)
    got = testing.packed_call(fn_of(lt, op), args, cu_of(), w_o, w_S, chunk_size=C, recompute=recompute)
    testing.assert_same_results(got, delta_reference(op, gate, C, strength), 1e-6,
                f"{op} {gate} C={C} recompute={recompute} {strength}")
    assert set(got[2]) == set(args) and got[1].shape == (len(LENGTHS), H, K, V)
    empty = [n for n, length in enumerate(LENGTHS) if length == 0]
    assert torch.equal(got[1][empty], args["initial_state"][empty])
    assert torch.equal(got[2]["initial_state"][empty], w_S[empty])


def test_delta_packed_forward_without_autograd():
    """The plain forward (no autograd.Function: the state pass writes Ṽ over U), KDA, chunks of 64,
    with initial states (against each sequence alone) and without (against zero initial states); also Gated DeltaNet's stored W̃ taken back to W from each
    chunk's first token within its sequence (wy.absolute_w) against each sequence's own."""
    from linattn.triton import delta as tdelta
    from linattn.triton import wy
    op, gate = "kda", "per_dim"
    args, _, _ = make(op, gate, seed=3)
    cu = cu_of()
    with testing.poisoned():
        o, S = lt.kda(**args, cu_seqlens=cu, output_final_state=True, chunk_size=64)
        o0, S0 = lt.kda(**{n: a for n, a in args.items() if n != "initial_state"}, cu_seqlens=cu, chunk_size=64)
        o_z, _ = lt.kda(**dict(args, initial_state=torch.zeros_like(args["initial_state"])), cu_seqlens=cu,
                        chunk_size=64)
    check_forward_alone(lt.kda, args, o, S, dict(chunk_size=64))
    assert torch.equal(o0, o_z) and S0 is None
    # Gated DeltaNet's W̃ (wy_stage), packed and alone
    args, _, _ = make("kda", "per_head", seed=4)
    x = {n: a for n, a in args.items() if n != "initial_state"}
    d = check_inputs(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], gate=True, delta=True)
    p = tdelta.plan(x["q"], x["g"], d, 16, gated.packed(cu, bounds(), 16))
    w = wy.absolute_w(tdelta.wy_stage(*(x[n] for n in ("q", "k", "v", "g", "beta")), p)["w"], x["g"], 16, cu)
    b = bounds()
    for s, e in zip(b, b[1:]):
        if s < e:
            y = {n: a[:, s:e].contiguous() for n, a in x.items()}
            p_n = tdelta.plan(y["q"], y["g"], check_inputs(
                y["q"], y["k"], y["v"], g=y["g"], beta=y["beta"], gate=True, delta=True), 16)
            w_n = wy.absolute_w(tdelta.wy_stage(*(y[n] for n in ("q", "k", "v", "g", "beta")), p_n)["w"], y["g"], 16)
            assert testing.rel_err(w[:, s:e], w_n) <= 1e-6, (s, e)


@pytest.mark.parametrize("op,gate", DELTAS, ids=DELTA_IDS)
def test_delta_packed_against_the_chunk_level_in_float64(op, gate):
    """Triton float32 against linattn.chunk with cu_seqlens in float64: float32's tolerances."""
    args, w_o, w_S = make(op, gate, seed=5)
    cu = cu_of()
    got = testing.packed_call(fn_of(lt, op), args, cu, w_o, w_S, chunk_size=64)
    ref = testing.packed_call(fn_of(chunk, op), testing.to_float64(args), cu, w_o.double(), w_S.double(), chunk_size=64)
    testing.assert_within_tolerance(got, ref, F32)


@pytest.mark.parametrize("name", ["linear", "gla"])
def test_layers_take_packed_rows_at_the_triton_level(name):
    """A linattn.nn layer with impl="triton" runs a packed row through the Triton level: outputs,
    recurrent states and the input's gradient equal the chunk level's (float32)."""
    from linattn import nn as lnn

    lengths = [3, 0, 20, 1]
    cu = cu_of(lengths)
    torch.manual_seed(0)
    layer = lnn.LAYERS[name](16, H, conv_width=4, impl="triton").to(DEV)
    runs = []
    for impl in ("triton", "chunk"):
        layer.impl = impl
        x = torch.randn(1, sum(lengths), 16, generator=torch.Generator().manual_seed(1)).to(DEV).requires_grad_()
        y, state = layer(x, cu_seqlens=cu)
        (y.sum() + state.memory.sum()).backward()
        runs.append((y.detach(), state.memory.detach(), x.grad))
    for got, want in zip(*runs):
        assert testing.rel_err(got, want) <= testing.GRAD_TOLERANCE[F32]


# Natively only (the interpreter would take minutes, and upcasts every tile to float32): documents of
# 1 to 1,500 tokens in one row, float32 and bf16, every op with initial states and final-state
# gradients — packed = alone (the same arithmetic, so far tighter than the dtype's tolerance), and
# within the dtype's tolerance of the chunk level's float64 on the same packed row.
NATIVE_LENGTHS = [1, 1500, 63, 0, 65, 700, 16, 64]
SAME = {F32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 1e-3}


@pytest.mark.skipif(DEV != "cuda", reason="compiled kernels: a GPU only")
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op,gate", GATES + DELTAS, ids=GATE_IDS + DELTA_IDS)
def test_native_packed_documents_of_one_to_thousands_of_tokens(op, gate, dtype):
    check_native_packed(op, gate, dtype, NATIVE_LENGTHS, seed=6, C=64)


def check_native_packed(op, gate, dtype, lengths, *, seed, C, dims=(H, K, V)):
    """q, k, v in dtype on a packed row of `lengths`: packed = each sequence alone within SAME[dtype],
    and within dtype's tolerance of the chunk level's float64 on the same row."""
    args, w_o, w_S = make(op, gate, lengths=lengths, seed=seed, dims=dims)
    args.update({n: args[n].to(dtype) for n in ("q", "k", "v")})
    w_o, cu, fn, kw = w_o.to(dtype), cu_of(lengths), fn_of(lt, op), knobs(op, C)
    got = testing.packed_call(fn, args, cu, w_o, w_S, **kw)
    what = f"{op} {gate} H, K, V = {dims} {dtype} C={C}"
    testing.assert_same_results(got, alone(fn, args, lengths, w_o, w_S, **kw), SAME[dtype], what)
    ref = testing.packed_call(fn_of(chunk, op), testing.to_float64(args), cu, w_o.double(), w_S.double(), chunk_size=C)
    testing.assert_within_tolerance(got, ref, dtype)


# Natively only: packed rows at the head dims models use (the tests above run K = V = 16), where the
# compiled kernels take other tiles: 64- and 128-wide key blocks, 256-wide value or key heads split
# into blocks, K != V; bf16 and fp16 inputs, chunks of 32 and 64. Packed = each sequence alone (the
# same kernels' unpacked variant) and within the dtype's tolerance of float64 on the same row.
MODEL_DIMS = [(64, 128, torch.bfloat16), (128, 128, torch.bfloat16), (128, 128, torch.float16),
              (128, 256, torch.bfloat16), (256, 128, torch.bfloat16)]
MODEL_LENGTHS = [1, 300, 63, 0, 65, 129, 16]


@pytest.mark.skipif(DEV != "cuda", reason="compiled kernels: a GPU only")
@pytest.mark.parametrize("C", [32, 64])
@pytest.mark.parametrize("K_,V_,dtype", MODEL_DIMS, ids=[f"K{k}-V{v}-{str(d)[6:]}" for k, v, d in MODEL_DIMS])
@pytest.mark.parametrize("op,gate", GATES + DELTAS, ids=GATE_IDS + DELTA_IDS)
def test_native_packed_rows_at_model_head_dims(op, gate, K_, V_, dtype, C):
    check_native_packed(op, gate, dtype, MODEL_LENGTHS, seed=8, C=C, dims=(2, K_, V_))


def test_chunk_tables_are_built_once_per_cu_seqlens_and_again_after_a_change():
    """The boundaries and chunk tables are remembered per cu_seqlens tensor (no host sync or copy
    on the later calls of a training step) and rebuilt when it changes in place or is another
    tensor with the same values."""
    from linattn import packing
    cu = cu_of()
    d = check_inputs(*(torch.zeros(1, sum(LENGTHS), H, K, device=DEV) for _ in range(3)))
    q = torch.zeros(1, sum(LENGTHS), H, K, device=DEV)
    p1 = gated.check_packed(cu, d, q, None, 16)
    assert gated.check_packed(cu, d, q, None, 16) is p1                       # remembered
    assert gated.check_packed(cu, d, q, None, 32) is not p1                   # per chunk size
    assert gated.check_packed(cu.clone(), d, q, None, 16) is not p1           # per tensor
    cu[1:] = sum(LENGTHS)                                                     # in place: [0, T, …, T]
    p2 = gated.check_packed(cu, d, q, None, 16)
    assert p2 is not p1 and p2.N == p1.N and p2.NT == triton_cdiv(sum(LENGTHS), 16)
    bad = cu_of()
    packing.check_cu_seqlens(bad, d, q.device)
    bad[3] = 0                                                                # no longer non-decreasing
    with pytest.raises(InputError, match="non-decreasing"):
        gated.check_packed(bad, d, q, None, 16)


def triton_cdiv(a, b):
    return -(-a // b)
