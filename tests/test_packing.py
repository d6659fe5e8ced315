"""Packed sequences (cu_seqlens) at the naive and chunk levels.

Several sequences back to back in one row (B = 1) with their boundaries in cu_seqlens must give
exactly what each sequence gives alone: outputs, final states [N, H, K, V] and every gradient
(q, k, v, g, β, initial state), with an incoming gradient on the final states, in float64 and
float32, for lengths from 1 to a few hundred, empty sequences next to each other and at the ends.
A sequence's result does not depend on where it sits in the row (chunks start at its own start).
Bad cu_seqlens is refused by name before any work, and the caller's tensors are never written.
"""
import pytest
import torch

import linattn
from linattn import chunk, naive, packing, testing
from linattn.validate import InputError

# empty sequences at both ends and side by side, single tokens, lengths across chunk boundaries
LENGTHS = [0, 1, 37, 0, 0, 230, 1, 64, 17, 0]
H, K, V = 2, 8, 6
VARIANTS = [(op, gate) for op, gate in testing.VARIANTS.values()]   # all six, gate shape per op
KNOBS = {"naive": {}, "chunk": {"chunk_size": 16, "sub_chunk_size": 4}}


def bounds(lengths):
    return [0] + torch.tensor(lengths).cumsum(0).tolist()


