"""Grading: run the reader's function on fresh random cases and say precisely what is wrong.

`check` never raises because of the reader's code: an exception (of any kind, whatever its
message does), sys.exit(), a time-out, a crash of the process, a load past the end of a tensor
(Triton kernels under the interpreter, see bounds.py), an input changed in place, a wrong shape,
a NaN, a meta or sparse tensor or a large error all become a verdict naming the case, the output
or argument, the worst position and the line. Only KeyboardInterrupt (the reader's own stop
button) goes through.

The reader's function runs in a forked child (isolate.py); this process computes the reference,
judges the plain data the child sends back, and alone records a pass.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sysconfig
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch

from .. import outputs, testing
from ..dispatch import accepted
from . import bounds, catalog, isolate, limits, progress
from .exercise import Case, Exercise

_collected: list | None = None  # the CLI collects results here instead of relying on printing


@dataclass
class Result:
    name: str
    passed: bool
    message: str
    seed: int
    worst_error: float = float("nan")
    cases: int = 0
    details: list = field(default_factory=list)

    def __repr__(self):
        return f"<{self.name}: {'passed' if self.passed else 'failed'}>"

    def __bool__(self):
        return self.passed


def check(name, fn, *, seed=None, record=True, quiet=False, time_limit=None) -> Result:
    """Grade `fn` for exercise `name` (see `exercises()`); print the verdict and return a Result.

    time_limit: seconds per case (default $LINATTN_TIME_LIMIT, else limits.DEFAULT_S; 0 or inf:
    none). `fn` runs in a forked child process where the platform allows (see isolate.py); the
    verdict is computed, and progress written, by this process only."""
    ex = name if isinstance(name, Exercise) else catalog.get(name)
    seed = int.from_bytes(os.urandom(3), "little") if seed is None else seed
    limit = limits.seconds(time_limit)
    nested = getattr(_state, "depth", 0) > 0
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        result = _grade(ex, fn, seed, limit, quiet)
    finally:
        _state.depth -= 1
    if result.passed and record:
        if nested or progress.read_only or not _recording:
            result.message += ("\n   (not recorded: " + ("a check run from inside a graded function"
                                                          if nested or progress.read_only else
                                                          "this run grades the library's solutions")
                               + " records nothing)")
        else:
            try:
                progress.record(ex, fn)
            except Exception as e:  # noqa: BLE001  (a read-only or full LINATTN_HOME: the verdict stands)
                result.message += (f"\n   (the pass could not be recorded in {progress.home()}: "
                                   f"{_text(e)}; set LINATTN_HOME to a writable folder)")
    if not quiet:
        print(result.message)
    if _collected is not None:
        _collected.append(result)
    return result


_state = threading.local()   # depth: checks running in this thread (a graded function may call check)
_recording = True            # off while `python -m linattn.grade --solved` grades the references


@contextlib.contextmanager
def not_recording():
    """Grade without recording passes (a workbook run with the library's solutions)."""
    global _recording
    saved, _recording = _recording, False
    try:
        yield
    finally:
        _recording = saved


def _grade(ex: Exercise, fn, seed: int, limit=None, quiet=True) -> Result:
    if not callable(fn):
        return Result(ex.name, False, f"❌ {ex.name}: expected a function, got {type(fn).__name__}", seed)
    worst = 0.0
    cases = ex.cases(seed)
    dev = "cuda" if ex.on_gpu and torch.cuda.is_available() else None
    inputs = [(_on(case.args, dev), _on(case.kwargs, dev)) for case in cases]
    runner = None
    if _isolated(dev):
        with contextlib.suppress(OSError):  # no process to spare (a limit on processes): in-process
            runner = isolate.Child(fn, inputs, _call_reader, _where_frame)
    runner = runner or isolate.InProcess(fn, inputs, _call_in_process)
    try:
        for i, case in enumerate(cases, 1):
            where = f"case {i} of {len(cases)}" + (f" ({case.note})" if case.note else "")
            try:
                problem, err = _grade_case(ex, case, runner, limit, dev, quiet)
            except _ReaderError as e:
                return Result(ex.name, False, f"❌ {ex.name} — {where}: {e}\n   (seed {seed})", seed,
                              cases=i)
            except Exception as e:  # noqa: BLE001  (never a traceback instead of a verdict)
                return Result(ex.name, False, f"❌ {ex.name} — {where}: the grader could not judge "
                              f"this case ({type(e).__name__}: {_text(e)})\n   (seed {seed})", seed,
                              cases=i)
            if problem:
                msg = f"❌ {ex.name} — {where}: {problem}"
                if ex.hint:
                    msg += f"\n   hint: {ex.hint}"
                return Result(ex.name, False, msg + f"\n   (seed {seed})", seed, err, i)
            worst = max(worst, err)
            runner.ahead()
    finally:
        runner.close()
    msg = (f"✅ {ex.name} passed {len(cases)} cases "
           f"(worst relative error {worst:.1e}) — seed {seed}")
    return Result(ex.name, True, msg, seed, worst, len(cases))


def _isolated(dev) -> bool:
    """Whether the function runs in a forked child: wherever fork exists and no GPU is visible (a
    forked child can use neither CUDA nor autograd once this process has; isolate.py)."""
    return dev is None and isolate.fork_is_safe()


class _ReaderError(Exception):
    """The reader's function raised (or hung, or ended the process); the message says where."""


def _grade_case(ex: Exercise, case: Case, runner, limit, dev, quiet):
    expect = _cpu(_as_tuple(ex.reference(*_on(case.args, dev), **_on(case.kwargs, dev))))
    truth_fn = ex.ground_truth
    truth = _as_tuple(truth_fn(*_to64(case.args), **accepted(truth_fn, testing.to_float64(case.kwargs))))
    got, args, kwargs = _outcome(runner.next(limit), limit, quiet)
    changed = _changed_inputs(ex, case, args, kwargs)
    if changed:
        return (f"your function changed its input {changed} in place; the caller's tensors must "
                "stay as they were (work on a copy, or write into a new output)"), 0.0
    if len(got) != len(expect):
        return (f"returned {len(got)} value(s), expected {len(expect)}"
                + (f" ({', '.join(ex.outputs)})" if ex.outputs else "")), 0.0
    dtype = case.dtype or _first_float_dtype(case)
    tol = ex.tol if ex.tol is not None else testing.tolerance(dtype)
    worst = 0.0
    for j, (g, e, t) in enumerate(zip(got, expect, truth)):
        label = ex.outputs[j] if j < len(ex.outputs) else f"output {j}"
        problem, err = _compare(label, g, e, t, tol)
        if problem:
            return problem + _diagnose(ex, case, got, truth, tol), err
        worst = max(worst, err)
    return None, worst


def _outcome(record, limit, quiet):
    """(outputs, args after, kwargs after) from a runner's record, or _ReaderError saying what
    happened instead. The record is plain data (isolate.portable), whichever way it came."""
    printed = record.get("printed")
    if printed and isinstance(printed, str) and not quiet:
        print(printed, end="" if printed.endswith("\n") else "\n")
    kind = record.get("kind")
    if kind == "keyboard":
        raise KeyboardInterrupt  # the reader pressed stop: stop grading too
    if kind == "timeout":
        where = record.get("where") if isinstance(record.get("where"), str) else ""
        raise _ReaderError(f"your function ran past the {limit:g} s limit{where} (an endless loop? "
                           "a launch grid far too large?); check(..., time_limit=s) or "
                           "$LINATTN_TIME_LIMIT changes the limit")
    if kind == "late":
        raise _ReaderError(f"your function ran past the {limit:g} s limit: it went on for "
                           f"{record.get('seconds', 0):.1f} s after being told to stop (does it "
                           "catch BaseException?); check(..., time_limit=s) or $LINATTN_TIME_LIMIT "
                           "changes the limit")
    if kind == "raised" and isinstance(record.get("message"), str):
        raise _ReaderError(record["message"])
    if kind == "lost":
        raise _ReaderError(f"your function ended the process grading it ({record.get('status')}) "
                           "before returning: os._exit, a crash in native code, or running out "
                           "of memory?")
    outs, args, kwargs = record.get("outputs"), record.get("args"), record.get("kwargs")
    if kind != "returned" or not (isinstance(outs, list) and isinstance(args, list)
                                  and isinstance(kwargs, dict)):
        raise _ReaderError("the process running your function sent back something unreadable "
                           "(did it write into the grader's pipe?)")
    return tuple(outs), args, kwargs


def _call_reader(fn, args, kwargs, invoke=None, cuda_ok=False):
    """Call fn(*args, **kwargs) and describe what happened as plain data (runs in the child, or in
    this process through _call_in_process). Never raises."""
    try:
        with outputs.poisoned(), _poisoned_empty(), bounds.checked(), warnings.catch_warnings():
            # NaN/inf from the reader's code are judged in the verdict; numpy's warnings about
            # them (the interpreter computes with numpy) would only clutter the notebook
            warnings.simplefilter("ignore", RuntimeWarning)
            got = invoke() if invoke else fn(*args, **kwargs)
    except KeyboardInterrupt:
        return {"kind": "keyboard"}
    except limits.TimeLimitExceeded as e:
        return {"kind": "timeout", "where": _safe(lambda: _where(e), "")}
    except SystemExit as e:
        code = _safe(lambda: "" if e.code is None else repr(e.code), "…")
        return {"kind": "raised", "message": f"your function called sys.exit({code}){_safe(lambda: _where(e), '')}"
                ": return the result instead (exiting would end the notebook's kernel)"}
    except BaseException as e:  # noqa: BLE001  (any failure of the reader's code is a verdict)
        return {"kind": "raised", "message": _safe(lambda: _describe_exception(e),
                                                   f"your function raised {type(e).__name__}")}
    try:
        return {"kind": "returned",
                "outputs": [isolate.portable(o, cuda_ok=cuda_ok) for o in _as_tuple(got)],
                "args": [isolate.portable(a, cuda_ok=cuda_ok) for a in args],
                "kwargs": {n: isolate.portable(a, cuda_ok=cuda_ok) for n, a in kwargs.items()}}
    except BaseException as e:  # noqa: BLE001
        return {"kind": "raised", "message": "your function returned something that cannot be read "
                f"back ({type(e).__name__}): return a tensor, or a tuple of tensors / None"}


def _call_in_process(fn, args, kwargs, limit):
    """_call_reader in this process, under limits.call; a call that outlasted the limit (it caught
    the interrupt) fails however right its answer."""
    took = [0.0]

    def invoke():
        started = time.monotonic()
        try:
            return limits.call(lambda: fn(*args, **kwargs), limit)
        finally:
            took[0] = time.monotonic() - started

    record = _call_reader(fn, args, kwargs, invoke=invoke, cuda_ok=True)
    if limit is not None and took[0] > limit and record.get("kind") not in ("timeout", "keyboard"):
        return {"kind": "late", "seconds": took[0]}
    return record


def _safe(make, fallback):
    try:
        return make()
    except Exception:  # noqa: BLE001
        return fallback


def _text(e: BaseException) -> str:
    """str(e), or a note when its __str__ fails (an exception class of the reader's)."""
    try:
        return str(e)
    except Exception as inner:  # noqa: BLE001
        return f"(its message cannot be shown: __str__ raised {type(inner).__name__})"


def _where_frame(frame) -> str:
    """' at line N in f: `code`' for the innermost frame of the reader's code at `frame`."""
    return _located(traceback.extract_stack(frame))


@contextlib.contextmanager
def _poisoned_empty():
    """torch.empty / torch.empty_like come back NaN-filled (-1 for integers) while the reader's
    code runs, as linattn.outputs.empty does: an output element a kernel never writes then shows
    as NaN instead of passing by luck (fresh memory is often zeros or an earlier correct result)."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point() or t.is_complex():
            return t.fill_(float("nan"))
        return t if t.dtype == torch.bool else t.fill_(-1)

    torch.empty = lambda *a, **kw: fill(real_empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: fill(real_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_like


def _changed_inputs(ex, case, args, kwargs) -> str:
    """The name of the first tensor argument the reader's call modified in place, or ''."""
    names = _positional_names(ex, len(case.args))
    pairs = list(zip(names, args, case.args)) + [(n, kwargs.get(n), a) for n, a in case.kwargs.items()]
    for name, after, before in pairs:
        if isinstance(before, torch.Tensor) and not _identical(after, before):
            return f"`{name}`"
    return ""


def _positional_names(ex, n):
    # the reference's names, not the reader's function's: this process never touches that object
    try:
        params = [p.name for p in inspect.signature(ex.reference).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return params[:n] if len(params) >= n else [f"argument {i + 1}" for i in range(n)]


def _identical(after, before) -> bool:
    if not isinstance(after, torch.Tensor) or after.shape != before.shape:
        return False
    same = (after == before) | (after.isnan() & before.isnan()) if after.is_floating_point() \
        else after == before
    return bool(same.all())


def _diagnose(ex: Exercise, case: Case, got, truth, tol) -> str:
    """Name the known mistake whose outputs the reader's answer reproduces, if there is one.

    A mistake that gives the right answer on this case (e.g. ignoring `scale` when the case
    passes none) says nothing about the reader's error and is skipped.
    """
    for what, mistake, *match_tol in ex.diagnoses:
        # an optional third entry loosens the match, e.g. for a mistake that rounds to bf16,
        # which the reader's code and the model of the mistake do not round identically
        near = match_tol[0] if match_tol else tol
        try:
            made = _as_tuple(mistake(*case.args, **{n: _clone(a) for n, a in case.kwargs.items()}))
        except Exception:  # noqa: BLE001  (a broken diagnosis must never hide the verdict)
            continue
        if len(made) != len(got) or all(_same(m, t, tol) for m, t in zip(made, truth)):
            continue
        if all(_same(g, m, near) for g, m in zip(got, made)):
            return f"\n   diagnosis: your result matches what you get if you {what}"
    return ""


def _same(got, made, tol) -> bool:
    """Equal within tol; NaN/inf must sit at the same places (an overflow, unwritten rows)."""
    if got is None or made is None:
        return got is made
    if not (isinstance(got, torch.Tensor) and got.shape == made.shape):
        return False
    ok_got, ok_made = torch.isfinite(got), torch.isfinite(made)
    if not torch.equal(ok_got, ok_made):
        return False
    return not bool(ok_got.any()) or testing.rel_err(got[ok_got], made[ok_made]) <= tol


def _compare(label, got, expect, truth, tol):
    if expect is None:
        return (None, 0.0) if got is None else (f"{label} should be None here", 0.0)
    if isinstance(got, isolate.Other):
        return f"{label} should be a tensor of shape {tuple(expect.shape)}, got {got.what}", 0.0
    if not isinstance(got, torch.Tensor):
        return f"{label} should be a tensor of shape {tuple(expect.shape)}, got {type(got).__name__}", 0.0
    if got.shape != expect.shape:
        return f"{label} has shape {tuple(got.shape)}, expected {tuple(expect.shape)}", 0.0
    if got.dtype != expect.dtype:
        return f"{label} has dtype {got.dtype}, expected {expect.dtype}", 0.0
    if not torch.isfinite(got).all():
        bad = (~torch.isfinite(got)).sum().item()
        pos = list(testing.worst_position(got, truth))
        return (f"{label} has {bad} NaN/inf element(s) of {got.numel()}, worst near {pos}, "
                f"all within {_box(~torch.isfinite(got))} "
                "(NaN also marks elements your function never wrote)"), float("inf")
    err = testing.rel_err(got, truth)
    if err > tol:
        pos = testing.worst_position(got, truth)
        return (f"{label}: relative error {err:.3g} > tolerance {tol:.0e}; worst at {list(pos)}: "
                f"got {got[pos].item():.6g}, expected {truth[pos].item():.6g}"), err
    return None, err


# Frames that are not the reader's code: the grader, installed packages, the standard library and
# generated code such as a dataclass's __init__ ("<string>"): an alarm or an error can land inside
# any of them while the reader's code calls them.
_NOT_READER = (os.sep + os.path.join("linattn", "grade") + os.sep, os.sep + "triton" + os.sep,
               os.sep + "torch" + os.sep, os.sep + "numpy" + os.sep, "<frozen ", "<string>")
_INSTALLED = tuple({os.path.realpath(p) + os.sep for p in
                    (sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))})


def _readers(filename: str) -> bool:
    return not (any(part in filename for part in _NOT_READER)
                or os.path.realpath(filename).startswith(_INSTALLED))


def _box(bad) -> str:
    """The index ranges, per axis, that hold every True element of `bad`: '[0, 32:37, 0:2, 0:16]'."""
    idx = bad.nonzero()
    lo, hi = idx.min(0).values.tolist(), idx.max(0).values.tolist()
    return "[" + ", ".join(str(a) if a == b else f"{a}:{b + 1}" for a, b in zip(lo, hi)) + "]"


def _describe_exception(e: BaseException) -> str:
    if isinstance(e, NotImplementedError):
        return "not written yet — the stub still raises NotImplementedError"
    # Triton's interpreter wraps an error inside a kernel as InterpreterError(repr(error)); the
    # original error, raised at the kernel's line, is its cause.
    for _ in range(20):  # (a cause chain can loop)
        if type(e).__name__ != "InterpreterError" or not isinstance(e.__cause__, BaseException):
            break
        e = e.__cause__
    if isinstance(e, bounds.OutOfBounds):
        return f"out-of-bounds access: {_text(e)}{_where(e)}"
    text = _text(e)
    if "forked subprocess" in text:
        text += (" (your function runs in a process forked from the notebook's, where CUDA cannot "
                 "be used: keep it on the device of the tensors it is given)")
    return f"your function raised {type(e).__name__}: {text}{_where(e)}"


def _where(e: BaseException) -> str:
    """' at line N in f: `code`' for the innermost frame of the reader's code in e's traceback."""
    return _located(traceback.extract_tb(e.__traceback__))


def _located(frames) -> str:
    mine = [f for f in frames if _readers(f.filename)]
    if not mine:
        return ""
    f = mine[-1]
    return f" at line {f.lineno} in {f.name}" + (f": `{f.line.strip()}`" if f.line else "")


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _clone(a):
    return a.clone() if isinstance(a, torch.Tensor) else a


def _on(xs, dev):
    """Fresh copies of the tensors in a tuple or dict, on `dev` (None: where they are)."""
    def move(a):
        return a.to(dev) if dev else a.clone()

    if isinstance(xs, dict):
        return {n: move(a) if isinstance(a, torch.Tensor) else a for n, a in xs.items()}
    return tuple(move(a) if isinstance(a, torch.Tensor) else a for a in xs)


def _cpu(xs):
    """The tensors of a tuple or dict on the CPU (outputs of a GPU call, for comparing)."""
    if isinstance(xs, dict):
        return {n: a.cpu() if isinstance(a, torch.Tensor) else a for n, a in xs.items()}
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in xs)


def _to64(args):
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _first_float_dtype(case: Case):
    for a in list(case.args) + list(case.kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
    return torch.float64
