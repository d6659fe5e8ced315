"""Graders of chapter 16 (packed sequences): the references pass, and each planted mistake is named.

The functions below are a reader's solution of workbook 16, written from the chapter (plain torch
loops and einsums, and a Triton kernel of its own), not the catalog's code, each with one bug that
`bug=` (a constexpr BUG in the kernel) switches on; the bug-free version passes too, so a rejection
is caused by the bug alone. Every mutant must be rejected with its diagnosis for several seeds,
since a reader gets a fresh seed at every check.
"""
import pytest
import torch

import linattn  # before triton: without a GPU it switches Triton's interpreter on
from linattn.grade import reference
from planted import assert_named, verdicts

import triton  # noqa: E402
import triton.language as tl  # noqa: E402



@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_HOME", str(tmp_path))


# ---------------------------------------------------------------- a reader's solution, with bugs
def start(initial_state, n, H, K, V):
    return torch.zeros(H, K, V) if initial_state is None else initial_state[n].clone()


def packed_loop(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
                bug=None):
    _, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    c = cu_seqlens.tolist()
    N = len(c) - 1
    order = sorted(range(N), key=lambda n: c[n] - c[n + 1]) if bug == "longest first" else range(N)
    o = torch.zeros(1, T, H, V)
    finals, S = [], None
    for n in order:
        if not (bug == "carried" and S is not None):
            S = start(initial_state, n - 1 if bug == "previous" else n, H, K, V)
        for t in range(c[n], c[n + 1]):
            S = g[0, t, :, None, None].exp() * S + k[0, t, :, :, None] * v[0, t, :, None, :]
            o[0, t] = scale * (q[0, t, :, None, :] @ S)[:, 0]
        finals.append(S)
    return o, (torch.stack(finals) if output_final_state else None)


def chunk_step(S, q, k, v, g, scale):
    """One chunk of GLA with per-head gates: q, k [c, H, K], v [c, H, V], g [c, H]; S [H, K, V]."""
    b = g.cumsum(0)                                                    # [c, H]
    causal = torch.ones(len(g), len(g), dtype=torch.bool).tril()
    decay = (b[:, None] - b[None, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    P = torch.einsum("thk,shk->tsh", q, k) * decay
    o = scale * (torch.einsum("tsh,shv->thv", P, v)
                 + torch.einsum("thk,hkv->thv", q * b.exp()[..., None], S))
    total = b[-1]
    S = total.exp()[:, None, None] * S + torch.einsum("thk,thv->hkv", k * (total - b).exp()[..., None], v)
    return o, S


def packed_chunk(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
                 chunk_size=16, bug=None):
    _, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    c = cu_seqlens.tolist()
    N = len(c) - 1
    o = torch.zeros(1, T, H, V)
    finals = [start(initial_state, n, H, K, V) for n in range(N)]
    if bug == "straddle":                      # chunks of the row, reset where a sequence starts on one
        S = None
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            first = [n for n in range(N) if c[n] == s < c[n + 1]]
            if first:
                S = start(initial_state, first[0], H, K, V)
            o[0, s:e], S = chunk_step(S, q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], scale)
            for n in range(N):
                if c[n] < c[n + 1] and s < c[n + 1] <= e:
                    finals[n] = S
    else:
        for n in range(N):
            end = min(c[n + 1] + 1, T) if bug == "end included" else c[n + 1]
            S = finals[n]
            for s in range(c[n], end, chunk_size):
                e = min(s + chunk_size, end)
                o[0, s:e], S = chunk_step(S, q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], scale)
            finals[n] = S
    return o, (torch.stack(finals) if output_final_state else None)


