"""Graders of chapters 03–05: the references pass, and the usual mistakes are rejected.

Each mistake is a small, otherwise correct implementation with one bug switched on (`bug=`). The
bug-free version of every implementation passes too, so a rejection is caused by the bug alone,
and every mutant must fail for several seeds (a reader gets a fresh seed at every check).
"""
from functools import partial

import pytest
import torch

from linattn import outputs
from linattn.grade import catalog, check, reference

SEEDS = (0, 1, 2)
NEG_INF = float("-inf")


def causal(n, diagonal=0):
    return torch.ones(n, n, dtype=torch.bool).tril(diagonal)


# ---------------------------------------------------------------- ch03.decay_mask
def decay_mask(g, *, bug=None):
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    g = g.to(acc)
    L = g.shape[-1]
    b = g.cumsum(-1)
    if bug == "cumulative products divided":
        a = g.exp().cumprod(-1)                                       # underflows to 0
        return (a[..., :, None] / a[..., None, :]) * causal(L)
    diff = b[..., :, None] - b[..., None, :]
    if bug == "counts the key's own gate":
        diff = diff + g[..., None, :]
    if bug == "mask applied after exp":
        return diff.exp() * causal(L)                                  # inf · 0 = NaN
    mask = causal(L, -1) if bug == "strict mask (no diagonal)" else causal(L)
    return diff.masked_fill(~mask, NEG_INF).exp()


# ------------------------------------------------ ch03.scalar_chunkwise, ch04.chunkwise
def chunkwise(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
              chunk_size=64, bug=None):
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    S = torch.zeros(B, H, K, v.shape[-1], dtype=acc)
    if initial_state is not None and bug != "ignores initial_state":
        S = initial_state.to(acc).clone()
    q, k, v_ = (x.to(acc).transpose(1, 2) for x in (q, k, v))       # [B, H, T, *]
    g = (g[..., None] if g.dim() == 3 else g).to(acc).transpose(1, 2)  # [B, H, T, K or 1]
    o = outputs.empty((B, H, T, v.shape[-1]), dtype=acc, device=q.device)
    C = chunk_size
    last = T - C + 1 if bug == "drops the last partial chunk" else T
    for s in range(0, max(last, 0), C):
        e = min(s + C, T)
        qc, kc, vc, b = q[:, :, s:e], k[:, :, s:e], v_[:, :, s:e], g[:, :, s:e].cumsum(2)
        lam, gam, tot = b.exp(), (b[:, :, -1:] - b).exp(), b[:, :, -1].exp()  # Λ, Γ, γ
        if bug == "Λ and Γ swapped":
            lam, gam = gam, lam
        if bug == "Λ measured from the chunk end":
            lam = (b - b[:, :, -1:]).exp()
        if bug == "intra decay absorbed relative to the chunk start":
            P = (qc * b.exp()) @ (kc * (-b).exp()).transpose(-1, -2) * causal(e - s)
        else:
            diff = b[:, :, :, None, :] - b[:, :, None, :, :]           # [B, H, c, c, K]
            if bug == "decay counts the key's own gate":
                diff = diff + g[:, :, s:e][:, :, None, :, :]
            w = diff.masked_fill(~causal(e - s)[:, :, None], NEG_INF).exp()
            P = torch.einsum("bhik,bhjk,bhijk->bhij", qc, kc, w)
        S_new = (S if bug == "no total decay in the state update" else tot[..., None] * S) \
            + (kc * gam).transpose(-1, -2) @ vc
        inter = (qc * lam) @ (S_new if bug == "reads the state after the chunk's update" else S)
        o[:, :, s:e] = scale * (inter + P @ vc)
        S = S_new
    return o.transpose(1, 2).to(v.dtype), (S if output_final_state else None)


