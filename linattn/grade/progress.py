"""Progress: which exercises the reader passed, and their passed code, kept under LINATTN_HOME.

Layout of $LINATTN_HOME (default ~/.linattn):
    progress.json        {"passed": {"ch01.recurrent": {"at": "...", "title": "..."}}}
    passes.log           one JSON line per pass, appended: progress.json can be rebuilt from it
    mine/<name>.py       the passed function's source (with the helpers it calls), so later
                         chapters can run the library through it: linattn.set_impl(op, "mine")
    progress.lock        taken while progress.json is read, changed and written back

Two notebooks may pass exercises at the same moment, and a session may be killed mid-write, so
every change is a read-modify-write under the lock, written to a temporary file and renamed into
place (a reader sees the old file or the new one, never half of one). A progress.json that is
damaged anyway (edited by hand, a full disk) is kept aside as progress.json.damaged-<n>, a message
says so, and the passes are rebuilt from passes.log and mine/*.py: none is lost silently.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import json
import math
import os
import tempfile
import time
import types
from pathlib import Path

from .exercise import Exercise

try:
    import fcntl
except ImportError:  # Windows: the lock falls back to an exclusive-create lock directory
    fcntl = None

LEVEL_ORDER = ("naive", "chunk", "triton")
HEADER = "import math\nimport torch\nimport torch.nn.functional as F\n"
STALE_LOCK_S = 30.0  # fallback lock only: a lock directory older than this was left by a dead process


def home() -> Path:
    return Path(os.environ.get("LINATTN_HOME") or "~/.linattn").expanduser()


def _progress_path() -> Path:
    return home() / "progress.json"


@contextlib.contextmanager
def locked():
    """Hold the progress lock (between processes) while the block runs."""
    home().mkdir(parents=True, exist_ok=True)
    if fcntl is not None:
        with open(home() / "progress.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return
    lock = home() / "progress.lock.d"
    while True:
        try:
            lock.mkdir()  # atomic everywhere: exactly one process creates it
            break
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                    lock.rmdir()
                    continue
            time.sleep(0.01)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.rmdir()


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _parse(text: str) -> dict | None:
    """The progress data in `text`, or None when it is not what record() writes."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(data, dict) and isinstance(data.get("passed"), dict)
            and all(isinstance(v, dict) for v in data["passed"].values())):
        return None
    return data


def load() -> dict:
    """{"passed": {name: {"at", "title"}}}; a damaged file is set aside and rebuilt (see above)."""
    path = _progress_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {"passed": _from_log()} if (home() / "passes.log").exists() else {"passed": {}}
    data = _parse(text)
    if data is not None:
        return data
    with locked():
        return _read_or_repair()


def _read_or_repair() -> dict:
    """Under the lock: the progress data, repairing a damaged file first."""
    path = _progress_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {"passed": _from_log()}
    data = _parse(text)
    if data is not None:
        return data
    n = 1
    while path.with_name(f"{path.name}.damaged-{n}").exists():
        n += 1
    kept = path.with_name(f"{path.name}.damaged-{n}")
    os.replace(path, kept)
    data = {"passed": _from_log()}
    _write_atomic(path, json.dumps(data, indent=1))
    names = ", ".join(sorted(data["passed"])) or "none"
    print(f"⚠️  linattn: {path} was damaged (not valid progress JSON). It is kept as {kept}; "
          f"progress was rebuilt from passes.log and mine/*.py — passes recovered: {names}. "
          "Grading goes on; an exercise not listed here can be passed again.")
    return data


def _from_log() -> dict:
    """Passes recorded in passes.log and mine/*.py (the unreadable lines of the log skipped)."""
    passed = {}
    with contextlib.suppress(FileNotFoundError):
        for line in (home() / "passes.log").read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                entry = json.loads(line)
                passed[entry["name"]] = {"at": entry.get("at", ""), "title": entry.get("title", "")}
    for src in sorted(home().glob("mine/*.py")):
        passed.setdefault(src.stem, {"at": datetime.datetime.fromtimestamp(src.stat().st_mtime)
                                     .isoformat(timespec="seconds"), "title": ""})
    return passed


def passed(name: str) -> bool:
    return name in load()["passed"]


