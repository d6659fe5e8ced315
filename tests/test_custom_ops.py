"""linattn.ops: the operations as torch.library custom ops, and the layers under torch.compile.

- torch.library.opcheck passes for every operation at the chunk level (float32 and float64, with
  and without an initial state, per-head and per-dimension gates, packed sequences), for the
  one-token steps, and for the Triton level (compiled on a GPU, in the interpreter on a CPU).
- Through the custom op, outputs and gradients equal the level called directly.
- torch.compile(layer, fullgraph=True) compiles every layer of linattn.nn with no graph break
  (prefill, prefill from a state, one decoding step) and gives eager's outputs and gradients.
  Backend "aot_eager": it traces forward and backward as inductor does (the custom ops' fake and
  autograd registrations included) but skips inductor's code generation, about 30 s per layer on
  two CPU cores; LINATTN_TEST_INDUCTOR=1 runs every layer under inductor as well.
- A planted graph break (an .item() in a layer) makes the fullgraph compile fail: the test can fail.
- Under torch.compile linattn.<op> keeps the eager contract: the final state only when asked for,
  a misspelled keyword refused by name, a NaN input refused when the graph runs.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import linattn
from linattn import device, dispatch, ops, nn as lnn, testing
from linattn.validate import InputError

B, T, H, K, V = 2, 11, 2, 4, 5
BACKEND = "aot_eager"
DEV = device.default_device()      # the Triton level: compiled on a GPU, the interpreter on a CPU


def inputs(op, dtype=torch.float32, *, h0=True, per_head=False, batch=B, grad=True, seed=0, dev="cpu"):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype).to(dev)      # noqa: E731
    made = dict(q=r(batch, T, H, K), k=F.normalize(r(batch, T, H, K), dim=-1), v=r(batch, T, H, V),
                g=-torch.rand(batch, T, H, *(() if per_head else (K,)), generator=gen, dtype=dtype).to(dev) / 2,
                beta=torch.rand(batch, T, H, generator=gen, dtype=dtype).to(dev))
    tensors = [made[n].requires_grad_(grad) for n in ops.TENSORS[op]]
    state = r(batch, H, K, V).requires_grad_(grad) if h0 else None
    return tensors, state


def args(name, tensors, **options):
    spec = ops.SPECS[name]
    _, opts = spec.split(tensors)
    opts.update(options)
    return tuple(spec.args(tensors, opts))


@pytest.mark.parametrize("op", ops.TENSORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("h0", [True, False])
def test_opcheck_chunk_level(op, dtype, h0):
    tensors, state = inputs(op, dtype, h0=h0)
    torch.library.opcheck(ops.OPS[op], args(op, tensors, initial_state=state, level="chunk", chunk_size=8,
                                            sub_chunk_size=4))


@pytest.mark.parametrize("op", ["gla", "kda"])
def test_opcheck_per_head_gates(op):
    tensors, state = inputs(op, per_head=True)
    torch.library.opcheck(ops.OPS[op], args(op, tensors, initial_state=state, level="chunk", chunk_size=4,
                                            sub_chunk_size=4))


@pytest.mark.parametrize("op", ops.TENSORS)
def test_opcheck_strided_inputs(op):
    # a layer hands the op views of one projection (time not the innermost stride): outputs and
    # gradients are still contiguous, as the fake implementation says (inductor asserts it)
    tensors, state = inputs(op, torch.float64)
    strided = [x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in tensors]
    assert not strided[0].is_contiguous()
    torch.library.opcheck(ops.OPS[op], args(op, strided, initial_state=state, level="chunk", chunk_size=4,
                                            sub_chunk_size=4))
    call = args(op, strided, initial_state=state, level="chunk", chunk_size=4, sub_chunk_size=4)
    o, S = ops.OPS[op](*call)
    backward = (torch.ones_like(o), torch.ones_like(S), *call)
    for fn, real_args in ((ops.OPS[op], call), (ops.BACKWARDS[op], backward)):
        real = fn(*real_args)
        with FakeTensorMode() as mode:
            fake = fn(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in real_args))
        assert [(x.shape, x.stride(), x.dtype) for x in real] == [(x.shape, x.stride(), x.dtype) for x in fake]


@pytest.mark.parametrize("op", ops.TENSORS)
def test_opcheck_packed_sequences(op):
    tensors, _ = inputs(op, torch.float64, batch=1, h0=False)
    cu = torch.tensor([0, 3, 3, T])                                   # an empty sequence included
    state = torch.randn(3, H, K, V, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(ops.OPS[op], args(op, tensors, initial_state=state, cu_seqlens=cu,
                                            level="chunk", chunk_size=4, sub_chunk_size=4))


@pytest.mark.parametrize("op", ops.TENSORS)
def test_opcheck_packed_sequences_triton_level(op):
    """The Triton level takes cu_seqlens for every op: the op passes it through."""
    tensors, _ = inputs(op, torch.float32, batch=1, h0=False, dev=DEV)
    cu = torch.tensor([0, 3, 3, T], device=DEV)                       # an empty sequence included
    state = torch.randn(3, H, K, V, device=DEV, requires_grad=True)
    torch.library.opcheck(ops.OPS[op], args(op, tensors, initial_state=state, cu_seqlens=cu,
                                            level="triton", chunk_size=16))


@pytest.mark.parametrize("op", ops.TENSORS)
@pytest.mark.parametrize("h0", [True, False])
def test_opcheck_step(op, h0):
    tensors, state = inputs(op, torch.float64, h0=h0)
    one = [x.detach()[:, 0].requires_grad_() for x in tensors]        # one token: [B, H, ·]
    torch.library.opcheck(ops.OPS[op + "_step"], args(op + "_step", one, state=state))


@pytest.mark.parametrize("op", ops.TENSORS)
def test_opcheck_triton_level(op):
    tensors, state = inputs(op, torch.float32, dev=DEV)
    torch.library.opcheck(ops.OPS[op], args(op, tensors, initial_state=state, level="triton", chunk_size=16))


@pytest.mark.parametrize("op", ops.TENSORS)
def test_custom_op_equals_the_level_gradients_included(op):
    tensors, state = inputs(op, torch.float64)
    leaves = tensors + [state]
    o, S = ops.call(op, tensors, initial_state=state, level="chunk", chunk_size=4, sub_chunk_size=4)
    do, dS = torch.randn_like(o), torch.randn_like(S)
    got = torch.autograd.grad((o, S), leaves, (do, dS))
    o_ref, S_ref = getattr(linattn, op)(*tensors, impl="chunk", initial_state=state, output_final_state=True,
                                        chunk_size=4, sub_chunk_size=4)
    want = torch.autograd.grad((o_ref, S_ref), leaves, (do, dS))
    # the forward is the level's plain one (the op runs below autograd): bitwise its no-grad call
    with torch.no_grad():
        o_plain, S_plain = getattr(linattn, op)(*tensors, impl="chunk", initial_state=state,
                                                output_final_state=True, chunk_size=4, sub_chunk_size=4)
    assert torch.equal(o, o_plain) and torch.equal(S, S_plain)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def make(name, seed=0):
    torch.manual_seed(seed)
    return lnn.LAYERS[name](16, 2)


def grads(layer, x, y):
    gs = torch.autograd.grad(y.square().sum(), [x, *layer.parameters()], allow_unused=True)
    return [g for g in gs if g is not None]


def close(a, b):
    return testing.rel_err(a, b) <= testing.tolerance(torch.float32)


@pytest.mark.parametrize("name", list(lnn.LAYERS))
def test_compiled_layer_equals_eager(name):
    torch._dynamo.reset()
    layer = make(name)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend=BACKEND)
    y, state = compiled(x)
    y_ref, state_ref = layer(x)
    # Training: the compiled graph's forward is the level's plain forward (a custom op runs below
    # autograd), eager's the forward inside its autograd.Function; for the delta rule started from
    # a state the two round differently (float32 rounding), so outputs are compared within tolerance.
    assert close(y, y_ref) and close(state.memory, state_ref.memory)
    for a, b in zip(grads(layer, x, y), grads(layer, x, y_ref)):
        assert close(a, b)
    # continuing from the state: a second prefill, then one decoding step, both compiled
    x2 = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    for chunk in (x2[:, :4], x2[:, 4:]):
        y, state = compiled(chunk, state)
        y_ref, state_ref = layer(chunk, state_ref)
        assert close(y, y_ref) and close(state.memory, state_ref.memory)
        assert state.seen == state_ref.seen


@pytest.mark.parametrize("name", list(lnn.LAYERS))
def test_compiled_inference_is_bitwise_eager(name):
    torch._dynamo.reset()
    layer = make(name)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(layer, fullgraph=True, backend=BACKEND)
    with torch.no_grad():
        (y, state), (y_ref, state_ref) = compiled(x), layer(x)
        assert torch.equal(y, y_ref) and torch.equal(state.memory, state_ref.memory)
        for chunk in (x[:, :4], x[:, 4:5]):                           # a prefill and a step, from a state
            (y, state), (y_ref, state_ref) = compiled(chunk, state), layer(chunk, state_ref)
            assert torch.equal(y, y_ref) and torch.equal(state.memory, state_ref.memory)


@pytest.mark.parametrize("name", list(lnn.LAYERS))
@pytest.mark.parametrize("T_", [9, 1])
def test_no_graph_break_in_any_layer(name, T_):
    torch._dynamo.reset()
    layer = make(name)
    _, state = layer(torch.randn(2, 3, 16))
    explained = torch._dynamo.explain(layer)(torch.randn(2, T_, 16), state)
    assert explained.graph_break_count == 0, [str(b.reason)[:300] for b in explained.break_reasons]


@pytest.mark.skipif(os.environ.get("LINATTN_TEST_INDUCTOR") != "1",
                    reason="inductor compiles each layer for about 30 s on two CPU cores: set LINATTN_TEST_INDUCTOR=1")
@pytest.mark.parametrize("name", list(lnn.LAYERS))
def test_inductor_compiled_layer_equals_eager(name):
    torch._dynamo.reset()
    layer = make(name)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y, _ = torch.compile(layer, fullgraph=True)(x)
    y_ref, _ = layer(x)
    assert close(y, y_ref)
    # inductor fuses and reorders the float32 arithmetic around the op: all gradients together
    # within tolerance (a tiny one, e.g. the gate bias's, 1e-5 of the others, differs relatively more)
    flat = lambda gs: torch.cat([g.flatten() for g in gs])           # noqa: E731
    assert close(flat(grads(layer, x, y)), flat(grads(layer, x, y_ref)))


class PlantedBreak(lnn.GatedLinearAttention):
    """A layer that reads a tensor's value in Python: a graph break, as a validation would be."""

    def extras(self, x, q, k):
        if x.abs().max().item() > 1e6:
            raise InputError("x is too large")
        return super().extras(x, q, k)


