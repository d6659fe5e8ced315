"""linattn.triton.delta_rule / kda against the float64 naive recurrence.

The same file runs natively on a GPU and through the Triton interpreter on a CPU (small shapes
there: the interpreter executes every program in Python). Outputs are poisoned with NaN, so an
element a kernel forgets to write fails the relative-error check.
"""
import pytest
import torch

from linattn import device, naive, testing
from linattn.chunk import delta as cdelta
from linattn.triton import delta as tri
from linattn.validate import InputError, check_inputs, value_checks

DEV = device.default_device()
GPU = DEV == "cuda"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (op, gate, B, T, H, K, V, chunk): T never a multiple of the chunk, K ≠ V
SHAPES = [
    ("delta_rule", None, 2, 45, 2, 32, 48, 16),
    ("kda", "per_head", 1, 100, 2, 32, 16, 32),
    ("kda", "per_dim", 2, 70, 1, 16, 48, 64),
]
if GPU:  # head dimensions of real models, longer sequences, every chunk size
    SHAPES += [(op, gate, 2, 1000, 4, 128, 128, 64)
               for op, gate in (("delta_rule", None), ("kda", "per_head"), ("kda", "per_dim"))]
    SHAPES += [("kda", "per_dim", 1, 700, 3, 64, 256, 32), ("kda", "per_head", 1, 700, 3, 32, 64, 16)]


def run(op, gate, B, T, H, K, V, C, dtype, strength="normal", initial_state=True, seed=0,
        gate_dtype=torch.float32):
    """(triton result, float64 naive result), each (o, final state)."""
    args = testing.make_inputs(op, B=B, T=T, H=H, K=K, V=V, dtype=dtype, device=DEV,
                               gate=gate or "per_dim", strength=strength,
                               initial_state=initial_state, seed=seed, gate_dtype=gate_dtype)
    ref = getattr(naive, op)(**testing.to_float64(args), output_final_state=True)
    with testing.poisoned():
        out = getattr(tri, op)(**args, output_final_state=True, chunk_size=C)
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_matches_naive(shape, dtype):
    (o, S), (o_ref, S_ref) = run(*shape, dtype)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert S.dtype == torch.float32
    tol = testing.tolerance(dtype)
    assert testing.rel_err(o, o_ref) <= tol, testing.worst_position(o, o_ref)
    assert testing.rel_err(S, S_ref) <= tol


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "-".join(map(str, s)))
def test_half_precision_gates_and_beta(shape, dtype):
    """g and β in half precision (the other tests pass them in float32): natively every kernel that
    reads them must compile for them (Triton's exp takes float32/float64 only). The reference sees
    the same rounded values."""
    (o, S), (o_ref, S_ref) = run(*shape, dtype, gate_dtype=dtype)
    tol = testing.tolerance(dtype)
    assert testing.rel_err(o, o_ref) <= tol, testing.worst_position(o, o_ref)
    assert testing.rel_err(S, S_ref) <= tol


# natively, float32 IEEE products at K = 256 compile to minutes of FMA code: the GPU run tests the
# dtypes models use there, and float32 up to K = V = 128 (test_matches_naive)
DTYPES_256 = (torch.bfloat16, torch.float16) + (() if GPU else (torch.float32,))


@pytest.mark.parametrize("dtype", DTYPES_256, ids=str)
@pytest.mark.parametrize("op, gate", [("delta_rule", None), ("kda", "per_dim")])
def test_head_dim_256(op, gate, dtype):
    # the largest supported head dimensions
    T, C = (300, 64) if GPU else (40, 32)
    (o, S), (o_ref, S_ref) = run(op, gate, 1, T, 2, 256, 256, C, dtype)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gate, chunk", [("per_head", 64), ("per_dim", 64), ("per_dim", 16),
                                         ("per_dim", 32)])
