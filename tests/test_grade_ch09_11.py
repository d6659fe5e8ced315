"""Graders of the Triton workbooks (chapters 09–11): references pass, planted wrong kernels fail
with the right verdict, and a passed whole kernel runs the library (impl="mine", Triton level).

Each planted kernel is a small, otherwise correct kernel with one bug switched on (`BUG`, a
constexpr); BUG = 0 passes too, so a rejection is caused by the bug alone. Under the interpreter
the grader bounds-checks every tl.load / tl.store (linattn/grade/bounds.py): an unmasked tail
load is reported as an out-of-bounds access at its line.
"""
import time

import pytest
import torch

import linattn  # before triton: without a GPU it switches Triton's interpreter on
from linattn.grade import check, reference

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SEEDS = (0, 1)
# Out-of-bounds mutants run only under the interpreter: natively nothing checks bounds, and a
# wild access could end the CUDA context for the rest of the suite.
INTERPRETER = linattn.device.triton_mode() == "interpreter"
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="bounds are checked by the interpreter")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_HOME", str(tmp_path))
    yield tmp_path
    for op in ("linear_attn", "gla", "kda"):
        linattn.set_impl(op, "auto")


def verdict(name, fn, seed=0):
    return check(name, fn, seed=seed, record=False, quiet=True)


def block(n):
    return max(16, triton.next_power_of_2(n))


