"""tools/build_book.py: a chapter that fails keeps the outputs of the cells that ran, under a name
the site and the checks do not read, and a chapter that then runs clean removes that file."""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import build_book  # noqa: E402

CHAPTER = """# %%
print("first cell ran")

# %%
{second}
"""


def run(tmp_path, monkeypatch, second):
    src = tmp_path / "src" / "98_probe.py"
    src.parent.mkdir(exist_ok=True)
    src.write_text(CHAPTER.format(second=second))
    monkeypatch.setattr(build_book, "OUT", tmp_path / "out")
    return src, tmp_path / "out"


def test_a_failing_chapter_keeps_the_cells_that_ran(tmp_path, monkeypatch):
    src, out = run(tmp_path, monkeypatch, 'raise RuntimeError("stopped here")')
    assert build_book.main([str(src)]) == 1
    assert not (out / "98_probe.ipynb").exists()
    nb = nbformat.read(out / "98_probe.failed.ipynb", as_version=4)
    printed = ["".join(o.get("text", "")) for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert "first cell ran\n" in printed
    assert any("stopped here" in str(o) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_a_clean_run_replaces_the_failed_notebook(tmp_path, monkeypatch):
    src, out = run(tmp_path, monkeypatch, 'raise RuntimeError("stopped here")')
    build_book.main([str(src)])
    src.write_text(CHAPTER.format(second='print("second cell ran")'))
    assert build_book.main([str(src)]) == 0
    assert (out / "98_probe.ipynb").exists() and not (out / "98_probe.failed.ipynb").exists()


@pytest.fixture(autouse=True)
def _no_colab_note(monkeypatch):
    """The probe chapter is not in pyproject's [tool.linattn]: leave its first cell as written."""
    monkeypatch.setattr(build_book.colab, "configure", lambda nb, name: None)