def test_strong_gates(gate, chunk, dtype):
    # log-gates down to −20 per token: e^{±G} over a chunk would be 0 or inf in float32; every
    # chunk size (one to four sub-chunks: the diagonal blocks' column recursion, the split dots)
    (o, S), (o_ref, S_ref) = run("kda", gate, 1, 150, 2, 32, 32, chunk, dtype, strength="strong")
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_gate_strengths(dtype):
    # KDA computes a chunk by split products when its gates decay by less than DIAG_DOT_RANGE
    # over the chunk, else by the exact kernel, which builds a 16×16 diagonal block by one dot
    # when its gates decay by less than that over the block, else column by column: chunk 0
    # holds blocks of both kinds, chunk 1 one big step that stays below the bound (split)
    args = testing.make_inputs("kda", B=1, T=100, H=2, K=32, V=32, dtype=dtype, device=DEV, seed=9)
    g = args["g"].clone()
    g[:, 16:32] = -20 * torch.rand(g[:, 16:32].shape, device=DEV)           # sub-chunk 1: strong
    g[:, 70] = -50.0                                                        # one big step in sub-chunk 4
    args["g"] = g
    ref = naive.kda(**testing.to_float64(args), output_final_state=True)
    with testing.poisoned():
        o, S = tri.kda(**args, output_final_state=True, chunk_size=64)
    assert testing.rel_err(o, ref[0]) <= testing.tolerance(dtype)
    assert testing.rel_err(S, ref[1]) <= testing.tolerance(dtype)
    assert exact_chunks(args, 64).tolist() == [[[1, 0], [1, 0]]]


def exact_chunks(args, C):
    """KDA's per-chunk flags [B, H, NT]: 1 where the exact kernel computed the chunk."""
    d = check_inputs(args["q"], args["k"], args["v"], g=args["g"], beta=args["beta"], gate=True,
                     delta=True)
    p = tri.plan(args["q"], args["g"], d, C)
    return tri.factor_stage(args["q"], args["k"], args["g"], args["beta"], p)["exact"].cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("per_token, exact", [(-0.92, 0), (-0.97, 1)])
def test_split_bound(per_token, exact, dtype):
    # every key dim decaying by 58.9 over a chunk of 64 (split products with factors up to
    # e^{58.9}), or by 62.1 (past the bound: the exact kernel)
    args = testing.make_inputs("kda", B=1, T=128, H=2, K=32, V=32, dtype=dtype, device=DEV, seed=4)
    args["g"] = torch.full_like(args["g"], per_token)
    ref = naive.kda(**testing.to_float64(args), output_final_state=True)
    with testing.poisoned():
        o, S = tri.kda(**args, output_final_state=True, chunk_size=64)
    assert testing.rel_err(o, ref[0]) <= testing.tolerance(dtype)
    assert testing.rel_err(S, ref[1]) <= testing.tolerance(dtype)
    assert (exact_chunks(args, 64) == exact).all()


def stage_refs(args, C):
    """The chunk level's float64 (I + A)⁻¹ (A with β on its rows, strict), W, U and scale·Aqk, each
    [B, T, H, *] like the kernels' outputs (row t holds its chunk's row)."""
    a = testing.to_float64(args)
    g = a.get("g")
    d = check_inputs(a["q"], a["k"], a["v"], g=g, beta=a["beta"], gate=g is not None, delta=True)
    kc = cdelta.to_chunks(a["k"], C)                                    # [B, H, N, C, K]
    gc = cdelta.chunk_gates(g, d, C, kc.device)
    A = cdelta.to_chunks(a["beta"][..., None], C) * cdelta.decayed_scores(kc, kc, gc, strict=True)
    f = cdelta.factors(a["q"], a["k"], a["v"], g, a["beta"], d, C, delta=True)
    return {name: cdelta.from_chunks(x, d.T) for name, x in
            dict(ai=cdelta.unit_lower_inverse(A), w=f.W, u=f.U, aqk=f.Aqk * d.scale).items()}


@pytest.mark.parametrize("gate, chunk", [(None, 64), ("per_head", 32), ("per_dim", 64),
                                         ("per_dim", 32), ("per_dim", 16)])
def test_stage_one_kernels(gate, chunk):
    # the factor kernel and W/U one by one against the chunk level: a wrong block in one of them
    # (e.g. a diagonal block of the inverse, or a split dot) shows here by name
    op = "delta_rule" if gate is None else "kda"
    args = testing.make_inputs(op, B=2, T=150, H=2, K=32, V=48, gate=gate or "per_dim",
                               device=DEV, seed=8)
    g = args.get("g")
    d = check_inputs(args["q"], args["k"], args["v"], g=g, beta=args["beta"],
                     gate=g is not None, delta=True)
    p = tri.plan(args["q"], g, d, chunk)
    with testing.poisoned():
        ours = tri.wy_stage(args["q"], args["k"], args["v"], g, args["beta"], p)
    refs = stage_refs(args, chunk)
    assert "a" not in ours   # the factor kernels keep A in registers; 𝒯 is checked
    # Gated DeltaNet stores W from each chunk's first token (W̃ = e^{−G_0} W): wy.py
    ours["w"] = tri.absolute_w(ours["w"], g, chunk)
    for name, ref in refs.items():
        assert testing.rel_err(ours[name], ref) <= testing.tolerance(torch.float32), name


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_chunk_sizes(chunk):
    # one, two and four 16×16 diagonal blocks in the inverse; T shorter than two chunks for 64
    (o, S), (o_ref, S_ref) = run("kda", "per_dim", 1, 100, 1, 32, 32, chunk, torch.float32)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(torch.float32)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(torch.float32)


