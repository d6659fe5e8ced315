"""Graders of chapter 12: the references pass, the bug-free versions of the planted mistakes pass,
and each planted mistake of a backward pass is rejected with a verdict that names it: the seed's
sign of the gate gradient, a prefix sum where the suffix sum belongs, the incoming final-state
gradient ignored, an off-by-one state, e^{−b} overflowing, the chunk's state term left out, no
initial-state gradient, the last partial chunk dropped; for the delta rule the inverse's sign and
β's place in A. The planted mistakes are written here independently of the grader's models of
them (linattn/grade/catalog/ch12.py), so a diagnosis is a real match, not the model grading itself.
"""
from functools import partial

import pytest
import torch

from linattn import chunk, naive, testing
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
    return -1.0 if bug == SIGN else 1.0


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
    S = [torch.zeros(B, H, K, v.shape[-1], dtype=acc, device=q.device) if initial_state is None
         else initial_state.to(acc)]
    for t in range(T):
        S.append(a[:, t, :, :, None] * S[-1] + k_[:, t, :, :, None] * v_[:, t, :, None, :])
    dS = torch.zeros_like(S[0])
    if dfinal_state is not None and bug != "ignores the incoming final-state gradient":
        dS = dfinal_state.to(acc)
    dq, dk, dv, dg = (torch.zeros_like(x) for x in (q_, k_, v_, q_))
    for t in reversed(range(T)):
        dS = dS + scale * q_[:, t, :, :, None] * do_[:, t, :, None, :]
        read = S[t] if bug == OFF_BY_ONE else S[t + 1]               # S[t]: the state before step t + 1
        dq[:, t] = scale * torch.einsum("bhv,bhkv->bhk", do_[:, t], read)
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
    S = torch.zeros(B, H, K, V, dtype=acc, device=q.device) if initial_state is None else initial_state.to(acc)
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
    dg = torch.zeros(B, H, T, K, dtype=acc, device=q.device)
    for n in reversed(range(len(starts))):
        sl = slice(starts[n], starts[n] + C)
        qc, kc, vc, doc = qh[:, :, sl], k_[:, :, sl], v_[:, :, sl], do_[:, :, sl]
        b = gg[:, :, sl].cumsum(2)                                    # [B, H, c, K or 1]
        L = qc.shape[2]
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        W = (b[:, :, :, None] - b[:, :, None]).masked_fill(~causal[:, :, None], NEG_INF).exp()
        P = torch.einsum("bhik,bhjk,bhijk->bhij", qc, kc, W)
        dP = (doc @ vc.transpose(-1, -2)) * causal
        lam, gam = b.exp(), (b[:, :, -1:] - b).exp()                  # Λ, Γ
        dv[:, :, sl] = P.transpose(-1, -2) @ doc + (kc * gam) @ dS
        if bug == OVERFLOW:                                            # through e^{b} and e^{−b}
            dq_in = b.exp() * (dP @ (kc * (-b).exp()))
            dk_in = (-b).exp() * (dP.transpose(-1, -2) @ (qc * b.exp()))
        else:
            dq_in = torch.einsum("bhij,bhjk,bhijk->bhik", dP, kc, W)
            dk_in = torch.einsum("bhij,bhik,bhijk->bhjk", dP, qc, W)
        read = Sin[n + 1] if bug == OFF_BY_ONE else Sin[n]
        dqc = dq_in + lam * (doc @ read.transpose(-1, -2))
        dkc = dk_in + gam * (vc @ dS.transpose(-1, -2))
        db = _sign(bug) * (qc * dqc - kc * dkc)                       # [B, H, c, K]
        if bug != CHUNK_TERM:
            db[:, :, -1] += _sign(bug) * (Sin[n + 1] * dS).sum(-1)
        dg[:, :, sl] = _suffix(db, 2, bug)
        dq[:, :, sl], dk[:, :, sl] = dqc * scale, dkc
        dS = b[:, :, -1, :, None].exp() * dS + (qc * lam).transpose(-1, -2) @ doc
    dg = dg.sum(-1) if g.dim() == 3 else dg
    dS0 = None if initial_state is None or bug == "returns no initial-state gradient" \
        else dS.to(initial_state.dtype)
    back = [x.transpose(1, 2) for x in (dq, dk, dv, dg)]
    return (back[0].to(q.dtype), back[1].to(k.dtype), back[2].to(v.dtype), back[3].to(g.dtype), dS0)


