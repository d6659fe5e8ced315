"""One long sequence measured: B = 1, few heads, tens of thousands of tokens, where a walk over the
chunks per (sequence, head) leaves most of a GPU idle, and the library cuts the walks into segments
(linattn/triton/segments.py).

    from linattn import bench_long; print(bench_long.report(bench_long.measure()))
    python tools/bench_long.py [--size small|full] [--only OP ...] [--out FILE]   (the same, as a script)

For each op of linattn.bench.OPS, forward alone and forward + backward (every floating input's
gradient of <o, dO>), at the Triton level:

  ours      the default call a user makes (segments where `segments.length` says they pay)
  one walk  the same call with every walk kept whole (`segments.fixed(0)`): what segments change
  fla       FLA's chunk kernel on the same inputs (its refusal recorded where it refuses)

Sizes come from linattn.device (--size overrides): on a GPU bf16, K = V = 128, H = 16 and 4,
T = 32k, 64k and 128k tokens; on a CPU a small copy under the Triton interpreter with segments
forced to two chunks, where times measure Python, not kernels. Medians (linattn.bench.median_ms).
A benchmark, not a test: nothing about speed is asserted.
"""
from __future__ import annotations

import contextlib

import torch

from . import bench

SIZES = {
    "small": dict(Ts=(256,), Hs=(2,), K=32, V=32, dtype=torch.float32, chunks=2),
    "full": dict(Ts=(32768, 65536, 131072), Hs=(16, 4), K=128, V=128, dtype=torch.bfloat16, chunks=None),
}
MODES = ("forward", "train")
LAYOUTS = ("ours", "one_walk", "fla")


def callables(op: str, mode: str, T: int, H: int, cfg: dict, dev: str) -> dict:
    """layout -> (a no-argument callable, the segment override it runs under) for one op, mode, T, H."""
    from .dispatch import level_fn
    from .triton import segments

    fn = level_fn(bench.OPS[op][0], "triton")
    args = bench.anchor_inputs(op, T, tokens=T, H=H, K=cfg["K"], V=cfg["V"], dtype=cfg["dtype"], device=dev)

    def make(f):
        return bench.train_call(f, args) if mode == "train" else (lambda: f(**args))
    forced = contextlib.nullcontext if cfg["chunks"] is None else (lambda: segments.fixed(cfg["chunks"]))
    fla = bench.fla_fn(op)
    return {"ours": (lambda: make(fn), forced), "one_walk": (lambda: make(fn), lambda: segments.fixed(0)),
            "fla": (None if fla is None else lambda: make(fla), contextlib.nullcontext)}


def measure(size: str | None = None, only=None, progress=print, modes=MODES, warm_only=False) -> dict:
    """Milliseconds of every op × mode × H × T × layout; failures (FLA's refusals, out of memory)
    recorded. warm_only: run each callable once and time nothing (compiles the kernels into Triton's
    cache, so that several processes can compile in parallel before one process times)."""
    size, cfg, dev = bench.sized(SIZES, size)
    rows = []
    for op in bench.selected_ops(only):
        for mode in modes:
            for H in cfg["Hs"]:
                for T in cfg["Ts"]:
                    row = {"op": op, "mode": mode, "H": H, "T": T}
                    for layout, (make, within) in callables(op, mode, T, H, cfg, dev).items():
                        with within():
                            bench.measure_layout(row, layout, make, warm_only)
                    rows.append(row)
                    if not warm_only:
                        progress(bench_line(row))
    return {"env": bench.environment(), "size": size,
            "setting": {n: (str(v).replace("torch.", "") if n == "dtype" else v) for n, v in cfg.items()},
            "rows": rows}


def bench_line(row: dict) -> str:
    return f"{row['op']:17s} {row['mode']:7s} H={row['H']:<3d} T={row['T']:<7d} " + bench.layout_cells(row, LAYOUTS)


def report(r: dict) -> str:
    """The table a chapter prints: ms of each layout and ours' ratios."""
    cfg = r["setting"]
    head = f"{bench.run_label(r['env'])}\nB = 1, {cfg['dtype']}, K = {cfg['K']}, V = {cfg['V']}\n"
    cols = ["op", "pass", "H", "T", "ours ms", "one walk ms", "FLA ms", "ours ÷ one walk", "ours ÷ FLA"]
    rows = [[x["op"], x["mode"], x["H"], x["T"], x.get("ours"), x.get("one_walk"), x.get("fla"),
             bench.ratio(x, "ours", "one_walk"), bench.ratio(x, "ours", "fla")] for x in r["rows"]]
    return head + "\n" + bench.markdown_table(cols, rows)
