"""CPU benchmark of the chunkwise level against the token loop, forward and backward.

    .venv/bin/python tools/bench_cpu.py [--T 4096] [--threads 1] [--ops gla,kda] [--out FILE]

Per operation (linear attention, GLA with per-dimension and per-head gates, DeltaNet, Gated
DeltaNet = KDA with per-head gates, KDA), B=1, H=4, K=V=64, float32, it prints and writes to JSON:

  (a) forward: the naive token loop (linattn.naive) vs the chunkwise level (linattn.chunk), and
      the speed-up (target ≥ 20×);
  (b) chunk forward + backward vs chunk forward alone (target ≤ 4×), and vs autograd through the
      naive token loop (target ≥ 10×);
  (c) memory of chunk forward + backward with recompute=True and False (linattn.bench.memory_use:
      every tensor storage the operations create until it is freed; not an operation's internal
      scratch space), against the forward's inputs + outputs + one K×V state per (batch, head)
      (target: recompute's peak ≤ 1.3×). "held" is what the forward leaves for the backward.

Times are the fastest of --reps linattn.bench.timeit runs (wall clock on a CPU) after one warm-up
run; in (a) the token loop and the chunk level run in turns, so that a machine whose speed drifts
affects both alike; elsewhere a call slower than --slow-ms is timed once. --forward-only: (a) alone. The load average is printed and recorded: on a
machine shared with other work, times are upper bounds. A benchmark, not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from linattn import bench, chunk, naive, testing  # noqa: E402

OPS = testing.VARIANTS   # name → (library function, gate shape)
TARGETS = {"fwd_speedup": 20.0, "bwd_over_fwd": 4.0, "bwd_speedup": 10.0, "peak_over_base": 1.3}


def time_ms(fn, reps, slow_ms):
    """Fastest of `reps` runs of fn after a warm-up, in ms; a fn slower than slow_ms is timed once
    (its warm-up). The fastest, not the median: on a shared CPU other work only ever adds time."""
    first = bench.timeit(fn, warmup=0, rep=1)
    return first if first > slow_ms else min(bench.timeit(fn, warmup=0, rep=1) for _ in range(reps))


def time_pair_ms(f, g, reps):
    """Fastest of `reps` runs of f and of g, taken in turns after a warm-up of each: on a shared
    machine whose speed drifts, both then see the same spells of fast and slow."""
    f(), g()
    tf, tg = [], []
    for _ in range(reps):
        tf.append(bench.timeit(f, warmup=0, rep=1))
        tg.append(bench.timeit(g, warmup=0, rep=1))
    return min(tf), min(tg)


def inputs(op, T, B, H, K, V):
    fn, gate = OPS[op]
    args = testing.make_inputs(fn, B=B, T=T, H=H, K=K, V=V, gate=gate or "per_dim", seed=0)
    return getattr(naive, fn), getattr(chunk, fn), args


def nbytes(*tensors):
    return sum(x.numel() * x.element_size() for x in tensors)


def forward_backward(fn, args, do, **kw):
    """One training step of the layer: grads cleared, forward with grad, backward from do."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in args.items()}

    def step():
        for x in leaves.values():
            x.grad = None
        o, _ = fn(**leaves, **kw)
        o.backward(do)
    return step, leaves


def bench_op(op, a):
    naive_fn, chunk_fn, args = inputs(op, a.T, a.B, a.H, a.K, a.V)
    do = torch.randn(a.B, a.T, a.H, a.V)
    r = {"op": op}
    with torch.no_grad():
        r["naive_fwd_ms"], r["chunk_fwd_ms"] = time_pair_ms(lambda: naive_fn(**args),
                                                            lambda: chunk_fn(**args), a.reps)
    r["fwd_speedup"] = r["naive_fwd_ms"] / r["chunk_fwd_ms"]
    if a.forward_only:
        return r
    step, _ = forward_backward(chunk_fn, args, do)
    r["chunk_fwdbwd_ms"] = time_ms(step, a.reps, a.slow_ms)
    step, _ = forward_backward(chunk_fn, args, do, recompute=False)
    r["chunk_fwdbwd_materialise_ms"] = time_ms(step, a.reps, a.slow_ms)
    if not a.skip_naive_backward:
        step, _ = forward_backward(naive_fn, args, do)
        r["naive_fwdbwd_ms"] = time_ms(step, 1, 0.0)
    base = nbytes(*args.values()) + nbytes(do) + a.B * a.H * a.K * a.V * 4  # inputs + o + one state
    r["base_bytes"] = base
    for mode, rc in (("recompute", True), ("materialise", False)):
        step, leaves = forward_backward(chunk_fn, args, do, recompute=rc)
        r[f"{mode}_peak_bytes"] = bench.memory_use(step)[0]
        r[f"{mode}_held_bytes"] = bench.memory_use(lambda: chunk_fn(**leaves, recompute=rc))[1]
    r["bwd_over_fwd"] = r["chunk_fwdbwd_ms"] / r["chunk_fwd_ms"]
    if "naive_fwdbwd_ms" in r:
        r["bwd_speedup"] = r["naive_fwdbwd_ms"] / r["chunk_fwdbwd_ms"]
    r["peak_over_base"] = r["recompute_peak_bytes"] / base
    r["materialise_peak_over_base"] = r["materialise_peak_bytes"] / base
    return r