@triton.jit
def states_kernel(k, v, g, h0, out, cu, T, H, K, V, max_chunks, C: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, BUG: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    bos = tl.load(cu + n)
    eos = tl.load(cu + n + 1)
    i, j = tl.arange(0, BK), tl.arange(0, BV)
    sm = (i[:, None] < K) & (j[None, :] < V)
    off = (n * H + h) * K * V + i[:, None] * V + j[None, :]
    S = tl.load(h0 + off, mask=sm, other=0.0)
    if BUG == 3:                                   # 3: the initial state never loaded
        S = tl.zeros([BK, BV], dtype=tl.float32)
    stop = eos
    if BUG == 1:                                   # 1: masked at the row's end only
        stop = T
    nchunks = tl.cdiv(eos - bos, C)
    if BUG == 2:                                   # 2: as many chunks as the longest, masked at T
        nchunks = max_chunks
        stop = T
    for c in range(0, nchunks):
        t = bos + c * C + tl.arange(0, C)
        ok = t < stop
        kt = tl.load(k + t[:, None] * H * K + h * K + i[None, :], mask=ok[:, None] & (i[None, :] < K),
                     other=0.0).to(tl.float32)
        vt = tl.load(v + t[:, None] * H * V + h * V + j[None, :], mask=ok[:, None] & (j[None, :] < V),
                     other=0.0).to(tl.float32)
        gt = tl.load(g + t * H + h, mask=ok, other=0.0)
        cum = tl.cumsum(gt, axis=0)
        last = tl.sum(gt, axis=0)
        S = tl.exp(last) * S + tl.dot(tl.trans(kt * tl.exp(last - cum)[:, None]), vt,
                                      input_precision="ieee")
    tl.store(out + off, S, mask=sm)


def make_states(bug):
    def packed_states(k, v, g, cu_seqlens, initial_state, chunk_size=16):
        _, T, H, K = k.shape
        V = v.shape[-1]
        N = len(cu_seqlens) - 1
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out = torch.empty(N, H, K, V, device=k.device)
        blk = lambda d: max(16, triton.next_power_of_2(d))  # noqa: E731
        states_kernel[(N, H)](k, v, g, initial_state, out, cu_seqlens, T, H, K, V,
                              triton.cdiv(longest, chunk_size), C=chunk_size, BK=blk(K), BV=blk(V),
                              BUG=bug)
        return out
    return packed_states


# ---------------------------------------------------------------- the tests
@pytest.mark.parametrize("name,fn", [("ch16.packed_loop", packed_loop),
                                     ("ch16.packed_chunk", packed_chunk),
                                     ("ch16.packed_states", make_states(0))])
def test_the_bug_free_solution_passes(name, fn):
    results = verdicts(name, fn)
    assert all(r.passed for r in results), [r.message for r in results]


@pytest.mark.parametrize("name", ["ch16.packed_loop", "ch16.packed_chunk", "ch16.packed_states"])
def test_the_reference_passes(name):
    assert all(r.passed for r in verdicts(name, reference(name), seeds=(0,)))


@pytest.mark.parametrize("bug,diagnosis", [
    ("carried", "carry the state across a boundary"),
    ("previous", "start sequence n from initial_state[n − 1]"),
    ("longest first", "stack the final states in the order you processed"),
])
def test_packed_loop_mistakes_are_named(bug, diagnosis):
    assert_named("ch16.packed_loop", lambda *a, **kw: packed_loop(*a, **kw, bug=bug), diagnosis)


@pytest.mark.parametrize("bug,diagnosis", [
    ("straddle", "a chunk that straddles a boundary"),
    ("end included", "with the end included (one token too many)"),
])
def test_packed_chunk_mistakes_are_named(bug, diagnosis):
    assert_named("ch16.packed_chunk", lambda *a, **kw: packed_chunk(*a, **kw, bug=bug), diagnosis)


@pytest.mark.parametrize("bug,diagnosis", [
    (1, "mask the last chunk at the row's end T"),
    (2, "loop over as many chunks as the longest sequence has"),
    (3, "start S at zeros"),
])
def test_packed_states_mistakes_are_named(bug, diagnosis):
    assert_named("ch16.packed_states", make_states(bug), diagnosis)
