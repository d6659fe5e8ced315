"""Decoding measured (linattn/bench_decode.py), as a script: prints the table, writes JSON with --out.

    .venv/bin/python tools/bench_decode.py [--size small|full] [--op kda|gla] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from linattn import bench, bench_decode  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=bench_decode.__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(bench_decode.SIZES), default=None, help="default: linattn.device's choice")
    p.add_argument("--op", choices=["kda", "gla"], default="kda")
    p.add_argument("--out", default=None, help="JSON file to write (e.g. book/data/decode_gpu.json)")
    a = p.parse_args()
    r = bench_decode.measure(a.size, a.op)
    print(bench_decode.report(r))
    if a.out:
        bench.save_json(a.out, r)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
