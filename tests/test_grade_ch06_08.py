"""Graders of chapters 06–08: the references pass, and the usual mistakes are rejected.

Each mistake is a small, otherwise correct implementation with one bug switched on (`bug=`); the
bug-free version passes too, so a rejection is caused by the bug alone. Every mutant must fail for
several seeds, since a reader gets a fresh seed at every check.
"""
from functools import partial
from pathlib import Path

import pytest
import torch

from linattn import outputs
from linattn.chunk.delta import decayed_scores, from_chunks, to_chunks
from linattn.decay import key_decay, query_decay, total_decay
from linattn.grade import check, reference, workbook

SEEDS = (0, 1, 2)
ROOT = Path(__file__).resolve().parent.parent


def graded(name, fn, seeds=SEEDS):
    return [check(name, fn, seed=s, record=False, quiet=True).passed for s in seeds]


def verdicts(name, fn, bug):
    """A mutant must fail for every seed; the bug-free version must pass (one seed is enough
    here: test_reference_passes and the solved workbook cover more)."""
    return graded(name, fn, SEEDS if bug else SEEDS[:1])


# ---------------------------------------------------------------- chapter 06: recurrences

def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              bug=None):
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    S = torch.zeros(B, H, K, v.shape[-1], dtype=acc)
    if initial_state is not None:
        S = initial_state.to(acc).clone()
    q, k, v_, beta = (x.to(acc) for x in (q, k, v, beta))
    if g is not None:
        g = g.to(acc)
        g = g[..., None] if g.dim() == 3 else g
    o = outputs.empty((B, T, H, v.shape[-1]), dtype=acc, device=q.device)
    for t in range(T):
        before = S
        D = g[:, t, :, :, None].exp() if g is not None else 1.0
        b = beta[:, t, :, None, None] if bug != "no beta" else 1.0
        if bug == "decay after the residual":
            r = v_[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)   # reads the undecayed state
            S = D * S + b * k[:, t, :, :, None] * r[:, :, None, :]
        elif bug == "decay after the write":
            r = v_[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
            S = D * (S + b * k[:, t, :, :, None] * r[:, :, None, :])
        else:
            S = D * S
            r = v_[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
            if bug == "plain linear attention write":
                r = v_[:, t]
            S = S + b * k[:, t, :, :, None] * r[:, :, None, :]
        src = before if bug == "reads the state before the update" else S
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], src)
    return o.to(v.dtype), (S if output_final_state else None)


def recurrent_delta(q, k, v, beta, **kw):
    return recurrent(q, k, v, None, beta, **kw)


@pytest.mark.parametrize("bug", [None, "no beta", "plain linear attention write",
                                 "reads the state before the update"])
def test_delta_rule_recurrence(bug):
    results = verdicts("ch06.delta_rule", partial(recurrent_delta, bug=bug), bug)
    assert all(results) if bug is None else not any(results)


@pytest.mark.parametrize("bug", [None, "decay after the residual", "decay after the write", "no beta"])
def test_kda_recurrence(bug):
    results = verdicts("ch06.kda", partial(recurrent, bug=bug), bug)
    assert all(results) if bug is None else not any(results)


# ---------------------------------------------------------------- chapter 07: WY pieces

def inverse(A, bug=None):
    C = A.shape[-1]
    X = torch.eye(C, dtype=A.dtype).expand(A.shape).clone()
    if bug == "first-order Neumann (I − A)":
        return X - A
    for i in range(1, C):
        row = (A[..., i:i + 1, :i] @ X[..., :i, :i]).squeeze(-2)
        X[..., i, :i] = row if bug == "sign of the sum" else -row
    return X.transpose(-1, -2) if bug == "transposed" else X


@pytest.mark.parametrize("bug", [None, "first-order Neumann (I − A)", "sign of the sum", "transposed"])
def test_unit_lower_inverse(bug):
    results = verdicts("ch07.unit_lower_inverse", partial(inverse, bug=bug), bug)
    assert all(results) if bug is None else not any(results)


