"""The delta family's sequential passes over their whole grid, natively, against float64
(linattn/conformance/passes.py): every K × V in 16…256, chunk sizes 16/32/64, bf16/fp16/float32,
the three gate kinds, with and without an initial state.

    python tools/pass_sweep.py [--out DIR] [--workers N] [--timeout S] [--kinds bfloat16:2 float32:0 ...]
                               [--keys 256 ...] [--values 64 128 ...]      (a part of the grid)

One worker process per (dtype, gate, K, V) group, so an illegal address loses one group, named, not
the run. Writes DIR/results.jsonl (one row per point) and DIR/summary.md; exits 1 on any failure,
crash or timeout.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKER = """
import json, sys
from linattn import device
from linattn.conformance import passes
for point in json.loads(sys.argv[1]):
    row = dict(point)
    try:
        row.update(passes.check(**point, device=device.default_device()))
    except Exception as e:
        row["failed"] = [f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"]
        print(json.dumps(row), flush=True)
        raise
    print(json.dumps(row), flush=True)
"""


def run_group(points, timeout):
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", WORKER, json.dumps(points)], capture_output=True, text=True,
                           timeout=timeout, cwd=ROOT)
        out, why = p.stdout, None if p.returncode == 0 else f"worker exited {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1][:300]}"
    except subprocess.TimeoutExpired as e:
        out, why = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    done = len(rows)
    for point in points[done:]:
        rows.append(dict(point, failed=[why or "not run"], lost=True))
    if why and done and not rows[done - 1]["failed"]:
        rows[done - 1]["failed"] = [why]
    return rows, round(time.perf_counter() - t0, 1)


def summary(rows) -> str:
    bad = [r for r in rows if r["failed"]]
    lines = [f"### Sequential passes: {len(rows)} points, {len(rows) - len(bad)} pass, {len(bad)} fail", ""]
    worst = {}
    for r in rows:
        if not r["failed"]:
            k = (r["dtype"], r["gate"])
            worst[k] = max(worst.get(k, 0.0), max(e for _, e in r["err"].values()))
    lines += ["| dtype | gate | worst relative error (passing points) |", "|---|---|---|"]
    lines += [f"| {d} | {g} | {e:.2e} |" for (d, g), e in sorted(worst.items())]
    if bad:
        lines += ["", "Failures:", ""]
        lines += [f"- {r['dtype']} gate={r['gate']} K={r['K']} V={r['V']} C={r['C']} B={r['B']} H={r['H']} "
                  f"T={r['T']} h0={r['with_h0']}: {r['failed']}" for r in bad]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="_build/passes")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--timeout", type=float, default=400.0, help="per group of points, seconds")
    ap.add_argument("--kinds", nargs="*", help="dtype:gate pairs (default: passes.KINDS)")
    ap.add_argument("--keys", nargs="*", type=int, help="key head dims K (default: passes.HEAD_DIMS)")
    ap.add_argument("--values", nargs="*", type=int, help="value head dims V (default: passes.HEAD_DIMS)")
    a = ap.parse_args(argv)
    from linattn.conformance import passes
    kinds = passes.KINDS if not a.kinds else [(k.split(":")[0], int(k.split(":")[1])) for k in a.kinds]
    groups = list(passes.grid(kinds, head_dims=a.keys or passes.HEAD_DIMS, values=a.values))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(out / "results.jsonl", "w") as f, ThreadPoolExecutor(a.workers) as pool:
        for got, seconds in pool.map(lambda g: run_group(g, a.timeout), groups):
            for r in got:
                f.write(json.dumps(r) + "\n")
            f.flush()                                    # a run cut by its caller keeps every finished group
            rows += got
            g = got[0]
            print(f"{g['dtype']} gate={g['gate']} K={g['K']} V={g['V']}: "
                  f"{sum(not r['failed'] for r in got)}/{len(got)} pass ({seconds} s)", flush=True)
    md = summary(rows)
    (out / "summary.md").write_text(md)
    print(md)
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
