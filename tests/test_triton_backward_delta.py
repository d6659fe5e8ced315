"""The backward of linattn.triton.delta_rule / kda against float64 autograd through linattn.naive.

The same file runs natively on a GPU and through the Triton interpreter on a CPU (small shapes
there). Every call, forward and backward, runs under `testing.poisoned()`: the kernels' outputs
and every gradient buffer start as NaN, so an element a kernel forgets to write fails the check.
"""
import pytest
import torch

from linattn import chunk, device, naive, testing
from linattn.triton import delta as tri
from linattn.triton import delta_backward, wy_backward

DEV = device.default_device()
GPU = DEV == "cuda"
# Gradient tolerances of the project (relative error vs float64 autograd through linattn.naive)
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")

# (op, gate, B, T, H, K, V, chunk): T never a multiple of the chunk, K ≠ V
SHAPES = [
    ("delta_rule", None, 2, 45, 1, 32, 48, 16),
    ("kda", "per_head", 1, 50, 2, 16, 32, 32),
    ("kda", "per_dim", 1, 40, 2, 32, 16, 16),
]
if GPU:  # head dimensions of real models, longer sequences
    SHAPES += [(op, gate, 2, 1000, 4, 128, 128, 64)
               for op, gate in (("delta_rule", None), ("kda", "per_head"), ("kda", "per_dim"))]
    SHAPES += [("kda", "per_dim", 1, 700, 3, 64, 128, 32), ("kda", "per_head", 1, 700, 3, 128, 64, 16)]


def inputs(op, gate, B, T, H, K, V, dtype, *, strength="normal", beta_max=1.0, initial_state=True,
           seed=0, gate_dtype=torch.float32):
    """Library inputs on DEV; β ∈ (0, beta_max) with unit keys, so β‖k‖² ≤ beta_max ≤ 2."""
    a = testing.make_inputs(op, B=B, T=T, H=H, K=K, V=V, dtype=dtype, device=DEV,
                            gate=gate or "per_dim", strength=strength,
                            initial_state=initial_state, seed=seed, gate_dtype=gate_dtype)
    a["beta"] = a["beta"] * beta_max
    return a