def record(ex: Exercise, fn) -> None:
    entry = {"at": datetime.datetime.now().isoformat(timespec="seconds"), "title": ex.title}
    src = capture_source(fn) if ex.unlocks else None
    with locked():
        # The log line first: if the process dies before progress.json is replaced, the pass
        # is still recovered from the log.
        with open(home() / "passes.log", "a") as log:
            log.write(json.dumps({"name": ex.name, **entry}) + "\n")
        if ex.unlocks and not src:
            print(f"note: {ex.name} passed, but your function's source could not be saved, so "
                  f"impl='mine' for {ex.unlocks[0]} cannot use it (define it at the top level "
                  "of a notebook cell or a file)")
        if src:
            (home() / "mine").mkdir(exist_ok=True)
            _write_atomic(home() / "mine" / f"{ex.name}.py",
                          src + f"\n\nSOLUTION = {_solution_name(fn)}\n")
        data = _read_or_repair()
        data["passed"][ex.name] = entry
        _write_atomic(_progress_path(), json.dumps(data, indent=1))


def reset() -> None:
    """Forget all progress (the saved functions and the log too; damaged copies are kept)."""
    with locked():
        for p in sorted(home().glob("mine/*.py")) + [_progress_path(), home() / "passes.log"]:
            p.unlink(missing_ok=True)


def _solution_name(fn) -> str:
    return getattr(fn, "__name__", None) or fn.fn.__name__


def _kernel_fn(obj):
    """The Python function inside a @triton.jit kernel (natively or interpreted), else None."""
    inner = getattr(obj, "fn", None)
    if isinstance(inner, types.FunctionType) and type(obj).__module__.startswith("triton"):
        return inner
    return None


def capture_source(fn) -> str | None:
    """fn's source plus what it uses from its notebook: helper functions, @triton.jit kernels
    (with their decorator), modules, constants."""
    try:
        parts, seen = [], set()
        _collect(fn, parts, seen)
        header = HEADER
        if any(p.lstrip().startswith("@triton") for p in parts):
            header += "import triton\nimport triton.language as tl\n"
        return header + "\n\n".join(reversed(parts))
    except (OSError, TypeError, AttributeError):
        return None  # defined where no source is kept (a lambda in a REPL, a builtin)


def _names(code) -> set:
    """Global names a code object uses, nested functions and lambdas (a launch grid) included."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _collect(fn, parts, seen):
    kernel = _kernel_fn(fn)
    fn = kernel or fn
    if fn.__name__ in seen:
        return
    seen.add(fn.__name__)
    if fn.__code__.co_freevars or fn.__qualname__ != fn.__name__:
        raise TypeError(f"{fn.__name__} is defined inside another function: its source alone "
                        "does not run (define it at the top level of the notebook)")
    parts.append(inspect.getsource(fn))  # a kernel's source starts with its @triton.jit line
    glb = fn.__globals__
    for name in sorted(_names(fn.__code__)):
        obj = glb.get(name)
        if obj is None or name in seen:
            continue
        same_module = getattr(obj, "__module__", None) == fn.__module__
        if isinstance(obj, types.FunctionType) and same_module:
            _collect(obj, parts, seen)
        elif _kernel_fn(obj) is not None and _kernel_fn(obj).__module__ == fn.__module__:
            _collect(obj, parts, seen)
        elif isinstance(obj, types.ModuleType):
            seen.add(name)
            parts.append(f"import {obj.__name__} as {name}")
        elif callable(obj) and getattr(obj, "__module__", None) and not same_module:
            seen.add(name)  # imported from a module: import it again
            parts.append(f"from {obj.__module__} import {obj.__qualname__} as {name}")
        elif isinstance(obj, (int, float, str, bool)):
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
    fn, desc = namespace["SOLUTION"], f"your {ex.name} ({path})"
    return (_no_grad_kernel(fn, desc) if ex.unlocks[1] == "triton" else fn), desc


def _no_grad_kernel(fn, desc):
    """A Triton kernel has no autograd backward: refuse inputs that require grad instead of
    returning a result silently detached from the graph (PyTorch code differentiates itself)."""
    from ..validate import refuse_grad

    @functools.wraps(fn)  # keeps fn's signature, which dispatch.accepted reads
    def run(*args, **kwargs):
        named = dict(zip(inspect.signature(fn).parameters, args))
        refuse_grad(desc, **named, **kwargs)
        return fn(*args, **kwargs)

    return run
