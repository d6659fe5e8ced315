"""Chapter 13 — the backward pass in Triton: the reverse state pass, an intra-chunk gradient tile,
the diagonal tiles' dk row walk, the gate gradient's chunk-local scan, and the whole GLA backward.

Kernel exercises take tensors in the library's layout (q, k, g [B, T, H, K], do [B, T, H, V]) with
per-dimension gates, and return what one kernel of `linattn.triton.gated_backward` writes. Their
references launch that kernel itself (for the tile exercises on a dA whose other tiles are zeroed,
so the kernel computes only the part asked for); the gate scan's reference is the two lines of
`_dqk_kernel` that form it, as a kernel of its own. Truths are float64 PyTorch. Cases are float32
and small (the Triton interpreter on a CPU). The whole backward unlocks impl="mine" for GLA's
gradients: `linattn.gla(..., impl="mine")` then differentiates through the reader's backward.
"""
from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from ... import decay, outputs, testing
from ... import triton as lt
from ...chunk import gla_backward as chunk_gla_backward
from ...triton import gated, gated_backward as gb
from ...triton.common import block, compute_dtype
from ..exercise import Case, Exercise
from .ch12 import (OFF_BY_ONE_CHUNK, OVERFLOW, PREFIX_CHUNK, SIGN, _setting,  # the classic mistakes
                   autograd_backward)

F32, F64 = torch.float32, torch.float64
CHUNK, SUB = 32, 16
GRAD_TOL = 1e-4