# ------------------------------------------------------------------------ ch09.scale_rows
@triton.jit
def scale_rows_kernel(x, w, y, T, D, BT: tl.constexpr, BD: tl.constexpr, BUG: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    inside = (rows[:, None] < T) & (cols[None, :] < D)
    load_mask = (cols[None, :] < D) if BUG == 1 else inside   # 1: rows past T not masked
    tile = tl.load(x + rows[:, None] * D + cols[None, :], mask=load_mask, other=0.0)
    wt = tl.load(w + rows, mask=rows < T, other=0.0)
    store_mask = (rows[:, None] >= 0) & (cols[None, :] < D) if BUG == 2 else inside  # 2: store
    if BUG != 3:                                                                      # 3: no store
        tl.store(y + rows[:, None] * D + cols[None, :], tile * wt[:, None], mask=store_mask)


def make_scale_rows(bug):
    def scale_rows(x, w):
        T, D = x.shape
        y = torch.empty_like(x)
        scale_rows_kernel[(triton.cdiv(T, 16),)](x, w, y, T, D, BT=16, BD=block(D), BUG=bug)
        return y
    return scale_rows


@pytest.mark.parametrize("seed", SEEDS)
def test_scale_rows(seed):
    assert verdict("ch09.scale_rows", make_scale_rows(0), seed).passed
    msg = verdict("ch09.scale_rows", make_scale_rows(3), seed).message
    assert "NaN/inf" in msg and "never wrote" in msg       # torch.empty poisoned while graded


@needs_interpreter
@pytest.mark.parametrize("seed", SEEDS)
def test_scale_rows_out_of_bounds(seed):
    msg = verdict("ch09.scale_rows", make_scale_rows(1), seed).message
    assert "out-of-bounds access: the kernel loads up to" in msg and "past the end of `x`" in msg
    assert "tl.load(x + rows[:, None] * D" in msg          # the line of the unmasked load
    msg = verdict("ch09.scale_rows", make_scale_rows(2), seed).message
    assert "out-of-bounds access: the kernel stores" in msg and "`y`" in msg


# --------------------------------------------------------- ch09.intra_chunk, ch09.chunk_state
@triton.jit
def tile(ptr, C, W, BC: tl.constexpr, BW: tl.constexpr):
    t, c = tl.arange(0, BC), tl.arange(0, BW)
    return tl.load(ptr + t[:, None] * W + c[None, :], mask=(t[:, None] < C) & (c[None, :] < W),
                   other=0.0).to(tl.float32)


@triton.jit
def intra_kernel(q, k, v, o, C, K, V, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 BUG: tl.constexpr):
    n = tl.program_id(0)
    Q, Kc, Vc = tile(q + n * C * K, C, K, BC, BK), tile(k + n * C * K, C, K, BC, BK), \
        tile(v + n * C * V, C, V, BC, BV)
    t = tl.arange(0, BC)
    A = tl.dot(Q, tl.trans(Kc), input_precision="ieee")
    if BUG == 1:
        A = tl.where(t[:, None] > t[None, :], A, 0.0)      # strict: no diagonal
    elif BUG == 2:
        A = tl.where(t[:, None] <= t[None, :], A, 0.0)     # upper triangle
    else:
        A = tl.where(t[:, None] >= t[None, :], A, 0.0)
    O = tl.dot(A, Vc, input_precision="ieee")
    c = tl.arange(0, BV)
    tl.store(o + n * C * V + t[:, None] * V + c[None, :], O.to(o.dtype.element_ty),
             mask=(t[:, None] < C) & (c[None, :] < V))


def make_intra(bug):
    def intra_chunk(q, k, v):
        N, C, K = q.shape
        o = torch.empty(N, C, v.shape[-1], dtype=v.dtype, device=v.device)
        intra_kernel[(N,)](q, k, v, o, C, K, v.shape[-1], BC=block(C), BK=block(K),
                           BV=block(v.shape[-1]), BUG=bug)
        return o
    return intra_chunk


@triton.jit
def state_kernel(k, v, s, out, C, K, V, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 BUG: tl.constexpr):
    n = tl.program_id(0)
    Kc, Vc = tile(k + n * C * K, C, K, BC, BK), tile(v + n * C * V, C, V, BC, BV)
    S = tile(s + n * K * V, K, V, BK, BV)
    KV = tl.dot(tl.trans(Kc), Vc, input_precision="ieee")
    if BUG == 1:
        S = KV                                             # forgets the entering state
    elif BUG == 2:
        S += KV.to(tl.bfloat16).to(tl.float32)              # bf16 accumulation
    else:
        S += KV
    r, c = tl.arange(0, BK), tl.arange(0, BV)
    tl.store(out + n * K * V + r[:, None] * V + c[None, :], S, mask=(r[:, None] < K) & (c[None, :] < V))


def make_state(bug):
    def chunk_state(k, v, S):
        N, C, K = k.shape
        out = torch.empty(N, K, v.shape[-1], device=k.device)
        state_kernel[(N,)](k, v, S, out, C, K, v.shape[-1], BC=block(C), BK=block(K),
                           BV=block(v.shape[-1]), BUG=bug)
        return out
    return chunk_state


@pytest.mark.parametrize("seed", SEEDS)
def test_intra_chunk(seed):
    assert verdict("ch09.intra_chunk", make_intra(0), seed).passed
    assert "diagnosis: your result matches what you get if you mask with a strict triangle" in \
        verdict("ch09.intra_chunk", make_intra(1), seed).message
    assert "if you mask with the upper triangle" in verdict("ch09.intra_chunk", make_intra(2), seed).message


@pytest.mark.parametrize("seed", SEEDS)
def test_chunk_state(seed):
    assert verdict("ch09.chunk_state", make_state(0), seed).passed
    assert "without the state S entering" in verdict("ch09.chunk_state", make_state(1), seed).message
    assert "accumulate in bfloat16" in verdict("ch09.chunk_state", make_state(2), seed).message


# ------------------------------------------------------------------------ ch09.linear_attn
@triton.jit
def linear_kernel(q, k, v, h0, o, ht, scale, T, H, K, V, C: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, BUG: tl.constexpr):
    # one program per (batch, head) walks the chunks; [B, T, H, *] row-major inputs
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    t, dk, dv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = dk < K, dv < V
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + bh * K * V + dk[:, None] * V + dv[None, :], mask=mk[:, None] & mv[None, :],
                     other=0.0)
    end = T - C + 1 if BUG == 3 else T                      # 3: the last partial chunk dropped
    for s in range(0, end, C):
        rows = s + t
        inside = rows < T
        if BUG == 2:
            inside = rows >= 0                               # 2: rows past T loaded (unmasked)
        qo = ((b * T + rows) * H + h) * K
        vo = ((b * T + rows) * H + h) * V
        Q = tl.load(q + qo[:, None] + dk[None, :], mask=inside[:, None] & mk[None, :], other=0.0).to(tl.float32)
        Kc = tl.load(k + qo[:, None] + dk[None, :], mask=inside[:, None] & mk[None, :], other=0.0).to(tl.float32)
        Vc = tl.load(v + vo[:, None] + dv[None, :], mask=inside[:, None] & mv[None, :], other=0.0).to(tl.float32)
        A = tl.dot(Q, tl.trans(Kc), input_precision="ieee")
        causal = (t[:, None] > t[None, :]) if BUG == 1 else (t[:, None] >= t[None, :])  # 1: strict
        A = tl.where(causal, A, 0.0)
        S_new = S + tl.dot(tl.trans(Kc), Vc, input_precision="ieee")
        Sread = S_new if BUG == 4 else S                   # 4: reads the state after the update
        O = scale * (tl.dot(Q, Sread, input_precision="ieee") + tl.dot(A, Vc, input_precision="ieee"))
        tl.store(o + vo[:, None] + dv[None, :], O.to(o.dtype.element_ty),
                 mask=(rows < T)[:, None] & mv[None, :])
        S = S_new
    if STORE_HT:
        tl.store(ht + bh * K * V + dk[:, None] * V + dv[None, :], S, mask=mk[:, None] & mv[None, :])


