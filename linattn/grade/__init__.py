"""Graded exercises: `check(name, fn)` grades your function; `exercises()` lists the names.

    from linattn.grade import check, exercises
    check("ch01.recurrent", my_recurrent)      # prints a verdict, returns a Result (.passed)

Passing is recorded under $LINATTN_HOME (default ~/.linattn); `progress_text()` and `dashboard()`
show it, and `linattn.set_impl(op, "mine")` runs the library through your passed code (PyTorch
functions, or from chapter 09 on, Triton kernels with their launchers). `spec(name)` prints the
PyTorch code a kernel exercise must match. Each case has a time limit: `check(..., time_limit=s)`
or $LINATTN_TIME_LIMIT (seconds; default 60; 0 or inf: none). Your function runs in a forked child
process that is killed at the limit, and only this process judges it and records a pass (see
isolate.py for where it runs in-process instead: Windows, a machine with a GPU).
"""
from . import catalog
from .grading import Result, check
from .dashboard import dashboard, progress_text
from .progress import reset


def exercises() -> list[str]:
    """Names of all exercises, in book order."""
    return [ex.name for ex in catalog.all_exercises()]


def reference(name: str):
    """The library function that solves exercise `name`."""
    return catalog.get(name).reference


def spec(name: str) -> str:
    """Print (and return) the PyTorch code exercise `name` must match: its `spec`, else its reference."""
    import inspect

    ex = catalog.get(name)
    fn = ex.spec or ex.reference
    text = f"# {ex.name}: {ex.signature}\n# what your code must compute ({fn.__module__}.{fn.__name__}):\n"
    text += inspect.getsource(fn)
    print(text)
    return text


def describe(name: str) -> str:
    ex = catalog.get(name)
    return f"{ex.name} — {ex.title}\n    {ex.signature}"


__all__ = ["check", "exercises", "reference", "describe", "spec", "Result", "progress_text", "dashboard",
           "reset"]
