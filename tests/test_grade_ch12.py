"""Graders of chapter 12: the references pass, the bug-free mistakes' bases pass, and the planted
mistakes of a backward pass are rejected (gate-gradient sign, prefix instead of suffix sum, the
incoming final-state gradient ignored, no initial-state gradient, the last partial chunk dropped).
"""
from functools import partial

import pytest
import torch

from linattn import naive, testing
from linattn.grade import catalog, check, reference
from linattn.grade.catalog import ch12
from linattn.naive import backward

SEEDS = (0, 1, 2)
NEG_INF = float("-inf")


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _suffix(x, dim, bug):
    return x.cumsum(dim) if bug == "sums from the start (prefix) instead of from the end" \
        else x.flip(dim).cumsum(dim).flip(dim)


def _sign(bug):
    return -1.0 if bug == "flips the sign of the gate gradient" else 1.0


# ---------------------------------------------------------------- ch12.gate_grad
def gate_grad(q, k, dq, dk, g, *, final_state=None, dfinal_state=None, bug=None):
    acc = _acc(q)
    q, k, dq, dk = (x.to(acc) for x in (q, k, dq, dk))
    db = _sign(bug) * (q * dq - k * dk)                                # [B, T, H, K]
    if dfinal_state is not None and bug != "ignores the incoming final-state gradient":
        db[:, -1] += _sign(bug) * (final_state.to(acc) * dfinal_state.to(acc)).sum(-1)
    dg = _suffix(db, 1, bug)
    return (dg.sum(-1) if g.dim() == 3 else dg).to(g.dtype)


# ---------------------------------------------------------------- ch12.recurrent_backward
def recurrent(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None, bug=None):
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    acc = _acc(q)
    q_, k_, v_, do_ = (x.to(acc) for x in (q, k, v, do))
    a = (g[..., None] if g.dim() == 3 else g).to(acc).exp()          # [B, T, H, K or 1]
    S = [torch.zeros(B, H, K, v.shape[-1], dtype=acc) if initial_state is None
         else initial_state.to(acc)]
    for t in range(T):
        S.append(a[:, t, :, :, None] * S[-1] + k_[:, t, :, :, None] * v_[:, t, :, None, :])
    dS = torch.zeros_like(S[0])
    if dfinal_state is not None and bug != "ignores the incoming final-state gradient":
        dS = dfinal_state.to(acc)
    dq, dk, dv, dg = (torch.zeros_like(x) for x in (q_, k_, v_, q_))
    for t in reversed(range(T)):
        dS = dS + scale * q_[:, t, :, :, None] * do_[:, t, :, None, :]
        dq[:, t] = scale * torch.einsum("bhv,bhkv->bhk", do_[:, t], S[t + 1])
        dk[:, t] = torch.einsum("bhv,bhkv->bhk", v_[:, t], dS)
        dv[:, t] = torch.einsum("bhk,bhkv->bhv", k_[:, t], dS)
        dg[:, t] = _sign(bug) * (a[:, t, :, :, None] * S[t] * dS).sum(-1)
        dS = a[:, t, :, :, None] * dS
    dg = dg.sum(-1) if g.dim() == 3 else dg
    dS0 = None if initial_state is None or bug == "returns no initial-state gradient" \
        else dS.to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dS0


