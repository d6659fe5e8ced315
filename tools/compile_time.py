"""Cold compilation of one variant's kernels: the first forward + backward at several lengths and head
counts, with every compilation Triton makes logged (kernel, seconds, of them ptxas).

    TRITON_CACHE_DIR=$(mktemp -d) python tools/compile_time.py VARIANT [--dtype bfloat16] [--head-dim 128]
    python tools/compile_time.py --mqar-offline [MIXER:HEADS ...] [--workers 2]

One JSON line per call (seconds, kernels compiled) and a last line with the total and the slowest
kernels. Give it a fresh TRITON_CACHE_DIR: a warm cache compiles nothing. GPU only (the interpreter
compiles nothing).

--mqar-offline needs no GPU: it records the launches one training step and one evaluation of each of
chapter 14's GPU models make (tools/arch_check.py's recorder: no kernel runs), and compiles every
distinct one for sm_90 through ptxas in a fresh cache (`workers` at a time), with the pipeline stages
`common.launch` would end on for an H200: each model's kernels, and the seconds compiling them one
after another takes on this machine (default: the models chapter 14 trains, MIXER:HEADS).
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


# chapter 14 on a GPU: d_model 64, two blocks, batch 128, vocabulary 512, 32 pairs; its six models
# (softmax attention compiles nothing of ours) and the two trained again with half the heads
MQAR = dict(d_model=64, layers=2, batch=128, vocab=512, pairs=32)
MQAR_MODELS = ["linear:2", "gla:2", "deltanet:2", "gated_deltanet:2", "kda:2", "linear:1", "deltanet:1"]
_RECORDS = []                     # the launches to compile (forked workers inherit them: they do not pickle)


def mqar_offline(models, workers: int) -> tuple:
    """({model: [(kernel, seconds) of each distinct launch it makes]}, the number of distinct launches
    of all the models together, and their seconds), compiled offline for sm_90 (module doc)."""
    import os
    import tempfile

    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import arch_check
    import torch

    arch_check._native_import()
    from linattn import dispatch, mqar, outputs, validate

    validate.value_checks(False)
    real_empty = outputs.empty
    outputs.empty = lambda *a, **k: torch.zeros(*a, **k)      # no kernel runs: keep the layers' data finite
    for op in dispatch.OPS:
        dispatch.set_impl(op, "triton")
    try:
        launches = {}
        for model in models:
            mixer, heads = model.split(":")
            job = dict(mixer=mixer, vocab=MQAR["vocab"], d_model=MQAR["d_model"], n_heads=int(heads),
                       layers=MQAR["layers"], n_pairs=MQAR["pairs"], batch_size=MQAR["batch"])
            with arch_check.recording() as recs:
                mqar.first_step(job, "cpu")                       # what mqar.warm_up runs for the model
            launches[model] = {_variant(r): r for r in recs}
    finally:
        outputs.empty = real_empty
        for op in dispatch.OPS:
            dispatch.set_impl(op, "auto")
    distinct = {k: r for by in launches.values() for k, r in by.items()}
    _RECORDS[:] = list(distinct.values())
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        seconds = dict(zip(distinct, pool.map(_compile_for_h200, range(len(_RECORDS)))))
    return ({model: [(k[0], seconds[k]) for k in by] for model, by in launches.items()}, len(seconds),
            sum(seconds.values()))


def _variant(r) -> tuple:
    import arch_check
    return (r.fn.__name__, str(sorted(arch_check._constexprs(r).items())), str(r.signature), r.warps,
            r.max_stages or r.stages)


def _compile_for_h200(i: int) -> float:
    """Seconds to compile record i with each stage count common.launch tries on an H200, down to the
    first that fits."""
    import arch_check
    r, start = _RECORDS[i], time.perf_counter()
    for stages in range(r.max_stages or r.stages, 0, -1):
        res = arch_check.compile_one(r, 90, stages)
        if "error" not in res and res["shared"] <= arch_check.ARCHS[90][1]:
            break
    return round(time.perf_counter() - start, 2)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--mqar-offline":
        ap = argparse.ArgumentParser(description="chapter 14's kernels compiled offline for sm_90")
        ap.add_argument("models", nargs="*", default=MQAR_MODELS, metavar="MIXER:HEADS")
        ap.add_argument("--workers", type=int, default=2)
        a = ap.parse_args(argv[1:])
        by_model, distinct, together = mqar_offline(a.models, a.workers)
        for model, kernels in by_model.items():
            print(json.dumps(dict(model=model, kernels=len(kernels), seconds=round(sum(s for _, s in kernels), 1),
                                  slowest=sorted(kernels, key=lambda ks: -ks[1])[:2])), flush=True)
        print(json.dumps(dict(models=len(by_model), distinct_launches=distinct,
                              seconds_one_after_another=round(together, 1))))
        return 0
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