def test_a_planted_graph_break_fails_the_fullgraph_compile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = PlantedBreak(16, 2)
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        torch.compile(layer, fullgraph=True, backend=BACKEND)(torch.randn(2, 9, 16))


def test_dispatcher_under_compile_keeps_the_eager_contract():
    torch._dynamo.reset()
    (q, k, v, g), state = inputs("gla", grad=False)

    @torch.compile(fullgraph=True, backend=BACKEND)
    def run(q, k, v, g, state):
        return linattn.gla(q, k, v, g, initial_state=state, chunk_size=8, sub_chunk_size=4), \
            linattn.gla(q, k, v, g, initial_state=state, output_final_state=True, chunk_size=8, sub_chunk_size=4)

    (o, none), (o2, S) = run(q, k, v, g, state)
    assert linattn.which("gla").startswith("linattn::gla")
    o_ref, S_ref = linattn.gla(q, k, v, g, initial_state=state, output_final_state=True, chunk_size=8, sub_chunk_size=4)
    assert none is None and torch.equal(o, o_ref) and torch.equal(o2, o_ref) and torch.equal(S, S_ref)

    # A misspelled keyword is refused by name. Under fullgraph=True PyTorch reports any exception
    # raised while tracing as Unsupported, with the library's message inside; without it, the
    # call falls back to eager and raises the KeywordError itself.
    typo = lambda: linattn.gla(q, k, v, g, initial_sate=state)      # noqa: E731
    with pytest.raises(torch._dynamo.exc.Unsupported, match="initial_sate.*initial_state"):
        torch.compile(typo, fullgraph=True, backend=BACKEND)()
    with pytest.raises(dispatch.KeywordError, match="initial_sate"):
        torch.compile(typo, backend=BACKEND)()
    bad = q.clone()
    bad[0, 3, 1, 2] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        run(bad, k, v, g, state)


