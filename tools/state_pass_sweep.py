"""The gated backward's two sequential passes, each timed alone, launch by launch.

    python tools/state_pass_sweep.py [--T 4096 32768] [--gates dim head] [--launch 32x128:4:4 ...]
                                     [--tokens 32768] [--heads 16] [--dim 128]

The backward recomputes the states before every chunk in float32 (`gated.chunk_states`) and walks
the chunks in reverse for their gradients (`gated_backward.reverse_pass`). Both take a launch
`config` (BK, BV, pipeline stages, warps); the library's is `gated_backward.state_launches`. For each
T (B = tokens // T) and gate kind (per-dimension: GLA; per-head: simple GLA), with bf16 inputs and
normal gates (`bench.anchor_inputs`), this times the library's launch and every `--launch BKxBV:S:W`
(`bench.median_ms`: do_bench's median on a GPU) and prints a markdown table: ms, and each launch's
relative difference from the library launch's states (`testing.rel_err`; 0: bit for bit the same).
docs/data/gpu_training/state_pass_launches.md holds the run behind `state_launches`.

Timings mean something on a GPU only. On a CPU the interpreter runs it at a toy size (the test
does): warps and stages change nothing there, and the tiles compute in float32.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from linattn import bench, device, testing  # noqa: E402
from linattn.triton import gated, gated_backward  # noqa: E402
from linattn.triton.common import compute_dtype  # noqa: E402
from linattn.validate import check_inputs  # noqa: E402

import triton.language as tl  # noqa: E402  (after linattn, which decides Triton's mode)

# The launches of the recorded sweep (docs/data/gpu_training/state_pass_launches.md)
LAUNCHES = ["32x128:2:4", "32x128:4:4", "32x128:3:8", "64x64:3:4", "64x64:4:4", "64x64:2:8", "64x128:2:8",
            "32x64:4:4", "128x64:2:8"]
GATES = {"dim": "gla", "head": "simple_gla"}


def parse_launch(text: str) -> tuple:
    """'BKxBV:STAGES:WARPS' -> (BK, BV, stages, warps)."""
    try:
        blocks, stages, warps = text.split(":")
        bk, bv = blocks.lower().split("x")
        return int(bk), int(bv), int(stages), int(warps)
    except ValueError:
        raise SystemExit(f"--launch {text}: expected BKxBV:STAGES:WARPS, e.g. 32x128:4:4") from None


def label(cfg: tuple) -> str:
    return f"{cfg[0]}×{cfg[1]}, {cfg[2]} stages, {cfg[3]} warps"


def passes(op: str, T: int, size: dict):
    """(recompute(config), reverse(config)): each runs one pass on the same inputs and returns its
    states [B, H, NT, K, V] (float32)."""
    a = bench.anchor_inputs(op, T, device=device.default_device(), **size)
    q, k, v, g = a["q"], a["k"], a["v"], a["g"]
    do = torch.randn_like(v)
    d = check_inputs(q, k, v, g=g, gate=True)
    b = gated.gate_sums(g, 64)
    gate = gated_backward.gate_kind(g)

    # one walk per sequence (segs=None): the launches swept are those of the uncut pass (segments.py
    # decides separately whether to cut it)
    def recompute(config):
        return gated.chunk_states(k, v, g, d, b=b, chunk_size=64, dtype=torch.float32, config=config,
                                  segs=None)[0]

    def reverse(config):
        return gated_backward.reverse_pass(q, do, b, None, gate=gate, scale=d.scale, chunk_size=64,
                                           dh_dtype=torch.float32, with_ds0=False, config=config, segs=None)[0]
    ieee = compute_dtype(q.dtype) == tl.float32       # as gated_backward.backward decides it
    return (recompute, reverse), d, gate, ieee


def sweep(Ts, gates, launches, size) -> list:
    """Rows [pass, setting, launch, ms, relative difference from the library's launch]."""
    rows = []
    for kind in gates:
        op = GATES[kind]
        for T in Ts:
            (recompute, reverse), d, gate, ieee = passes(op, T, size)
            own = gated_backward.state_launches(d.K, d.V, d.B * d.H, gate, ieee, 64)
            setting = f"{op}, B = {d.B}, T = {T}"
            for name, run, mine in (("recomputed states", recompute, own[0]), ("reverse pass", reverse, own[1])):
                ref = run(mine)
                rows.append([name, setting, "library: " + label(mine), bench.median_ms(lambda: run(mine)), 0.0])
                for cfg in launches:
                    rows.append([name, setting, label(cfg), bench.median_ms(lambda: run(cfg)), testing.rel_err(run(cfg), ref)])
                print(f"{setting}: {name} done", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--gates", nargs="+", choices=list(GATES), default=list(GATES))
    p.add_argument("--launch", nargs="*", default=LAUNCHES, metavar="BKxBV:S:W")
    p.add_argument("--tokens", type=int, default=32768, help="B·T (small only to try the script on a CPU)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="K = V")
    a = p.parse_args(argv)
    launches = [parse_launch(x) for x in a.launch]
    size = {"tokens": a.tokens, "H": a.heads, "K": a.dim, "V": a.dim}
    print(f"# python tools/state_pass_sweep.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    env = bench.environment()
    print(f"# {bench.run_label(env)}; H = {a.heads}, K = V = {a.dim}, bf16, chunk 64, normal gates\n")
    rows = sweep(a.T, a.gates, launches, size)
    print(bench.markdown_table(["pass", "setting", "launch", "ms", "rel. difference"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