def test_without_initial_or_final_state():
    args = testing.make_inputs("kda", B=1, T=33, H=1, K=16, V=16, device=DEV, seed=3)
    o_ref, _ = naive.kda(**testing.to_float64(args))
    with testing.poisoned():
        o, S = tri.kda(**args, chunk_size=16)
    assert S is None
    assert testing.rel_err(o, o_ref) <= testing.tolerance(torch.float32)


def test_gated_delta_with_zero_gates_is_delta_rule():
    args = testing.make_inputs("delta_rule", B=1, T=40, H=1, K=16, V=32, device=DEV, seed=4)
    g = torch.zeros(1, 40, 1, device=DEV)
    with testing.poisoned():
        o1, _ = tri.delta_rule(**args, chunk_size=16)
        o2, _ = tri.kda(g=g, **args, chunk_size=16)
    assert testing.rel_err(o2, o1) <= testing.tolerance(torch.float32)


def _args(**kw):
    a = testing.make_inputs("kda", B=1, T=20, H=1, K=16, V=16, device=DEV, seed=5)
    a.update(kw)
    return a


@pytest.mark.parametrize("bad, word", [
    (dict(chunk_size=48), "chunk_size"),                 # not a power of two
    (dict(chunk_size=8), "chunk_size"),                  # below one 16×16 block
    (dict(chunk_size=128), "≤ 64"),                      # over what the kernels compile to in time
    (dict(beta=torch.rand(1, 20, 2)), "beta"),
    (dict(g=torch.full((1, 20, 1, 16), 0.5)), "g"),      # a decay, not a log-decay
    (dict(scale=-1.0), "scale"),
    (dict(initial_state=torch.zeros(1, 1, 16, 8)), "initial_state"),
])
def test_bad_inputs(bad, word):
    a = _args()
    a.update({n: (x.to(DEV) if isinstance(x, torch.Tensor) else x) for n, x in bad.items()})
    with value_checks(True), pytest.raises(InputError, match=word):   # opt-in on a GPU
        tri.kda(**a)


def test_bad_keys_and_dtypes():
    a = _args()
    with value_checks(True), pytest.raises(InputError, match="k"):
        tri.kda(**{**a, "k": a["k"] * 3})                  # β‖k‖² > 2: not normalised
    with pytest.raises(InputError, match="q"):
        tri.kda(**{n: x.double() if n in "qkv" else x for n, x in a.items()})
    big = testing.make_inputs("delta_rule", B=1, T=4, H=1, K=512, V=16, device=DEV)
    with pytest.raises(InputError, match="q"):
        tri.delta_rule(**big)


def test_narrow_value_blocks(monkeypatch):
    # several V-blocks per head in the state pass and the output stage (asked for 16, MIN_TILE = 32
    # wide: V = 40 gives two, the second partly masked)
    monkeypatch.setitem(tri.TUNING, "bv_state", 16)
    monkeypatch.setitem(tri.TUNING, "bv_out", 16)
    (o, S), (o_ref, S_ref) = run("kda", "per_dim", 1, 50, 2, 16, 40, 32, torch.float32)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(torch.float32)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(torch.float32)


def test_w_in_two_parts_up_to_128_wide_keys():
    """W = 𝒯 diag(β e^G) K as a float32 tile against the keys in two parts (`common.dot_input`),
    except with a 256-wide key tile, where the parts overflow a T4's shared memory (`wy.split_w`;
    tests/test_architectures.py compiles both for every architecture)."""
    from types import SimpleNamespace
    from linattn.triton import wy
    for work, BK, two in ((torch.bfloat16, 128, True), (torch.float16, 128, True), (torch.float16, 64, True),
                          (torch.float16, 256, False), (torch.bfloat16, 256, False)):
        assert wy.split_w(SimpleNamespace(work=work, BK=BK)) is two, (work, BK)
