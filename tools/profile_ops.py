"""Where the time goes: GPU time per kernel for linattn.triton and FLA, same inputs (anchor setting).

    python tools/profile_ops.py [--T 1024 32768] [--ops gla kda ...] [--calls 10] [--train]
                                [--tuning MODULE.KEY=N ...] [--launch KERNEL.ARG=N ...]
                                [--gates normal|logsigmoid|mamba] [--no-fla]
    python tools/profile_ops.py --packed [packed longest equal …] [--ops …] [--train]

For each op and T, runs each implementation `calls` times under torch.profiler after a warm-up
and prints the mean GPU time per call of every kernel it launched, longest first. This is the
table that says which stage of a kernel pipeline to work on; tools/bench.py gives the end-to-end
times. --train: forward + backward (linattn.bench.train_call) instead of the forward. --tuning
sets a launch choice of linattn.triton.MODULE.TUNING before the first call, e.g.
`--tuning delta_backward.bv_chunk_wide=32 wy_backward.warps_no_gate=8`, to time the kernels with
another one. --launch overrides one keyword argument of every launch of a kernel made through
`common.launch` (num_warps, max_stages or a block constexpr such as BV), e.g.
`--launch _dqk_kernel.num_warps=8 _dqk_kernel.max_stages=3 _dv_kernel.num_warps=8`; a named kernel
that never launches through it, or an argument it is not given, stops the run. --gates picks the
gated ops' log-gates (`bench.GATE_SWEEP`; a kernel's fast path may hold only for mild ones).
--packed profiles the layouts of `tools/bench_packing.py` instead of --T (the same calls on the same
inputs: one row of eight documents with cu_seqlens, the same tokens as rows of the longest document,
as eight equal rows, …; default: packed, longest, equal), to see which kernel a packed row loses
in. Needs CUDA.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from linattn import bench, bench_packing  # noqa: E402
from linattn.dispatch import level_fn  # noqa: E402


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


def assignment(item: str) -> tuple[str, str, str]:
    """'A.B=N' -> (A, B, N) as written, for --tuning and --launch."""
    name, _, value = item.partition("=")
    owner, _, key = name.partition(".")
    return owner, key, value


def set_tuning(item: str):
    """MODULE.KEY=N: linattn.triton.MODULE.TUNING[KEY] = N (KEY must exist there)."""
    module, key, value = assignment(item)
    tuning = getattr(importlib.import_module(f"linattn.triton.{module}"), "TUNING", None)
    if tuning is None or key not in tuning or not value.lstrip("-").isdigit():
        raise SystemExit(f"--tuning {item}: expected MODULE.KEY=N with KEY in linattn.triton.MODULE.TUNING")
    tuning[key] = int(value)


LAUNCH: dict = {}          # kernel name -> {keyword argument: value}, from --launch
SEEN: set = set()          # (kernel name, argument) overrides applied at least once


def set_launch(item: str):
    """KERNEL.ARG=N: every common.launch of KERNEL gets ARG=N."""
    kernel, arg, value = assignment(item)
    if not kernel or not arg or not value.lstrip("-").isdigit():
        raise SystemExit(f"--launch {item}: expected KERNEL.ARG=N, e.g. _dqk_kernel.num_warps=4")
    LAUNCH.setdefault(kernel, {})[arg] = int(value)


def overriding(launch):
    """common.launch with LAUNCH's arguments put in for the kernels it names."""
    def launch_with(kernel, grid, *args, **kw):
        name = getattr(kernel, "__name__", "")
        for arg, value in LAUNCH.get(name, {}).items():
            if arg not in kw and arg not in ("num_warps", "max_stages"):
                raise SystemExit(f"--launch {name}.{arg}: {name} is not launched with {arg}")
            kw[arg] = value
            SEEN.add((name, arg))
        return launch(kernel, grid, *args, **kw)
    return launch_with


def install_launch_overrides():
    """Every linattn.triton module's `launch` (bound at import) goes through `overriding`."""
    if not LAUNCH:
        return
    import pkgutil
    import linattn.triton as lt
    from linattn.triton import common
    original = common.launch
    rerouted = overriding(original)
    for info in pkgutil.iter_modules(lt.__path__):
        module = importlib.import_module(f"linattn.triton.{info.name}")
        if getattr(module, "launch", None) is original:
            module.launch = rerouted


def check_launch_overrides():
    missing = [f"{k}.{a}" for k, args in LAUNCH.items() for a in args if (k, a) not in SEEN]
    if missing:
        raise SystemExit(f"--launch {' '.join(missing)}: no launch of that kernel went through common.launch")


def report(label: str, fn, calls: int) -> None:
    """One line: the call's GPU time and its kernels', longest first (errors reported, not raised)."""
    try:
        t = kernel_times(fn, calls)
    except Exception as exc:  # report and go on
        print(f"{label}: {type(exc).__name__}: {exc}"[:300], flush=True)
        return
    print(f"{label}: {sum(t.values()):.3f} ms = " + " + ".join(f"{k} {v:.3f}" for k, v in t.items() if v > 0.002),
          flush=True)


def profile_packed(ops, layouts, train: bool, calls: int, no_fla: bool) -> None:
    """Kernel times of bench_packing's layouts (its full size), op by op."""
    for op in ops:
        made = bench_packing.callables(op, "train" if train else "forward", bench_packing.SIZES["full"], "cuda")
        for layout in layouts:
            if made.get(layout) is not None and not (no_fla and layout == "fla"):
                report(f"{op} {layout} {'forward + backward' if train else 'forward'}", made[layout], calls)
        del made
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[1024, 32768])
    p.add_argument("--ops", nargs="+", default=list(bench.OPS))
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--train", action="store_true", help="forward + backward")
    p.add_argument("--tuning", nargs="+", default=[], metavar="MODULE.KEY=N")
    p.add_argument("--launch", nargs="+", default=[], metavar="KERNEL.ARG=N")
    p.add_argument("--gates", choices=bench.GATE_SWEEP, default="normal",
                   help="the gated ops' log-gate distribution (bench.GATE_SWEEP)")
    p.add_argument("--no-fla", action="store_true", help="ours only (FLA's autotuning compiles for minutes)")
    p.add_argument("--packed", nargs="*", default=None, choices=bench_packing.LAYOUTS, metavar="LAYOUT",
                   help="instead of --T: tools/bench_packing.py's layouts (default: packed longest equal)")
    a = p.parse_args()
    for item in a.tuning:
        set_tuning(item)
    for item in a.launch:
        set_launch(item)
    install_launch_overrides()
    if a.packed is not None:
        profile_packed(a.ops, a.packed or ["packed", "longest", "equal"], a.train, a.calls, a.no_fla)
        check_launch_overrides()
        return
    for T in a.T:
        for op in a.ops:
            args = bench.anchor_inputs(op, T, gates=a.gates)
            if a.train:
                fla = None if a.no_fla else bench.fla_fn(op)
                impls = {"ours": bench.train_call(level_fn(bench.OPS[op][0], "triton"), args),
                         "fla": None if fla is None else bench.train_call(fla, args)}
            else:
                impls = {"ours": bench.library_call(op, "triton", args),
                         "fla": None if a.no_fla else bench.fla_call(op, args)}
            for name, fn in impls.items():
                if fn is not None:
                    report(f"T={T} {op} {name} gates={a.gates}", fn, a.calls)
            del args
            torch.cuda.empty_cache()
    check_launch_overrides()


if __name__ == "__main__":
    main()
