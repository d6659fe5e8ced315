"""`python -m linattn.grade WORKBOOK...` grades whole workbooks and prints a score table.

    python -m linattn.grade exercises/01_linear_attention.py
    python -m linattn.grade --list          # every exercise
    python -m linattn.grade --progress      # what you have passed and unlocked
"""
from __future__ import annotations

import argparse
import sys

from . import catalog, workbook
from .dashboard import progress_text


def grade_workbook(path, solved=False):
    """Rows (exercise, verdict line) for one workbook, and the workbook's cell errors."""
    nb = workbook.read(path)
    if solved:
        nb = workbook.solved(nb)
    results, errors = workbook.run(nb, label=str(path))
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
    ap.add_argument("--solved", action="store_true", help=argparse.SUPPRESS)  # tests: references
    a = ap.parse_args(argv)
    if a.list:
        for ex in catalog.all_exercises():
            print(f"{ex.name:<28} ch{ex.chapter:02d}  {ex.signature}")
    if a.progress:
        print(progress_text())
    total = passed = 0
    for path in a.workbooks:
        rows, errors = grade_workbook(path, a.solved)
        print(f"\n{path}")
        for name, ok, line in rows:
            print(f"  {'PASS' if ok else 'FAIL'}  {name:<28} {line}")
        for e in errors:
            print(f"  cell error: {e}")
        total += len(rows)
        passed += sum(ok for _, ok, _ in rows)
    if a.workbooks:
        print(f"\nscore: {passed}/{total} exercises passed")
    elif not (a.list or a.progress):
        ap.print_help()
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
