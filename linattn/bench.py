"""Timing: the median of repeated runs, with device events on a GPU and a wall clock on a CPU.

Speed is measured here and in tools/bench.py, never asserted in unit tests.
"""
from __future__ import annotations

import statistics
import time

import torch


def timeit(fn, *, warmup: int = 2, rep: int = 7) -> float:
    """Median milliseconds of fn() over `rep` runs after `warmup` runs (compilation, caches)."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        times = []
        for _ in range(rep):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
