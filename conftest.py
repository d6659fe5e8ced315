"""Collect the book's chapters and the workbooks as notebooks, executed by nbval.

The py:percent sources are the truth. Each is read with jupytext and handed to nbval (run with
--nbval-lax: every cell must run without error; the chapters' own asserts are the checks).
Workbooks run *solved*: each exercise function is bound to the library's reference, so every
check cell must pass (that stubs fail is tested in tests/test_workbooks.py). A copy of each
converted notebook is written to _build/nbtest/ for inspection.
"""
from __future__ import annotations

import os

from pathlib import Path

ROOT = Path(__file__).parent
BUILD = ROOT / "_build" / "nbtest"
NOTEBOOK_DIRS = ("book", "exercises")


def pytest_configure(config):
    # Hermetic progress: tests and executed notebooks (their kernels inherit the environment)
    # must never read or write the reader's own ~/.linattn.
    import tempfile

    os.environ["LINATTN_HOME"] = tempfile.mkdtemp(prefix="linattn-test-home-")
    os.environ.setdefault("MPLBACKEND", "Agg")
    _share_cores_between_workers()


def _share_cores_between_workers():
    # With several xdist workers, each worker and the notebook kernels it starts (they inherit
    # the environment) get their share of the cores. Oversubscribed, a multi-threaded torch op
    # stalls whenever the OS parks one of its threads: on a loaded 2-core machine
    # tests/test_grade_ch01_02.py took 50 s instead of 3 s, the ch01-02 notebooks 43 s instead
    # of 25 s. An OMP_NUM_THREADS set by the caller wins.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _is_notebook(path: Path) -> bool:
    return (path.suffix == ".py" and path.parent.name in NOTEBOOK_DIRS
            and path.parent.parent == ROOT and path.name[:2].isdigit())


def _collector(parent, path: Path):
    import jupytext
    import nbformat
    from nbval.plugin import IPyNbFile

    class PyPercentNotebook(IPyNbFile):
        def collect(self):
            nb = jupytext.read(str(self.path))
            if self.path.parent.name == "exercises":
                from linattn.grade import workbook

                nb = workbook.solved(nb)
            out = BUILD / self.path.parent.name / (self.path.stem + ".ipynb")
            out.parent.mkdir(parents=True, exist_ok=True)
            jupytext.write(nb, str(out), fmt="ipynb")
            read = nbformat.read
            nbformat.read = lambda *a, **k: nbformat.reads(jupytext.writes(nb, "ipynb"), 4)
            try:
                yield from super().collect()
            finally:
                nbformat.read = read

    return PyPercentNotebook.from_parent(parent, path=path)


def pytest_collect_file(file_path, parent):
    # Found while walking book/ or exercises/; files named on the command line come through
    # pytest_pycollect_makemodule instead (pytest would otherwise import them as test modules).
    if _is_notebook(file_path) and not parent.session.isinitpath(file_path):
        return _collector(parent, file_path)
    return None


def pytest_pycollect_makemodule(module_path, parent):
    if _is_notebook(module_path):
        return _collector(parent, module_path)
    return None
