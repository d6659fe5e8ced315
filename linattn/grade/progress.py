"""Progress: which exercises the reader passed, and their passed code, kept under LINATTN_HOME.

Layout of $LINATTN_HOME (default ~/.linattn):
    progress.json        {"passed": {"ch01.recurrent": {"at": "...", "title": "..."}}}
    mine/<name>.py       the passed function's source (with the helpers it calls), so later
                         chapters can run the library through it: linattn.set_impl(op, "mine")
"""
from __future__ import annotations

import datetime
import inspect
import json
import math
import os
import types
from pathlib import Path

from .exercise import Exercise

LEVEL_ORDER = ("naive", "chunk", "triton")
HEADER = "import math\nimport torch\nimport torch.nn.functional as F\n"


def home() -> Path:
    return Path(os.environ.get("LINATTN_HOME") or "~/.linattn").expanduser()


def load() -> dict:
    path = home() / "progress.json"
    if not path.exists():
        return {"passed": {}}
    return json.loads(path.read_text())


def passed(name: str) -> bool:
    return name in load()["passed"]


def record(ex: Exercise, fn) -> None:
    data = load()
    data["passed"][ex.name] = {"at": datetime.datetime.now().isoformat(timespec="seconds"),
                               "title": ex.title}
    home().mkdir(parents=True, exist_ok=True)
    tmp = home() / "progress.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(home() / "progress.json")
    src = capture_source(fn)
    if ex.unlocks and src:
        (home() / "mine").mkdir(exist_ok=True)
        (home() / "mine" / f"{ex.name}.py").write_text(src + f"\n\nSOLUTION = {fn.__name__}\n")


def reset() -> None:
    """Forget all progress (the saved functions too)."""
    for p in sorted(home().glob("mine/*.py")) + [home() / "progress.json"]:
        p.unlink(missing_ok=True)


def capture_source(fn) -> str | None:
    """fn's source plus what it uses from its notebook: helper functions, modules, constants."""
    try:
        parts, seen = [], set()
        _collect(fn, parts, seen)
        return HEADER + "\n\n".join(reversed(parts))
    except (OSError, TypeError):
        return None  # defined where no source is kept (a lambda in a REPL, a builtin)


def _collect(fn, parts, seen):
    if fn.__name__ in seen:
        return
    seen.add(fn.__name__)
    parts.append(inspect.getsource(fn))
    glb = fn.__globals__
    for name in fn.__code__.co_names:
        obj = glb.get(name)
        if isinstance(obj, types.FunctionType) and obj.__module__ == fn.__module__:
            _collect(obj, parts, seen)
        elif callable(obj) and getattr(obj, "__module__", None) and name not in seen:
            seen.add(name)  # imported from a module: import it again
            parts.append(f"from {obj.__module__} import {obj.__qualname__} as {name}")
        elif isinstance(obj, types.ModuleType) and name not in seen:
            seen.add(name)
            parts.append(f"import {obj.__name__} as {name}")
        elif isinstance(obj, (int, float, str, bool)) and name not in seen:
            seen.add(name)
            # repr(float("inf")) is `inf`, not Python source: spell non-finite floats out
            value = f"float({str(obj)!r})" if isinstance(obj, float) and not math.isfinite(obj) else repr(obj)
            parts.append(f"{name} = {value}")


def load_mine(op: str):
    """(function, description) of the reader's most advanced passed implementation of `op`."""
    from . import catalog
    from ..validate import InputError

    done = load()["passed"]
    mine = [ex for ex in catalog.all_exercises()
            if ex.unlocks and ex.unlocks[0] == op and ex.name in done
            and (home() / "mine" / f"{ex.name}.py").exists()]
    if not mine:
        raise InputError(f"impl='mine' for {op}: you have not passed an exercise that implements "
                         f"{op} yet (see linattn.grade.progress_text())")
    ex = max(mine, key=lambda e: LEVEL_ORDER.index(e.unlocks[1]))
    path = home() / "mine" / f"{ex.name}.py"
    namespace = {"__name__": f"linattn_mine_{ex.name.replace('.', '_')}"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["SOLUTION"], f"your {ex.name} ({path})"