def _nt(T, C):
    return -(-T // C)


def _chunk_of(T, C, device="cpu"):
    """Chunk index and position inside the chunk of every token."""
    t = torch.arange(T, device=device)
    return t // C, t % C


# ---------------------------------------------------------------- ch13.dstates
def reverse_state_pass(q, do, b, dfinal_state, *, scale, chunk_size=CHUNK):
    """The library's `_dstates_kernel`: dh [B, H, NT, K, V] (the gradient of the state after each
    chunk) and dinitial_state [B, H, K, V], both float32."""
    return gb.reverse_pass(q, do, b, dfinal_state, gate=gated.DIM_GATE, scale=scale, chunk_size=chunk_size,
                           dh_dtype=F32)


def _dstates(q, do, b, dfinal_state, scale, C, *, reverse=True, decay=True, store_after=False,
             final=True, decay_queries=True):
    """The reverse pass in PyTorch; the keywords switch one step off (the known mistakes)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    NT = _nt(T, C)
    acc = F64 if q.dtype == F64 else F32
    q, do, b = q.to(acc), do.to(acc), b.to(acc)
    D = torch.zeros(B, H, K, V, dtype=acc)
    if final and dfinal_state is not None:
        D = D + dfinal_state.to(acc)
    dh = torch.zeros(B, H, NT, K, V, dtype=acc)
    for n in (reversed(range(NT)) if reverse else range(NT)):
        sl = slice(n * C, min((n + 1) * C, T))
        qd = q[:, sl] * b[:, sl].exp() if decay_queries else q[:, sl]        # [B, c, H, K]
        if not store_after:
            dh[:, :, n] = D
        if decay:
            D = b[:, sl.stop - 1].exp()[..., None] * D                       # diag(e^{b_C}) D
        D = D + scale * torch.einsum("bthk,bthv->bhkv", qd, do[:, sl])
        if store_after:
            dh[:, :, n] = D
    return dh, D


def dstates_truth(q, do, b, dfinal_state, *, scale, chunk_size=CHUNK):
    """dh[n] = D, the gradient of the state after chunk n; then, walking to the previous chunk,
    D ← diag(e^{b_C}) D + scale · (Q_[n] ⊙ e^{G_[n]})ᵀ dO_[n]. Starts from dfinal_state (zeros
    if None); what is left after chunk 0 is dinitial_state."""
    return _dstates(q, do, b, dfinal_state, scale, chunk_size)


def _dstates_mistake(**switch):
    def mistake(q, do, b, dfinal_state, *, scale, chunk_size=CHUNK):
        return _dstates(q, do, b, dfinal_state, scale, chunk_size, **switch)
    return mistake


DSTATES_MISTAKES = (
    ("walk the chunks from first to last: the state gradient flows backwards in time, from the "
     "final state's gradient to the first chunk", _dstates_mistake(reverse=False)),
    ("leave out the decay diag(e^{b_C}) of the state gradient between chunks",
     _dstates_mistake(decay=False)),
    ("store D after adding the chunk's own queries: dh[n] is the gradient of the state *after* "
     "chunk n, which chunk n's outputs do not read", _dstates_mistake(store_after=True)),
    ("start from zeros instead of the final state's gradient dfinal_state",
     _dstates_mistake(final=False)),
    ("use the queries without their decay e^{b_t} from the chunk start",
     _dstates_mistake(decay_queries=False)),
)


def _grads_inputs(seed, i, B, T, H, K, V, strength):
    gen = torch.Generator().manual_seed(seed * 37 + i)
    q = torch.randn(B, T, H, K, generator=gen) / K ** 0.25
    k = torch.randn(B, T, H, K, generator=gen) / K ** 0.25
    g = testing.log_gates((B, T, H, K), strength, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    return gen, q, k, g, do


# (B, T, H, K, V, strength): normal gates first, so a known mistake is told apart on the first case
STATE_SHAPES = [(1, 45, 2, 16, 16, "normal"), (2, 70, 1, 32, 24, "strong"), (1, 20, 1, 16, 40, "weak")]


def dstates_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (B, T, H, K, V, strength) in enumerate(STATE_SHAPES):
        T = max(1, T + rng.randint(-3, 3))
        gen, q, _, g, do = _grads_inputs(seed, i, B, T, H, K, V, strength)
        b = decay.chunk_local_prefix(g, CHUNK).contiguous()   # torch: cases are made on the CPU, graded anywhere
        dsT = torch.randn(B, H, K, V, generator=gen)
        scale = K ** -0.5 if i != 1 else 0.5
        cases.append(Case(args=(q, do, b, dsT), kwargs={"scale": scale, "chunk_size": CHUNK}, dtype=F32,
                          note=f"B={B} T={T} H={H} K={K} V={V}, {strength} gates, scale={scale:.3g}"))
    return cases


# ---------------------------------------------------------------- ch13.offdiag_dq, ch13.diag_dk
def _blocks(T, C, c):
    """[T, C] masks over dA's entries (row t, column j of t's chunk): the lower triangle, and
    whether row and column share a sub-chunk."""
    n, pos = _chunk_of(T, C)
    j = torch.arange(C)
    col = n[:, None] * C + j[None, :]                                # the column's token
    lower = (j[None, :] <= pos[:, None]) & (col < T)
    same = (j[None, :] // c) == (pos[:, None] // c)
    return lower, same


def _intra(q, k, g, dA, C, c, keep_diag):
    """The library's `_intra_grad_kernel` on dA with only the diagonal (keep_diag) or only the
    off-diagonal sub-chunk tiles kept: (dq_intra, dk_intra) of those tiles, float32."""
    B, T, H, K = q.shape
    _, same = _blocks(T, C, c)
    keep = same if keep_diag else ~same
    dA = torch.where(keep[None, :, None, :].to(dA.device), dA, 0.0).to(F32).contiguous()
    q, k, g = (x.contiguous() for x in (q, k, g))
    b = gated.gate_sums(g, C)
    dqi = outputs.empty((B, T, H, K), dtype=F32, device=q.device)
    dki = outputs.empty((B, T, H, K), dtype=F32, device=q.device)
    BK = min(block(K), gb.GRAD_BLOCK)
    COMPUTE = compute_dtype(q.dtype)
    gb._intra_grad_kernel[(triton.cdiv(K, BK), _nt(T, C) * (C // c), B * H)](
        q, k, g, b, dA, dqi, dki, T, H, K, C=C, c=c, BK=BK, GATE=gated.DIM_GATE, COMPUTE=COMPUTE,
        IEEE=COMPUTE == tl.float32)
    return dqi, dki


def offdiag_dq(q, k, b, dA, *, chunk_size=CHUNK, sub_chunk_size=SUB):
    """The library's off-diagonal dq tiles: dq_t = Σ_{s in earlier sub-chunks} dA_ts k_s ⊙ e^{b_t − b_s}."""
    g = _gates_from(b, chunk_size)
    return _intra(q, k, g, dA, chunk_size, sub_chunk_size, keep_diag=False)[0]