# ---------------------------------------------------------------- ch04.recurrent
def recurrent(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, bug=None):
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    S = torch.zeros(B, H, K, v.shape[-1], dtype=acc)
    if initial_state is not None:
        S = initial_state.to(acc).clone()
    q, k, v_ = (x.to(acc) for x in (q, k, v))
    a = (g[..., None] if g.dim() == 3 else g).to(acc).exp()          # [B, T, H, K or 1]
    o = outputs.empty((B, T, H, v.shape[-1]), dtype=acc, device=q.device)
    for t in range(T):
        kv = k[:, t, :, :, None] * v_[:, t, :, None, :]
        if bug == "decays after adding k_tᵀ v_t":
            S = a[:, t, :, :, None] * (S + kv)
        elif bug == "decays the previous step's gate":
            S = (a[:, t - 1, :, :, None] if t else 1.0) * S + kv
        else:
            S = a[:, t, :, :, None] * S + kv
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o.to(v.dtype), (S if output_final_state else None)


# ---------------------------------------------------------------- ch05.intra_matrix
def intra_matrix(q, k, g, *, sub_chunk_size=16, bug=None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, g = q.to(acc), k.to(acc), g.to(acc)
    C, c = q.shape[-2], sub_chunk_size
    b = g.cumsum(-2)                                                  # [..., C, K] from the chunk start
    P = torch.zeros(*q.shape[:-1], C, dtype=acc)
    for i in range(C // c):
        r = i * c
        rows = slice(r, r + c)
        ref = b[..., r - 1:r, :] if r else torch.zeros_like(b[..., :1, :])  # b_{r−1}
        if bug == "absorbs relative to the chunk start":
            ref = torch.zeros_like(ref)
        for j in range(i):
            cols = slice(j * c, j * c + c)
            jref = b[..., j * c - 1:j * c, :] if j else torch.zeros_like(ref)
            rr = jref if bug == "absorbs relative to the key sub-chunk start" else ref
            qa = q[..., rows, :] * (b[..., rows, :] - rr).exp()
            ka = k[..., cols, :] * (rr - b[..., cols, :]).exp()
            P[..., rows, cols] = qa @ ka.transpose(-1, -2)
        bi = b[..., rows, :]
        if bug == "diagonal tiles by absorption":
            tile = (q[..., rows, :] * (bi - ref).exp()) @ (k[..., rows, :] * (ref - bi).exp()).transpose(-1, -2)
            P[..., rows, rows] = tile * causal(c)
            continue
        diff = bi[..., :, None, :] - bi[..., None, :, :]               # [..., c, c, K]
        mask = torch.ones(c, c, dtype=torch.bool) if bug == "diagonal tiles unmasked" else causal(c)
        w = diff.masked_fill(~mask[:, :, None], NEG_INF).exp()
        P[..., rows, rows] = torch.einsum("...ik,...jk,...ijk->...ij", q[..., rows, :], k[..., rows, :], w)
    return P


CHUNK_BUGS = ["Λ and Γ swapped", "Λ measured from the chunk end",
              "intra decay absorbed relative to the chunk start", "decay counts the key's own gate",
              "no total decay in the state update", "reads the state after the chunk's update",
              "drops the last partial chunk", "ignores initial_state"]
MUTANTS = {
    "ch03.decay_mask": (decay_mask, ["cumulative products divided", "counts the key's own gate",
                                     "mask applied after exp", "strict mask (no diagonal)"]),
    "ch03.scalar_chunkwise": (chunkwise, CHUNK_BUGS),
    "ch04.recurrent": (recurrent, ["decays after adding k_tᵀ v_t", "decays the previous step's gate"]),
    "ch04.chunkwise": (chunkwise, CHUNK_BUGS),
    "ch05.intra_matrix": (intra_matrix, ["absorbs relative to the chunk start",
                                         "absorbs relative to the key sub-chunk start",
                                         "diagonal tiles by absorption", "diagonal tiles unmasked"]),
}
CASES = [(name, bug) for name, (_, bugs) in MUTANTS.items() for bug in bugs]

# Mistakes that overflow under strong gates must be reported as NaN/inf, not as a mere error.
SYMPTOM = {
    "cumulative products divided": "NaN/inf",
    "mask applied after exp": "NaN/inf",
    "intra decay absorbed relative to the chunk start": "NaN/inf",
    "drops the last partial chunk": "NaN/inf",
    "absorbs relative to the chunk start": "NaN/inf",
    "absorbs relative to the key sub-chunk start": "NaN/inf",
    "diagonal tiles by absorption": "NaN/inf",
}


def grade(name, fn, seed):
    return check(name, fn, seed=seed, record=False, quiet=True)


@pytest.mark.parametrize("name", list(MUTANTS))
@pytest.mark.parametrize("seed", SEEDS)
def test_reference_passes(name, seed):
    r = grade(name, reference(name), seed)
    assert r.passed, r.message
    assert r.cases >= 5


@pytest.mark.parametrize("name", list(MUTANTS))
@pytest.mark.parametrize("seed", SEEDS)
def test_bug_free_versions_pass(name, seed):
    # Without this the mutants below could fail for a reason other than their bug.
    r = grade(name, MUTANTS[name][0], seed)
    assert r.passed, r.message


@pytest.mark.parametrize("name,bug", CASES, ids=[f"{n}:{b}" for n, b in CASES])
def test_mistake_is_rejected_with_a_useful_verdict(name, bug):
    fn = partial(MUTANTS[name][0], bug=bug)
    for seed in SEEDS:
        r = grade(name, fn, seed)
        assert not r.passed, f"{name} accepted the mistake {bug!r} (seed {seed})"
        expected = SYMPTOM.get(bug, "relative error")
        assert expected in r.message, r.message


@pytest.mark.parametrize("name", ["ch03.scalar_chunkwise", "ch04.recurrent", "ch04.chunkwise"])
def test_cases_cover_what_the_mutants_need(name):
    kws = [c.kwargs for c in catalog.get(name).cases(7)]
    assert any(kw.get("initial_state") is not None for kw in kws)
    assert any(kw["q"].dtype == torch.bfloat16 for kw in kws)
    assert any(kw.get("scale") is not None for kw in kws)
    assert any(not kw["output_final_state"] for kw in kws)
    assert any(kw["k"].shape[-1] != kw["v"].shape[-1] for kw in kws)
    assert any(kw["g"].min() < -15 and kw["q"].dtype == torch.float32 for kw in kws)  # strong
    per_dim = [kw["g"].dim() == 4 for kw in kws]
    assert all(not p for p in per_dim) if name.startswith("ch03") else (any(per_dim) and not all(per_dim))
    if "chunk_size" in kws[0]:
        C = kws[0]["chunk_size"]
        lengths = [kw["q"].shape[1] for kw in kws]
        assert any(T < C for T in lengths) and sum(T % C != 0 for T in lengths) >= len(lengths) - 1


def test_case_tolerance_follows_q_not_the_float32_gates():
    # g comes first in the kwargs and is float32; a bf16 case must still be graded at bf16.
    cases = catalog.get("ch04.chunkwise").cases(0)
    assert [c.dtype for c in cases] == [c.kwargs["q"].dtype for c in cases]


def test_passed_chunkwise_gla_runs_the_library(tmp_path, monkeypatch):
    """Unlocking: once ch04.chunkwise passes, linattn.gla(impl="auto") can run the reader's code."""
    import linattn
    from linattn import naive, testing

    monkeypatch.setenv("LINATTN_HOME", str(tmp_path))
    assert check("ch04.chunkwise", chunkwise, seed=0, quiet=True).passed
    args = testing.make_inputs("gla", B=1, T=40, H=2, K=8, V=8, seed=3)
    linattn.set_impl("gla", "mine")
    try:
        o, _ = linattn.gla(**args)
        assert "ch04.chunkwise" in linattn.which("gla")
    finally:
        linattn.set_impl("gla", "auto")
    assert testing.rel_err(o, naive.gla(**testing.to_float64(args))[0]) <= testing.tolerance(torch.float32)
