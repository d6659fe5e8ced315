"""One long sequence measured (linattn/bench_long.py), as a script: prints the table, writes JSON with --out.

    .venv/bin/python tools/bench_long.py [--size small|full] [--only OP ...] [--modes forward train] [--warm] [--out FILE]

--warm compiles only (each callable run once, nothing timed): run one such process per op in
parallel first, then the timing run finds every kernel in Triton's cache.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from linattn import bench, bench_long  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=bench_long.__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(bench_long.SIZES), default=None, help="default: linattn.device's choice")
    p.add_argument("--only", nargs="+", choices=sorted(bench.OPS), default=None)
    p.add_argument("--modes", nargs="+", choices=bench_long.MODES, default=bench_long.MODES)
    p.add_argument("--warm", action="store_true", help="compile only, time nothing")
    p.add_argument("--out", default=None, help="JSON file to write (e.g. book/data/long_sequence.json)")
    a = p.parse_args()
    r = bench_long.measure(a.size, a.only, modes=a.modes, warm_only=a.warm)
    if a.warm:
        return
    print(bench_long.report(r))
    if a.out:
        bench.save_json(a.out, r)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
