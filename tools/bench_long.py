"""One long sequence measured (linattn/bench_long.py), as a script: prints the table, writes JSON with --out.

    .venv/bin/python tools/bench_long.py [--size small|full] [--only OP ...] [--modes forward train] [--warm] [--out FILE]

--warm compiles only (each callable run once, nothing timed): run one such process per op in
parallel first, then the timing run finds every kernel in Triton's cache (linattn.bench.table_cli).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from linattn import bench, bench_long  # noqa: E402

if __name__ == "__main__":
    bench.table_cli(bench_long, "book/data/long_sequence.json")
