"""Train the MQAR models of chapter 14 at GPU size and record the results in book/data/mqar.json.

Chapter 14 trains CPU-sized models live; on a CPU it also shows this recorded GPU run. Each model
(softmax attention, linear attention, GLA, DeltaNet, Gated DeltaNet, KDA) is trained at every
model width in --dims on MQAR with up to --pairs key-value pairs, then its recall accuracy is
measured for several numbers of pairs. The file holds the device, versions and date of the run.

    python tools/mqar_gpu.py                          # the default sweep (about 5–8 min on an H200)
    python tools/mqar_gpu.py --steps 300 --dims 64    # a quick look
    python tools/mqar_gpu.py --dims 64 && python tools/mqar_gpu.py --dims 128 --append   # in two calls
"""
from __future__ import annotations

import argparse
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
    p.add_argument("--dims", default="64,128", help="model widths d_model (comma separated)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pairs", type=int, default=32, help="most key-value pairs per training sequence")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", default="auto", help="level the linear layers train through (auto: Triton on CUDA)")
    p.add_argument("--append", action="store_true",
                   help="keep the runs already in --out (split a sweep over several calls)")
    p.add_argument("--out", default=str(ROOT / "book" / "data" / "mqar.json"))
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dims = [int(x) for x in a.dims.split(",")]
    test_pairs = sorted({max(1, a.pairs // 8), a.pairs // 4, a.pairs // 2, a.pairs})
    runs = json.loads(Path(a.out).read_text())["runs"] if a.append and Path(a.out).exists() else []
    for d in dims:
        for name in a.models.split(","):
            torch.manual_seed(a.seed)
            model = mqar.RecallModel(name, a.vocab, d_model=d, n_heads=a.heads, layers=a.layers,
                                     **({} if name == "softmax" else {"impl": a.impl}))
            start = time.perf_counter()
            run = mqar.train(model, n_pairs=a.pairs, vocab=a.vocab, steps=a.steps, batch_size=a.batch,
                             lr=a.lr, seed=a.seed, device=device, name=f"{name} d={d}")
            acc = {str(n): mqar.accuracy(model, n, a.vocab, device=device) for n in test_pairs}
            runs.append({"model": name, "d_model": d, "state_size": run.state_size,
                         "accuracy": acc, "seconds": round(time.perf_counter() - start, 1),
                         "losses": [round(x, 4) for x in run.losses[:: max(1, a.steps // 200)]]})
            print(f"{name:15s} d={d:4d} state={run.state_size:7d} acc={acc} {runs[-1]['seconds']} s",
                  flush=True)
            _save(a, device, test_pairs, runs)                       # keep what is done if cut off


def _save(a, device, test_pairs, runs):
    env = bench.environment()
    env.pop("fla", None)
    config = {k: getattr(a, k) for k in ("heads", "layers", "pairs", "vocab", "steps", "batch", "lr", "seed")}
    out = {"env": env, "device": device, "config": config, "test_pairs": test_pairs, "runs": runs}
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