def _gates_from(b, C):
    """The raw log-gates whose chunk-local cumulative sums are b."""
    B, T, H, K = b.shape
    g = b.clone()
    n, pos = _chunk_of(T, C, b.device)
    prev = torch.cat([torch.zeros_like(b[:, :1]), b[:, :-1]], dim=1)
    return torch.where((pos > 0)[None, :, None, None], b - prev, g)


def _decay_sum(x, y, b, dA, keep, transpose, b_col=None):
    """Σ over the kept entries of dA (row t, column s): dA_ts y_s ⊙ e^{b_t − b_s} into row t, or
    (transpose) dA_ts x_t ⊙ e^{b_t − b_s} into row s; exponents masked with -inf before exp."""
    B, T, H, K = x.shape
    C = dA.shape[-1]
    n, _ = _chunk_of(T, C)
    cols = n[:, None] * C + torch.arange(C)[None, :]                  # [T, C] token of each column
    valid = keep & (cols < T)
    cols = cols.clamp(max=T - 1)
    bs = (b if b_col is None else b_col)[:, cols]                     # [B, T, C, H, K]
    diff = (b[:, :, None] - bs).masked_fill(~valid[None, :, :, None, None], float("-inf"))
    w = dA.permute(0, 1, 3, 2)[..., None] * diff.exp()                # [B, T, C, H, K]
    if not transpose:
        return (w * y[:, cols]).sum(2)
    out = torch.zeros_like(x)
    out.index_add_(1, cols.flatten(), (w * x[:, :, None]).flatten(1, 2))
    return out


def offdiag_truth(q, k, b, dA, *, chunk_size=CHUNK, sub_chunk_size=SUB):
    """dq_t = Σ_s dA_ts k_s ⊙ e^{b_t − b_s} over the keys s of the same chunk in *earlier*
    sub-chunks (tiles j < i); the diagonal tiles are the next exercise's."""
    T = q.shape[1]
    lower, same = _blocks(T, chunk_size, sub_chunk_size)
    return _decay_sum(q, k, b, dA, lower & ~same, transpose=False)


def _offdiag_chunk_start(q, k, b, dA, *, chunk_size=CHUNK, sub_chunk_size=SUB):
    T = q.shape[1]
    lower, same = _blocks(T, chunk_size, sub_chunk_size)
    n, _ = _chunk_of(T, chunk_size)
    cols = (n[:, None] * chunk_size + torch.arange(chunk_size)[None, :]).clamp(max=T - 1)
    kk = (k.float() * (-b).exp())[:, cols]                            # e^{−b_s}: overflows
    terms = dA.float().permute(0, 1, 3, 2)[..., None] * kk            # [B, T, C, H, K]
    terms = torch.where((lower & ~same)[None, :, :, None, None], terms, 0.0)
    return terms.sum(2) * b.exp()


def _offdiag_variant(diag=False, transposed=False):
    def mistake(q, k, b, dA, *, chunk_size=CHUNK, sub_chunk_size=SUB):
        T = q.shape[1]
        lower, same = _blocks(T, chunk_size, sub_chunk_size)
        keep = lower if diag else lower & ~same
        if transposed:        # read dA[s, t] (the entry of the key's row) instead of dA[t, s]
            dA = _transpose_in_chunks(dA, chunk_size)
        return _decay_sum(q.float(), k.float(), b.float(), dA.float(), keep, transpose=False)
    return mistake


def _transpose_in_chunks(dA, C):
    B, T, H, _ = dA.shape
    NT = _nt(T, C)
    full = torch.zeros(B, NT * C, H, C, dtype=dA.dtype)
    full[:, :T] = dA
    full = full.view(B, NT, C, H, C).transpose(2, 4)
    return full.reshape(B, NT * C, H, C)[:, :T]


OFFDIAG_MISTAKES = (
    ("absorb the decay relative to the chunk start (k ⊙ e^{−b_s} and e^{b_t}): e^{−b} overflows "
     "float32 under strong gates; split at r = b just before the query's sub-chunk",
     _offdiag_chunk_start),
    ("include the diagonal sub-chunk tile (j ≤ i): its entries belong to the float32 column walk, "
     "not to the matmul tiles", _offdiag_variant(diag=True)),
    ("read dA transposed (dA[s, t] for query t, key s)", _offdiag_variant(transposed=True)),
)


