"""Where the time goes: GPU time per kernel for linattn.triton and FLA, same inputs (anchor setting).

    python tools/profile_ops.py [--T 1024 32768] [--ops gla kda ...] [--calls 10]

For each op and T, runs each implementation `calls` times under torch.profiler after a warm-up
and prints the mean GPU time per call of every kernel it launched, longest first. This is the
table that says which stage of a kernel pipeline to work on; tools/bench.py gives the end-to-end
times. Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from linattn import bench  # noqa: E402


def kernel_times(fn, calls: int) -> dict:
    """Mean device milliseconds per call of each kernel fn launches."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]] += e.device_time / 1e3 / calls   # µs → ms
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[1024, 32768])
    p.add_argument("--ops", nargs="+", default=list(bench.OPS))
    p.add_argument("--calls", type=int, default=10)
    a = p.parse_args()
    for T in a.T:
        for op in a.ops:
            args = bench.anchor_inputs(op, T)
            impls = {"ours": bench.library_call(op, "triton", args), "fla": bench.fla_call(op, args)}
            for name, fn in impls.items():
                if fn is None:
                    continue
                try:
                    t = kernel_times(fn, a.calls)
                except Exception as exc:  # report and go on
                    print(f"T={T} {op} {name}: {type(exc).__name__}: {exc}"[:300], flush=True)
                    continue
                total = sum(t.values())
                print(f"T={T} {op} {name}: {total:.3f} ms = " +
                      " + ".join(f"{k} {v:.3f}" for k, v in t.items() if v > 0.002), flush=True)
            del args
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