def make_linear(bug):
    def my_linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                       chunk_size=16):
        B, T, H, K = q.shape
        V = v.shape[-1]
        scale = K ** -0.5 if scale is None else scale
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
        ht = torch.empty(B, H, K, V, device=v.device) if output_final_state else None
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        linear_kernel[(B * H,)](q, k, v, h0, o, ht, scale, T, H, K, V, C=chunk_size,
                                BK=block(K), BV=block(V), HAS_H0=h0 is not None,
                                STORE_HT=output_final_state, BUG=bug)
        return o, ht
    return my_linear_attn


def reader_linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                       chunk_size=16):
    """A launcher at the top level, as in a notebook (its source can be saved)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(B, H, K, V, device=v.device) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    linear_kernel[(B * H,)](q, k, v, h0, o, ht, scale, T, H, K, V, C=chunk_size, BK=block(K),
                            BV=block(V), HAS_H0=h0 is not None, STORE_HT=output_final_state, BUG=0)
    return o, ht


@pytest.mark.parametrize("seed", SEEDS)
def test_linear_attn_kernel(seed):
    assert verdict("ch09.linear_attn", make_linear(0), seed).passed
    assert "if you read the state before adding k_tᵀ v_t (a strict triangle" in \
        verdict("ch09.linear_attn", make_linear(1), seed).message
    if INTERPRETER:
        msg = verdict("ch09.linear_attn", make_linear(2), seed).message
        assert "out-of-bounds access: the kernel loads" in msg and "past the end of `q`" in msg
        assert "Q = tl.load(q + qo[:, None]" in msg
    msg = verdict("ch09.linear_attn", make_linear(3), seed).message
    assert "NaN/inf" in msg and "drop the last partial chunk" in msg
    assert "if you read the state after adding the chunk's Kᵀ V" in \
        verdict("ch09.linear_attn", make_linear(4), seed).message


def test_passed_kernel_runs_the_library(home):
    """Pass ch09.linear_attn with a kernel, then linattn.linear_attn(impl="mine") runs that kernel."""
    assert not linattn.grade.progress.passed("ch09.linear_attn")
    assert check("ch09.linear_attn", reader_linear_attn, seed=4, quiet=True).passed
    saved = (home / "mine" / "ch09.linear_attn.py").read_text()
    assert "@triton.jit" in saved and "def linear_kernel" in saved and "def block" in saved
    assert "def tile" not in saved                          # only what the launcher uses
    q, k, v = torch.randn(3, 1, 20, 2, 16, device=linattn.device.default_device()).unbind(0)
    o, _ = linattn.linear_attn(q, k, v, impl="mine", chunk_size=16)   # natively: CUDA tensors
    assert linattn.which("linear_attn").startswith("your ch09.linear_attn")
    assert linattn.testing.rel_err(o, linattn.naive.linear_attn(q, k, v)[0]) < 1e-5
    linattn.set_impl("linear_attn", "mine")
    linattn.linear_attn(q, k, v)
    assert linattn.which("linear_attn").startswith("your ch09.linear_attn")
    # a kernel has no backward: inputs that require grad are refused, not silently detached
    with pytest.raises(linattn.InputError, match="your ch09.linear_attn .* no backward pass.*q"):
        linattn.linear_attn(q.requires_grad_(), k, v)


def test_nested_launcher_passes_but_says_it_cannot_be_saved(home, capsys):
    assert check("ch09.linear_attn", make_linear(0), seed=4).passed
    assert "could not be saved" in capsys.readouterr().out
    with pytest.raises(linattn.InputError, match="you have not passed"):
        linattn.linear_attn(*torch.randn(3, 1, 20, 2, 16), impl="mine")


# ------------------------------------------------------ ch10.offdiag_tiles, ch10.diag_tiles
@triton.jit
def rows16(ptr, row0, K, BK: tl.constexpr):
    t, c = row0 + tl.arange(0, 16), tl.arange(0, BK)
    return tl.load(ptr + t[:, None] * K + c[None, :], mask=c[None, :] < K, other=0.0).to(tl.float32)


@triton.jit
def tiles_kernel(q, k, b, a, C, K, BK: tl.constexpr, DIAG: tl.constexpr, BUG: tl.constexpr):
    i, j, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q, k, b, a = q + n * C * K, k + n * C * K, b + n * C * K, a + n * C * C
    t, c = tl.arange(0, 16), tl.arange(0, BK)
    A = tl.zeros([16, 16], dtype=tl.float32)
    if DIAG:
        if i == j:
            Q, Kt, Bt = rows16(q, i * 16, K, BK), rows16(k, i * 16, K, BK), rows16(b, i * 16, K, BK)
            causal = (t[:, None] > t[None, :]) if BUG == 1 else (t[:, None] >= t[None, :])
            diff = Bt[:, None, :] - Bt[None, :, :]
            if BUG == 2:
                dec = tl.exp(diff) * causal[:, :, None].to(tl.float32)        # mask after exp
            else:
                dec = tl.exp(tl.where(causal[:, :, None], diff, float("-inf")))
            if BUG == 3:
                dec = dec.to(tl.bfloat16).to(tl.float32)                        # bf16 decay
            A = tl.sum(Q[:, None, :] * Kt[None, :, :] * dec, axis=2)
    else:
        if j < i:
            r = tl.load(b + (i * 16 - 1) * K + c, mask=c < K, other=0.0)
            if BUG == 1:
                r = r * 0.0                                                   # chunk start
            Qa = rows16(q, i * 16, K, BK) * tl.exp(rows16(b, i * 16, K, BK) - r[None, :])
            Ka = rows16(k, j * 16, K, BK) * tl.exp(r[None, :] - rows16(b, j * 16, K, BK))
            A = tl.dot(Qa, tl.trans(Ka), input_precision="ieee")
    tl.store(a + (i * 16 + t[:, None]) * C + j * 16 + t[None, :], A)


def make_tiles(diag, bug):
    def tiles(q, k, b):
        N, C, K = q.shape
        a = torch.empty(N, C, C, device=q.device)
        tiles_kernel[(C // 16, C // 16, N)](q, k, b, a, C, K, BK=block(K), DIAG=diag, BUG=bug)
        return a
    return tiles


@pytest.mark.parametrize("seed", SEEDS)
def test_offdiag_tiles(seed):
    assert verdict("ch10.offdiag_tiles", make_tiles(False, 0), seed).passed
    msg = verdict("ch10.offdiag_tiles", make_tiles(False, 1), seed).message
    assert "NaN/inf" in msg and "if you absorb the decay relative to the chunk start" in msg


@pytest.mark.parametrize("seed", SEEDS)
def test_diag_tiles(seed):
    assert verdict("ch10.diag_tiles", make_tiles(True, 0), seed).passed
    assert "if you mask with a strict triangle" in verdict("ch10.diag_tiles", make_tiles(True, 1), seed).message
    msg = verdict("ch10.diag_tiles", make_tiles(True, 2), seed).message
    assert "NaN/inf" in msg and "if you apply the mask after exp" in msg
    assert "if you round the decay to bfloat16" in verdict("ch10.diag_tiles", make_tiles(True, 3), seed).message


# ------------------------------------------------------------------------ ch10.gla
@triton.jit
def gla_kernel(q, k, v, g, h0, o, ht, scale, T, H, K, V, C: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, BUG: tl.constexpr):
    # one program per (batch, head); the intra-chunk part as a [C, C, BK] float32 product (no
    # secondary chunking: the grader checks results, not structure)
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    t, dk, dv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = dk < K, dv < V
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + bh * K * V + dk[:, None] * V + dv[None, :], mask=mk[:, None] & mv[None, :],
                     other=0.0)
    causal = t[:, None] >= t[None, :]
    end = T - C + 1 if BUG == 1 else T                      # 1: the last partial chunk dropped
    for s in range(0, end, C):
        rows = s + t
        inside = rows < T
        qo = ((b * T + rows) * H + h) * K
        vo = ((b * T + rows) * H + h) * V
        mq = inside[:, None] & mk[None, :]
        Q = tl.load(q + qo[:, None] + dk[None, :], mask=mq, other=0.0).to(tl.float32)
        Kc = tl.load(k + qo[:, None] + dk[None, :], mask=mq, other=0.0).to(tl.float32)
        G = tl.load(g + qo[:, None] + dk[None, :], mask=mq, other=0.0).to(tl.float32)
        Vc = tl.load(v + vo[:, None] + dv[None, :], mask=inside[:, None] & mv[None, :], other=0.0).to(tl.float32)
        Bc = tl.cumsum(G, axis=0)                             # [C, BK]
        blast = tl.sum(G, axis=0)                             # [BK]
        if BUG == 2:                                          # 2: absorbed from the chunk start
            A = tl.dot(Q * tl.exp(Bc), tl.trans(Kc * tl.exp(-Bc)), input_precision="ieee")
            A = tl.where(causal, A, 0.0)
        else:
            diff = tl.where(causal[:, :, None], Bc[:, None, :] - Bc[None, :, :], float("-inf"))
            A = tl.sum(Q[:, None, :] * Kc[None, :, :] * tl.exp(diff), axis=2)
        O = scale * (tl.dot(Q * tl.exp(Bc), S, input_precision="ieee")
                     + tl.dot(A, Vc, input_precision="ieee"))
        tl.store(o + vo[:, None] + dv[None, :], O.to(o.dtype.element_ty), mask=inside[:, None] & mv[None, :])
        S = tl.exp(blast)[:, None] * S + tl.dot(tl.trans(Kc * tl.exp(blast[None, :] - Bc)), Vc,
                                               input_precision="ieee")
    if STORE_HT:
        tl.store(ht + bh * K * V + dk[:, None] * V + dv[None, :], S, mask=mk[:, None] & mv[None, :])


def make_gla(bug):
    def my_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
               chunk_size=32, sub_chunk_size=16):
        B, T, H, K = q.shape
        V = v.shape[-1]
        scale = K ** -0.5 if scale is None else scale
        if g.dim() == 3:
            g = g[..., None].expand(B, T, H, K)
        q, k, v, g = (x.contiguous() for x in (q, k, v, g))
        o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
        ht = torch.empty(B, H, K, V, device=v.device) if output_final_state else None
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        gla_kernel[(B * H,)](q, k, v, g, h0, o, ht, scale, T, H, K, V, C=chunk_size, BK=block(K),
                             BV=block(V), HAS_H0=h0 is not None, STORE_HT=output_final_state, BUG=bug)
        return o, ht
    return my_gla


@pytest.mark.parametrize("seed", SEEDS[:1])  # whole kernels are the slow ones under the interpreter
def test_gla_kernel(seed):
    assert verdict("ch10.gla", make_gla(0), seed).passed
    msg = verdict("ch10.gla", make_gla(1), seed).message
    assert "NaN/inf" in msg and "if you drop the last partial chunk" in msg
    msg = verdict("ch10.gla", make_gla(2), seed).message
    assert "NaN/inf" in msg and "strong gates" in msg and "absorb relative to the sub-chunk boundary" in msg


# ------------------------------------------------------- ch11.unit_lower_inverse, ch11.wy_factors
@triton.jit
def substitute(A, t, C, SIGN: tl.constexpr, STEPS: tl.constexpr):
    """(I + SIGN·A)⁻¹ of a [BC, BC] tile by forward substitution (STEPS = 0: I − A)."""
    X = (t[:, None] == t[None, :]).to(tl.float32)
    if STEPS == 0:
        X = X - A
    else:
        for i in range(1, C):
            a_i = tl.sum(tl.where(t[:, None] == i, A, 0.0), axis=0)
            X = tl.where(t[:, None] == i, (tl.where(t == i, 1.0, 0.0) - SIGN * tl.sum(a_i[:, None] * X, axis=0))[None, :], X)
    return X


@triton.jit
def inverse_kernel(a, x, C, BC: tl.constexpr, BUG: tl.constexpr):
    n = tl.program_id(0)
    t = tl.arange(0, BC)
    m = (t[:, None] < C) & (t[None, :] < C)
    A = tl.load(a + n * C * C + t[:, None] * C + t[None, :], mask=m, other=0.0)
    X = substitute(A, t, C, -1.0 if BUG == 2 else 1.0, 0 if BUG == 3 else 1)
    if BUG == 1:
        X = tl.trans(X)                                          # 1: transposed inverse
    tl.store(x + n * C * C + t[:, None] * C + t[None, :], X, mask=m)


def make_inverse(bug):
    def unit_lower_inverse(A):
        N, C, _ = A.shape
        X = torch.empty(N, C, C, device=A.device)
        inverse_kernel[(N,)](A, X, C, BC=block(C), BUG=bug)
        return X
    return unit_lower_inverse


@triton.jit
def wy_kernel(k, v, g, beta, u, w, C, K, V, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              BUG: tl.constexpr):
    n = tl.program_id(0)
    t, dk, dv = tl.arange(0, BC), tl.arange(0, BK), tl.arange(0, BV)
    mk = (t[:, None] < C) & (dk[None, :] < K)
    mv = (t[:, None] < C) & (dv[None, :] < V)
    Kc = tl.load(k + n * C * K + t[:, None] * K + dk[None, :], mask=mk, other=0.0).to(tl.float32)
    Vc = tl.load(v + n * C * V + t[:, None] * V + dv[None, :], mask=mv, other=0.0).to(tl.float32)
    G = tl.cumsum(tl.load(g + n * C * K + t[:, None] * K + dk[None, :], mask=mk, other=0.0), axis=0)
    bt = tl.load(beta + n * C + t, mask=t < C, other=0.0).to(tl.float32)
    keep = (t[:, None] >= t[None, :]) if BUG == 1 else (t[:, None] > t[None, :])  # 1: diagonal kept
    diff = tl.where(keep[:, :, None], G[:, None, :] - G[None, :, :], float("-inf"))
    S = tl.sum(Kc[:, None, :] * Kc[None, :, :] * tl.exp(diff), axis=2)
    A = (bt[None, :] * S) if BUG == 2 else (bt[:, None] * S)                      # 2: β on columns
    X = substitute(A, t, C, 1.0, 1)
    if BUG == 3:
        X = tl.trans(X)                                                            # 3: transposed
    tl.store(u + n * C * V + t[:, None] * V + dv[None, :], tl.dot(X, bt[:, None] * Vc, input_precision="ieee"), mask=mv)
    tl.store(w + n * C * K + t[:, None] * K + dk[None, :],
             tl.dot(X, bt[:, None] * Kc * tl.exp(G), input_precision="ieee"), mask=mk)


def make_wy(bug):
    def wy_factors(k, v, g, beta):
        N, C, K = k.shape
        U, W = torch.empty(N, C, v.shape[-1], device=k.device), torch.empty(N, C, K, device=k.device)
        wy_kernel[(N,)](k, v, g, beta, U, W, C, K, v.shape[-1], BC=block(C), BK=block(K),
                        BV=block(v.shape[-1]), BUG=bug)
        return U, W
    return wy_factors


@pytest.mark.parametrize("seed", SEEDS)
def test_unit_lower_inverse(seed):
    assert verdict("ch11.unit_lower_inverse", make_inverse(0), seed).passed
    assert "if you return the transpose of (I + A)⁻¹" in verdict("ch11.unit_lower_inverse", make_inverse(1), seed).message
    assert "if you invert I − A instead" in verdict("ch11.unit_lower_inverse", make_inverse(2), seed).message
    assert "first-order approximation" in verdict("ch11.unit_lower_inverse", make_inverse(3), seed).message


@pytest.mark.parametrize("seed", SEEDS)
def test_wy_factors(seed):
    assert verdict("ch11.wy_factors", make_wy(0), seed).passed
    assert "if you keep the diagonal in A" in verdict("ch11.wy_factors", make_wy(1), seed).message
    assert "if you put β_j on column j" in verdict("ch11.wy_factors", make_wy(2), seed).message
    assert "if you use the transpose of (I + A)⁻¹" in verdict("ch11.wy_factors", make_wy(3), seed).message


# ------------------------------------------------------------------------ ch11.kda
@triton.jit
def kda_kernel(q, k, v, g, beta, h0, o, ht, scale, T, H, K, V, C: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, BUG: tl.constexpr):
    # one program per (batch, head) walks the chunks: WY factors, residuals, output, state
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    t, dk, dv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = dk < K, dv < V
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + bh * K * V + dk[:, None] * V + dv[None, :], mask=mk[:, None] & mv[None, :],
                     other=0.0)
    end = T - C + 1 if BUG == 1 else T                      # 1: the last partial chunk dropped
    for s in range(0, end, C):
        rows = s + t
        inside = rows < T
        if BUG == 2:
            inside = rows >= 0                               # 2: rows past T loaded (unmasked)
        qo = ((b * T + rows) * H + h) * K
        vo = ((b * T + rows) * H + h) * V
        mq = inside[:, None] & mk[None, :]
        Q = tl.load(q + qo[:, None] + dk[None, :], mask=mq, other=0.0).to(tl.float32)
        Kc = tl.load(k + qo[:, None] + dk[None, :], mask=mq, other=0.0).to(tl.float32)
        G = tl.cumsum(tl.load(g + qo[:, None] + dk[None, :], mask=mq, other=0.0).to(tl.float32), axis=0)
        Vc = tl.load(v + vo[:, None] + dv[None, :], mask=inside[:, None] & mv[None, :], other=0.0).to(tl.float32)
        bt = tl.load(beta + (b * T + rows) * H + h, mask=inside, other=0.0).to(tl.float32)
        diff = G[:, None, :] - G[None, :, :]
        A = bt[:, None] * tl.sum(Kc[:, None, :] * Kc[None, :, :] * tl.exp(
            tl.where((t[:, None] > t[None, :])[:, :, None], diff, float("-inf"))), axis=2)
        X = substitute(A, t, C, 1.0, 1)
        U = tl.dot(X, bt[:, None] * Vc, input_precision="ieee")
        W = tl.dot(X, bt[:, None] * Kc * tl.exp(G), input_precision="ieee")
        Vn = U - tl.dot(W, S, input_precision="ieee")                                  # Ṽ
        Aqk = tl.sum(Q[:, None, :] * Kc[None, :, :] * tl.exp(
            tl.where((t[:, None] >= t[None, :])[:, :, None], diff, float("-inf"))), axis=2)
        O = scale * (tl.dot(Q * tl.exp(G), S, input_precision="ieee") + tl.dot(Aqk, Vn, input_precision="ieee"))
        tl.store(o + vo[:, None] + dv[None, :], O.to(o.dtype.element_ty), mask=(rows < T)[:, None] & mv[None, :])
        glast = tl.sum(tl.where((t == C - 1)[:, None], G, 0.0), axis=0)              # [BK]
        S = tl.exp(glast)[:, None] * S + tl.dot(tl.trans(Kc * tl.exp(glast[None, :] - G)), Vn,
                                               input_precision="ieee")
    if STORE_HT:
        tl.store(ht + bh * K * V + dk[:, None] * V + dv[None, :], S, mask=mk[:, None] & mv[None, :])


def make_kda(bug):
    def my_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
               chunk_size=16):
        B, T, H, K = q.shape
        V = v.shape[-1]
        scale = K ** -0.5 if scale is None else scale
        if g.dim() == 3:
            g = g[..., None].expand(B, T, H, K)
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
        ht = torch.empty(B, H, K, V, device=v.device) if output_final_state else None
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        kda_kernel[(B * H,)](q, k, v, g, beta, h0, o, ht, scale, T, H, K, V, C=chunk_size,
                             BK=block(K), BV=block(V), HAS_H0=h0 is not None,
                             STORE_HT=output_final_state, BUG=bug)
        return o, ht
    return my_kda


@pytest.mark.parametrize("seed", SEEDS[:1])
def test_kda_kernel(seed):
    assert verdict("ch11.kda", make_kda(0), seed).passed
    msg = verdict("ch11.kda", make_kda(1), seed).message
    assert "NaN/inf" in msg and "if you drop the last partial chunk" in msg
    if INTERPRETER:
        msg = verdict("ch11.kda", make_kda(2), seed).message
        assert "out-of-bounds access: the kernel loads" in msg and "past the end of `q`" in msg


# ------------------------------------------------------------------------ CPU time per check
@pytest.mark.parametrize("name", ["ch09.scale_rows", "ch09.intra_chunk", "ch09.chunk_state",
                                  "ch09.linear_attn", "ch10.offdiag_tiles", "ch10.diag_tiles",
                                  "ch10.gla", "ch11.unit_lower_inverse", "ch11.wy_factors", "ch11.kda"])
def test_reference_passes(name, capsys):
    """Every reference passes; the CPU seconds of its check are printed (run with -s to see them),
    not asserted: a timed assertion would fail on a busy machine."""
    start = time.process_time()
    r = check(name, reference(name), seed=11, record=False, quiet=True)
    assert r.passed, r.message
    with capsys.disabled():
        print(f"\n{name}: {time.process_time() - start:.2f} CPU s for {r.cases} cases")


def reader_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
               chunk_size=32, sub_chunk_size=16):
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    if g.dim() == 3:
        g = g[..., None].expand(B, T, H, K)
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(B, H, K, V, device=v.device) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    gla_kernel[(B * H,)](q, k, v, g, h0, o, ht, scale, T, H, K, V, C=chunk_size, BK=block(K),
                         BV=block(V), HAS_H0=h0 is not None, STORE_HT=output_final_state, BUG=0)
    return o, ht


def reader_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
               chunk_size=16):
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    if g.dim() == 3:
        g = g[..., None].expand(B, T, H, K)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(B, H, K, V, device=v.device) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    kda_kernel[(B * H,)](q, k, v, g, beta, h0, o, ht, scale, T, H, K, V, C=chunk_size, BK=block(K),
                         BV=block(V), HAS_H0=h0 is not None, STORE_HT=output_final_state, BUG=0)
    return o, ht


@pytest.mark.parametrize("name, op, fn", [("ch10.gla", "gla", reader_gla),
                                          ("ch11.kda", "kda", reader_kda)])
def test_passed_gated_kernels_run_the_library(home, name, op, fn):
    assert check(name, fn, seed=6, quiet=True).passed
    kw = linattn.testing.make_inputs(op, B=1, T=21, H=2, K=16, V=16, seed=3,
                                     device=linattn.device.default_device())
    o, _ = getattr(linattn, op)(**kw, impl="mine")
    assert linattn.which(op).startswith(f"your {name}")
    want, _ = getattr(linattn.naive, op)(**kw)
    assert linattn.testing.rel_err(o, want) < 1e-5


def in_place_chunk_state(k, v, S):
    """Writes S + Kᵀ V into the caller's S and returns it: right values, wrong contract."""
    N, C, K = k.shape
    state_kernel[(N,)](k, v, S, S, C, K, v.shape[-1], BC=block(C), BK=block(K),
                       BV=block(v.shape[-1]), BUG=0)
    return S


