"""Train the MQAR models of chapter 14 at GPU size and record the results in book/data/mqar.json.

Chapter 14 trains CPU-sized models live; on a CPU it also shows this recorded GPU run. Each model
(softmax attention, linear attention, GLA, DeltaNet, Gated DeltaNet, KDA) is trained at every
model width in --dims on MQAR with up to --pairs key-value pairs, then its recall accuracy is
measured for several numbers of pairs. The file holds the device, versions and date of the run.

    python tools/mqar_gpu.py                          # the default sweep (about 5 min per width and task on an H200)
    python tools/mqar_gpu.py --steps 300 --dims 64    # a quick look
    python tools/mqar_gpu.py --dims 64 --pairs 32 && python tools/mqar_gpu.py --dims 64 --pairs 64 --append
                                                      # split over two calls, one file
    python tools/mqar_gpu.py --dims 64 --pairs 64 --lr 1e-3,1e-2 --append   # more learning rates
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linattn import bench, mqar  # noqa: E402

MODELS = ("softmax", "linear", "gla", "deltanet", "gated_deltanet", "kda")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dims", default="32,64", help="model widths d_model (comma separated)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pairs", default="32,64", help="most key-value pairs per training sequence (comma separated: "
                                                  "one task per number)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", default="3e-3", help="learning rates (comma separated: a sweep; the published MQAR "
                                              "comparisons report each model at its best)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", default="auto", help="level the linear layers train through (auto: Triton on CUDA)")
    p.add_argument("--append", action="store_true",
                   help="keep the runs already in --out (split a sweep over several calls)")
    p.add_argument("--out", default=str(ROOT / "book" / "data" / "mqar.json"))
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dims = [int(x) for x in a.dims.split(",")]
    runs = _previous_runs(a) if a.append else []
    lrs = [float(x) for x in a.lr.split(",")]
    for pairs, d, name, lr in itertools.product([int(x) for x in a.pairs.split(",")], dims, a.models.split(","), lrs):
        # up to twice the longest training list: beyond it, whether a memory generalises
        test_pairs = sorted(n for n in {max(1, pairs // 8), pairs // 4, pairs // 2, pairs, 3 * pairs // 2,
                                        2 * pairs} if n <= a.vocab // 2)
        torch.manual_seed(a.seed)
        model = mqar.RecallModel(name, a.vocab, d_model=d, n_heads=a.heads, layers=a.layers,
                                 **({} if name == "softmax" else {"impl": a.impl}))
        start = time.perf_counter()
        run = mqar.train(model, n_pairs=pairs, vocab=a.vocab, steps=a.steps, batch_size=a.batch,
                         lr=lr, seed=a.seed, device=device, name=f"{name} d={d} lr={lr:g}")
        acc = {str(n): mqar.accuracy(model, n, a.vocab, device=device) for n in test_pairs}
        runs.append({"model": name, "d_model": d, "pairs": pairs, "lr": lr, "test_pairs": test_pairs,
                     "state_size": run.state_size, "accuracy": acc, "seconds": round(time.perf_counter() - start, 1),
                     "losses": [round(x, 4) for x in run.losses[:: max(1, a.steps // 200)]]})
        print(f"{name:15s} d={d:4d} pairs={pairs:3d} lr={lr:g} state={run.state_size:7d} acc={acc} "
              f"{runs[-1]['seconds']} s", flush=True)
        _save(a, device, runs)                                   # keep what is done if cut off


def _config(a) -> dict:
    """What every run of one file shares (the number of pairs, the width and the learning rate vary per run)."""
    return {k: getattr(a, k) for k in ("heads", "layers", "vocab", "steps", "batch", "seed")}


def _previous_runs(a) -> list:
    if not Path(a.out).exists():
        return []
    old = json.loads(Path(a.out).read_text())
    if old["config"] != _config(a):
        raise SystemExit(f"--append: {a.out} was made with {old['config']}, this call has {_config(a)}; "
                         "use the same settings or another --out")
    return old["runs"]


def _save(a, device, runs):
    write_record(a.out, device, runs, config=_config(a))


def write_record(path, device, runs, **fields):
    """Write a recorded run: device, versions and date (no FLA: these runs do not use it), runs."""
    env = bench.environment()
    env.pop("fla", None)
    Path(path).write_text(json.dumps({"env": env, "device": device, **fields, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
