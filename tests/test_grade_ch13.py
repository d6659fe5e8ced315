"""Graders of workbook 13 (the backward pass in Triton): references pass, planted wrong kernels
fail with the mistake named, and a passed whole backward differentiates impl="mine".

As in tests/test_grade_ch09_11.py each planted kernel is a small, otherwise correct kernel with
one bug switched on (`BUG`, a constexpr); BUG = 0 passes, so a rejection is caused by the bug alone.
"""
import pytest
import torch

import linattn  # before triton: without a GPU it switches Triton's interpreter on
from linattn.grade import check, reference
from linattn.grade.catalog import ch13

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SEEDS = (0, 1)
DIAG = "diagnosis: your result matches what you get if you "


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_HOME", str(tmp_path))
    yield tmp_path
    linattn.set_impl("gla", "auto")


def verdict(name, fn, seed=0):
    return check(name, fn, seed=seed, record=False, quiet=True)


def block(n):
    return max(16, triton.next_power_of_2(n))


@pytest.mark.parametrize("name", [ex.name for ex in ch13.EXERCISES])
def test_reference_passes(name):
    r = verdict(name, reference(name), seed=11)
    assert r.passed, r.message


# ------------------------------------------------------------------------ ch13.dstates
@triton.jit
def dstates_kernel(q, do, b, dh, dsT, ds0, T, H, K, V, NT, scale, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, HAS_DST: tl.constexpr, BUG: tl.constexpr):
    bh = tl.program_id(0)
    i_b, i_h = bh // H, bh % H
    ks, vs = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = ks < K, vs < V
    sm = mk[:, None] & mv[None, :]
    so = ks[:, None] * V + vs[None, :]
    D = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DST and BUG != 4:                                   # 4: final-state gradient dropped
        D += tl.load(dsT + bh * K * V + so, mask=sm, other=0.0)
    for u in range(NT):
        n = NT - 1 - u
        if BUG == 1:                                           # 1: chunks first to last
            n = u
        if BUG != 3:
            tl.store(dh + (bh * NT + n) * K * V + so, D, mask=sm)
        rows = n * C + tl.arange(0, C)
        rm = rows < T
        off = (i_b * T + rows) * H + i_h
        Q = tl.load(q + off[:, None] * K + ks[None, :], mask=rm[:, None] & mk[None, :], other=0.0)
        Bn = tl.load(b + off[:, None] * K + ks[None, :], mask=rm[:, None] & mk[None, :], other=0.0)
        dO = tl.load(do + off[:, None] * V + vs[None, :], mask=rm[:, None] & mv[None, :], other=0.0)
        last = tl.minimum(n * C + C, T) - 1
        bl = tl.load(b + ((i_b * T + last) * H + i_h) * K + ks, mask=mk, other=0.0)
        if BUG != 2:                                           # 2: no decay between chunks
            D = D * tl.exp(bl)[:, None]
        D += scale * tl.dot(tl.trans(Q * tl.exp(Bn)), dO, input_precision="ieee")
        if BUG == 3:                                           # 3: stored after the update
            tl.store(dh + (bh * NT + n) * K * V + so, D, mask=sm)
    tl.store(ds0 + bh * K * V + so, D, mask=sm)


def make_dstates(bug):
    def reverse_state_pass(q, do, b, dfinal_state, *, scale, chunk_size=32):
        B, T, H, K = q.shape
        V = do.shape[-1]
        NT = triton.cdiv(T, chunk_size)
        dh = torch.empty(B, H, NT, K, V, device=q.device)
        ds0 = torch.empty(B, H, K, V, device=q.device)
        dsT = dfinal_state if dfinal_state is not None else ds0
        dstates_kernel[(B * H,)](q, do, b, dh, dsT, ds0, T, H, K, V, NT, scale, C=chunk_size, BK=block(K),
                                 BV=block(V), HAS_DST=dfinal_state is not None, BUG=bug)
        return dh, ds0
    return reverse_state_pass


