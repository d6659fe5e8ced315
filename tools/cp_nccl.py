"""Context parallelism across processes: the max relative error of every operation against the
float64 single-process result.

    python tools/cp_nccl.py                      # NCCL, one process per GPU (2 GPUs)
    python tools/cp_nccl.py --backend gloo       # the same check on the CPU
    python tools/cp_nccl.py --world 4 --T 4096

Each rank holds a contiguous slice of the sequence, computes its affine map (M_r, B_r) from a zero
state, the maps are all-gathered and folded, and each rank corrects its outputs with its true
entering state (linattn/context.py). Processes are started with torch.multiprocessing and meet on
a free port of 127.0.0.1. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1) — set here, before any process group exists.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, no install

import torch  # noqa: E402

from linattn import context, testing  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    p.add_argument("--world", type=int, default=2, help="number of processes (GPUs for nccl)")
    p.add_argument("--T", type=int, default=context.SIZES["T"], help="sequence length")
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--ops", nargs="+", default=list(context.OPS), choices=list(context.OPS))
    args = p.parse_args(argv)
    if args.backend == "nccl" and torch.cuda.device_count() < args.world:
        sys.exit(f"--backend nccl needs {args.world} GPUs, found {torch.cuda.device_count()}")
    sizes = {**context.SIZES, "T": args.T}
    start = time.perf_counter()
    errors = context.selfcheck(args.world, args.backend, args.ops, sizes=sizes,
                               chunk_size=args.chunk_size)
    tol = testing.tolerance(torch.float32)
    print(f"context parallel, backend {args.backend}, {args.world} processes, sizes {sizes}, "
          f"chunk {args.chunk_size} ({time.perf_counter() - start:.1f} s)")
    ok = True
    for op, e in errors.items():
        good = e["o"] <= tol and e["final_state"] <= tol
        ok &= good
        print(f"  {op:12s} max rel err: outputs {e['o']:.2e}  final state {e['final_state']:.2e}  "
              f"(vs {e['ref']} float64)  {'ok' if good else 'FAIL'}")
    print("all within", tol if ok else "— FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
