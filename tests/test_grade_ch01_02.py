"""Graders of chapters 01–02: the references pass, and the usual mistakes are rejected.

Each mistake is a small, otherwise correct implementation with one bug switched on (`bug=`). The
bug-free version of every implementation passes too, so a rejection is caused by the bug alone.
Every mutant must fail for several seeds, since a reader gets a fresh seed at every check.
"""
from functools import partial

import pytest
import torch

from linattn import outputs
from linattn.grade import catalog, check, reference

SEEDS = (0, 1, 2)


@pytest.fixture(autouse=True)
def one_thread():
    # The graded tensors are tiny: extra threads only add synchronisation, and on a busy CI
    # machine every synchronisation can stall for a whole time slice (measured: 2.5 s -> 50 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def setup(q, k, v, scale, initial_state, bug):
    """Shared start of every implementation: scale, compute dtype, inputs in it, the first state."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    if bug == "no scale":
        scale = 1.0
    if bug == "ignores the scale argument":
        scale = K ** -0.5
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    S = torch.zeros(B, H, K, v.shape[-1], dtype=acc)
    if initial_state is not None and bug != "ignores initial_state":
        S = initial_state.to(acc).clone()
    return scale, acc, S


def finish(o, S, v, output_final_state, bug):
    """Shared end: o back to v's dtype, the final state only when asked for."""
    if bug != "float32 o":
        o = o.to(v.dtype)
    want_state = output_final_state or bug == "always returns the state"
    return o, (S if want_state else None)


def recurrent(q, k, v, *, scale=None, initial_state=None, output_final_state=False, bug=None):
    scale, acc, S = setup(q, k, v, scale, initial_state, bug)
    B, T, H, _ = q.shape
    q, k, v_ = (x.to(acc) for x in (q, k, v))
    o = outputs.empty((B, T, H, v.shape[-1]), dtype=acc, device=q.device)
    for t in range(T):
        before = S
        update = k[:, t, :, :, None] * v_[:, t, :, None, :]           # [B, H, K, V]
        if bug == "reads the state before the update":
            o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
            S = S + update
        else:
            S = S + update
            o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    if bug == "final state one token early":
        S = before
    return finish(o, S, v, output_final_state, bug)


MASKS = {
    None: lambda n: torch.ones(n, n).tril(),
    "mask includes the future": lambda n: torch.ones(n, n).triu(),
    "no mask": lambda n: torch.ones(n, n),
    "strict mask (no diagonal)": lambda n: torch.ones(n, n).tril(-1),
}


def parallel(q, k, v, *, scale=None, initial_state=None, output_final_state=False, bug=None):
    scale, acc, S0 = setup(q, k, v, scale, initial_state, bug)
    T = q.shape[1]
    q, k, v_ = (x.to(acc).transpose(1, 2) for x in (q, k, v))       # [B, H, T, *]
    mask = MASKS.get(bug, MASKS[None])(T).to(acc)
    o = scale * ((q @ k.transpose(-1, -2)) * mask @ v_ + q @ S0)     # [B, H, T, V]
    S = S0 + k.transpose(-1, -2) @ v_
    if bug == "final state misses S_0":
        S = S - S0
    return finish(o.transpose(1, 2), S, v, output_final_state, bug)


def chunkwise(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
              chunk_size=64, bug=None):
    scale, acc, S = setup(q, k, v, scale, initial_state, bug)
    B, T, H, _ = q.shape
    C = chunk_size
    q, k, v_ = (x.to(acc).transpose(1, 2) for x in (q, k, v))       # [B, H, T, *]
    o = outputs.empty((B, H, T, v.shape[-1]), dtype=acc, device=q.device)
    last = T - C + 1 if bug == "drops the last partial chunk" else T
    mask = MASKS.get(bug, MASKS[None])(C).to(acc)
    for s in range(0, max(last, 0), C):
        e = min(s + C, T)
        qc, kc, vc = q[:, :, s:e], k[:, :, s:e], v_[:, :, s:e]       # [B, H, c, *]
        S_before = S
        S = S + kc.transpose(-1, -2) @ vc                             # [B, H, K, V]
        inter = qc @ (S if bug == "reads the state after the chunk's update" else S_before)
        intra = (qc @ kc.transpose(-1, -2)) * mask[: e - s, : e - s] @ vc
        o[:, :, s:e] = scale * (inter + intra)
        if bug == "final state before the last chunk" and e == T:
            S = S_before
    return finish(o.transpose(1, 2), S, v, output_final_state, bug)