def verdict(key, value):
    if value is None:
        return "—"
    ok = value >= TARGETS[key] if key in ("fwd_speedup", "bwd_speedup") else value <= TARGETS[key]
    return f"{value:.2f}{'' if ok else ' ✗'}"


def tables(rows):
    mb = 1e-6
    print("\n(a) forward, ms: naive token loop vs chunk (speed-up target ≥ "
          f"{TARGETS['fwd_speedup']:.0f}×; ✗ = missed)")
    print(f"{'op':>17} {'naive':>9} {'chunk':>9} {'speed-up':>9}")
    for r in rows:
        print(f"{r['op']:>17} {r['naive_fwd_ms']:>9.1f} {r['chunk_fwd_ms']:>9.1f} "
              f"{verdict('fwd_speedup', r['fwd_speedup']):>9}")
    if "bwd_over_fwd" not in rows[0]:
        return
    print(f"\n(b) forward + backward, ms: chunk (recompute / materialise) vs chunk forward (target ≤ "
          f"{TARGETS['bwd_over_fwd']:.0f}×) and vs autograd through the token loop (target ≥ "
          f"{TARGETS['bwd_speedup']:.0f}×)")
    print(f"{'op':>17} {'recompute':>10} {'material.':>10} {'÷ fwd':>7} {'naive':>9} {'speed-up':>9}")
    for r in rows:
        print(f"{r['op']:>17} {r['chunk_fwdbwd_ms']:>10.1f} {r['chunk_fwdbwd_materialise_ms']:>10.1f} "
              f"{verdict('bwd_over_fwd', r['bwd_over_fwd']):>7} {r.get('naive_fwdbwd_ms', float('nan')):>9.1f} "
              f"{verdict('bwd_speedup', r.get('bwd_speedup')):>9}")
    print(f"\n(c) memory of chunk forward + backward, MB, vs inputs + outputs + one state per "
          f"(batch, head) (target: recompute peak ≤ {TARGETS['peak_over_base']}×)")
    print(f"{'op':>17} {'base':>7} {'peak rc':>8} {'peak mat':>9} {'× base':>7} {'held rc':>8} {'held mat':>9}")
    for r in rows:
        print(f"{r['op']:>17} {r['base_bytes'] * mb:>7.1f} {r['recompute_peak_bytes'] * mb:>8.1f} "
              f"{r['materialise_peak_bytes'] * mb:>9.1f} {verdict('peak_over_base', r['peak_over_base']):>7} "
              f"{r['recompute_held_bytes'] * mb:>8.1f} {r['materialise_held_bytes'] * mb:>9.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--V", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steady on a shared machine)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {', '.join(OPS)}")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--slow-ms", type=float, default=2000.0, help="time calls slower than this once")
    p.add_argument("--skip-naive-backward", action="store_true", help="leave out autograd through the loop")
    p.add_argument("--forward-only", action="store_true", help="only (a): the forward speed-ups")
    p.add_argument("--out", default=None, help="JSON file to write (e.g. book/data/cpu_bench.json)")
    a = p.parse_args(argv)
    ops = [o for o in a.ops.split(",") if o]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        p.error(f"unknown op(s) {unknown}; choose from {list(OPS)}")
    torch.set_num_threads(a.threads)
    env = bench.environment()
    env.update(threads=a.threads, cpu_count=os.cpu_count(), load_average=os.getloadavg())
    print(f"{env['device']} · torch {env['torch']} · {a.threads} thread(s) of {os.cpu_count()} cores "
          f"(load average {env['load_average'][0]:.1f}) · {env['date']} · "
          f"B={a.B} T={a.T} H={a.H} K={a.K} V={a.V} float32")
    rows = []
    for op in ops:
        rows.append(bench_op(op, a))
        print(f"  done {op} (load average {os.getloadavg()[0]:.1f})", flush=True)
    tables(rows)
    if a.out:
        bench.save_json(a.out, {"env": env, "setting": {k: getattr(a, k) for k in ("B", "T", "H", "K", "V")},
                                "targets": TARGETS, "rows": rows})
        print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