# ---------------------------------------------------------------- ch12.autograd_function
class _GLAFunction(torch.autograd.Function):
    """The library's forward, the chunkwise mutant above as the backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, bug):
        o, S = chunk.gla(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=True)
        ctx.save_for_backward(q, k, v, g, initial_state)
        ctx.scale, ctx.bug = scale, bug
        return o, S

    @staticmethod
    def backward(ctx, do, dS):
        q, k, v, g, S0 = ctx.saved_tensors
        grads = chunkwise(q, k, v, g, do, scale=ctx.scale, initial_state=S0, dfinal_state=dS,
                          bug=ctx.bug)
        return (*grads, None, None)


def function(q, k, v, g, *, scale=None, initial_state=None, bug=None):
    return _GLAFunction.apply(q, k, v, g, initial_state, scale, bug)


def function_graded(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None, bug=None):
    return ch12.gradients_through(partial(function, bug=bug))(
        q, k, v, g, do, scale=scale, initial_state=initial_state, dfinal_state=dfinal_state)


# ---------------------------------------------------------------- ch12.delta_backward
def delta(q, k, v, beta, do, *, scale=None, initial_state=None, dfinal_state=None, chunk_size=64,
          bug=None):
    """The chunkwise delta-rule backward through the WY/UT transform, written out per chunk."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    acc = _acc(q)
    qs, ks, vs, dos = (x.to(acc).transpose(1, 2) for x in (q, k, v, do))    # [B, H, T, *]
    bs = beta.to(acc).transpose(1, 2)[..., None]                          # [B, H, T, 1]
    S = torch.zeros(B, H, K, v.shape[-1], dtype=acc, device=q.device) if initial_state is None else initial_state.to(acc)
    spans = [(s, min(s + chunk_size, T)) for s in range(0, T, chunk_size)]
    saved = []
    for s, e in spans:                                                    # forward, keeping factors
        qc, kc, vc, bc = qs[:, :, s:e], ks[:, :, s:e], vs[:, :, s:e], bs[:, :, s:e]
        Akk = (kc @ kc.transpose(-1, -2)).tril(-1)
        eye = torch.eye(e - s, dtype=acc, device=q.device)
        Tm = torch.linalg.solve_triangular(eye + bc * Akk, eye, upper=False, unitriangular=True)
        U, W = Tm @ (bc * vc), Tm @ (bc * kc)
        Vt = U - W @ S
        saved.append((Akk, Tm, U, W, Vt, S))
        S = S + kc.transpose(-1, -2) @ Vt
    saved.append((None,) * 5 + (S,))
    dS = torch.zeros_like(S) if dfinal_state is None or bug == FINAL else dfinal_state.to(acc)
    dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(ks), torch.zeros_like(vs)
    dbeta = torch.zeros_like(bs)
    for n in reversed(range(len(spans))):
        s, e = spans[n]
        qc, kc, vc, bc, dO = qs[:, :, s:e], ks[:, :, s:e], vs[:, :, s:e], bs[:, :, s:e], scale * dos[:, :, s:e]
        Akk, Tm, U, W, Vt, Sn = saved[n]
        Aqk = (qc @ kc.transpose(-1, -2)).tril()
        dVt = Aqk.transpose(-1, -2) @ dO + kc @ dS
        read = saved[n + 1][5] if bug == OFF_BY_ONE else Sn
        dAqk = (dO @ Vt.transpose(-1, -2)).tril()
        dYU, dYW = Tm.transpose(-1, -2) @ dVt, Tm.transpose(-1, -2) @ (-dVt @ Sn.transpose(-1, -2))
        dA = (dYU @ U.transpose(-1, -2) + dYW @ W.transpose(-1, -2)).tril(-1)
        dA = dA if bug == INVERSE_SIGN else -dA
        dAkk = bc * dA
        dq[:, :, s:e] = dO @ read.transpose(-1, -2) + dAqk @ kc
        dk[:, :, s:e] = (dAqk.transpose(-1, -2) @ qc + dAkk @ kc + dAkk.transpose(-1, -2) @ kc
                         + bc * dYW + Vt @ dS.transpose(-1, -2))
        dv[:, :, s:e] = bc * dYU
        in_A = 0 if bug == BETA_IN_A else (dA * Akk).sum(-1, keepdim=True)
        dbeta[:, :, s:e] = (dYU * vc).sum(-1, keepdim=True) + (dYW * kc).sum(-1, keepdim=True) + in_A
        dS = qc.transpose(-1, -2) @ dO - W.transpose(-1, -2) @ dVt + dS
    dS0 = None if initial_state is None or bug == INIT else dS.to(initial_state.dtype)
    back = [x.transpose(1, 2) for x in (dq, dk, dv)]
    return (back[0].to(q.dtype), back[1].to(k.dtype), back[2].to(v.dtype),
            dbeta.transpose(1, 2)[..., 0].to(beta.dtype), dS0)


