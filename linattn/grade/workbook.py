"""Workbooks: py:percent notebooks whose exercise cells carry `exercise="chNN.name"` metadata.

    # %% exercise="ch01.recurrent"
    def recurrent_linear_attn(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
        raise NotImplementedError  # your code here

`solved(nb)` binds each exercise's function to the library's reference instead (for tests: a
solved workbook must run clean and pass); `run(nb)` executes a workbook and collects the verdicts
(`run(nb, record=False)` records no pass: the CLI's --solved runs that way).
"""
from __future__ import annotations

import ast
import contextlib
import linecache
import os
from pathlib import Path

import jupytext


def read(path):
    return jupytext.read(str(path))


def exercise_cells(nb):
    """(cell, exercise name, function name) for each exercise cell."""
    out = []
    for cell in nb.cells:
        name = cell.metadata.get("exercise")
        if cell.cell_type == "code" and name:
            defs = [n.name for n in ast.parse(cell.source).body if isinstance(n, ast.FunctionDef)]
            if not defs:
                raise ValueError(f"exercise cell {name!r} defines no function")
            out.append((cell, name, defs[-1]))
    return out


def solved(nb):
    """A copy of `nb` in which each exercise function is the library's reference."""
    nb = jupytext.reads(jupytext.writes(nb, "ipynb"), "ipynb")
    for cell, name, fn in exercise_cells(nb):
        cell.source += f"\n\n{fn} = __import__('linattn.grade').grade.reference({name!r})  # solved\n"
    return nb


def run(nb, label="workbook", record=True):
    """Execute the code cells of `nb` in one namespace; return (results, cell errors).
    record=False: passes are not recorded (a workbook run with the library's solutions)."""
    from . import grading

    os.environ.setdefault("MPLBACKEND", "Agg")
    namespace = {"__name__": "__main__"}
    grading._collected = results = []
    errors = []
    try:
        with contextlib.nullcontext() if record else grading.not_recording():
            for i, cell in enumerate(nb.cells):
                if cell.cell_type != "code" or cell.source.lstrip().startswith(("!", "%")):
                    continue
                filename = f"<{label} cell {i}>"
                src = cell.source
                linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
                try:
                    exec(compile(src, filename, "exec"), namespace)
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # noqa: BLE001  (a broken cell, even sys.exit(), is reported; the rest still runs)
                    errors.append(f"cell {i}: {type(e).__name__}: {grading._text(e)}")
    finally:
        grading._collected = None
    return results, errors


def workbook_paths(root: Path):
    return sorted(Path(root).glob("[0-9][0-9]_*.py"))
