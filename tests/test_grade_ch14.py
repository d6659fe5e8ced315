"""Graders of chapter 14: the references pass, the stubs fail, and the usual mistakes are rejected.

Each mistake is a small, otherwise correct implementation with one bug switched on (`bug=`); the
bug-free version passes too, so a rejection is caused by the bug alone. Every mutant must fail for
several seeds, since a reader gets a fresh seed at every check.
"""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linattn.grade import check, workbook

SEEDS = (0, 1, 2)
ROOT = Path(__file__).resolve().parent.parent


def graded(name, fn, seeds=SEEDS):
    return [check(name, fn, seed=s, record=False, quiet=True).passed for s in seeds]


def verdicts(name, fn, bug):
    return graded(name, fn, SEEDS if bug else SEEDS[:1])


# ---------------------------------------------------------------- ch14.log_gate
def log_gate(z, tau=16.0, *, bug=None):
    given = z.dtype
    z = z if z.dtype == torch.float64 else z.float()
    if bug == "log of the sigmoid (−inf when saturated)":
        return torch.sigmoid(z).log() / tau
    if bug == "no temperature":
        return F.logsigmoid(z)
    if bug == "temperature inside the sigmoid":
        return F.logsigmoid(z / tau)
    if bug == "returns α, not log α":
        return torch.sigmoid(z) ** (1 / tau)
    if bug == "softplus sign flipped":
        return F.softplus(z) / tau
    g = F.logsigmoid(z) / tau
    return g.to(given) if bug == "result in the input's dtype" else g


@pytest.mark.parametrize("bug", [None, "log of the sigmoid (−inf when saturated)", "no temperature",
                                 "temperature inside the sigmoid", "returns α, not log α",
                                 "softplus sign flipped", "result in the input's dtype"])
def test_log_gate(bug):
    def fn(z, tau=16.0):
        return log_gate(z, tau, bug=bug)
    passed = verdicts("ch14.log_gate", fn, bug)
    assert all(passed) if bug is None else not any(passed)


# ---------------------------------------------------------------- ch14.decode
@torch.no_grad()
def decode(layer, x, prefill, *, bug=None):
    y, state = layer(x[:, :prefill])
    first, ys = state, [y]
    for t in range(prefill, x.shape[1]):
        if bug == "state not passed":
            y, state = layer(x[:, t:t + 1])
        elif bug == "always the prefill's state":
            y, _ = layer(x[:, t:t + 1], first)
        elif bug == "skips the token after the prompt" and t == prefill:
            continue
        else:
            y, state = layer(x[:, t:t + 1], state)
        ys.append(y)
    if bug == "prompt outputs dropped":
        ys = ys[1:]
    return torch.cat(ys, dim=1)


@pytest.mark.parametrize("bug", [None, "state not passed", "always the prefill's state",
                                 "skips the token after the prompt", "prompt outputs dropped"])
def test_decode(bug):
    passed = verdicts("ch14.decode", lambda layer, x, prefill: decode(layer, x, prefill, bug=bug), bug)
    assert all(passed) if bug is None else not any(passed)


@pytest.mark.parametrize("name", ["ch14.log_gate", "ch14.decode"])
def test_reference_passes(name):
    from linattn.grade import catalog
    assert all(graded(name, catalog.get(name).reference))


def test_stub_fails_its_grader():
    nb = workbook.read(ROOT / "exercises" / "14_layers.py")
    cells = workbook.exercise_cells(nb)
    assert [name for _, name, _ in cells] == ["ch14.log_gate", "ch14.decode"]
    for cell, name, fn_name in cells:
        namespace = {}
        exec(cell.source, namespace)
        result = check(name, namespace[fn_name], seed=0, record=False, quiet=True)
        assert not result.passed and "not written yet" in result.message
