"""Planted-mistake checks shared by the grader tests: a mistake is planted in a solution, and the
grader must reject it for every seed and name it in its diagnosis."""
from linattn.grade import check

SEEDS = (0, 1, 2)


def verdicts(name, fn, seeds=SEEDS):
    return [check(name, fn, seed=s, record=False, quiet=True) for s in seeds]


def assert_named(name, fn, diagnosis, seeds=SEEDS):
    """Rejected for every seed, and the verdict names the mistake (`diagnosis` is a fragment of it)."""
    for r in verdicts(name, fn, seeds):
        assert not r.passed, f"{name}: the planted mistake passed (seed {r.seed})"
        assert "diagnosis" in r.message and diagnosis in r.message, r.message