def test_a_nan_input_is_refused_by_a_compiled_layer():
    torch._dynamo.reset()
    layer = make("kda")
    x = torch.randn(2, 9, 16)
    compiled = torch.compile(layer, fullgraph=True, backend=BACKEND)
    compiled(x)
    x[1, 4, 3] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        compiled(x)


@pytest.mark.skipif(DEV != "cuda", reason="the Triton level compiled: a GPU only (the CPU runs the tests above)")
@pytest.mark.parametrize("name", [n for n in lnn.LAYERS if n != "softmax"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_compiled_layer_on_the_gpu(name, packed):
    """torch.compile(layer, fullgraph=True) on CUDA tensors, where the ops run the Triton level:
    outputs, states and every gradient equal eager's; a packed row (cu_seqlens) too."""
    torch._dynamo.reset()
    layer = make(name).to(DEV)
    shape, kw = ((1, 40, 16), {"cu_seqlens": torch.tensor([0, 7, 7, 40], device=DEV)}) if packed else ((2, 37, 16), {})
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(DEV).requires_grad_()
    y, state = torch.compile(layer, fullgraph=True, backend=BACKEND)(x, **kw)
    y_ref, state_ref = layer(x, **kw)
    assert close(y, y_ref) and close(state.memory, state_ref.memory)
    for a, b in zip(grads(layer, x, y), grads(layer, x, y_ref)):
        assert close(a, b)
