"""Every workbook: its stubs fail their graders, its solved form passes them all, and every
exercise in the catalog is asked for by exactly one workbook."""
from pathlib import Path

import pytest

from linattn.grade import exercises, workbook

ROOT = Path(__file__).resolve().parent.parent
WORKBOOKS = workbook.workbook_paths(ROOT / "exercises")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_HOME", str(tmp_path))


def graded(path, solved):
    nb = workbook.read(path)
    names = [name for _, name, _ in workbook.exercise_cells(nb)]
    results, errors = workbook.run(workbook.solved(nb) if solved else nb, label=path.name)
    return names, {r.name: r for r in results}, errors


@pytest.mark.parametrize("path", WORKBOOKS, ids=lambda p: p.name)
def test_stubs_fail(path):
    names, results, _ = graded(path, solved=False)
    assert names, f"{path.name} has no exercise cells"
    for name in names:
        assert name in results, f"{path.name}: no check cell grades {name}"
        assert not results[name].passed, f"{path.name}: the stub of {name} passes its grader"
        assert "not written yet" in results[name].message


@pytest.mark.parametrize("path", WORKBOOKS, ids=lambda p: p.name)
def test_solved_workbook_passes(path):
    names, results, errors = graded(path, solved=True)
    assert not errors, errors
    for name in names:
        assert results[name].passed, results[name].message


def test_every_exercise_is_in_one_workbook():
    asked = [name for p in WORKBOOKS for _, name, _ in workbook.exercise_cells(workbook.read(p))]
    assert sorted(asked) == sorted(exercises())