def diag_dk(q, g, dA, *, chunk_size=CHUNK, sub_chunk_size=SUB):
    """The library's diagonal dk tiles (its row walk)."""
    return _intra(q, q, g, dA, chunk_size, sub_chunk_size, keep_diag=True)[1]


def diag_dk_truth(q, g, dA, *, chunk_size=CHUNK, sub_chunk_size=SUB):
    """dk_s = Σ_t dA_ts q_t ⊙ e^{b_t − b_s} over the queries t ≥ s (s itself included) of the
    same sub-chunk; b the chunk-local cumulative sum of g."""
    T = q.shape[1]
    lower, same = _blocks(T, chunk_size, sub_chunk_size)
    b = decay.chunk_local_prefix(g, chunk_size)
    return _decay_sum(q, q, b, dA, lower & same, transpose=True)


def _diag_dk_variant(strict=False, own_gate=False, no_decay=False):
    def mistake(q, g, dA, *, chunk_size=CHUNK, sub_chunk_size=SUB):
        q, g, dA = q.float(), g.float(), dA.float()
        T = q.shape[1]
        lower, same = _blocks(T, chunk_size, sub_chunk_size)
        if strict:
            _, pos = _chunk_of(T, chunk_size)
            lower = lower & (torch.arange(chunk_size)[None, :] != pos[:, None])
        b = torch.zeros_like(g) if no_decay else decay.chunk_local_prefix(g, chunk_size)
        # own_gate: e^{b_t − b_s + g_s} = e^{b_t − b_{s−1}}, the column's own gate walked in too
        return _decay_sum(q, q, b, dA, lower & same, transpose=True, b_col=b - g if own_gate else None)
    return mistake


DIAG_DK_MISTAKES = (
    ("walk the rows with a strict triangle (t > s): each key misses its own query's dA_ss q_s",
     _diag_dk_variant(strict=True)),
    ("start the decay of column s with its own gate (e^{b_t − b_{s−1}}, an inclusive prefix): "
     "F_t[s] = 1 at t = s, and only later rows multiply in their gates e^{g_t}",
     _diag_dk_variant(own_gate=True)),
    ("leave out the decay e^{b_t − b_s} inside the tile", _diag_dk_variant(no_decay=True)),
)

# (B, T, H, K, strength): C = 32 with sub-chunks of 16; lengths not multiples of either
TILE_SHAPES = [(1, 45, 2, 16, "normal"), (2, 37, 1, 32, "strong"), (1, 20, 1, 24, "weak")]


def _dA(gen, B, T, H, C):
    lower, _ = _blocks(T, C, SUB)
    return torch.where(lower[None, :, None, :], torch.randn(B, T, H, C, generator=gen), 0.0)


def offdiag_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (B, T, H, K, strength) in enumerate(TILE_SHAPES):
        T = max(1, T + rng.randint(-3, 3))
        gen, q, k, g, _ = _grads_inputs(seed, i, B, T, H, K, 16, strength)
        b = decay.chunk_local_prefix(g, CHUNK).contiguous()   # torch: cases are made on the CPU, graded anywhere
        cases.append(Case(args=(q, k, b, _dA(gen, B, T, H, CHUNK)), dtype=F32,
                          kwargs={"chunk_size": CHUNK, "sub_chunk_size": SUB},
                          note=f"B={B} T={T} H={H} K={K}, {strength} gates"))
    return cases


def diag_dk_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (B, T, H, K, strength) in enumerate(TILE_SHAPES):
        T = max(1, T + rng.randint(-3, 3))
        gen, q, _, g, _ = _grads_inputs(seed, i + 10, B, T, H, K, 16, strength)
        cases.append(Case(args=(q, g, _dA(gen, B, T, H, CHUNK)), dtype=F32,
                          kwargs={"chunk_size": CHUNK, "sub_chunk_size": SUB},
                          note=f"B={B} T={T} H={H} K={K}, {strength} gates"))
    return cases


