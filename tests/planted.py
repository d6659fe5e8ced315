"""Shared by the grader tests. Planted-mistake checks: a mistake is planted in a solution, and the
grader must reject it for every seed and name it in its diagnosis. And `fork_as_on_a_cpu`, for the
tests of the forked child itself."""
import pytest

from linattn.grade import check, isolate

SEEDS = (0, 1, 2)


def verdicts(name, fn, seeds=SEEDS):
    return [check(name, fn, seed=s, record=False, quiet=True) for s in seeds]


def assert_named(name, fn, diagnosis, seeds=SEEDS):
    """Rejected for every seed, and the verdict names the mistake (`diagnosis` is a fragment of it)."""
    for r in verdicts(name, fn, seeds):
        assert not r.passed, f"{name}: the planted mistake passed (seed {r.seed})"
        assert "diagnosis" in r.message and diagnosis in r.message, r.message


@pytest.fixture(autouse=True)
def fork_as_on_a_cpu(monkeypatch):
    """Imported by the tests of the grader's forked child (autouse there): they fork even where a GPU
    is visible, which makes every check run in-process (isolate.fork_is_safe). The functions they
    grade use neither CUDA nor autograd, the two things a forked child cannot use there."""
    monkeypatch.setattr(isolate, "accelerators", lambda: 0)
