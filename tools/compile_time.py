"""Cold compilation of one variant's kernels: the first forward + backward at several lengths and head
counts, with every compilation Triton makes logged (kernel, seconds, of them ptxas).

    TRITON_CACHE_DIR=$(mktemp -d) python tools/compile_time.py VARIANT [--dtype bfloat16] [--head-dim 128]

One JSON line per call (seconds, kernels compiled) and a last line with the total and the slowest
kernels. Give it a fresh TRITON_CACHE_DIR: a warm cache compiles nothing. GPU only (the interpreter
compiles nothing).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (T, H): one chunk, a partial one, a single token, an odd head count, a long sequence with 16 heads
# and with one: every length and head class Triton would specialise on by default
CALLS = [(64, 4), (65, 4), (1, 4), (100, 3), (1000, 16), (1000, 1)]


def main(argv=None) -> int:
    import torch

    import linattn.triton as lt  # first: it decides Triton's mode before triton is imported
    from linattn import testing
    from triton import knobs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant", choices=list(testing.VARIANTS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools/compile_time.py needs a GPU")
    op, gate = testing.VARIANTS[a.variant]
    compiled = []

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:
            stages = dict(times.lowering_stages)
            compiled.append(dict(kernel=getattr(src, "name", "?"), seconds=round(times.total / 1e6, 2),
                                 ptxas=round(stages.get("cubin", 0) / 1e6, 2)))

    knobs.compilation.listener = listener
    total = 0.0
    for T, H in CALLS:
        x = testing.make_inputs(op, B=1, T=T, H=H, K=a.head_dim, V=a.head_dim, dtype=getattr(torch, a.dtype),
                                device="cuda", gate=gate or "per_dim", initial_state=True)
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        before = len(compiled)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o, S = getattr(lt, op)(**leaves, output_final_state=True)
        (o.float().sum() + S.sum()).backward()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        total += dt
        print(json.dumps(dict(variant=a.variant, dtype=a.dtype, T=T, H=H, seconds=round(dt, 1),
                              compiled=len(compiled) - before)), flush=True)
    print(json.dumps(dict(variant=a.variant, dtype=a.dtype, K=a.head_dim, total_seconds=round(total, 1),
                          kernels=len(compiled), slowest=sorted(compiled, key=lambda c: -c["seconds"])[:4])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