@triton.jit
def endless_kernel(x, y, n):
    acc = tl.load(x)
    for i in range(0, n):                      # n = 10**9: hours under the interpreter
        acc += 1.0
    tl.store(y, acc)


def endless_scale_rows(x, w):
    y = torch.empty_like(x)
    endless_kernel[(1,)](x, y, 10 ** 9)
    return y


def test_kernel_writing_into_its_input_is_named():
    msg = verdict("ch09.chunk_state", in_place_chunk_state).message
    assert "changed its input `S` in place" in msg


@needs_interpreter
def test_endless_kernel_hits_the_time_limit():
    endless_kernel[(1,)](torch.zeros(1), torch.zeros(1), 1)  # prepared once, so the 2 s go to the loop
    r = check("ch09.scale_rows", endless_scale_rows, seed=0, record=False, quiet=True, time_limit=2)
    assert "ran past the 2 s limit" in r.message and "in endless_kernel: `acc += 1.0`" in r.message


@needs_interpreter
@pytest.mark.parametrize("name, op", [("ch09.linear_attn", "linear_attn"), ("ch10.gla", "gla")])
def test_library_kernels_pass_the_bounds_check(name, op):
    """No false alarms: the library's own kernels, called as the reader's code (so every load and
    store is bounds-checked), pass. (The GLA kernel's masks arrive as int32 arrays.)"""
    import linattn.triton

    lib = getattr(linattn.triton, op)
    assert verdict(name, lambda *a, **kw: lib(*a, **kw), seed=7).passed