# ---------------------------------------------------------------- ch13.gate_scan
@triton.jit
def _gate_scan_kernel(db, w, carried, dg, T, H, K, NT, C: tl.constexpr, BK: tl.constexpr):
    # One program per (chunk, batch·head): the chunk-local gate gradient, as _dqk_kernel forms it
    # (a suffix sum of db, an exclusive prefix sum of the writes w, the chunk's carried decay).
    n, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = bh // H, bh % H
    rows = n * C + tl.arange(0, C)
    ks = tl.arange(0, BK)
    m = (rows < T)[:, None] & (ks < K)[None, :]
    p = ((i_b * T + rows) * H + i_h)[:, None] * K + ks[None, :]
    x = tl.load(db + p, mask=m, other=0.0)
    y = tl.load(w + p, mask=m, other=0.0)
    c = tl.load(carried + ((i_b * NT + n) * H + i_h) * K + ks, mask=ks < K, other=0.0)
    out = tl.cumsum(x, axis=0, reverse=True) + (tl.cumsum(y, axis=0) - y) + c[None, :]
    tl.store(dg + p, out, mask=m)


def gate_scan(db, w, carried, *, chunk_size=CHUNK):
    """dg [B, T, H, K] float32 from db, w [B, T, H, K] and carried [B, NT, H, K]."""
    B, T, H, K = db.shape
    NT = carried.shape[1]
    dg = outputs.empty((B, T, H, K), dtype=F32, device=db.device)
    db, w, carried = (x.to(F32).contiguous() for x in (db, w, carried))
    _gate_scan_kernel[(NT, B * H)](db, w, carried, dg, T, H, K, NT, C=chunk_size, BK=block(K, 16))
    return dg


def _scan(db, w, carried, C, *, across=False, inclusive=False, prefix=False, carry=True):
    B, T, H, K = db.shape
    NT = _nt(T, C)
    acc = F64 if db.dtype == F64 else F32
    pad = lambda x: torch.cat([x.to(acc), torch.zeros(B, NT * C - T, H, K, dtype=acc)], 1).view(B, NT, C, H, K)
    x, y = pad(db), pad(w)
    if across:                                           # the suffix runs on past the chunk's end
        s = x.flatten(1, 2).flip(1).cumsum(1).flip(1).view(B, NT, C, H, K)
    elif prefix:
        s = x.cumsum(2)
    else:
        s = x.flip(2).cumsum(2).flip(2)                  # Σ_{t ≥ u} inside the chunk
    wp = y.cumsum(2) if inclusive else y.cumsum(2) - y   # Σ_{j ≤ u} or Σ_{j < u}
    out = s + wp
    if carry:
        out = out + carried.to(acc)[:, :, None]
    return out.view(B, NT * C, H, K)[:, :T]


def gate_scan_truth(db, w, carried, *, chunk_size=CHUNK):
    """For token u of chunk n: dg_u = Σ_{t ≥ u} db_t + Σ_{j < u} w_j + carried[n], both sums
    over chunk n only (chapter 12's chunk-local form: db = q ⊙ dq − k ⊙ dk^intra, w = k ⊙ write,
    carried = e^{b_C} ⊙ Σ_ν S_[n−1] ⊙ dS_[n])."""
    return _scan(db, w, carried, chunk_size)


def _scan_mistake(**switch):
    def mistake(db, w, carried, *, chunk_size=CHUNK):
        return _scan(db, w, carried, chunk_size, **switch)
    return mistake


SCAN_MISTAKES = (
    ("run the suffix sum on to the end of the sequence: in the chunk-local form it stops at the "
     "chunk's end, where the carried term takes over", _scan_mistake(across=True)),
    ("include each token's own write (an inclusive prefix Σ_{j ≤ u}; the form needs Σ_{j < u})",
     _scan_mistake(inclusive=True)),
    ("sum db from the chunk start (a prefix) instead of from the chunk's end (a suffix)",
     _scan_mistake(prefix=True)),
    ("leave out the carried term e^{b_C} ⊙ Σ_ν S_[n−1] ⊙ dS_[n], which every token of the chunk gets",
     _scan_mistake(carry=False)),
)

SCAN_SHAPES = [(1, 45, 2, 16), (2, 70, 1, 24), (1, 9, 3, 16)]


def gate_scan_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (B, T, H, K) in enumerate(SCAN_SHAPES):
        T = max(1, T + rng.randint(-3, 3))
        gen = torch.Generator().manual_seed(seed * 41 + i)
        db, w = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
        carried = torch.randn(B, _nt(T, CHUNK), H, K, generator=gen)
        cases.append(Case(args=(db, w, carried), kwargs={"chunk_size": CHUNK}, dtype=F32,
                          note=f"B={B} T={T} H={H} K={K}"))
    return cases


