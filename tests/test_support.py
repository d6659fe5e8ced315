"""The supported range (linattn.support): inside it the Triton level runs, outside it every op refuses
by name before any kernel launches (here under the interpreter, so a launch would be slow, not wrong:
the refusals must come from the check)."""
import pytest
import torch

from linattn import device, support, testing
from linattn.validate import InputError
import linattn.triton as tri

DEV = device.default_device()   # natively CUDA tensors: the Triton level refuses CPU ones before any check here
OPS = {"linear_attn": ("linear_attn", None), "gla": ("gla", "per_dim"), "delta_rule": ("delta_rule", None),
       "kda": ("kda", "per_head")}


def args(op, K=16, V=16, T=4, dtype=torch.float32):
    name, gate = OPS[op]
    return name, testing.make_inputs(name, B=1, T=T, H=1, K=K, V=V, dtype=dtype, gate=gate or "per_dim",
                                     device=DEV)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("K, V, name", [(support.MAX_HEAD_DIM + 1, 16, "q"), (16, support.MAX_HEAD_DIM + 8, "v")])
def test_head_dims_past_the_range_are_refused(op, K, V, name):
    fn, a = args(op, K, V)
    with pytest.raises(InputError, match=f"^{name} has head dimension"):
        getattr(tri, fn)(**a)


@pytest.mark.parametrize("op", OPS)
def test_float64_is_refused(op):
    fn, a = args(op, dtype=torch.float64)
    with pytest.raises(InputError, match="^q has dtype torch.float64"):
        getattr(tri, fn)(**a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_chunk_sizes_are_exactly_the_supported_ones(op, dtype):
    fn, a = args(op, dtype=dtype)
    sizes = support.triton_chunk_sizes(OPS[op][0], dtype)
    assert sizes[0] == support.MIN_TRITON_CHUNK and sizes[-1] == support.max_triton_chunk(OPS[op][0], dtype)
    kw = {"sub_chunk_size": 16} if op == "gla" else {}
    for C in (sizes[0], sizes[-1]):
        o, _ = getattr(tri, fn)(**a, chunk_size=C, **kw)
        assert o.shape == a["v"].shape
    for C in (sizes[0] // 2, sizes[-1] * 2, 48):
        with pytest.raises(InputError, match="^chunk_size"):
            getattr(tri, fn)(**a, chunk_size=C, **kw)


def test_float32_stops_at_a_smaller_chunk():
    """float32 tiles are twice as large: chunk 256 is refused before launch for float32 inputs only."""
    assert support.max_triton_chunk("gla", torch.float32) < support.max_triton_chunk("gla", torch.bfloat16)
    fn, a = args("linear_attn")
    with pytest.raises(InputError, match="^chunk_size must be at most 128 for torch.float32"):
        tri.linear_attn(**a, chunk_size=256)


def test_gla_sub_chunks_past_the_range_are_refused():
    fn, a = args("gla")
    o, _ = tri.gla(**a, chunk_size=128, sub_chunk_size=support.MAX_TRITON_SUB_CHUNK)
    assert o.shape == a["v"].shape
    with pytest.raises(InputError, match="^sub_chunk_size must be at most 64"):
        tri.gla(**a, chunk_size=128, sub_chunk_size=2 * support.MAX_TRITON_SUB_CHUNK)


@pytest.mark.parametrize("op", OPS)
def test_packed_sequences_run_at_the_triton_level(op):
    """Every Triton op takes cu_seqlens (tests/test_triton_packing.py): one state per sequence, the
    initial states [N, H, K, V] not refused as a wrong shape."""
    fn, a = args(op)
    a["initial_state"] = torch.zeros(2, 1, 16, 16, device=DEV)
    o, S = getattr(tri, fn)(**a, cu_seqlens=torch.tensor([0, 1, 4], device=DEV), output_final_state=True)
    assert o.shape == a["v"].shape and S.shape == (2, 1, 16, 16)
