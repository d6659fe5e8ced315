"""`python -m linattn.grade WORKBOOK...` grades whole workbooks and prints a score table.

    python -m linattn.grade exercises/01_linear_attention.py
    python -m linattn.grade --list          # every exercise
    python -m linattn.grade --progress      # what you have passed and unlocked
    python -m linattn.grade --solved FILE   # the workbook with the library's solutions (records nothing)

Exit status: 0 when every exercise of the workbooks passed, 1 when one failed, 2 when a file is
not a workbook (no cells marked `# %% exercise="chNN.name"`) or cannot be read.
"""
from __future__ import annotations

import argparse
import sys

from . import catalog, workbook
from .dashboard import progress_text


class NotAWorkbook(Exception):
    """The file cannot be graded: missing, unreadable, or without exercise cells."""


def grade_workbook(path, solved=False):
    """Rows (exercise, verdict line) for one workbook, and the workbook's cell errors.
    `solved`: each exercise function is the library's reference, and no pass is recorded."""
    try:
        nb = workbook.read(path)
        cells = workbook.exercise_cells(nb)
    except FileNotFoundError:
        raise NotAWorkbook(f"{path}: no such file") from None
    except IsADirectoryError:
        raise NotAWorkbook(f"{path} is a folder; name a workbook file, e.g. exercises/01_*.py") from None
    except Exception as e:  # noqa: BLE001  (jupytext and ast raise many kinds)
        raise NotAWorkbook(f"{path} cannot be read as a notebook ({type(e).__name__}: {e})") from None
    if not cells:
        raise NotAWorkbook(f"{path} is not a workbook: it has no exercise cells "
                           '(code cells marked `# %% exercise="chNN.name"`), so there is nothing '
                           "to grade")
    if solved:
        nb = workbook.solved(nb)
    results, errors = workbook.run(nb, label=str(path), record=not solved)
    by_name = {}
    for r in results:
        by_name[r.name] = r  # the last check of an exercise counts
    rows = []
    for _, name, _ in workbook.exercise_cells(nb):
        r = by_name.get(name)
        rows.append((name, r.passed if r is not None else False,
                     r.message.splitlines()[0] if r is not None else "not checked (no check cell ran)"))
    return rows, errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m linattn.grade", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workbooks", nargs="*", help="exercises/NN_*.py (or .ipynb)")
    ap.add_argument("--list", action="store_true", help="list every exercise")
    ap.add_argument("--progress", action="store_true", help="show recorded progress")
    ap.add_argument("--solved", action="store_true",
                    help="run the workbooks with the library's solutions in place of yours (checks "
                         "that a workbook runs clean; records nothing)")
    a = ap.parse_args(argv)
    if a.list:
        for ex in catalog.all_exercises():
            print(f"{ex.name:<28} ch{ex.chapter:02d}  {ex.signature}")
    if a.progress:
        print(progress_text())
    total = passed = 0
    unreadable = False
    for path in a.workbooks:
        try:
            rows, errors = grade_workbook(path, a.solved)
        except NotAWorkbook as e:
            print(f"\n{e}")
            unreadable = True
            continue
        print(f"\n{path}")
        for name, ok, line in rows:
            print(f"  {'PASS' if ok else 'FAIL'}  {name:<28} {line}")
        for e in errors:
            print(f"  cell error: {e}")
        total += len(rows)
        passed += sum(ok for _, ok, _ in rows)
    if total:
        print(f"\nscore: {passed}/{total} exercises passed")
    elif not (a.workbooks or a.list or a.progress):
        ap.print_help()
    if unreadable:
        return 2
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
