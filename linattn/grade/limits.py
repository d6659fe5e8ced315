"""A time limit for the reader's code: an endless loop becomes a verdict, not a frozen notebook.

In the main thread (a notebook cell, a script) a SIGALRM timer interrupts the call between two
Python bytecodes — a single long PyTorch operation finishes first. Elsewhere (another thread, a
platform without SIGALRM) the call runs in a worker thread that is waited for with a timeout and,
if it does not finish, abandoned (it cannot be stopped from outside; it ends with the process).
The limit is per case: `check(..., time_limit=s)`, else $LINATTN_TIME_LIMIT, else DEFAULT_S.
"""
from __future__ import annotations

import os
import signal
import threading
import time

DEFAULT_S = 60.0  # generous: the slowest reference case under the Triton interpreter takes a few s


class TimeLimitExceeded(BaseException):
    """Raised into the reader's code when its time is up. A BaseException, so a bare
    `except Exception` in the reader's code cannot swallow it."""


def seconds(limit=None) -> float | None:
    """The limit in force: the argument, else $LINATTN_TIME_LIMIT, else DEFAULT_S; ≤ 0 means none."""
    if limit is None:
        limit = float(os.environ.get("LINATTN_TIME_LIMIT") or DEFAULT_S)
    return limit if limit > 0 else None


def call(fn, limit: float | None):
    """fn(), interrupted by TimeLimitExceeded after `limit` seconds (None: no limit)."""
    if limit is None:
        return fn()
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        return _with_alarm(fn, limit)
    return _in_thread(fn, limit)


def _with_alarm(fn, limit):
    def on_alarm(signum, frame):
        raise TimeLimitExceeded(limit)

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, limit)
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