# ---------------------------------------------------------------- ch12.chunk_backward
def chunkwise(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None,
              chunk_size=64, bug=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    acc = _acc(q)
    qh, k_, v_, do_ = (x.to(acc).transpose(1, 2) for x in (q, k, v, do))  # [B, H, T, *]
    qh = qh * scale                                                   # Q̂
    gg = (g[..., None] if g.dim() == 3 else g).to(acc).transpose(1, 2)  # [B, H, T, K or 1]
    C = chunk_size
    stop = T - C + 1 if bug == "drops the last partial chunk" else T
    starts = list(range(0, max(stop, 0), C))
    S = torch.zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    Sin = []
    for s in starts:                                                  # the forward's chunk states
        b = gg[:, :, s:s + C].cumsum(2)
        Sin.append(S)
        S = b[:, :, -1, :, None].exp() * S + \
            (k_[:, :, s:s + C] * (b[:, :, -1:] - b).exp()).transpose(-1, -2) @ v_[:, :, s:s + C]
    Sin.append(S)
    dS = torch.zeros_like(S)
    if dfinal_state is not None and bug != "ignores the incoming final-state gradient":
        dS = dfinal_state.to(acc)
    dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(k_), torch.zeros_like(v_)
    dg = torch.zeros(B, H, T, K, dtype=acc)
    for n in reversed(range(len(starts))):
        sl = slice(starts[n], starts[n] + C)
        qc, kc, vc, doc = qh[:, :, sl], k_[:, :, sl], v_[:, :, sl], do_[:, :, sl]
        b = gg[:, :, sl].cumsum(2)                                    # [B, H, c, K or 1]
        L = qc.shape[2]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        W = (b[:, :, :, None] - b[:, :, None]).masked_fill(~causal[:, :, None], NEG_INF).exp()
        P = torch.einsum("bhik,bhjk,bhijk->bhij", qc, kc, W)
        dP = (doc @ vc.transpose(-1, -2)) * causal
        lam, gam = b.exp(), (b[:, :, -1:] - b).exp()                  # Λ, Γ
        dv[:, :, sl] = P.transpose(-1, -2) @ doc + (kc * gam) @ dS
        dqc = torch.einsum("bhij,bhjk,bhijk->bhik", dP, kc, W) + lam * (doc @ Sin[n].transpose(-1, -2))
        dkc = torch.einsum("bhij,bhik,bhijk->bhjk", dP, qc, W) + gam * (vc @ dS.transpose(-1, -2))
        db = _sign(bug) * (qc * dqc - kc * dkc)                       # [B, H, c, K]
        db[:, :, -1] += _sign(bug) * (Sin[n + 1] * dS).sum(-1)
        dg[:, :, sl] = _suffix(db, 2, bug)
        dq[:, :, sl], dk[:, :, sl] = dqc * scale, dkc
        dS = b[:, :, -1, :, None].exp() * dS + (qc * lam).transpose(-1, -2) @ doc
    dg = dg.sum(-1) if g.dim() == 3 else dg
    dS0 = None if initial_state is None or bug == "returns no initial-state gradient" \
        else dS.to(initial_state.dtype)
    back = [x.transpose(1, 2) for x in (dq, dk, dv, dg)]
    return (back[0].to(q.dtype), back[1].to(k.dtype), back[2].to(v.dtype), back[3].to(g.dtype), dS0)


SIGN, PREFIX = "flips the sign of the gate gradient", "sums from the start (prefix) instead of from the end"
FINAL, INIT = "ignores the incoming final-state gradient", "returns no initial-state gradient"
DROPPED = "drops the last partial chunk"
MUTANTS = {
    "ch12.gate_grad": (gate_grad, [SIGN, PREFIX, FINAL]),
    "ch12.recurrent_backward": (recurrent, [SIGN, FINAL, INIT]),
    "ch12.chunk_backward": (chunkwise, [SIGN, PREFIX, FINAL, INIT, DROPPED]),
}
CASES = [(name, bug) for name, (_, bugs) in MUTANTS.items() for bug in bugs]
# What the verdict says: a missing gradient is named as such, not as a numeric error.
SYMPTOM = {INIT: "should be a tensor"}


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
        assert SYMPTOM.get(bug, "relative error") in r.message, r.message


@pytest.mark.parametrize("name", list(MUTANTS))
def test_cases_cover_what_the_mutants_need(name):
    kws = [c.kwargs for c in catalog.get(name).cases(7)]
    assert any(kw.get("dfinal_state") is not None for kw in kws)
    assert any(kw.get("dfinal_state") is None for kw in kws)
    assert any(kw["g"].dim() == 3 for kw in kws) and any(kw["g"].dim() == 4 for kw in kws)
    assert any(kw["g"].min() < -15 and kw["q"].dtype == torch.float32 for kw in kws)  # strong
    if name != "ch12.gate_grad":
        assert any(kw.get("initial_state") is not None for kw in kws)
        assert any(kw.get("initial_state") is None for kw in kws)
        assert any(kw.get("scale") is not None for kw in kws)
    if "chunk_size" in kws[0]:
        C = kws[0]["chunk_size"]
        lengths = [kw["q"].shape[1] for kw in kws]
        assert any(T < C for T in lengths) and sum(T % C != 0 for T in lengths) >= len(lengths) - 1


@pytest.mark.parametrize("seed", SEEDS)
def test_gate_grad_truth_is_autograds(seed):
    # The gate-gradient grader's truth is the closed form on the cases' float64 dq, dk: on those
    # inputs it must equal autograd's dg through the naive recurrence.
    for i, shape in enumerate(ch12.SHAPES):
        kw, _, _ = ch12._setting(seed, i, shape)
        a = testing.to_float64(kw)
        want = ch12.autograd_backward(a["q"], a["k"], a["v"], a["g"], a["do"],
                                      initial_state=a.get("initial_state"),
                                      dfinal_state=a.get("dfinal_state"))[3]
        grads = backward.gla_backward(a["q"], a["k"], a["v"], a["g"], a["do"],
                                      initial_state=a.get("initial_state"),
                                      dfinal_state=a.get("dfinal_state"))
        final = naive.gla(a["q"], a["k"], a["v"], a["g"], initial_state=a.get("initial_state"),
                          output_final_state=True)[1] if "dfinal_state" in a else None
        got = backward.gate_grad_closed_form(a["q"], a["k"], grads["dq"], grads["dk"], a["g"],
                                             final_state=final, dfinal_state=a.get("dfinal_state"))
        assert testing.rel_err(got, want) <= testing.tolerance(torch.float64)