COMMON = ["no scale", "ignores the scale argument", "ignores initial_state", "float32 o", "always returns the state"]
MUTANTS = {
    "ch01.recurrent": (recurrent, COMMON + ["reads the state before the update",
                                            "final state one token early"]),
    "ch01.parallel": (parallel, COMMON + ["mask includes the future", "no mask",
                                          "strict mask (no diagonal)", "final state misses S_0"]),
    "ch02.chunkwise": (chunkwise, COMMON + ["drops the last partial chunk",
                                            "reads the state after the chunk's update",
                                            "mask includes the future", "strict mask (no diagonal)",
                                            "final state before the last chunk"]),
}
CASES = [(name, bug) for name, (_, bugs) in MUTANTS.items() for bug in bugs]

# What the verdict must say for mistakes that have a precise symptom (the others: an error bound).
SYMPTOM = {
    "float32 o": "o has dtype torch.float32, expected torch.bfloat16",
    "always returns the state": "final_state should be None here",
    "drops the last partial chunk": "NaN/inf",
}


# The diagnosis a failing answer gets (the catalog's own written-out mistakes must recognise these
# independently written ones); None: no diagnosis may be given.
DIAGNOSIS = {
    "no scale": "forget the scale",
    "ignores the scale argument": "ignore the `scale` argument",
    "ignores initial_state": "ignore `initial_state`",
    "reads the state before the update": "read the state before adding k_tᵀ v_t",
    "strict mask (no diagonal)": "read the state before adding k_tᵀ v_t",
    "no mask": "leave out the causal mask",
    "final state misses S_0": "leave S_0 out of the final state",
    "reads the state after the chunk's update": "read the state after adding the chunk's Kᵀ V",
    "final state before the last chunk": "return the state from before the last chunk",
    ("ch01.parallel", "mask includes the future"): "let each token see the later ones",
    ("ch02.chunkwise", "mask includes the future"): "mask the chunk with the upper triangle",
}


def grade(name, fn, seed):
    return check(name, fn, seed=seed, record=False, quiet=True)


@pytest.mark.parametrize("name", list(MUTANTS))
@pytest.mark.parametrize("seed", SEEDS)
def test_reference_passes(name, seed):
    r = grade(name, reference(name), seed)
    assert r.passed, r.message
    assert r.cases >= 6


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
        if expected == "relative error":
            assert "worst at" in r.message and "hint:" in r.message, r.message
        diagnosis = DIAGNOSIS.get((name, bug), DIAGNOSIS.get(bug))
        if diagnosis is None:
            assert "diagnosis:" not in r.message, r.message
        else:
            assert f"diagnosis: your result matches what you get if you {diagnosis}" in r.message, r.message


def test_a_broken_diagnosis_never_hides_the_verdict():
    from dataclasses import replace

    def broken(q, k, v, **kw):
        raise RuntimeError("diagnosis bug")

    ex = replace(catalog.get("ch01.recurrent"), diagnoses=(("crash", broken),))
    r = check(ex, partial(recurrent, bug="no scale"), seed=0, record=False, quiet=True)
    assert not r.passed and "relative error" in r.message and "diagnosis" not in r.message


@pytest.mark.parametrize("name", list(MUTANTS))
def test_cases_cover_what_the_mutants_need(name):
    # The mutants above are caught only because the case set has these; keep them there.
    kws = [c.kwargs for c in catalog.get(name).cases(7)]
    assert any(kw.get("initial_state") is not None for kw in kws)
    assert any(kw["q"].dtype == torch.bfloat16 for kw in kws)
    assert any(kw.get("scale") is not None for kw in kws)
    assert any(not kw["output_final_state"] for kw in kws) and any(kw["output_final_state"] for kw in kws)
    assert any(kw["k"].shape[-1] != kw["v"].shape[-1] for kw in kws)
    if name == "ch02.chunkwise":
        C = kws[0]["chunk_size"]
        lengths = [kw["q"].shape[1] for kw in kws]
        assert any(T < C for T in lengths) and sum(T % C != 0 for T in lengths) >= len(lengths) - 1
        assert sum(T > 2 * C for T in lengths) >= len(lengths) // 2  # state passed several times


def test_cli_score_table_names_why_a_stub_fails(tmp_path, monkeypatch, capsys):
    # A failed Result is falsy; the table must still show its verdict, not "not checked".
    from pathlib import Path

    from linattn.grade.cli import main as cli

    monkeypatch.setenv("LINATTN_HOME", str(tmp_path))
    book = Path(__file__).resolve().parent.parent / "exercises"
    assert cli([str(book / "01_linear_attention.py"), str(book / "02_chunkwise.py")]) == 1
    out = capsys.readouterr().out
    for name in MUTANTS:
        assert f"FAIL  {name:<28} ❌ {name}" in out and "not written yet" in out, out
    assert "score: 0/3 exercises passed" in out