def wy(k, v, g, beta, bug=None):
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    k, v, g, beta = (x.to(acc) for x in (k, v, g, beta))
    C = k.shape[-2]
    G = g.cumsum(-2)
    E = (G[..., :, None, :] - G[..., None, :, :])                       # [.., C, C, K]
    keep = torch.ones(C, C, dtype=torch.bool).tril(0 if bug == "non-strict A" else -1)
    E = torch.where(keep[:, :, None], E, float("-inf")).exp()
    KK = torch.einsum("...ik,...ijk,...jk->...ij", k, E, k)
    b = beta[..., None]
    A = (b.transpose(-1, -2) if bug == "β on the wrong side (β_j)" else b) * KK
    eye = torch.eye(C, dtype=acc).expand(A.shape)
    X = torch.linalg.solve_triangular(eye + A, eye, upper=False)
    keys = k if bug == "undecayed keys in W" else k * G.exp()
    return X @ (b * v), X @ (b * keys)


WY_BUGS = ["non-strict A", "β on the wrong side (β_j)", "undecayed keys in W"]


@pytest.mark.parametrize("bug", [None] + WY_BUGS)
def test_wy_factors(bug):
    results = verdicts("ch07.wy_factors", partial(wy, bug=bug), bug)
    assert all(results) if bug is None else not any(results)


def chunk_map(k, v, g, beta, bug=None):
    wy_bug = "undecayed keys in W" if bug == "decay after the residual" else bug
    U, W = wy(k, v, g, beta, wy_bug if wy_bug in WY_BUGS else None)
    acc = U.dtype
    g = g.to(acc)
    Kdec = k.to(acc) * (key_decay(g) if bug != "keys not decayed to the chunk end" else 1.0)
    M = torch.diag_embed(total_decay(g)) - Kdec.transpose(-1, -2) @ W
    if bug == "bias and transition swapped in order":
        M = torch.diag_embed(total_decay(g)) - W.transpose(-1, -2) @ Kdec
    return M, Kdec.transpose(-1, -2) @ U


@pytest.mark.parametrize("bug", [None, "decay after the residual", "non-strict A",
                                 "β on the wrong side (β_j)", "keys not decayed to the chunk end",
                                 "bias and transition swapped in order"])
def test_chunk_map(bug):
    results = verdicts("ch07.chunk_map", partial(chunk_map, bug=bug), bug)
    assert all(results) if bug is None else not any(results)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              chunk_size=64, bug=None):
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    C = chunk_size
    qc, kc, vc = (to_chunks(x.to(acc), C) for x in (q, k, v))
    gc = to_chunks((g[..., None] if g.dim() == 3 else g).to(acc), C)
    bc = to_chunks(beta.to(acc)[..., None], C)[..., 0]
    U, W = wy(kc, vc, gc.expand(kc.shape), bc,
              "undecayed keys in W" if bug == "decay after the residual" else None)
    Aqk = decayed_scores(qc, kc, gc, strict=False)
    Qg, Kdec, last = qc * query_decay(gc), kc * key_decay(gc), total_decay(gc)[..., None]
    S = torch.zeros(B, H, K, v.shape[-1], dtype=acc) if initial_state is None else initial_state.to(acc)
    N = qc.shape[2] - (1 if bug == "drops the last partial chunk" and T % C else 0)
    o = torch.zeros(qc.shape[:4] + (v.shape[-1],), dtype=acc)
    for n in range(N):
        Vt = U[:, :, n] - W[:, :, n] @ S
        S_next = last[:, :, n] * S + Kdec[:, :, n].transpose(-1, -2) @ Vt
        S_read = S_next if bug == "reads the state after the chunk" else S
        o[:, :, n] = scale * (Qg[:, :, n] @ S_read + Aqk[:, :, n] @ Vt)
        S = S_next
    return from_chunks(o, T).to(v.dtype), (S if output_final_state else None)


@pytest.mark.parametrize("bug", [None, "decay after the residual", "drops the last partial chunk",
                                 "reads the state after the chunk"])
def test_chunk_kda(bug):
    results = verdicts("ch07.chunk_kda", partial(chunk_kda, bug=bug), bug)
    assert all(results) if bug is None else not any(results)


# ---------------------------------------------------------------- chapter 08: composition, scan

def compose(M2, B2, M1, B1, bug=None):
    if bug == "wrong order":
        return M1 @ M2, M1 @ B2 + B1
    if bug == "bias of the first map not carried":
        return M2 @ M1, B1 + B2
    return M2 @ M1, M2 @ B1 + B2