@pytest.mark.parametrize("seed", SEEDS)
def test_dstates(seed):
    assert verdict("ch13.dstates", make_dstates(0), seed).passed
    expect = {1: "walk the chunks from first to last", 2: "leave out the decay diag(e^{b_C})",
              3: "store D after adding the chunk's own queries", 4: "start from zeros instead of the final"}
    for bug, what in expect.items():
        assert DIAG + what in verdict("ch13.dstates", make_dstates(bug), seed).message, bug


# ------------------------------------------------------------------------ ch13.offdiag_dq
@triton.jit
def offdiag_kernel(k, b, dA, dq, T, H, K, C: tl.constexpr, c: tl.constexpr, BK: tl.constexpr, BUG: tl.constexpr):
    ni, bh = tl.program_id(0), tl.program_id(1)
    n, i = ni // (C // c), ni % (C // c)
    i_b, i_h = bh // H, bh % H
    idx, ks = tl.arange(0, c), tl.arange(0, BK)
    mk = ks < K
    rows = n * C + i * c + idx
    rm = rows < T
    off = (i_b * T + rows) * H + i_h
    Bi = tl.load(b + off[:, None] * K + ks[None, :], mask=rm[:, None] & mk[None, :], other=0.0)
    r_row = n * C + i * c - 1                                  # b just before sub-chunk i
    r = tl.load(b + ((i_b * T + r_row) * H + i_h) * K + ks, mask=mk & (i > 0) & (r_row < T), other=0.0)
    if BUG == 1:                                               # 1: reference at the chunk start
        r = r * 0.0
    hi = i
    if BUG == 2:                                               # 2: the diagonal tile as a matmul too
        hi = i + 1
    acc = tl.zeros([c, BK], dtype=tl.float32)
    for j in range(hi):
        cols = n * C + j * c + idx
        cm = cols < T
        offc = (i_b * T + cols) * H + i_h
        Kj = tl.load(k + offc[:, None] * K + ks[None, :], mask=cm[:, None] & mk[None, :], other=0.0)
        Bj = tl.load(b + offc[:, None] * K + ks[None, :], mask=cm[:, None] & mk[None, :], other=0.0)
        A = tl.load(dA + off[:, None] * C + (j * c + idx)[None, :], mask=rm[:, None], other=0.0)
        acc += tl.dot(A, Kj * tl.exp(r[None, :] - Bj), input_precision="ieee")
    acc = acc * tl.exp(Bi - r[None, :])
    tl.store(dq + off[:, None] * K + ks[None, :], acc, mask=rm[:, None] & mk[None, :])