# ---------------------------------------------------------------- ch13.gla_backward
def triton_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None,
                    chunk_size=CHUNK, sub_chunk_size=SUB):
    """The library's Triton backward (linattn.triton.gla's autograd.Function) as a tuple."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    S0 = None if initial_state is None else initial_state.detach().clone().requires_grad_()
    o, S = lt.gla(*leaves, scale=scale, initial_state=S0, output_final_state=True, chunk_size=chunk_size,
                  sub_chunk_size=sub_chunk_size)
    outs, douts = [o], [do]
    if dfinal_state is not None:
        outs.append(S)
        douts.append(dfinal_state)
    grads = torch.autograd.grad(outs, leaves + ([S0] if S0 is not None else []), douts)
    return tuple(grads[:4]) + (grads[4] if S0 is not None else None,)


# (B, T, H, K, V, dtype, gate, strength, initial_state, final-state gradient), float32 only
BACKWARD_SHAPES = [
    (1, 45, 2, 16, 16, F32, "per_dim", "normal", True, True),
    (2, 37, 1, 16, 24, F32, "per_dim", "strong", True, True),
    (1, 40, 2, 16, 16, F32, "per_head", "normal", False, True),
    (1, 9, 1, 16, 16, F32, "per_dim", "weak", True, False),
]


def backward_cases(seed):
    cases = []
    for i, shape in enumerate(BACKWARD_SHAPES):
        kw, note, dtype = _setting(seed, i, shape)
        kw.update(chunk_size=CHUNK, sub_chunk_size=SUB)
        if i == 1:
            kw["scale"] = 0.5
            note += ", scale=0.5"
        cases.append(Case(kwargs=kw, note=note, dtype=dtype))
    return cases


def _without_final_gradient(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None, **_):
    a = testing.to_float64(dict(q=q, k=k, v=v, g=g, do=do, initial_state=initial_state))
    grads = autograd_backward(**a, scale=scale)
    return tuple(None if x is None else x.float() for x in grads)


def _restarted_gate_gradient(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None,
                             chunk_size=CHUNK, **_):
    """Every gradient right but dg: q ⊙ dq − k ⊙ dk suffix-summed inside each chunk, with neither
    the writes' prefix nor the carried decay."""
    a = testing.to_float64(dict(q=q, k=k, v=v, g=g, do=do, initial_state=initial_state,
                                dfinal_state=dfinal_state))
    dq, dk, dv, _, ds0 = autograd_backward(**a, scale=scale)
    x = a["q"] * dq - a["k"] * dk
    dg = torch.cat([c.flip(1).cumsum(1).flip(1) for c in x.split(chunk_size, dim=1)], dim=1)
    if g.dim() == 3:
        dg = dg.sum(-1)
    return tuple(None if t is None else t.float() for t in (dq, dk, dv, dg, ds0))


BACKWARD_MISTAKES = (
    ("ignore dfinal_state: the reverse pass must start from the final state's gradient",
     _without_final_gradient),
    ("restart the gate gradient's suffix sum at every chunk without the writes' exclusive prefix "
     "and the carried decay (chapter 12's chunk-local form has all three)", _restarted_gate_gradient),
    # chapter 12's classic mistakes, modelled there from the float64 truth (chunk_size from the case)
    SIGN, PREFIX_CHUNK, OFF_BY_ONE_CHUNK, OVERFLOW,
)

GRADS = ("dq", "dk", "dv", "dg", "dinitial_state")