@pytest.mark.parametrize("bug", [None, "wrong order", "bias of the first map not carried"])
def test_compose(bug):
    results = verdicts("ch08.compose", partial(compose, bug=bug), bug)
    assert all(results) if bug is None else not any(results)


def scan(M, B, bug=None):
    N, step = M.shape[2], 1
    stop = N // 2 if bug == "one round too few" else N
    while step < stop:
        later, earlier = (M[:, :, step:], B[:, :, step:]), (M[:, :, :-step], B[:, :, :-step])
        m, b = compose(*(earlier + later) if bug == "later map applied first" else later + earlier)
        M, B = torch.cat([M[:, :, :step], m], 2), torch.cat([B[:, :, :step], b], 2)
        step *= 2
    if bug == "exclusive scan":
        eye = torch.eye(M.shape[-1], dtype=M.dtype).expand(M[:, :, :1].shape)
        M = torch.cat([eye, M[:, :, :-1]], 2)
        B = torch.cat([torch.zeros_like(B[:, :, :1]), B[:, :, :-1]], 2)
    return M, B


@pytest.mark.parametrize("bug", [None, "later map applied first", "exclusive scan", "one round too few"])
def test_prefix_scan(bug):
    results = verdicts("ch08.prefix_scan", partial(scan, bug=bug), bug)
    assert all(results) if bug is None else not any(results)


def rwkv7(w, kappa_hat, a, k, v, bug=None):
    """RWKV-7's per-token maps written independently of the catalog (bug=None passes)."""
    removed = kappa_hat if bug == "rate a dropped" else a * kappa_hat
    if bug == "seed's A_t not transposed":
        low_rank = kappa_hat[..., :, None] * removed[..., None, :]
    else:
        low_rank = removed[..., :, None] * kappa_hat[..., None, :]
    decay = torch.ones_like(w) if bug == "no decay" else w
    return torch.diag_embed(decay) - low_rank, k[..., :, None] * v[..., None, :]


@pytest.mark.parametrize("bug", [None, "seed's A_t not transposed", "rate a dropped", "no decay"])
def test_rwkv7_maps(bug):
    results = verdicts("ch08.rwkv7_maps", partial(rwkv7, bug=bug), bug)
    assert all(results) if bug is None else not any(results)
    if bug == "seed's A_t not transposed":
        r = check("ch08.rwkv7_maps", partial(rwkv7, bug=bug), seed=0, record=False, quiet=True)
        assert "diagnosis: your result matches what you get if you take seeds/004's A_t" in r.message


def test_rwkv7_maps_scan_to_the_token_loop():
    """The reference's maps, composed by the library's prefix scan, give the states of the token
    loop — and the transposed (seed-convention) maps do not."""
    from linattn import affine, testing
    from linattn.grade.catalog import ch08

    x = ch08.rwkv7_inputs(torch.Generator().manual_seed(0), 1, 2, 6, 5, 3, torch.float64)
    S0 = torch.randn(1, 2, 5, 3, dtype=torch.float64)
    loop = ch08.rwkv7_loop(*x, S0)
    errors = []
    for maps in (ch08.rwkv7_maps, ch08.rwkv7_maps_untransposed):
        M_pre, B_pre, _ = affine.prefix_scan(*maps(*x))
        errors.append(testing.rel_err(M_pre @ S0[:, :, None] + B_pre, loop))
    assert errors[0] < 1e-12 and errors[1] > 1e-2


# ---------------------------------------------------------------- references and stubs

NAMES = ["ch06.delta_rule", "ch06.kda", "ch07.unit_lower_inverse", "ch07.wy_factors",
         "ch07.chunk_map", "ch07.chunk_kda", "ch08.compose", "ch08.prefix_scan", "ch08.rwkv7_maps"]


@pytest.mark.parametrize("name", NAMES)
def test_reference_passes(name):
    assert all(graded(name, reference(name), SEEDS[1:2]))


@pytest.mark.parametrize("path", ["06_delta_rule.py", "07_wy_kda.py", "08_affine_scan.py"])
def test_stubs_fail_their_graders(path):
    nb = workbook.read(ROOT / "exercises" / path)
    cells = workbook.exercise_cells(nb)
    assert cells
    for cell, name, fn_name in cells:
        namespace = {}
        exec(cell.source, namespace)
        result = check(name, namespace[fn_name], seed=0, record=False, quiet=True)
        assert not result.passed and "not written yet" in result.message