def make(op, gate, dtype, lengths=LENGTHS, seed=0):
    """Packed inputs [1, T, ...] with one initial state per sequence [N, H, K, V], and random
    incoming gradients for the output and the final states."""
    args = testing.make_inputs(op, B=1, T=sum(lengths), H=H, K=K, V=V, gate=gate or "per_dim",
                               seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    args["initial_state"] = torch.randn(len(lengths), H, K, V, generator=gen)
    w_o = torch.randn(1, sum(lengths), H, V, generator=gen)
    w_S = torch.randn(len(lengths), H, K, V, generator=gen)
    if dtype == torch.float64:
        args, w_o, w_S = testing.to_float64(args), w_o.double(), w_S.double()
    return args, w_o, w_S


def knobs(level, op):
    kw = dict(KNOBS[level])
    if op != "gla":
        kw.pop("sub_chunk_size", None)
    return kw



def alone(fn, args, lengths, w_o, w_S, **kw):
    """The same, from each sequence run alone on fresh tensors, joined along T (N for states).
    An empty sequence has no tokens: its final state is its initial state, whose gradient is
    the incoming one."""
    outs, finals, grads = [], [], {n: [] for n in args}
    b = bounds(lengths)
    for n, (s, e) in enumerate(zip(b, b[1:])):
        h0 = args["initial_state"][n:n + 1]
        if s == e:
            finals.append(h0.to(w_S.dtype))
            grads["initial_state"].append(w_S[n:n + 1].to(h0.dtype))
            continue
        x = testing.leaves({n_: (h0 if n_ == "initial_state" else a[:, s:e]) for n_, a in args.items()})
        o, S = fn(**x, output_final_state=True, **kw)
        ((o * w_o[:, s:e].to(o.dtype)).sum() + (S * w_S[n:n + 1].to(S.dtype)).sum()).backward()
        outs.append(o.detach())
        finals.append(S.detach())
        for name, a in x.items():
            grads[name].append(a.grad)
    joined = {name: torch.cat(gs, dim=0 if name == "initial_state" else 1) for name, gs in grads.items()}
    return torch.cat(outs, 1), torch.cat(finals), joined



@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("level", ["naive", "chunk"])
@pytest.mark.parametrize("op,gate", VARIANTS)
def test_packed_equals_each_sequence_alone(op, gate, level, dtype):
    args, w_o, w_S = make(op, gate, dtype)
    fn, kw = getattr(getattr(linattn, level), op), knobs(level, op)
    cu = torch.tensor(bounds(LENGTHS))
    got = testing.packed_call(fn, args, cu, w_o, w_S, **kw)
    # the same level, each sequence alone: the same arithmetic, so float64 precision in both dtypes
    same = 1e-12 if dtype == torch.float64 else 1e-6
    testing.assert_same_results(got, alone(fn, args, LENGTHS, w_o, w_S, **kw), same, f"{level} packed vs alone")
    # and the ground truth: the float64 recurrence, each sequence alone
    ref = alone(getattr(naive, op), testing.to_float64(args), LENGTHS, w_o.double(), w_S.double())
    testing.assert_same_results(got, ref, testing.GRAD_TOLERANCE[dtype], f"{level} packed vs float64 naive")


@pytest.mark.parametrize("op,gate", [("gla", "per_dim"), ("kda", "per_dim"), ("delta_rule", None)])
def test_result_does_not_depend_on_position(op, gate):
    """One sequence of 21 tokens packed after 0, 5 and 16 others: its output and final state are
    the same each time (each sequence is chunked from its own start, never across a boundary)."""
    fn = getattr(chunk, op)
    seq, _, _ = make(op, gate, torch.float64, lengths=[21], seed=3)
    results = []
    for before in (0, 5, 16):
        other, _, _ = make(op, gate, torch.float64, lengths=[before + 11], seed=4)
        row = {n: (torch.cat([other[n][:, :before], seq[n], other[n][:, before:]], 1)
                   if n != "initial_state" else torch.cat([other[n], seq[n], other[n]]))
               for n in seq}
        o, S = fn(**row, cu_seqlens=torch.tensor([0, before, before + 21, before + 32]),
                  output_final_state=True, chunk_size=16)
        results.append((o[:, before:before + 21], S[1]))
    for o, S in results[1:]:
        assert torch.equal(o, results[0][0]) and torch.equal(S, results[0][1])


@pytest.mark.parametrize("level", ["naive", "chunk"])
def test_without_initial_state_and_final_state(level):
    """No initial state: every sequence starts from zeros; output_final_state=False gives None."""
    args, _, _ = make("gla", "per_head", torch.float64, lengths=[3, 0, 9])
    h0 = args.pop("initial_state")
    fn = getattr(getattr(linattn, level), "gla")
    cu = torch.tensor([0, 3, 3, 12])
    o, S = fn(**args, cu_seqlens=cu, output_final_state=True)
    o2, S2 = fn(**args, cu_seqlens=cu, initial_state=torch.zeros_like(h0).double(),
                output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(S, S2) and not S[1].any()
    assert fn(**args, cu_seqlens=cu)[1] is None


def test_inputs_and_cu_seqlens_never_written():
    """Layers that overwrite the caller's cu_seqlens break the next layer: nothing here writes it,
    nor q, k, v, g, β or the initial states, forward or backward."""
    args, w_o, w_S = make("kda", "per_dim", torch.float32, lengths=[5, 0, 40])
    cu = torch.tensor([0, 5, 5, 45])
    before = {n: a.clone() for n, a in args.items()}, cu.clone()
    for level in ("naive", "chunk"):
        testing.packed_call(getattr(getattr(linattn, level), "kda"), args, cu, w_o, w_S)
    assert torch.equal(cu, before[1])
    assert all(torch.equal(args[n], a) for n, a in before[0].items())


T_BAD = 12
BAD = [  # (change to the packed call, what the message must say)
    (dict(cu_seqlens=torch.tensor([[0, 5, 12]])), r"cu_seqlens must be 1-D"),
    (dict(cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32)), r"cu_seqlens must have dtype torch.int64"),
    (dict(cu_seqlens=torch.tensor([0.0, 5.0, 12.0])), r"cu_seqlens must have dtype torch.int64"),
    (dict(cu_seqlens=[0, 5, 12]), r"cu_seqlens must be a torch.Tensor"),
    (dict(cu_seqlens=torch.tensor([12])), r"cu_seqlens must hold N\+1 ≥ 2 boundaries"),
    (dict(cu_seqlens=torch.tensor([1, 5, 12])), r"cu_seqlens must start at 0, got cu_seqlens\[0\] = 1"),
    (dict(cu_seqlens=torch.tensor([0, 5, 11])), r"cu_seqlens must end at T = 12"),
    (dict(cu_seqlens=torch.tensor([0, 5, 13])), r"cu_seqlens must end at T = 12"),
    (dict(cu_seqlens=torch.tensor([0, 7, 5, 12])), r"non-decreasing.*cu_seqlens\[1\] = 7 > cu_seqlens\[2\] = 5"),
    (dict(cu_seqlens=torch.tensor([0, 5, 12], device="meta")), r"cu_seqlens is on meta but q is on cpu"),
    (dict(initial_state=torch.zeros(3, H, K, V)), r"initial_state must have shape \[N, H, K, V\] = \[2, 2, 8, 6\]"),
    (dict(initial_state=torch.zeros(2, H, K, V + 1)), r"initial_state must have shape \[N, H, K, V\]"),
    (dict(initial_state=torch.zeros(1, H, K, V)), r"one state per sequence"),
    (dict(batch=2), r"q must have B = 1, got B = 2"),
]


@pytest.mark.parametrize("change,match", BAD)
@pytest.mark.parametrize("fn", [naive.linear_attn, chunk.linear_attn, naive.gla, chunk.gla,
                                naive.delta_rule, chunk.delta_rule, naive.kda, chunk.kda,
                                linattn.kda])
def test_bad_cu_seqlens_named_before_any_work(fn, change, match, monkeypatch):
    op = fn.__name__
    gate = "per_dim" if op in ("gla", "kda") else None
    change = dict(change)
    args, _, _ = make(op, gate, torch.float32, lengths=[5, 7])
    if change.pop("batch", 1) == 2:
        args = {n: torch.cat([a, a]) for n, a in args.items()}
    args.update({"cu_seqlens": torch.tensor([0, 5, T_BAD]), **change})
    calls = []
    real = packing.per_sequence
    monkeypatch.setattr(packing, "per_sequence", lambda f, *a, **kw: real(
        lambda *x, **y: calls.append(1), *a, **kw))    # no sequence may run before the refusal
    with pytest.raises(InputError, match=match):
        fn(**args)
    assert not calls


def test_dispatch_passes_cu_seqlens_to_the_level():
    args, _, _ = make("gla", "per_dim", torch.float64, lengths=[3, 9])
    cu = torch.tensor([0, 3, 12])
    o, S = linattn.gla(**args, cu_seqlens=cu, output_final_state=True)        # CPU: the chunk level
    o_n, S_n = linattn.gla(**args, cu_seqlens=cu, output_final_state=True, impl="naive")
    assert testing.rel_err(o, o_n) < 1e-12 and testing.rel_err(S, S_n) < 1e-12
    # the Triton level takes it too (tests/test_triton_packing.py), the delta family included
    args, _, _ = make("kda", "per_head", torch.float32, lengths=[3, 9])
    dev = linattn.device.default_device()                  # compiled kernels take CUDA tensors
    args, cu = {n: a.to(dev) for n, a in args.items()}, cu.to(dev)
    o, S = linattn.kda(**args, cu_seqlens=cu, output_final_state=True, impl="triton")
    o_c, S_c = linattn.kda(**args, cu_seqlens=cu, output_final_state=True, impl="chunk")
    assert testing.rel_err(o, o_c) < 1e-5 and testing.rel_err(S, S_c) < 1e-5


BACKWARD = {"linear_attn": naive.backward.linear_attn_backward, "gla": naive.backward.gla_backward,
            "delta_rule": naive.backward.delta_rule_backward, "kda": naive.backward.kda_backward}


@pytest.mark.parametrize("op,gate", VARIANTS)
@pytest.mark.parametrize("init", [True, False])
def test_reverse_walks_take_packed_rows(op, gate, init):
    """linattn.naive.backward's explicit reverse walks (chapter 12) on a packed row give autograd's
    gradients through the packed token loop; an empty sequence hands its final-state gradient
    straight to its initial state."""
    lengths = [0, 4, 0, 0, 19, 1, 0]
    args, w_o, w_S = make(op, gate, torch.float64, lengths=lengths)
    if not init:
        args.pop("initial_state")
    cu = torch.tensor(bounds(lengths))
    _, _, want = testing.packed_call(getattr(naive, op), args, cu, w_o, w_S)
    names = [n for n in ("q", "k", "v", "g", "beta") if n in args]      # positional order
    got = BACKWARD[op](*(args[n] for n in names), w_o, cu_seqlens=cu, dfinal_state=w_S,
                       initial_state=args.get("initial_state"))
    for n in names:
        assert testing.rel_err(got["d" + n], want[n]) < 1e-12, n
    if init:
        assert testing.rel_err(got["dinitial_state"], want["initial_state"]) < 1e-12
        assert torch.equal(got["dinitial_state"][0], w_S[0])
    else:
        assert got["dinitial_state"] is None


def test_reverse_walk_refuses_bad_gradients():
    args, w_o, w_S = make("gla", "per_dim", torch.float64, lengths=[3, 9])
    cu = torch.tensor([0, 3, 12])
    q, k, v, g, h0 = (args[n] for n in ("q", "k", "v", "g", "initial_state"))
    with pytest.raises(InputError, match=r"do must be a tensor of the output's shape \[1, T, H, V\]"):
        naive.backward.gla_backward(q, k, v, g, w_o[:, :5], cu_seqlens=cu)
    with pytest.raises(InputError, match=r"dfinal_state must have shape \[N, H, K, V\] = \[2, 2, 8, 6\]"):
        naive.backward.gla_backward(q, k, v, g, w_o, cu_seqlens=cu, dfinal_state=w_S[:1])
    with pytest.raises(InputError, match=r"cu_seqlens must end at T = 12"):
        naive.backward.gla_backward(q, k, v, g, w_o, cu_seqlens=torch.tensor([0, 3, 11]),
                                    initial_state=h0)