def upstream(a, seed=1):
    """Incoming gradients dO [B, T, H, V] and dS_final [B, H, K, V], float64 on DEV."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, V = a["v"].shape
    K = a["k"].shape[-1]
    return (torch.randn(B, T, H, V, generator=gen, dtype=torch.float64).to(DEV),
            torch.randn(B, H, K, V, generator=gen, dtype=torch.float64).to(DEV))


def grads(fn, a, dO, dS, final=True, **kw):
    """(gradients of Σ o·dO [+ Σ S_final·dS] for every tensor input, o)."""
    leaves = {n: a[n].detach().clone().requires_grad_(True) for n in NAMES if n in a}
    o, S = fn(**{**a, **leaves}, output_final_state=final, **kw)
    loss = (o.double() * dO).sum()
    if final:
        loss = loss + (S.double() * dS).sum()
    loss.backward()
    return {n: x.grad for n, x in leaves.items()}, o


def reference(op, a, dO, dS, final=True):
    return grads(getattr(naive, op), testing.to_float64(a), dO, dS, final)


def ours(op, a, dO, dS, final=True, **kw):
    with testing.poisoned():
        return grads(getattr(tri, op), a, dO, dS, final, **kw)


def assert_close(got, ref, tol):
    for n, r in ref.items():
        assert got[n] is not None, n
        err = testing.rel_err(got[n], r)
        assert err <= tol, (n, err, testing.worst_position(got[n], r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_grads_match_naive(shape, dtype):
    # every input's gradient, an initial state and an incoming final-state gradient
    op, gate, *dims, C = shape
    a = inputs(op, gate, *dims, dtype)
    dO, dS = upstream(a)
    ref, o_ref = reference(op, a, dO, dS)
    got, o = ours(op, a, dO, dS, chunk_size=C)
    for n in ref:
        assert got[n].dtype == a[n].dtype, n
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    assert_close(got, ref, GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op, gate", [("delta_rule", None), ("kda", "per_head"), ("kda", "per_dim")])
def test_half_precision_gates_and_beta(op, gate, dtype):
    # g and β in the inputs' half precision, as a bf16 model trains with them (the other tests
    # pass float32): natively every backward kernel that reads them must compile for them (Triton's
    # exp takes float32/float64 only; the interpreter does not check)
    B, T, H, K, V = (1, 300, 2, 64, 64) if GPU else (1, 40, 2, 16, 32)
    a = inputs(op, gate, B, T, H, K, V, dtype, gate_dtype=dtype)
    dO, dS = upstream(a)
    ref, _ = reference(op, a, dO, dS)
    got, _ = ours(op, a, dO, dS, chunk_size=64 if GPU else 16)
    assert_close(got, ref, GRAD_TOL[dtype])


@pytest.mark.parametrize("strength", ["normal", "strong"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op, gate", [("delta_rule", None), ("kda", "per_head")])
def test_fused_gate_step_equals_the_separate_kernel(op, gate, dtype, strength, monkeypatch):
    # Half-precision inputs without per-dimension gates: the per-chunk kernel applies the chain rule
    # through the scores and the per-head gate itself (`fused_gates`), on the tiles the separate
    # gate kernel would read back from memory, so the two paths agree far closer than either to
    # float64 (the sums over key dims of dβ and dg differ in order only); a wrong mask, decay or
    # β term does not.
    B, T, H, K, V, C = (2, 300, 3, 128, 64, 64) if GPU else (2, 45, 2, 32, 48, 16)
    a = inputs(op, gate, B, T, H, K, V, dtype, strength=strength, seed=3)
    dO, dS = upstream(a)
    calls = []
    real = delta_backward.gate_stage
    monkeypatch.setattr(delta_backward, "gate_stage", lambda *args: calls.append(1) or real(*args))
    fused, _ = ours(op, a, dO, dS, chunk_size=C)
    assert not calls, "the gate kernel ran: this case is not fused"
    monkeypatch.setattr(delta_backward, "fused_gates", lambda *args: False)
    separate, _ = ours(op, a, dO, dS, chunk_size=C)
    assert calls
    for n in separate:
        err = testing.rel_err(fused[n], separate[n])
        assert err <= 1e-4, f"d{n}: fused against the separate gate kernel {err:.2e}"


@pytest.mark.skipif(not GPU, reason="natively only: the interpreter would take minutes at K = 256")
@pytest.mark.parametrize("op, gate", [("delta_rule", None), ("kda", "per_head"), ("kda", "per_dim")])
def test_head_dim_256(op, gate):
    # the largest head dimensions, in bf16: as in the forward's tests, float32 IEEE products at
    # K = 256 compile to minutes of FMA code natively
    a = inputs(op, gate, 1, 300, 2, 256, 256, torch.bfloat16)
    dO, dS = upstream(a)
    ref, _ = reference(op, a, dO, dS)
    got, _ = ours(op, a, dO, dS, chunk_size=64)
    assert_close(got, ref, GRAD_TOL[torch.bfloat16])


@pytest.mark.parametrize("gate, chunk", [("per_head", 64), ("per_dim", 32), ("per_dim", 16)])
def test_strong_gates_and_large_beta(gate, chunk):
    # log-gates down to −20 per token (e^{±G} over a chunk is 0 or inf in float32) and β up to 2
    # (β‖k‖² up to the contraction bound)
    T = 300 if GPU else 50
    a = inputs("kda", gate, 1, T, 2, 32, 32, torch.float32, strength="strong", beta_max=2.0)
    dO, dS = upstream(a)
    ref, _ = reference("kda", a, dO, dS)
    got, _ = ours("kda", a, dO, dS, chunk_size=chunk)
    assert_close(got, ref, GRAD_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("per_token", [-0.92, -0.97])
def test_split_bound(per_token, dtype):
    # every key dim decaying by 58.9 over a chunk of 64 (the split score terms, factors up to
    # e^{58.9}) or by 62.1 (past the bound: the column walks); one chunk of each kind per head
    a = inputs("kda", "per_dim", 1, 128, 2, 32, 32, dtype)
    a["g"] = torch.full_like(a["g"], per_token)
    a["g"][:, 64:] *= -0.97 / per_token
    dO, dS = upstream(a)
    ref, _ = reference("kda", a, dO, dS)
    got, _ = ours("kda", a, dO, dS, chunk_size=64)
    assert_close(got, ref, GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [64, 32])
def test_block_references_past_the_chunk_bound(monkeypatch, chunk, dtype):
    # log-gates from −2.5 to −1 per token, as a model's gates start (testing.log_gates "mamba"): a
    # chunk decays past the split's bound, each 16-row block by less, so the gate kernel's score
    # terms take the block references (`_block_terms`); under the interpreter the column walk is
    # made to fail, so a chunk that went there would fail the test
    a = inputs("kda", "per_dim", 1, 150, 2, 32, 32, dtype)
    a["g"] = -1.0 - 1.5 * torch.rand(a["g"].shape, generator=torch.Generator().manual_seed(3)).to(DEV)
    if not GPU:
        def walk(*args, **kw):
            raise AssertionError("the column walk ran")
        monkeypatch.setattr(wy_backward, "_columns", walk)
    dO, dS = upstream(a)
    ref, _ = reference("kda", a, dO, dS)
    got, _ = ours("kda", a, dO, dS, chunk_size=chunk)
    assert_close(got, ref, GRAD_TOL[dtype])


@pytest.mark.parametrize("op, gate", [("delta_rule", None), ("kda", "per_dim")])
def test_recompute_or_keep(op, gate):
    # recompute=False hands the forward's stage-1/2 tensors to the backward; the kernels are the
    # same and deterministic, so the gradients are equal bit for bit
    a = inputs(op, gate, 1, 40, 1, 16, 32, torch.float32)
    dO, dS = upstream(a)
    g1, _ = ours(op, a, dO, dS, chunk_size=16, recompute=True)
    g2, _ = ours(op, a, dO, dS, chunk_size=16, recompute=False)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n


def test_without_states():
    # no initial state, no final state asked for: gradients of q, k, v, g, β only (B, H > 1)
    a = inputs("kda", "per_head", 2, 33, 2, 16, 16, torch.float32, initial_state=False, seed=3)
    dO, dS = upstream(a)
    ref, _ = reference("kda", a, dO, dS, final=False)
    got, _ = ours("kda", a, dO, dS, final=False, chunk_size=16)
    assert set(got) == {"q", "k", "v", "g", "beta"}
    assert_close(got, ref, GRAD_TOL[torch.float32])


def test_against_chunk_level():
    # the chunkwise PyTorch level in float64 (its own backward) as a second reference
    a = inputs("kda", "per_dim", 1, 40, 1, 16, 16, torch.float32, seed=4)
    dO, dS = upstream(a)
    ref, _ = grads(chunk.kda, testing.to_float64(a), dO, dS, chunk_size=16)
    got, _ = ours("kda", a, dO, dS, chunk_size=16)
    assert_close(got, ref, GRAD_TOL[torch.float32])


def test_narrow_blocks(monkeypatch):
    # several V-blocks in the reverse state pass (64 wide) and the per-chunk reductions (32 wide),
    # several K-blocks in the gate kernel (their partial sums of dβ and of a per-head dg), all
    # partly masked: V = 100, K = 40
    monkeypatch.setitem(delta_backward.TUNING, "bv_state", 64)
    monkeypatch.setitem(delta_backward.TUNING, "bv_chunk", 32)
    monkeypatch.setitem(delta_backward.TUNING, "bv_chunk_wide", 32)
    monkeypatch.setattr(wy_backward, "BK_GATES", 32)
    for gate in ("per_head", "per_dim"):
        a = inputs("kda", gate, 1, 20, 1, 40, 100, torch.float32, seed=6)
        dO, dS = upstream(a)
        ref, _ = reference("kda", a, dO, dS)
        got, _ = ours("kda", a, dO, dS, chunk_size=16)
        assert_close(got, ref, GRAD_TOL[torch.float32])


def test_some_inputs_require_grad():
    # only v and g: the others get no gradient, and those two are right
    a = inputs("kda", "per_dim", 1, 20, 1, 16, 16, torch.float32, seed=7)
    dO, dS = upstream(a)
    ref, _ = reference("kda", a, dO, dS)
    v, g = a["v"].clone().requires_grad_(True), a["g"].clone().requires_grad_(True)
    with testing.poisoned():
        o, S = tri.kda(**{**a, "v": v, "g": g}, output_final_state=True, chunk_size=16)
        ((o.double() * dO).sum() + (S.double() * dS).sum()).backward()
    assert a["q"].grad is None and a["k"].grad is None
    assert_close({"v": v.grad, "g": g.grad}, {"v": ref["v"], "g": ref["g"]}, GRAD_TOL[torch.float32])


def test_plain_forward_without_grad(monkeypatch):
    # no input requires grad, or grad mode is off: the plain forward runs, not the Function
    a = inputs("delta_rule", None, 1, 20, 1, 16, 16, torch.float32)
    used = []
    monkeypatch.setattr(delta_backward, "apply", lambda *x, **kw: used.append(1))
    o, _ = tri.delta_rule(**a, chunk_size=16)
    a["q"].requires_grad_(True)
    with torch.no_grad():
        o2, _ = tri.delta_rule(**a, chunk_size=16)
    assert not used and not o.requires_grad and not o2.requires_grad
    assert torch.equal(o, o2)


# ---------------------------------------------------------------- peak memory of the forward

def forward_bytes(op, gate, B, T, H, K, V, C, dtype):
    """Bytes the forward's buffers hold, stage by stage, when each intermediate is dropped as soon
    as no later stage reads it (linattn.triton.delta.factors_and_states); returns the peak."""
    R, NT = B * T * H, -(-T // C)
    w = 4 if dtype == torch.float32 or not GPU else torch.tensor([], dtype=dtype).element_size()
    gated = gate is not None
    aqk, ai = R * C * w, R * C * 4
    W, U, hs = R * K * w, R * V * w, B * H * NT * K * V * w
    kd = R * K * w if gated else 0
    qg = R * K * w if gate == "per_dim" else 0                  # a per-head e^G is applied in place
    dl = B * H * NT * K * 4 if gated else 0
    flags = B * H * NT * 4 if gate == "per_dim" else 0          # KDA: the chunks redone exactly
    o = R * V * torch.tensor([], dtype=dtype).element_size()
    return max(aqk + ai + W + U + qg + kd + dl + flags,         # W, U: 𝒯 still read (A: registers)
               aqk + W + U + qg + kd + dl + hs,                 # the state pass (Ṽ over U)
               aqk + qg + U + hs + o)                           # the output stage


def tracked_peak(monkeypatch, fn):
    """Peak bytes held at once by the buffers allocated through linattn.outputs.empty."""
    from linattn import outputs
    import weakref
    real, live = outputs.empty, {"now": 0, "peak": 0}

    def empty(shape, *, dtype, device):
        x = real(shape, dtype=dtype, device=device)
        n = x.numel() * x.element_size()
        live["now"] += n
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(x, lambda: live.__setitem__("now", live["now"] - n))
        return x

    monkeypatch.setattr(outputs, "empty", empty)
    out = fn()
    return live["peak"], out


@pytest.mark.parametrize("op, gate", [("delta_rule", None), ("kda", "per_head"), ("kda", "per_dim")])
def test_forward_frees_intermediates(monkeypatch, op, gate):
    # A, 𝒯, W, U and the decays do not outlive the stage that last reads them, and Ṽ reuses U
    shape = (1, 200, 2, 32, 48, 64)
    a = inputs(op, gate, *shape[:-1], torch.float32, initial_state=False)
    peak, (o, _) = tracked_peak(monkeypatch, lambda: getattr(tri, op)(**a, chunk_size=64))
    assert peak <= forward_bytes(op, gate, *shape, torch.float32)


@pytest.mark.skipif(not GPU, reason="CUDA memory statistics")
@pytest.mark.parametrize("op, gate", [("delta_rule", None), ("kda", "per_head"), ("kda", "per_dim")])
def test_forward_peak_memory_gpu(op, gate):
    # the benchmark's long sequence: the CUDA allocator's peak during one forward, beyond the
    # inputs, is the live set of the heaviest stage (plus a little for launch bookkeeping)
    shape = (1, 32768, 16, 128, 128, 64)
    a = inputs(op, gate, *shape[:-1], torch.bfloat16, initial_state=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    o, _ = getattr(tri, op)(**a, chunk_size=64)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= forward_bytes(op, gate, *shape, torch.bfloat16) + 8 * 2**20, extra / 2**20


def test_no_second_derivative():
    # the backward's kernels build no graph: a gradient of the gradient (here through an incoming
    # gradient that depends on w) raises instead of silently leaving w without its part through dq
    a = inputs("delta_rule", None, 1, 20, 1, 16, 16, torch.float32)
    q = a["q"].clone().requires_grad_(True)
    w = torch.randn(a["v"].shape, device=DEV, requires_grad=True)
    o, _ = tri.delta_rule(**{**a, "q": q}, chunk_size=16)
    (dq,) = torch.autograd.grad((o * w).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


def test_wide_blocks_that_do_not_fit_fall_back(monkeypatch):
    # a GPU with too little shared memory for the per-chunk kernel's 64-wide V-blocks (a T4 at
    # K = V = 128): common.launch refuses them with an InputError, and the backward launches the
    # 32-wide ones instead, with the same gradients. bf16: natively float32 takes the 32-wide
    # blocks anyway (delta_backward.chunk_block), so a float32 case would never try the wide ones
    from linattn.validate import InputError
    real, tried = delta_backward.launch, []

    def launch(kernel, grid, *args, **kw):
        if kernel is delta_backward._dchunk_kernel:
            tried.append(kw["BV"])
            if kw["BV"] == delta_backward.TUNING["bv_chunk_wide"]:
                raise InputError("does not fit this GPU (simulated)")
        return real(kernel, grid, *args, **kw)
    monkeypatch.setattr(delta_backward, "launch", launch)
    a = inputs("kda", "per_head", 1, 20, 1, 64, 64, torch.bfloat16, seed=8)      # BK = 64: wide
    dO, dS = upstream(a)
    ref, _ = reference("kda", a, dO, dS)
    got, _ = ours("kda", a, dO, dS, chunk_size=16)
    assert tried == [64, 32]
    assert_close(got, ref, GRAD_TOL[torch.bfloat16])


def test_two_part_pass_that_does_not_fit_falls_back(monkeypatch):
    # a GPU with too little shared memory for KDA's bf16 reverse pass with two-part products (a T4
    # at K = 256): common.launch refuses it with an InputError, and the backward launches the pass
    # with one product each, with the gradients that pass gives
    from linattn.validate import InputError
    real, tried = delta_backward.launch, []

    def launch(kernel, grid, *args, **kw):
        if kernel is delta_backward._dstate_kernel:
            tried.append(kw["TWO"])
            if kw["TWO"]:
                raise InputError("does not fit this GPU (simulated)")
        return real(kernel, grid, *args, **kw)
    monkeypatch.setattr(delta_backward, "launch", launch)
    monkeypatch.setattr(delta_backward, "two_part_state_grads", lambda p: True)   # as for KDA bf16
    a = inputs("kda", "per_dim", 1, 20, 1, 32, 32, torch.float32, seed=9)
    dO, dS = upstream(a)
    ref, _ = reference("kda", a, dO, dS)
    got, _ = ours("kda", a, dO, dS, chunk_size=16)
    assert tried == [True, False]
    assert_close(got, ref, GRAD_TOL[torch.float32])
