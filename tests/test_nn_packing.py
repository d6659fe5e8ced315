"""linattn.nn with packed sequences (`cu_seqlens`, linattn.packing): each layer's forward on a
packed row equals each sequence run alone through the same layer.

- Every recurrent layer at the chunk level in float64, lengths 1 and below the convolution width
  among them (and an empty sequence), with and without an initial state: outputs, recurrent states,
  convolution caches and the gradients of the input, of the initial state and of every weight agree
  with the sequences run alone (rel err ≤ 1e-12).
- A packed prefill of unequal lengths, then batched one-token decode steps (B = N rows), equals each
  sequence prefilled and decoded alone.
- A bad cu_seqlens or a state of another number of sequences is refused by name before any work;
  the caller's cu_seqlens and state are unchanged; softmax attention refuses cu_seqlens.
- torch.compile(layer, fullgraph=True) runs a packed forward with no graph break, equal to eager.
"""
import pytest
import torch

from linattn import nn as lnn, testing
from linattn.nn import LayerState
from linattn.validate import InputError

D, H, W = 16, 2, 4
RECURRENT = [n for n in lnn.LAYERS if n != "softmax"]
LENGTHS = [3, 1, 0, 2, 19, 5]     # 1, 2, 3 < the convolution's width 4; an empty one among them
TOL = 1e-12


def make(name, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return lnn.LAYERS[name](D, H, conv_width=W, impl="chunk").to(dtype)


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def random_state(layer, N, seed=3):
    gen = torch.Generator().manual_seed(seed)
    memory = torch.randn(N, H, layer.head_k, layer.head_v, generator=gen, dtype=torch.float64)
    conv = torch.randn(N, W - 1, layer.conv.conv.weight.shape[0], generator=gen, dtype=torch.float64)
    return LayerState(memory.requires_grad_(), conv.requires_grad_(), layer.owner, 0)


def grads(layer, leaves, y, state):
    """Gradients of a fixed random function of (y, state) w.r.t. leaves and every weight."""
    gen = torch.Generator().manual_seed(7)
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum()
               for t in (y, state.memory, state.conv))
    ts = list(leaves) + list(layer.parameters())
    return [g if g is not None else torch.zeros_like(t)
            for g, t in zip(torch.autograd.grad(loss, ts, allow_unused=True), ts)]


def close(a, b, tol=TOL):
    return testing.rel_err(a, b) <= tol


@pytest.mark.parametrize("name", RECURRENT)
@pytest.mark.parametrize("with_state", [False, True])
def test_packed_layer_equals_each_sequence_alone(name, with_state):
    layer = make(name)
    bounds = cu(LENGTHS)
    N = len(LENGTHS)
    x = torch.randn(1, sum(LENGTHS), D, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64, requires_grad=True)
    s0 = random_state(layer, N) if with_state else None
    y, state = layer(x, s0, cu_seqlens=bounds)
    assert state.memory.shape == (N, H, layer.head_k, layer.head_v)
    assert state.conv.shape == (N, W - 1, layer.conv.conv.weight.shape[0])
    leaves = [x] + ([s0.memory, s0.conv] if s0 else [])
    packed = grads(layer, leaves, y, state)

    # the reference: each sequence alone, its gradients summed over the sequences (the loss is a sum)
    ys, mems, convs, alone = [], [], [], None
    loss_grads = torch.Generator().manual_seed(7)
    dy = torch.randn(y.shape, generator=loss_grads, dtype=y.dtype)
    dmem = torch.randn(state.memory.shape, generator=loss_grads, dtype=y.dtype)
    dconv = torch.randn(state.conv.shape, generator=loss_grads, dtype=y.dtype)
    loss = 0
    for n, (a, b) in enumerate(zip(bounds.tolist(), bounds.tolist()[1:])):
        sn = LayerState(s0.memory[n:n + 1], s0.conv[n:n + 1], layer.owner, 0) if s0 else None
        if a == b:      # an empty sequence: its state passes through (zeros without one)
            mem = sn.memory if sn else torch.zeros_like(state.memory[:1])
            conv = sn.conv if sn else torch.zeros_like(state.conv[:1])
        else:
            yn, st = layer(x[:, a:b], sn)
            ys.append(yn)
            mem, conv = st.memory, st.conv
            loss = loss + (yn * dy[:, a:b]).sum()
        mems.append(mem)
        convs.append(conv)
        loss = loss + (mem * dmem[n:n + 1]).sum() + (conv * dconv[n:n + 1]).sum()
    assert close(y, torch.cat(ys, 1))
    assert close(state.memory, torch.cat(mems)) and close(state.conv, torch.cat(convs))
    ts = leaves + list(layer.parameters())
    alone = [g if g is not None else torch.zeros_like(t)
             for g, t in zip(torch.autograd.grad(loss, ts, allow_unused=True), ts)]
    names = ["x"] + (["state.memory", "state.conv"] if s0 else []) + [n for n, _ in layer.named_parameters()]
    for what, a, b in zip(names, packed, alone):
        assert close(a, b), (what, testing.rel_err(a, b))


