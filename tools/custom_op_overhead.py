"""What calling an operation through its custom op (linattn.ops) costs on the CPU, against the
level called directly, and what torch.compile of a layer costs against the eager layer.

    python tools/custom_op_overhead.py [--out docs/data/custom_ops_overhead.json] [--repeat 7]

ops:    each op at the chunk level, B = 2, T = 256, H = 4, K = V = 32, float32, gates and β as a
        layer makes them: forward without grad, and forward + backward (gradients of every input).
layers: each layer of linattn.nn (d_model = 128, 4 heads, B = 2, T = 256): forward + backward,
        eager and torch.compile(fullgraph=True, backend="aot_eager"), timed after the compile.
The fastest of --repeat calls, alternating between the two ways (see `fastest_ms`). Writes the
JSON with the device, versions and date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import linattn  # noqa: E402
from linattn import nn as lnn, ops  # noqa: E402

B, T, H, K, V = 2, 256, 4, 32, 32
D_MODEL, HEADS = 128, 4


def fastest_ms(fns: dict, repeat) -> dict:
    """The fastest of `repeat` calls of each function, in milliseconds. The calls alternate
    between the functions, so that load from other processes falls on all of them alike, and the
    minimum is the call that was least disturbed (on a shared CPU the median is not)."""
    times = {name: [] for name in fns}
    for name, fn in fns.items():
        fn()                                                          # warm-up
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {name: min(ts) for name, ts in times.items()}


def inputs(op, grad):
    gen = torch.Generator().manual_seed(0)
    made = dict(q=torch.randn(B, T, H, K, generator=gen), k=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
                v=torch.randn(B, T, H, V, generator=gen),
                g=F.logsigmoid(torch.randn(B, T, H, K, generator=gen)) / 16,
                beta=torch.rand(B, T, H, generator=gen))
    return [made[n].requires_grad_(grad) for n in ops.TENSORS[op]]


def op_rows(repeat):
    rows = []
    for op in ops.TENSORS:
        direct = lambda *xs, op=op: getattr(linattn, op)(*xs, impl="chunk")   # noqa: E731
        via_op = lambda *xs, op=op: ops.call(op, xs, level="chunk")          # noqa: E731
        plain, needy = inputs(op, False), inputs(op, True)

        def forward(fn):
            def run():
                with torch.no_grad():
                    fn(*plain)
            return run

        def train(fn):
            return lambda: fn(*needy)[0].sum().backward()

        row = {"op": op}
        row.update({f"{k}_forward_ms": x for k, x in fastest_ms(
            {"direct": forward(direct), "custom_op": forward(via_op)}, repeat).items()})
        row.update({f"{k}_train_ms": x for k, x in fastest_ms(
            {"direct": train(direct), "custom_op": train(via_op)}, repeat).items()})
        rows.append(row)
    return rows


def layer_rows(repeat):
    rows = []
    for name, cls in lnn.LAYERS.items():
        torch.manual_seed(0)
        layer = cls(D_MODEL, HEADS)
        x = torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(1))
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        step = lambda fn: (lambda: fn(x)[0].square().sum().backward())   # noqa: E731
        times = fastest_ms({"eager": step(layer), "compiled": step(compiled)}, repeat)
        rows.append({"layer": name, **{f"{k}_train_ms": t for k, t in times.items()}})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/data/custom_ops_overhead.json")
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    result = {
        "device": f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "date": datetime.date.today().isoformat(),
        "setting": {"B": B, "T": T, "H": H, "K": K, "V": V, "dtype": "float32", "level": "chunk",
                    "layers": f"d_model {D_MODEL}, {HEADS} heads, aot_eager", "repeat": a.repeat},
        "ops": op_rows(a.repeat),
        "layers": layer_rows(a.repeat),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in result["ops"] + result["layers"]:
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()})


if __name__ == "__main__":
    main()
