"""Packed sequences measured: one row of documents of different lengths (`cu_seqlens`) against the
same tokens as an equal-length batch, against every document padded to the longest, and against
flash-linear-attention's `cu_seqlens` path on the same row.

    from linattn import bench_packing; print(bench_packing.report(bench_packing.measure()))
    python tools/bench_packing.py [--size small|full] [--only OP ...] [--out FILE]   (the same, as a script)

For each op of linattn.bench.OPS, forward alone and forward + backward (every floating input's
gradient of <o, dO>), the default call a user makes at the Triton level:

  packed    one row [1, ΣL, H, ·] with cu_seqlens: the mix of document lengths below
  equal     the same number of tokens as a batch of equal-length rows [N, ΣL / N, H, ·]
  longest   the same number of tokens as rows of the longest document [ΣL / max L, max L, H, ·]:
            a kernel that walks a sequence's chunks in order lasts as long as its longest sequence,
            so this is what the packed row would cost if the kernels paid nothing for the boundaries
  padded    every document right-padded to the longest, [N, max L, H, ·]: what a user without
            cu_seqlens runs (its time counts only the real tokens as work)
  fla       FLA's chunk kernel on the packed row with its cu_seqlens (forward + backward where FLA
            runs its backward on this toolchain; the row records its refusal otherwise)

Sizes come from linattn.device (--size overrides, as LINATTN_SIZE does): on a GPU the anchor setting
(bf16, H = 16, K = V = 128) and eight documents of 256 to 16,384 tokens, 32,768 in all; on a CPU a
small copy under the Triton interpreter, where times measure Python, not kernels. Times are
medians (linattn.bench.median_ms). A benchmark, not a test: nothing about speed is asserted.
"""
from __future__ import annotations

import torch

from . import bench

SIZES = {
    "small": dict(lengths=(64, 32, 16, 8, 4, 2, 1, 1), H=2, K=32, V=32, dtype=torch.float32),
    "full": dict(lengths=(16384, 8192, 4096, 2048, 1024, 512, 256, 256), H=16, K=128, V=128,
                 dtype=torch.bfloat16),
}
MODES = ("forward", "train")
LAYOUTS = ("packed", "equal", "longest", "padded", "fla")


def row_inputs(op: str, lengths, *, H, K, V, dtype, dev) -> tuple:
    """(args of the packed row [1, ΣL, ...], cu_seqlens int64 [N+1]) at the anchor gates."""
    total = sum(lengths)
    args = bench.anchor_inputs(op, total, tokens=total, H=H, K=K, V=V, dtype=dtype, device=dev)
    cu = torch.tensor((0,) + tuple(lengths), device=dev).cumsum(0)
    return args, cu


def callables(op: str, mode: str, cfg: dict, dev: str) -> dict:
    """layout -> a no-argument callable for one op and mode (None for "fla" where FLA is absent)."""
    from .dispatch import level_fn

    L = cfg["lengths"]
    size = dict(H=cfg["H"], K=cfg["K"], V=cfg["V"], dtype=cfg["dtype"], device=dev)
    fn = level_fn(bench.OPS[op][0], "triton")
    row, cu = row_inputs(op, L, dev=dev, **{n: size[n] for n in ("H", "K", "V", "dtype")})
    equal = bench.anchor_inputs(op, sum(L) // len(L), tokens=sum(L), **size)
    longest = bench.anchor_inputs(op, max(L), tokens=sum(L), **size)
    padded = bench.anchor_inputs(op, max(L), tokens=len(L) * max(L), **size)

    def ours(args, **kw):
        f = (lambda **a: fn(**a, **kw))
        return bench.train_call(f, args) if mode == "train" else (lambda: f(**args))
    out = {"packed": ours(row, cu_seqlens=cu), "equal": ours(equal), "longest": ours(longest),
           "padded": ours(padded)}
    fla = bench.fla_fn(op)
    out["fla"] = (None if fla is None else
                  bench.train_call(fla, row, cu_seqlens=cu) if mode == "train" else (lambda: fla(**row, cu_seqlens=cu)))
    return out


def measure(size: str | None = None, only=None, progress=print, warm_only=False, modes=MODES) -> dict:
    """Milliseconds of every op × mode × layout; failures (FLA's refusals, out of memory) recorded.
    warm_only: run each callable once and time nothing (compiles the kernels into Triton's cache, so
    that several processes can compile in parallel before one process times)."""
    size, cfg, dev = bench.sized(SIZES, size)
    rows = []
    for op in bench.selected_ops(only):
        for mode in modes:
            row = {"op": op, "mode": mode}
            for layout, fn in callables(op, mode, cfg, dev).items():
                bench.measure_layout(row, layout, None if fn is None else (lambda fn=fn: fn), warm_only)
            rows.append(row)
            progress(bench_line(row))
    return {"env": bench.environment(), "size": size,
            "setting": {n: (str(v).replace("torch.", "") if n == "dtype" else v) for n, v in cfg.items()},
            "rows": rows}


def tokens_per_ms(row: dict, layout: str, cfg: dict):
    """Real tokens per millisecond of a layout (padding does not count), None where it did not run."""
    ms = row.get(layout)
    return None if ms is None else sum(cfg["lengths"]) / ms


def bench_line(row: dict) -> str:
    return f"{row['op']:17s} {row['mode']:7s} " + bench.layout_cells(row, LAYOUTS)


def report(r: dict) -> str:
    """The table a chapter prints: ms of each layout and packed's ratio to the others."""
    cfg = r["setting"]
    head = (f"{bench.run_label(r['env'])}\n{cfg['dtype']}, H = {cfg['H']}, K = V = {cfg['K']}, "
            f"documents of {', '.join(map(str, cfg['lengths']))} tokens ({sum(cfg['lengths'])} in all)\n")
    cols = ["op", "pass", "packed ms", "equal-length ms", "longest-length ms", "padded ms", "FLA packed ms",
            "packed ÷ equal", "packed ÷ longest", "packed ÷ padded", "packed ÷ FLA"]
    rows = [[x["op"], x["mode"], x.get("packed"), x.get("equal"), x.get("longest"), x.get("padded"), x.get("fla"),
             bench.ratio(x, "packed", "equal"), bench.ratio(x, "packed", "longest"), bench.ratio(x, "packed", "padded"),
             bench.ratio(x, "packed", "fla")]
            for x in r["rows"]]
    return head + "\n" + bench.markdown_table(cols, rows)