def test_a_short_sequence_keeps_its_own_cache_zero_padded():
    # a sequence shorter than w − 1 has a cache of zeros, then its inputs: nothing of its neighbour
    layer = make("gla")
    x = torch.randn(1, 8, D, dtype=torch.float64)
    _, state = layer(x, cu_seqlens=cu([6, 1, 1]))
    qkv = layer.qkv(x)[0]
    assert torch.equal(state.conv[1, :-1], torch.zeros_like(state.conv[1, :-1]))
    assert torch.equal(state.conv[1, -1], qkv[6]) and torch.equal(state.conv[2, -1], qkv[7])
    assert torch.equal(state.conv[0], qkv[3:6])


@pytest.mark.parametrize("name", RECURRENT)
def test_packed_prefill_then_batched_decode_of_unequal_lengths(name):
    layer = make(name)
    lengths, steps = [1, 6, 2, 11], 3
    N = len(lengths)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randn(1, n, D, generator=gen, dtype=torch.float64) for n in lengths]
    tokens = torch.randn(N, steps, D, generator=gen, dtype=torch.float64)   # row n continues sequence n
    with torch.no_grad():
        _, state = layer(torch.cat(prompts, 1), cu_seqlens=cu(lengths))
        decoded = []
        for t in range(steps):                                    # one token per sequence per call
            y, state = layer(tokens[:, t:t + 1], state)
            decoded.append(y)
        decoded = torch.cat(decoded, 1)                           # [N, steps, D]
        for n in range(N):
            _, alone = layer(prompts[n])
            for t in range(steps):
                y, alone = layer(tokens[n:n + 1, t:t + 1], alone)
                assert close(decoded[n:n + 1, t:t + 1], y), (n, t)
            assert close(state.memory[n:n + 1], alone.memory) and close(state.conv[n:n + 1], alone.conv)


BAD = [
    (torch.tensor([0, 3, 8], dtype=torch.int32), "int64"),
    (torch.tensor([0, 3, 7]), "end at T"),
    (torch.tensor([1, 3, 8]), "start at 0"),
    (torch.tensor([0, 5, 3, 8]), "non-decreasing"),
    (torch.tensor([[0, 3, 8]]), "1-D"),
    ([0, 3, 8], "torch.Tensor"),
]


@pytest.mark.parametrize("bad,says", BAD)
def test_a_bad_cu_seqlens_is_refused_by_name(bad, says):
    layer = make("kda")
    with pytest.raises(InputError, match="cu_seqlens") as err:
        layer(torch.randn(1, 8, D, dtype=torch.float64), cu_seqlens=bad)
    assert says in str(err.value)


def test_packed_rows_have_one_row_and_a_state_per_sequence():
    layer = make("gla")
    with pytest.raises(InputError, match="B = 1"):
        layer(torch.randn(2, 8, D, dtype=torch.float64), cu_seqlens=cu([3, 5]))
    _, state = layer(torch.randn(1, 8, D, dtype=torch.float64), cu_seqlens=cu([3, 5]))
    with pytest.raises(InputError, match="state holds a batch of 2 sequences but cu_seqlens holds 3"):
        layer(torch.randn(1, 8, D, dtype=torch.float64), state, cu_seqlens=cu([3, 4, 1]))


def test_the_callers_tensors_are_unchanged():
    layer = make("deltanet")
    bounds = cu([3, 1, 4])
    x = torch.randn(1, 8, D, dtype=torch.float64, requires_grad=True)
    s0 = random_state(layer, 3)
    before = [t.detach().clone() for t in (bounds, x, s0.memory, s0.conv)]
    y, state = layer(x, s0, cu_seqlens=bounds)
    (y.sum() + state.memory.sum() + state.conv.sum()).backward()
    for a, b in zip(before, (bounds, x, s0.memory, s0.conv)):
        assert torch.equal(a, b)


def test_softmax_attention_refuses_packed_sequences():
    layer = lnn.SoftmaxAttention(D, H)
    with pytest.raises(InputError, match="cu_seqlens: SoftmaxAttention"):
        layer(torch.randn(1, 8, D), cu_seqlens=cu([3, 5]))


@pytest.mark.parametrize("name", ["gla", "gated_deltanet"])
def test_compiled_packed_forward_equals_eager(name):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = lnn.LAYERS[name](D, H, conv_width=W)
    bounds = cu([3, 1, 0, 6])
    x = torch.randn(1, 10, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y, state = compiled(x, cu_seqlens=bounds)
    y_ref, state_ref = layer(x, cu_seqlens=bounds)
    tol = testing.tolerance(torch.float32)
    assert close(y, y_ref, tol) and close(state.memory, state_ref.memory, tol)
    assert close(state.conv, state_ref.conv, tol)
    g = torch.autograd.grad(y.square().sum(), x)[0]
    g_ref = torch.autograd.grad(y_ref.square().sum(), x)[0]
    assert close(g, g_ref, tol)
    with pytest.raises(InputError, match="cu_seqlens"):     # the op's own check, when the graph runs
        compiled(x, cu_seqlens=torch.tensor([0, 3, 4, 4, 9]))
