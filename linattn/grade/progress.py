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
damaged anyway (edited by hand, a full disk, bytes that are not UTF-8, a folder in its place) is
kept aside as progress.json.damaged-<n>, a message says so, and the passes are rebuilt from
passes.log (its unreadable lines skipped) and mine/*.py: none is lost silently. A LINATTN_HOME that
cannot be read at all (a file, no permission) reads as no progress, and `status()` says why.

Only the notebook's process writes: the child process a check runs the reader's function in sets
`read_only` (isolate.py), so nothing the function does through this module records a pass.
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
read_only = False    # set in a grading child process: only the notebook's process records passes


class ReadOnly(PermissionError):
    """Progress written from the child process a check runs the reader's function in."""


def _writable():
    if read_only:
        raise ReadOnly("progress is recorded by the notebook's process only, not from inside a "
                       "graded function")


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


def _parse(raw: bytes) -> tuple[dict | None, str]:
    """(the progress data in `raw`, '') or (None, what is wrong with it)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "it is not valid UTF-8"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None, "it is not valid JSON" if text.strip() else "it is empty"
    if not (isinstance(data, dict) and isinstance(data.get("passed"), dict)
            and all(isinstance(v, dict) for v in data["passed"].values())):
        return None, "it is JSON, but not progress data"
    return data, ""


def _read() -> tuple[dict | None, str]:
    """(progress data, '') from progress.json (or the log when there is none yet), or (None, why
    progress.json is damaged). OSError when LINATTN_HOME itself cannot be read."""
    path = _progress_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if not home().exists() or home().is_dir():
            return {"passed": _from_log()}, ""
        raise NotADirectoryError(f"LINATTN_HOME ({home()}) is a file, not a folder")
    except IsADirectoryError:
        return None, "it is a folder, not a file"
    except NotADirectoryError:
        raise NotADirectoryError(f"LINATTN_HOME ({home()}) is a file, not a folder") from None
    return _parse(raw)


def status() -> tuple[dict, str]:
    """(progress data, '') or (what could be read, why progress cannot be read or kept)."""
    try:
        data, why = _read()
        if data is not None:
            return data, ""
        if read_only:
            return {"passed": _from_log()}, ""
        with locked():
            return _read_or_repair(), ""
    except OSError as e:
        with contextlib.suppress(OSError):
            return {"passed": _from_log()}, _reason(e)
        return {"passed": {}}, _reason(e)


def _reason(e: OSError) -> str:
    text = e.strerror or str(e)
    return f"{text}: {e.filename}" if e.filename and e.strerror else text


def load() -> dict:
    """{"passed": {name: {"at", "title"}}}; a damaged file is set aside and rebuilt (see above)."""
    return status()[0]


def _read_or_repair() -> dict:
    """Under the lock: the progress data, repairing a damaged file first."""
    data, why = _read()
    if data is not None:
        return data
    path = _progress_path()
    n = 1
    while os.path.lexists(path.with_name(f"{path.name}.damaged-{n}")):
        n += 1
    kept = path.with_name(f"{path.name}.damaged-{n}")
    os.replace(path, kept)
    data = {"passed": _from_log()}
    _write_atomic(path, json.dumps(data, indent=1))
    names = ", ".join(sorted(data["passed"])) or "none"
    print(f"⚠️  linattn: {path} was damaged ({why}); kept aside as {kept}. Progress was rebuilt "
          f"from passes.log and mine/*.py — passes recovered: {names}. Grading goes on; an "
          "exercise not listed here can be passed again.")
    return data


def _from_log() -> dict:
    """Passes recorded in passes.log and mine/*.py (unreadable lines of the log skipped)."""
    passed = {}
    try:
        text = (home() / "passes.log").read_bytes().decode("utf-8", errors="replace")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        text = ""
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            passed[entry["name"]] = {k: entry.get(k) if isinstance(entry.get(k), str) else ""
                                     for k in ("at", "title")}
    with contextlib.suppress(OSError):
        for src in sorted(home().glob("mine/*.py")):
            with contextlib.suppress(OSError, ValueError, OverflowError):
                passed.setdefault(src.stem, {"at": datetime.datetime.fromtimestamp(
                    src.stat().st_mtime).isoformat(timespec="seconds"), "title": ""})
    return passed


def passed(name: str) -> bool:
    return name in load()["passed"]


def record(ex: Exercise, fn) -> None:
    _writable()
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
    _writable()
    with locked():
        for p in sorted(home().glob("mine/*.py")) + [_progress_path(), home() / "passes.log"]:
            p.unlink(missing_ok=True)


def _solution_name(fn) -> str:
    return (_kernel_fn(fn) or fn).__name__


# capture_source looks only at plain functions, Triton kernels, modules and constants, by their
# exact types: the passed object is the reader's, and a class of theirs could run code on any
# attribute looked up (a check never runs the reader's code in the notebook's process).

def _kernel_fn(obj):
    """The Python function inside a @triton.jit kernel (natively or interpreted), else None."""
    if not str(inspect.getattr_static(type(obj), "__module__", "")).startswith("triton"):
        return None
    inner = inspect.getattr_static(obj, "fn", None)
    return inner if type(inner) is types.FunctionType else None


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
    except (OSError, TypeError, AttributeError, IndexError, SyntaxError):
        return None  # defined where no source is kept (a lambda in a REPL, a builtin)


def _static(obj, attr):
    """obj.<attr> as a str (else None), without running code of the reader's classes."""
    if type(obj) in (types.FunctionType, types.BuiltinFunctionType, type):
        value = getattr(obj, attr, None)
    else:
        value = inspect.getattr_static(obj, attr, None)
    return value if type(value) is str else None


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
    if type(fn) is not types.FunctionType:
        raise TypeError(f"a {type(fn).__name__} is not a function defined in the notebook")
    if type(fn.__dict__.get("__wrapped__", fn)) is not types.FunctionType:
        raise TypeError("inspect would follow __wrapped__ into an object that is not a function")
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
        module = _static(obj, "__module__")
        same_module = module == fn.__module__
        if type(obj) is types.FunctionType and same_module:
            _collect(obj, parts, seen)
        elif _kernel_fn(obj) is not None and _kernel_fn(obj).__module__ == fn.__module__:
            _collect(obj, parts, seen)
        elif type(obj) is types.ModuleType:
            seen.add(name)
            parts.append(f"import {obj.__name__} as {name}")
        elif callable(obj) and module and not same_module:
            qualname = _static(obj, "__qualname__")
            if qualname is None:
                continue
            seen.add(name)  # imported from a module: import it again
            parts.append(f"from {module} import {qualname} as {name}")
        elif type(obj) in (int, float, str, bool):
            seen.add(name)
            # repr(float("inf")) is `inf`, not Python source: spell non-finite floats out
            value = f"float({str(obj)!r})" if isinstance(obj, float) and not math.isfinite(obj) else repr(obj)
            parts.append(f"{name} = {value}")


def load_mine(op: str):
    """(function, description) of the reader's most advanced passed implementation of `op`.

    A passed backward exercise (unlocks = (op, "triton", "backward")) gives the Triton forward its
    gradients: the reader's Triton forward if they passed one, else linattn.triton's."""
    from . import catalog
    from ..dispatch import level_fn
    from ..validate import InputError

    done = load()["passed"]
    saved = [ex for ex in catalog.all_exercises()
             if ex.unlocks and ex.unlocks[0] == op and ex.name in done
             and (home() / "mine" / f"{ex.name}.py").exists()]
    mine = [ex for ex in saved if ex.unlocks[2:] != ("backward",)]
    backward = [ex for ex in saved if ex.unlocks[2:] == ("backward",)]
    if not mine and not backward:
        raise InputError(f"impl='mine' for {op}: you have not passed an exercise that implements "
                         f"{op} yet (see linattn.grade.progress_text())")
    if mine:
        ex = max(mine, key=lambda e: LEVEL_ORDER.index(e.unlocks[1]))
        fn, desc = _exec_saved(ex)
        level = ex.unlocks[1]
    else:
        fn, desc, level = level_fn(op, "triton"), f"linattn.triton.{op} (reference forward)", "triton"
    if level != "triton":
        return fn, desc                         # PyTorch code differentiates itself
    if backward:
        bwd, bdesc = _exec_saved(backward[-1])
        desc = f"{desc} with {bdesc}"
        return _with_backward(fn, bwd, desc), desc
    return _no_grad_kernel(fn, desc), desc


def _exec_saved(ex):
    path = home() / "mine" / f"{ex.name}.py"
    namespace = {"__name__": f"linattn_mine_{ex.name.replace('.', '_')}"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["SOLUTION"], f"your {ex.name} ({path})"


def _with_backward(fn, bwd, desc):
    """fn (a forward returning (o, final_state)) differentiated by bwd, the reader's backward
    (q, k, v, g, do, *, scale, initial_state, dfinal_state, chunk_size, sub_chunk_size)."""
    import torch

    from ..dispatch import accepted

    class Trained(torch.autograd.Function):
        @staticmethod
        def forward(ctx, kwargs, initial_state, *xs):
            ctx.set_materialize_grads(False)
            ctx.kwargs = kwargs
            ctx.save_for_backward(initial_state, *xs)
            return fn(*xs, initial_state=initial_state, **kwargs)

        @staticmethod
        def backward(ctx, do, dS):
            initial_state, *xs = ctx.saved_tensors
            kw = accepted(bwd, {n: a for n, a in ctx.kwargs.items() if n in ("scale", "chunk_size",
                                                                              "sub_chunk_size")})
            do = torch.zeros_like(xs[2]) if do is None else do
            grads = bwd(*xs, do, initial_state=initial_state, dfinal_state=dS, **kw)
            return (None, grads[-1], *grads[:-1])

    @functools.wraps(fn)  # keeps fn's signature, which dispatch.accepted reads
    def run(*xs, initial_state=None, **kwargs):
        if not torch.is_grad_enabled() or not any(isinstance(x, torch.Tensor) and x.requires_grad
                                                  for x in (*xs, initial_state)):
            return fn(*xs, initial_state=initial_state, **kwargs)
        return Trained.apply(kwargs, initial_state, *xs)

    return run


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
