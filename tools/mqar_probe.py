"""Why a gated layer recalls less: train it on the GPU MQAR task with its forget gate changed.

tools/mqar_gpu.py trains every layer as the library builds it. This probe trains one gated layer
(KDA by default) on the same task with the same settings, once per --gates variant:

    learned   the layer as built: log α = logsigmoid(x W₁W₂ + b)/16, b = 4 at initialisation
    fixed     the gate held at α = 1 (its output weights zero, its bias 40, not trained): the
              recurrence is then exactly the ungated one (KDA → DeltaNet) run through the gated kernels
    bias=B    the gate as built, but initialised with bias B (B = 12: α nearer 1 at the start)

    python tools/mqar_probe.py                                  # KDA: learned, fixed, bias=12
    python tools/mqar_probe.py --model gated_deltanet --steps 6000 --gates learned

Results go to --out (book/data/mqar_probe.json; chapter 14 shows them), one run per line printed.
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

from linattn import mqar  # noqa: E402
from linattn.validate import InputError  # noqa: E402
from mqar_gpu import write_record  # noqa: E402  (tools/, beside this script)

def set_gates(model, variant: str):
    """Change every block's forget gate in place as `variant` says (see the module docstring)."""
    for block in model.blocks:
        gate = getattr(block.mixer, "gate", None)
        if gate is None:
            raise InputError(f"--model {model.mixer_name!r} has no forget gate to probe")
        last = gate.out_layer
        if variant == "fixed":
            torch.nn.init.zeros_(last.weight)
            torch.nn.init.constant_(last.bias, 40.0)        # logsigmoid(40)/16 ≈ −3e-19: α = 1 in float32
            gate.requires_grad_(False)
        elif variant.startswith("bias="):
            torch.nn.init.constant_(last.bias, float(variant[5:]))
        elif variant != "learned":
            raise InputError(f"--gates: each variant must be learned, fixed or bias=<number>, got {variant!r}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kda", help="a gated layer: gla, gated_deltanet or kda")
    p.add_argument("--gates", default="learned,fixed,bias=12", help="variants (comma separated)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", default="auto")
    p.add_argument("--out", default=str(ROOT / "book" / "data" / "mqar_probe.json"))
    p.add_argument("--append", action="store_true", help="keep the runs already in --out")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(a.out)
    runs = json.loads(out.read_text())["runs"] if a.append and out.exists() else []
    tests = [n for n in (a.pairs // 2, a.pairs, 2 * a.pairs) if n <= a.vocab // 2]   # as mqar_gpu.py's
    for variant in a.gates.split(","):
        torch.manual_seed(a.seed)
        model = mqar.RecallModel(a.model, a.vocab, d_model=a.d_model, n_heads=a.heads, layers=a.layers,
                                 impl=a.impl)
        set_gates(model, variant)
        start = time.perf_counter()
        mqar.train(model, n_pairs=a.pairs, vocab=a.vocab, steps=a.steps, batch_size=a.batch, lr=a.lr,
                   seed=a.seed, device=device, progress=False)
        acc = {str(n): mqar.accuracy(model, n, a.vocab, device=device) for n in tests}
        runs.append({"model": a.model, "gates": variant, "d_model": a.d_model, "heads": a.heads,
                     "layers": a.layers, "pairs": a.pairs, "vocab": a.vocab, "steps": a.steps,
                     "batch": a.batch, "lr": a.lr, "seed": a.seed, "accuracy": acc,
                     "seconds": round(time.perf_counter() - start, 1)})
        print(f"{a.model} gates={variant:9s} steps={a.steps} lr={a.lr:g} seed={a.seed} acc={acc}", flush=True)
        write_record(out, device, runs)                               # keep what is done if cut off


if __name__ == "__main__":
    main()
