"""A time limit for the reader's code: an endless loop becomes a verdict, not a frozen notebook.

Checks normally run the reader's function in a forked child that the grader kills at the limit
(isolate.py). This module is the limit where the function runs in the notebook's own process
(no fork, or a machine with a GPU), and the parsing of the limit itself.

In the main thread (a notebook cell, a script) a SIGALRM timer interrupts the call between two
Python bytecodes — a single long PyTorch operation finishes first. Elsewhere (another thread, a
platform without SIGALRM) the call runs in a worker thread that is waited for with a timeout and,
if it does not finish, abandoned (it cannot be stopped from outside; it ends with the process).
The alarm repeats every REPEAT_S after the limit, so code that swallows one interrupt meets the
next; code that catches BaseException in a loop can still outlast every one of them, and is then
failed for running past the limit when it returns (grading.py measures the time).
The limit is per case: `check(..., time_limit=s)`, else $LINATTN_TIME_LIMIT, else DEFAULT_S.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

DEFAULT_S = 60.0  # generous: the slowest reference case under the Triton interpreter takes a few s
REPEAT_S = 0.5
_said: set = set()  # warnings about $LINATTN_TIME_LIMIT already printed in this session


class TimeLimitExceeded(BaseException):
    """Raised into the reader's code when its time is up. A BaseException, so a bare
    `except Exception` in the reader's code cannot swallow it."""


def seconds(limit=None) -> float | None:
    """The limit in force: the argument, else $LINATTN_TIME_LIMIT, else DEFAULT_S; ≤ 0 or inf
    means none. A bad argument raises ValueError; a bad environment variable is reported once and
    the default used (a typo in the environment must not stop every check)."""
    if limit is not None:
        try:
            value = float(limit)
        except (TypeError, ValueError):
            raise ValueError(f"time_limit must be a number of seconds (0 or inf: no limit), "
                             f"got {limit!r}") from None
        if math.isnan(value):
            raise ValueError("time_limit must be a number of seconds (0 or inf: no limit), got nan")
        return value if 0 < value < math.inf else None
    raw = os.environ.get("LINATTN_TIME_LIMIT", "").strip()
    if not raw:
        return DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value):
        if raw not in _said:
            _said.add(raw)
            print(f"⚠️  linattn: LINATTN_TIME_LIMIT={raw!r} is not a number of seconds; checks use "
                  f"the default limit of {DEFAULT_S:g} s (0 or inf: no limit)")
        return DEFAULT_S
    return value if 0 < value < math.inf else None


def call(fn, limit: float | None):
    """fn(), interrupted by TimeLimitExceeded after `limit` seconds (None: no limit)."""
    if limit is None:
        return fn()
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        return _with_alarm(fn, limit)
    return _in_thread(fn, limit)


def _with_alarm(fn, limit):
    fired = [0]

    def on_alarm(signum, frame):
        fired[0] += 1
        if fired[0] == 3:
            print(f"⚠️  linattn: the function being graded keeps running past its {limit:g} s limit "
                  "(does it catch BaseException?); press stop, or restart the kernel",
                  file=sys.stderr)
        raise TimeLimitExceeded(limit)

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, limit, REPEAT_S)
    started = time.monotonic()
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_timer[0] > 0:  # someone else's timer was running: let it go on
            signal.setitimer(signal.ITIMER_REAL, max(old_timer[0] - (time.monotonic() - started), 1e-3), old_timer[1])


def _in_thread(fn, limit):
    box = {}

    def work():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the caller below)
            box["error"] = e

    worker = threading.Thread(target=work, daemon=True, name="linattn-grade")
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        raise TimeLimitExceeded(limit)
    if "error" in box:
        raise box["error"]
    return box["value"]
