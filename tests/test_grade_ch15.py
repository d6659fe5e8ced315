"""Graders of chapter 15: the references pass, and each planted mistake is named.

The functions below are a reader's solution of workbook 15, written from the chapter (plain torch
and `linattn.kda`, not the catalog's code), each with one bug that `bug=` switches on; the bug-free
version passes too, so a rejection is caused by the bug alone. Every mutant must be rejected, with
its diagnosis, for several seeds, since a reader gets a fresh seed at every check.
"""
import pytest
import torch

import linattn
from planted import assert_named, verdicts



@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_HOME", str(tmp_path))


# ---------------------------------------------------------------- a reader's solution, with bugs
def padded_prefill(q, k, v, g, beta, lengths, *, bug=None):
    B, T = q.shape[:2]
    t = torch.arange(T)
    ends = torch.tensor(lengths) + {"t <= L": 1, "t < L - 1": -1}.get(bug, 0)
    real = (t[None, :] < ends[:, None]).float()                      # [B, T]
    if bug == "no mask":
        real = torch.ones(B, T)
    if bug == "v instead of beta":
        v = v * real[..., None, None]
        g = g * real[..., None, None]
        _, S = linattn.kda(q, k, v, g, beta, output_final_state=True)
        return S
    if bug != "decay kept":
        g = g * real[..., None, None]
    if bug != "write kept":
        beta = beta * real[..., None]
    _, S = linattn.kda(q, k, v, g, beta, output_final_state=True)
    return S


def next_token_probs(logits, temperature=1.0, top_k=None, *, bug=None):
    if temperature == 0 and bug != "temperature 0 as 1":
        p = torch.zeros_like(logits)
        p[torch.arange(len(logits)), logits.argmax(-1)] = 1
        return p
    theta = temperature or 1.0
    z = logits * theta if bug == "times temperature" else logits / theta
    if top_k is not None and bug != "top-k ignored":
        keep = top_k + 1 if bug == "k + 1" else top_k
        order = z.argsort(-1, descending=True)
        drop = torch.ones_like(z, dtype=torch.bool).scatter(-1, order[:, :keep], False)
        if bug == "not renormalised":
            return z.softmax(-1).masked_fill(drop, 0.0)
        z = z.masked_fill(drop, float("-inf"))
    return z.softmax(0 if bug == "softmax over the batch" else -1)


# ---------------------------------------------------------------- the tests
@pytest.mark.parametrize("name,fn", [("ch15.padded_prefill", padded_prefill),
                                     ("ch15.next_token_probs", next_token_probs)])
def test_the_bug_free_solution_passes(name, fn):
    assert all(r.passed for r in verdicts(name, fn)), [r.message for r in verdicts(name, fn)]


@pytest.mark.parametrize("bug,diagnosis", [
    ("no mask", "run the padded batch as it is"),
    ("decay kept", "block the write (β = 0 or k = 0) but not the decay"),
    ("write kept", "stop the decay (g = 0) but not the write"),
    ("v instead of beta", "zero v (and g) on the padding"),
    ("t <= L", "count one token too many"),
    ("t < L - 1", "count one token too few"),
])
def test_padded_prefill_mistakes_are_named(bug, diagnosis):
    assert_named("ch15.padded_prefill", lambda *a: padded_prefill(*a, bug=bug), diagnosis)


@pytest.mark.parametrize("bug,diagnosis", [
    ("times temperature", "multiply the logits by the temperature"),
    ("not renormalised", "then zero all but the top k"),
    ("k + 1", "keep k + 1 logits"),
    ("top-k ignored", "ignore top_k"),
    ("temperature 0 as 1", "treat temperature 0 as 1"),
    ("softmax over the batch", "normalise over the batch axis"),
])
def test_next_token_probs_mistakes_are_named(bug, diagnosis):
    assert_named("ch15.next_token_probs", lambda *a, **kw: next_token_probs(*a, **kw, bug=bug), diagnosis)