SIGN, PREFIX = "flips the sign of the gate gradient", "sums from the start (prefix) instead of from the end"
FINAL, INIT = "ignores the incoming final-state gradient", "returns no initial-state gradient"
DROPPED, OFF_BY_ONE = "drops the last partial chunk", "reads the state after the step for dq"
OVERFLOW, CHUNK_TERM = "absorbs the decay as e^b and e^-b", "leaves out each chunk's state term"
INVERSE_SIGN, BETA_IN_A = "drops the minus sign of dA", "leaves beta out of A's gradient"
MUTANTS = {
    "ch12.gate_grad": (gate_grad, [SIGN, PREFIX, FINAL]),
    "ch12.recurrent_backward": (recurrent, [SIGN, FINAL, INIT, OFF_BY_ONE]),
    "ch12.chunk_backward": (chunkwise, [SIGN, PREFIX, FINAL, INIT, DROPPED, OFF_BY_ONE, OVERFLOW,
                                        CHUNK_TERM]),
    "ch12.autograd_function": (function_graded, [FINAL, SIGN, OFF_BY_ONE, OVERFLOW]),
    "ch12.delta_backward": (delta, [FINAL, INIT, OFF_BY_ONE, INVERSE_SIGN, BETA_IN_A]),
}
CASES = [(name, bug) for name, (_, bugs) in MUTANTS.items() for bug in bugs]
# What the verdict must say: the diagnosis naming the mistake (words of the grader's diagnosis),
# or for a missing gradient that it is missing. Keyed by (exercise, mistake) where one mistake
# reads differently in two exercises.
NAMED = {
    SIGN: "diagnosis: your result matches what you get if you take the seed's sign",
    PREFIX: "(a prefix sum)",
    FINAL: "final-state",
    INIT: "should be a tensor",
    DROPPED: "relative error",
    OFF_BY_ONE: "diagnosis: your result matches what you get if you read the state",
    OVERFLOW: "OVERFLOWS float32",
    CHUNK_TERM: "restart the gate gradient at every chunk without rowsum(S_[n] ⊙ dS_[n])",
    INVERSE_SIGN: "drop the minus sign of the inverse's gradient",
    BETA_IN_A: "leave out β's third place",
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
        assert NAMED[bug] in r.message, r.message
        if bug not in (INIT, DROPPED):
            assert "diagnosis:" in r.message, r.message


@pytest.mark.parametrize("name", list(MUTANTS))
def test_cases_cover_what_the_mutants_need(name):
    kws = [c.kwargs for c in catalog.get(name).cases(7)]
    assert any(kw.get("dfinal_state") is not None for kw in kws)
    assert any(kw.get("dfinal_state") is None for kw in kws)
    if "g" in kws[0]:
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


def test_function_reference_is_differentiable_gla():
    # Bound as the reader's function in the solved workbook, the reference must be what the
    # reader writes: (o, final_state) with a backward attached.
    a = testing.make_inputs("gla", B=1, T=20, H=1, K=8, V=8, seed=0)
    a = {n: x.requires_grad_() for n, x in a.items()}
    o, S = ch12.gla_function(**a)
    (o.sum() + S.sum()).backward()
    assert all(x.grad is not None for x in a.values())