EXERCISES = [
    Exercise(
        name="ch13.dstates",
        chapter=13,
        on_gpu=True,
        title="The reverse pass over the state gradients",
        signature="reverse_state_pass(q, do, b, dfinal_state, *, scale, chunk_size=32) -> (dh, "
                  "dinitial_state)   # dh [B, H, NT, K, V] float32, dinitial_state [B, H, K, V] float32",
        reference=reverse_state_pass,
        truth=dstates_truth,
        spec=dstates_truth,
        cases=dstates_cases,
        outputs=("dh", "dinitial_state"),
        hint="one program per (K-block, V-block, batch·head); D = dfinal_state; for n = NT−1 … 0: "
             "store D as dh[n], then D ← e^{b_C} ⊙ D + scale · (Q ⊙ e^{b})ᵀ dO over the chunk's rows "
             "(b_C: b at the chunk's last row < T); store D as dinitial_state at the end.",
        diagnoses=DSTATES_MISTAKES,
    ),
    Exercise(
        name="ch13.offdiag_dq",
        chapter=13,
        on_gpu=True,
        title="An intra-chunk gradient tile: dq from the off-diagonal sub-chunk tiles",
        signature="offdiag_dq(q, k, b, dA, *, chunk_size=32, sub_chunk_size=16) -> dq   # dA [B, T, H, C] "
                  "float32; dq [B, T, H, K] float32",
        reference=offdiag_dq,
        truth=offdiag_truth,
        spec=offdiag_truth,
        cases=offdiag_cases,
        outputs=("dq",),
        hint="for the query sub-chunk i of a chunk, r = b just before it: dq_[i] = e^{G_[i] − r} ⊙ "
             "Σ_{j < i} dA_[i][j] (K_[j] ⊙ e^{r − G_[j]}); both exponents ≤ 0. dA[t, j] is column j "
             "of t's chunk. Sub-chunk 0 has no earlier tiles: zeros.",
        diagnoses=OFFDIAG_MISTAKES,
    ),
    Exercise(
        name="ch13.diag_dk",
        chapter=13,
        on_gpu=True,
        title="The dk row walk of the diagonal sub-chunk tiles",
        signature="diag_dk(q, g, dA, *, chunk_size=32, sub_chunk_size=16) -> dk   # g raw log-gates "
                  "[B, T, H, K]; dk [B, T, H, K] float32",
        reference=diag_dk,
        truth=diag_dk_truth,
        spec=diag_dk_truth,
        cases=diag_dk_cases,
        outputs=("dk",),
        hint="per sub-chunk: F = 0 [c, BK]; for t = 0 … c−1: F ← where(row == t, 1, F ⊙ e^{g_t}) "
             "(F[s] = e^{b_t − b_s} for s ≤ t), then dk += dA[t, sub-chunk] ⊗ q_t ⊙ F, a rank-one "
             "tile; rows past T load g = 0, q = 0.",
        diagnoses=DIAG_DK_MISTAKES,
    ),
    Exercise(
        name="ch13.gate_scan",
        chapter=13,
        on_gpu=True,
        title="The gate gradient's chunk-local scan",
        signature="gate_scan(db, w, carried, *, chunk_size=32) -> dg   # db, w [B, T, H, K], carried "
                  "[B, NT, H, K]; dg [B, T, H, K] float32",
        reference=gate_scan,
        truth=gate_scan_truth,
        spec=gate_scan_truth,
        cases=gate_scan_cases,
        outputs=("dg",),
        hint="per chunk: tl.cumsum(db, axis=0, reverse=True) + (tl.cumsum(w, axis=0) − w) + "
             "carried[n]; rows past T load zeros and are not stored.",
        diagnoses=SCAN_MISTAKES,
    ),
    Exercise(
        name="ch13.gla_backward",
        chapter=13,
        on_gpu=True,
        title="The whole GLA backward in Triton",
        signature="gla_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None, "
                  "chunk_size=32, sub_chunk_size=16) -> (dq, dk, dv, dg, dinitial_state)",
        reference=triton_backward,
        truth=autograd_backward,
        spec=chunk_gla_backward.gradients,          # the chunk level's algorithm, step by step
        cases=backward_cases,
        tol=GRAD_TOL,
        unlocks=("gla", "triton", "backward"),
        outputs=GRADS,
        hint="states S_[n−1] (chapter 10's state pass); your reverse pass from dfinal_state; dA = "
             "scale · tril(dO Vᵀ) per chunk; intra dq, dk from your tiles and walks; dv = (K ⊙ e^{b_C − "
             "G}) dS_[n] + Σ_t A_tj dO_t; state parts of dq, dk; dg by your scan. Per-head g [B,T,H]: "
             "expand to [B,T,H,K], sum dg over K. dinitial_state None without initial_state.",
        diagnoses=BACKWARD_MISTAKES,
    ),
]