def make_offdiag(bug):
    def offdiag_dq(q, k, b, dA, *, chunk_size=32, sub_chunk_size=16):
        B, T, H, K = q.shape
        dq = torch.empty(B, T, H, K, device=q.device)
        grid = (triton.cdiv(T, chunk_size) * (chunk_size // sub_chunk_size), B * H)
        offdiag_kernel[grid](k, b, dA, dq, T, H, K, C=chunk_size, c=sub_chunk_size, BK=block(K), BUG=bug)
        return dq
    return offdiag_dq


@pytest.mark.parametrize("seed", SEEDS)
def test_offdiag_dq(seed):
    assert verdict("ch13.offdiag_dq", make_offdiag(0), seed).passed
    msg = verdict("ch13.offdiag_dq", make_offdiag(1), seed).message
    assert DIAG + "absorb the decay relative to the chunk start" in msg
    assert DIAG + "include the diagonal sub-chunk tile" in verdict("ch13.offdiag_dq", make_offdiag(2), seed).message


# ------------------------------------------------------------------------ ch13.diag_dk
@triton.jit
def diag_dk_kernel(q, g, dA, dk, T, H, K, C: tl.constexpr, c: tl.constexpr, BK: tl.constexpr, BUG: tl.constexpr):
    ni, bh = tl.program_id(0), tl.program_id(1)
    n, i = ni // (C // c), ni % (C // c)
    i_b, i_h = bh // H, bh % H
    idx, ks = tl.arange(0, c), tl.arange(0, BK)
    mk = ks < K
    s0 = n * C + i * c
    F = tl.zeros([c, BK], dtype=tl.float32)
    acc = tl.zeros([c, BK], dtype=tl.float32)
    for t in range(c):
        live = s0 + t < T
        o = ((i_b * T + s0 + t) * H + i_h) * K
        qt = tl.load(q + o + ks, mask=mk & live, other=0.0)
        gt = tl.exp(tl.load(g + o + ks, mask=mk & live, other=0.0))
        if BUG == 2:                                           # 2: the column's own gate walked in
            F = tl.where(idx[:, None] == t, gt[None, :], F * gt[None, :])
        else:
            F = tl.where(idx[:, None] == t, 1.0, F * gt[None, :])
        Fm = F
        if BUG == 1:                                           # 1: strict triangle
            Fm = tl.where(idx[:, None] == t, 0.0, F)
        a = tl.load(dA + ((i_b * T + s0 + t) * H + i_h) * C + i * c + idx, mask=live, other=0.0)
        acc += a[:, None] * qt[None, :] * Fm
    rows = s0 + idx
    off = (i_b * T + rows) * H + i_h
    tl.store(dk + off[:, None] * K + ks[None, :], acc, mask=(rows < T)[:, None] & mk[None, :])


def make_diag_dk(bug):
    def diag_dk(q, g, dA, *, chunk_size=32, sub_chunk_size=16):
        B, T, H, K = q.shape
        dk = torch.empty(B, T, H, K, device=q.device)
        grid = (triton.cdiv(T, chunk_size) * (chunk_size // sub_chunk_size), B * H)
        diag_dk_kernel[grid](q, g, dA, dk, T, H, K, C=chunk_size, c=sub_chunk_size, BK=block(K), BUG=bug)
        return dk
    return diag_dk


@pytest.mark.parametrize("seed", SEEDS)
def test_diag_dk(seed):
    assert verdict("ch13.diag_dk", make_diag_dk(0), seed).passed
    assert DIAG + "walk the rows with a strict triangle" in verdict("ch13.diag_dk", make_diag_dk(1), seed).message
    assert DIAG + "start the decay of column s with its own gate" in verdict("ch13.diag_dk", make_diag_dk(2),
                                                                            seed).message


# ------------------------------------------------------------------------ ch13.gate_scan
@triton.jit
def scan_kernel(db, w, carried, dg, T, H, K, NT, C: tl.constexpr, BK: tl.constexpr, BUG: tl.constexpr):
    n, bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = bh // H, bh % H
    rows, ks = n * C + tl.arange(0, C), tl.arange(0, BK)
    m = (rows < T)[:, None] & (ks < K)[None, :]
    p = ((i_b * T + rows) * H + i_h)[:, None] * K + ks[None, :]
    x = tl.load(db + p, mask=m, other=0.0)
    y = tl.load(w + p, mask=m, other=0.0)
    s = tl.cumsum(x, axis=0, reverse=True)
    if BUG == 2:                                               # 2: a prefix instead of a suffix
        s = tl.cumsum(x, axis=0)
    wp = tl.cumsum(y, axis=0) - y
    if BUG == 1:                                               # 1: inclusive prefix of the writes
        wp = tl.cumsum(y, axis=0)
    out = s + wp
    if BUG != 3:                                               # 3: no carried term
        out += tl.load(carried + ((i_b * NT + n) * H + i_h) * K + ks, mask=ks < K, other=0.0)[None, :]
    tl.store(dg + p, out, mask=m)


def make_scan(bug):
    def gate_scan(db, w, carried, *, chunk_size=32):
        B, T, H, K = db.shape
        dg = torch.empty(B, T, H, K, device=db.device)
        scan_kernel[(carried.shape[1], B * H)](db, w, carried, dg, T, H, K, carried.shape[1], C=chunk_size,
                                                BK=block(K), BUG=bug)
        return dg
    return gate_scan


@pytest.mark.parametrize("seed", SEEDS)
def test_gate_scan(seed):
    assert verdict("ch13.gate_scan", make_scan(0), seed).passed
    expect = {1: "include each token's own write", 2: "sum db from the chunk start",
              3: "leave out the carried term"}
    for bug, what in expect.items():
        assert DIAG + what in verdict("ch13.gate_scan", make_scan(bug), seed).message, bug


def test_gate_scan_truth_is_the_chunk_levels_gate_gradient():
    """The scan's three inputs, formed from the chunk level's pieces, give autograd's dg."""
    from linattn import chunk, testing
    from linattn.chunk import gla_backward
    kw = testing.make_inputs("gla", B=1, T=45, H=1, K=8, V=8, dtype=torch.float64, initial_state=True, seed=2)
    x = {n: a.clone().requires_grad_() for n, a in kw.items()}
    o, _ = chunk.gla(**x, chunk_size=16)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    got = {}

    def spy(qc, kc, dq_read, dk_in, write, Sin, dS_out, gam, gc):
        B, H, N, C, K = qc.shape
        flat = lambda t: t.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, K)[:, :45]
        got["dg"] = ch13.gate_scan_truth(flat(qc * dq_read - kc * dk_in), flat(kc * write),
                                         (torch.linalg.vecdot(Sin, dS_out) * gam).permute(0, 2, 1, 3), chunk_size=C)
        return real(qc, kc, dq_read, dk_in, write, Sin, dS_out, gam, gc)

    real = gla_backward.gate_gradient
    gla_backward.gate_gradient = spy
    try:
        x2 = {n: a.clone().requires_grad_() for n, a in kw.items()}
        o2, _ = chunk.gla(**x2, chunk_size=16)
        (o2 * do).sum().backward()
    finally:
        gla_backward.gate_gradient = real
    assert testing.rel_err(got["dg"], x["g"].grad) < 1e-6     # g is float32 in make_inputs


# ------------------------------------------------------------------------ ch13.gla_backward
def reader_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None, chunk_size=32,
                    sub_chunk_size=16):
    # Stands in for a reader's kernels: the library's Triton backward (grad mode on, as it may be
    # called from inside an autograd backward)
    with torch.enable_grad():
        return triton_backward(q, k, v, g, do, scale=scale, initial_state=initial_state,
                               dfinal_state=dfinal_state, chunk_size=chunk_size, sub_chunk_size=sub_chunk_size)


triton_backward = ch13.triton_backward


def backward_ignoring_final(q, k, v, g, do, *, dfinal_state=None, **kw):
    return reader_backward(q, k, v, g, do, **kw)


def backward_restarting_dg(q, k, v, g, do, *, chunk_size=32, **kw):
    dq, dk, dv, _, ds0 = reader_backward(q, k, v, g, do, chunk_size=chunk_size, **kw)
    x = q * dq - k * dk
    dg = torch.cat([c.flip(1).cumsum(1).flip(1) for c in x.split(chunk_size, dim=1)], dim=1)
    return dq, dk, dv, dg.sum(-1) if g.dim() == 3 else dg, ds0


def test_gla_backward_mistakes():
    assert verdict("ch13.gla_backward", reader_backward).passed
    assert DIAG + "ignore dfinal_state" in verdict("ch13.gla_backward", backward_ignoring_final).message
    assert DIAG + "restart the gate gradient's suffix sum" in verdict("ch13.gla_backward",
                                                                      backward_restarting_dg).message


# Chapter 12's classic mistakes in a whole backward: the planted reader is chapter 12's chunkwise
# backward written out in tests/test_grade_ch12.py (one bug switched on), run at this grader's chunk
# size; ch13's verdict must name each one as ch12's does.
def chunkwise_reader(bug):
    from test_grade_ch12 import chunkwise

    def gla_backward(q, k, v, g, do, *, sub_chunk_size=16, **kw):
        return chunkwise(q, k, v, g, do, bug=bug, **kw)
    return gla_backward


CLASSIC = {"flips the sign of the gate gradient": "take the seed's sign",
           "sums from the start (prefix) instead of from the end": "sum ∂L/∂b from the chunk's start",
           "reads the state after the step for dq": "read the state after the chunk, S_[n], for dq",
           "absorbs the decay as e^b and e^-b": "absorb the decay as e^{b} and e^{−b}"}


def test_gla_backward_bug_free_chunkwise_reader_passes():
    # without this the planted mistakes below could fail for a reason other than their bug
    for seed in SEEDS:
        assert verdict("ch13.gla_backward", chunkwise_reader(None), seed).passed


@pytest.mark.parametrize("bug", list(CLASSIC))
def test_gla_backward_names_the_classic_mistakes(bug):
    for seed in SEEDS:
        r = verdict("ch13.gla_backward", chunkwise_reader(bug), seed)
        assert not r.passed and DIAG + CLASSIC[bug] in r.message, r.message


def test_passed_backward_trains_through_impl_mine(home):
    kw = linattn.testing.make_inputs("gla", B=1, T=21, H=2, K=16, V=16, seed=3, initial_state=True,
                                     device=linattn.device.default_device())
    x = {n: a.clone().requires_grad_() for n, a in kw.items()}
    with pytest.raises(linattn.validate.InputError):           # nothing passed yet
        linattn.gla(**x, impl="mine")
    assert check("ch13.gla_backward", reader_backward, seed=6, quiet=True).passed
    o, S = linattn.gla(**x, impl="mine", output_final_state=True, chunk_size=16)
    assert linattn.which("gla").startswith("linattn.triton.gla (reference forward) with your ch13.gla_backward")
    do, dS = torch.randn_like(o), torch.randn_like(S)
    ((o * do).sum() + (S * dS).sum()).backward()
    y = {n: a.double().requires_grad_() for n, a in kw.items()}
    o64, S64 = linattn.naive.gla(**y, output_final_state=True)
    ((o64 * do.double()).sum() + (S64 * dS.double()).sum()).backward()
    for n in x:
        assert linattn.testing.rel_err(x[n].grad, y[n].grad) < 1e-4, n


lt_gla = linattn.triton.gla


def reader_forward(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, chunk_size=32,
                   sub_chunk_size=16):
    # Stands in for a reader's workbook-10 kernel
    return lt_gla(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  chunk_size=chunk_size, sub_chunk_size=sub_chunk_size)


def test_passed_forward_and_backward_train_together(home):
    kw = linattn.testing.make_inputs("gla", B=1, T=19, H=1, K=16, V=16, seed=4,
                                     device=linattn.device.default_device())
    assert check("ch10.gla", reader_forward, seed=2, quiet=True).passed
    x = {n: a.clone().requires_grad_() for n, a in kw.items()}
    with pytest.raises(linattn.validate.InputError, match="has no backward pass"):
        linattn.gla(**x, impl="mine")                          # a forward kernel alone has no backward
    assert check("ch13.gla_backward", reader_backward, seed=2, quiet=True).passed
    o, _ = linattn.gla(**x, impl="mine")
    assert linattn.which("gla").startswith("your ch10.gla") and "with your ch13.gla_backward" in linattn.which("gla")
    o.square().sum().backward()
    y = {n: a.double().requires_grad_() for n, a in kw.items()}
    linattn.naive.gla(**y)[0].square().sum().backward()
    for n in x:
        assert linattn.testing.rel_err(x[n].grad, y[n].grad) < 1e-4, n
