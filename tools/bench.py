"""Forward timings of every op × level against SDPA and FLA, at the anchor setting (ANCHORS.md).

    python tools/bench.py [--suite anchors|chunks|resources|train|all] [--T 1024 2048 ...] [--out DIR]
    python tools/bench.py --suite train --warm --ops OP          (compile only; one process per op, in parallel)
    python tools/bench.py --suite train|anchors --out DIR2 --resume DIR1 (time the rows DIR1's cut run lacks)

anchors:   each op × level × T ∈ {1k … 32k}, H=16, K=V=128, B·T = 32768 tokens, bf16, forward;
           the gated ops with each gate distribution of bench.GATE_SWEEP (--gates): mild,
           logsigmoid(randn)/16, in "rows" (what the chapters read), the others in "by_gates";
           FLA 0.6.0 (when importable) and SDPA causal in the same run on the same inputs; median
           of triton.testing.do_bench; ratios to FLA.
chunks:    GLA (per-dim gate) with materialised states as the chunk size C grows 16 … 256:
           the inter-chunk state pass alone vs the rest (intra-chunk tiles + q·S) — the shape of the
           GLA paper's Figure 2 (right).
resources: registers, spills and shared memory of each compiled kernel (natively only).
train:     forward + backward of every op × T at the anchor setting (bf16, gradients for every input
           that has one), ours (recompute=True, and recompute=False where the op has it) against FLA
           0.6.0 and SDPA causal on the same inputs; peak memory of each (torch.cuda.max_memory_allocated
           after a reset); where FLA refuses a backward the row says so. Plus the milliseconds of each
           backward stage of GLA/linear attention at one T (gated_backward.backward(timer=)).
Writes DIR/bench.json (results + device, date, versions), DIR/bench.md (tables), DIR/bench.png.
Each row times the default call, exactly what a user runs (value checks as the library decides: off
for GPU tensors); each Triton result is compared once with the chunk level.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from linattn import bench, testing  # noqa: E402

TS = [1024, 2048, 4096, 8192, 16384, 32768]
PYTHON_LEVELS = ("chunk", "naive")  # Python loops over chunks / tokens: seconds of device time per point


def triton_ops():
    """Ops the Triton level has in this tree (delta.py may not exist yet)."""
    import linattn.triton as lt

    return [op for op, (fn, _, _) in bench.OPS.items() if hasattr(lt, fn)]


def levels_for(op):
    modes = ["triton", "triton:fused", "triton:states"] if op in ("linear_attn", "gla", "simple_gla") else ["triton"]
    return modes + ["chunk", "naive"]


def call_for(op, level, args):
    if level.startswith("triton"):
        kw = {"mode": level.split(":")[1]} if ":" in level else {}
        return bench.library_call(op, "triton", args, **kw)
    return bench.library_call(op, level, args)


def check(op, args, fn):
    """Relative error of a Triton output against the chunk level (float32 compute) on the same inputs."""
    o = fn()[0]
    ref = bench.library_call(op, "chunk", {n: a.float() for n, a in args.items()})()[0]
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return testing.rel_err(o, ref)


def gate_runs(op, gates):
    """The gate distributions op is timed with: each of `gates` for a gated op, None for the others."""
    return list(gates) if op in bench.GATED else [None]


def place(res, row):
    """A row goes to res["rows"] (mild gates, "normal", or none: what the chapters read) or to
    res["by_gates"][distribution]."""
    if row["gates"] in (None, "normal"):
        res["rows"].append(row)
    else:
        res["by_gates"].setdefault(row["gates"], []).append(row)


def order(rows):
    rows.sort(key=lambda r: (list(bench.OPS).index(r["op"]), r["T"]))   # --T may come in any order


def suite_anchors(Ts, log, size, all_levels=False, save=None, only=None, gates=bench.GATE_SWEEP, warm=False,
                  done=None):
    """done: {(op, T, gates): row} of an earlier run of the same setting (`done_rows`), kept as they
    are; warm: only call everything once (compile Triton's and FLA's kernels), time nothing."""
    ops = [op for op in triton_ops() if not only or op in only]
    done = done or {}
    if warm:                              # compile only: every Triton mode and FLA's call once
        for T in Ts:
            for op in ops:
                for gs in gate_runs(op, gates):
                    if (op, T, gs) not in done:
                        warm_anchor(op, T, gs, size)
                        log(f"compiled {op} T={T} gates={gs}")
        return {}
    bw = bench.copy_bandwidth() if torch.cuda.is_available() else None
    if bw:
        log(f"device copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    missing = [op for op in bench.OPS if op not in triton_ops() and (not only or op in only)]
    res = {"rows": [], "by_gates": {}}
    for T in Ts:
        todo = [(op, gs) for op in ops for gs in gate_runs(op, gates) if (op, T, gs) not in done]
        sd = bench.median_ms(bench.sdpa_call(T, tokens=size["tokens"], H=size["H"], D=size["K"],
                                             device=size["device"])) if todo else None
        for op in ops:
            for gs in gate_runs(op, gates):
                if (op, T, gs) in done:
                    place(res, done[op, T, gs])
                    continue
                row = anchor_row(op, T, gs, sd, bw, size, Ts, all_levels)
                place(res, row)
                for rows in (res["rows"], *res["by_gates"].values()):
                    order(rows)
                if save:
                    save(dict(res, notes=[]))
                log(label(row) + ": " + ", ".join(f"{k}={v:.3g}" for k, v in row.items() if isinstance(v, float)))
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    skipped = "naive" if all_levels else "chunk and naive"
    notes = [f"{skipped}: timed at T = {Ts[0]} only: Python loops over chunks or tokens cost seconds of "
             "device time per point and are not what the table compares (--all-levels times chunk at every T)"] + [f"{op}: linattn.triton has no {bench.OPS[op][0]} in this tree" for op in missing]
    notes.append("rows: mild gates (logsigmoid(x)/16) or none; by_gates: the gated ops with the other "
                 "distributions of bench.GATE_SWEEP (Python levels not timed there)")
    if bw:
        notes.append(f"floor: reading every input once and writing o once at the copy bandwidth measured in "
                     f"this run, {bw / 1e12:.2f} TB/s (read + write)")
    if done:
        notes.append(resumed_note(res, done))
    return dict(res, notes=notes, bandwidth=bw)


def warm_anchor(op, T, gs, size):
    """Run every Triton mode of an anchor row and FLA's call once: what a later timing run of the
    same row compiles first (the Python levels compile nothing)."""
    args = bench.anchor_inputs(op, T, **size, gates=gs or "normal")
    for level in levels_for(op):
        if level.startswith("triton"):
            call_for(op, level, args)()
    fla = bench.fla_call(op, args)
    if fla:
        fla()


def anchor_row(op, T, gs, sd, bw, size, Ts, all_levels):
    """One op × T × gate distribution of the forward suite: every level's median ms, FLA, SDPA, floor."""
    from linattn.triton import gated

    args = bench.anchor_inputs(op, T, **size, gates=gs or "normal")
    row = {"op": op, "T": T, "gates": gs, "B": args["q"].shape[0], "sdpa": sd,
           "floor": bench.floor_ms(args, bw) if bw else None}
    fla = bench.fla_call(op, args)
    row["fla"] = bench.median_ms(fla) if fla else None
    for level in levels_for(op):
        if level in PYTHON_LEVELS and (T != Ts[0] or gs not in (None, "normal")) and not (all_levels and level == "chunk"):
            row[level] = None
            continue
        fn = call_for(op, level, args)
        try:
            if level.startswith("triton") and T in (Ts[0], Ts[-1]):  # natively correct?
                row[f"rel_err_{level}"] = check(op, args, fn)
            row[level] = bench.median_ms(fn)
            if level == "triton:fused" and gated.ran.get("mode") != "fused":  # fell back
                row[level], row[f"error_{level}"] = None, gated.ran.get("mode")
        except Exception as exc:  # a kernel that fails to compile or run: record it, go on
            row[level], row[f"error_{level}"] = None, f"{type(exc).__name__}: {exc}"[:300]
    row["ratio_fla"] = row["triton"] / row["fla"] if row["fla"] and row["triton"] else None
    row["ratio_floor"] = row["triton"] / row["floor"] if row["floor"] and row["triton"] else None
    del args
    return row


def suite_chunks(T, chunk_sizes, log, size):
    """GLA states mode as C varies: inter = local cumsum + state pass, intra = the rest (A and output)."""
    from linattn.triton import gated
    from linattn.validate import check_inputs

    args = bench.anchor_inputs("gla", T, **size)
    q, k, v, g = args["q"], args["k"], args["v"], args["g"]
    d = check_inputs(q, k, v, g=g, gate=True)
    rows = []
    for C in chunk_sizes:
        c = min(16, C)
        try:
            total = bench.median_ms(bench.library_call("gla", "triton", args, chunk_size=C,
                                                       sub_chunk_size=c, mode="states"))
            fused = bench.median_ms(bench.library_call("gla", "triton", args, chunk_size=C,
                                                       sub_chunk_size=c, mode="fused"))
            fused = fused if gated.ran.get("mode") == "fused" else None  # did not fit: ran as states
            inter = bench.median_ms(lambda: gated.chunk_states(k, v, g, d, chunk_size=C))
        except Exception as exc:  # e.g. out of shared memory at C = 256: record it, go on
            log(f"chunks C={C}: {type(exc).__name__}: {exc}"[:300])
            continue
        rows.append({"C": C, "c": c, "total": total, "inter": inter, "intra": total - inter, "fused": fused})
        log(f"chunks T={T} C={C}: total={total:.3g} inter={inter:.3g} intra={total - inter:.3g} "
            f"fused={'did not fit' if fused is None else f'{fused:.3g}'}")
    return {"T": T, "B": q.shape[0], "rows": rows}


def suite_resources(log, size):
    """Registers / spills / shared memory of each kernel at the anchor shape (native compile only)."""
    from linattn.triton import gated

    out = []
    for op in ("linear_attn", "simple_gla", "gla"):
        args = bench.anchor_inputs(op, min(4096, size["tokens"]), **size)
        for mode in ("fused", "states"):
            gated.last_launch.clear()
            try:
                bench.library_call(op, "triton", args, mode=mode)()
            except Exception as exc:
                log(f"resources {op} {mode}: {type(exc).__name__}: {exc}"[:300])
            for name, kern in gated.last_launch.items():
                meta = getattr(kern, "metadata", None)
                out.append({"op": op, "mode": mode, "kernel": name, "n_regs": getattr(kern, "n_regs", None),
                            "n_spills": getattr(kern, "n_spills", None),
                            "shared_bytes": getattr(meta, "shared", None),
                            "num_warps": getattr(meta, "num_warps", None)})
                log(f"resources {op} {mode} {name}: {out[-1]}")
    return out


TRAIN_KEEP = ("linear_attn", "gla", "simple_gla")   # ops whose level takes recompute=False


def sdpa_train_call(T, *, tokens, H, D, device):
    B = max(1, tokens // T)
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16)
    F = torch.nn.functional
    return lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)


def train_check(op, args):
    """Largest relative error of a Triton gradient against the chunk level's (float32, same inputs)."""
    from linattn.dispatch import level_fn

    name = bench.OPS[op][0]
    got = bench.train_call(level_fn(name, "triton"), args)()
    ref = bench.train_call(level_fn(name, "chunk"), {n: a.float() for n, a in args.items()})()
    return max(testing.rel_err(a, b) for a, b in zip(got, ref))


def suite_train(Ts, log, size, only=None, save=None, gates=bench.GATE_SWEEP, done=None, warm=False):
    """done: {(op, T, gates): row} of an earlier run of the same setting (`done_rows`), kept as they
    are; warm: only call everything once (compile Triton's and FLA's kernels), time nothing."""
    ops = [op for op in triton_ops() if not only or op in only]
    dev = size["device"]
    done = done or {}
    res = {"rows": [], "by_gates": {}}
    for T in Ts:
        todo = [(op, gs) for op in ops for gs in gate_runs(op, gates) if (op, T, gs) not in done]
        if warm:
            for op, gs in todo:
                warm_row(op, T, gs, size)
                log(f"compiled {op} T={T}" + (f" ({gs} gates)" if gs else ""))
            continue
        sd = {}
        if todo:
            bench.timed(sd, "sdpa", lambda: sdpa_train_call(T, tokens=size["tokens"], H=size["H"], D=size["K"],
                                                             device=dev))
        for op in ops:
            for gs in gate_runs(op, gates):
                if (op, T, gs) in done:
                    place(res, done[op, T, gs])
                    continue
                row = train_row(op, T, gs, sd, size, check_grads=T == Ts[0])
                place(res, row)
                if save:                     # row by row, so a run cut by its time limit still reports
                    save(dict(res, stages={}, notes=[]))
                log("train " + label(row) + ": " +
                    ", ".join(f"{k}={v:.3g}" for k, v in row.items() if isinstance(v, float)) +
                    "".join(f"; {k}: {v}" for k, v in row.items() if k.startswith("error")))
    if warm:
        return res
    stages = {}
    for op in ops:
        T = 8192 if 8192 in Ts else Ts[-1]
        try:
            stages[op] = {"T": T, "ms": bench.backward_stages(op, T, **size)}
            log(f"backward stages {op} T={T}: {stages[op]['ms']}")
        except Exception as exc:
            stages[op] = {"T": T, "error": f"{type(exc).__name__}: {exc}"[:300]}
    notes = ["forward + backward of <o, dO> for every floating input (q, k, v, g, β), "
             "torch.autograd.grad, median ms; mem_*: peak bytes above what was allocated before the call",
             "triton = recompute=True (the default: states recomputed in the backward); triton:keep = "
             "recompute=False (states kept from the forward)",
             "rel_err_grad: largest relative error of a Triton gradient against the chunk level (float32 "
             "compute, same bf16 inputs), at the first T"]
    notes.append("rows: mild gates (logsigmoid(x)/16) or none; by_gates: the gated ops with the other "
                 "distributions of bench.GATE_SWEEP")
    if done:
        notes.append(resumed_note(res, done))
    return dict(res, stages=stages, notes=notes)


def resumed_note(res: dict, done: dict) -> str:
    kept = sum(k in done for k in ((r["op"], r["T"], r["gates"]) for r in all_rows(res)))
    return f"{kept} rows timed by an earlier call of the same run (--resume), the others by this one"


def all_rows(result: dict) -> list:
    """Every row of a forward or training result, mild gates and the other distributions."""
    return result.get("rows", []) + [r for rs in result.get("by_gates", {}).values() for r in rs]


def done_rows(paths, suite: str = "train") -> dict:
    """{(op, T, gates): row} of the suite's rows in earlier runs' bench.json (--resume): a run cut by
    a device call's time limit saves row by row, and the next call goes on where it stopped."""
    done = {}
    for path in paths:
        path = Path(path)
        result = bench.load_json(path / "bench.json" if path.is_dir() else path).get(suite, {})
        done.update({(r["op"], r["T"], r["gates"]): r for r in all_rows(result) if r.get("triton") is not None})
    return done


def train_calls(op, args) -> dict:
    """The callables a training row times, by column: ours (recompute), ours keeping the states where
    the op has that, FLA's where fla is importable. Each makes a fresh `bench.train_call`."""
    import linattn.triton as lt

    fn = getattr(lt, bench.OPS[op][0])
    calls = {"triton": lambda: bench.train_call(fn, args)}
    if op in TRAIN_KEEP:
        calls["triton:keep"] = lambda: bench.train_call(lambda **a: fn(**a, recompute=False), args)
    if bench.fla_fn(op) is not None:
        calls["fla"] = lambda: bench.train_call(bench.fla_fn(op), args)
    return calls


def warm_row(op, T, gs, size):
    """Run every call of a training row once: what a later timing run of the same row would
    compile first. FLA's refusals are its row's business."""
    args = bench.anchor_inputs(op, T, **size, gates=gs or "normal")
    for column, make in train_calls(op, args).items():
        try:
            make()()
        except Exception:  # noqa: BLE001  (a refusal of FLA's: recorded by the timing run)
            if column != "fla":
                raise


def train_row(op, T, gs, sd, size, check_grads):
    """One op × T × gate distribution of the training suite: ours (recompute and keep), FLA, SDPA."""
    args = bench.anchor_inputs(op, T, **size, gates=gs or "normal")
    row = {"op": op, "T": T, "gates": gs, "B": args["q"].shape[0], "sdpa": sd.get("sdpa"),
           "mem_sdpa": sd.get("mem_sdpa")}
    calls = train_calls(op, args)
    for column, make in calls.items():
        bench.timed(row, column, make)
    if "fla" not in calls:
        row["fla"], row["error_fla"] = None, "fla not importable"
    if check_grads and row.get("triton") is not None:
        try:
            row["rel_err_grad"] = train_check(op, args)
        except Exception as exc:
            row["error_check"] = f"{type(exc).__name__}: {exc}"[:300]
    row["ratio_fla"] = row["triton"] / row["fla"] if row.get("fla") and row.get("triton") else None
    row["ratio_sdpa"] = row["triton"] / row["sdpa"] if row.get("sdpa") and row.get("triton") else None
    del args
    return row


def label(row) -> str:
    return f"{row['op']} T={row['T']}" + (f" ({row['gates']} gates)" if row.get("gates") else "")


def markdown(res) -> str:
    size = res["size"]
    parts = [f"Device: {res['env']['device']} · {res['env']['date']} · torch {res['env']['torch']} · "
             f"triton {res['env']['triton']} · fla {res['env']['fla']}"]
    if "anchors" in res:
        rows = res["anchors"]["rows"]
        cols = ["op", "T", "B", "triton", "triton:fused", "triton:states", "chunk", "naive", "fla", "ratio_fla",
                "sdpa", "floor", "ratio_floor"]
        parts.append(f"Forward, ms (median), H={size['H']}, K=V={size['K']}, bf16, {size['tokens']} tokens, "
                     "mild gates:\n\n" + bench.markdown_table(cols, [[r.get(c) for c in cols] for r in rows]))
        for gs, grows in res["anchors"].get("by_gates", {}).items():
            parts.append(f"Forward with {gs} gates, ms:\n\n" + bench.markdown_table(
                cols[:5] + ["fla", "ratio_fla"], [[r.get(c) for c in cols[:5] + ["fla", "ratio_fla"]] for r in grows]))
            rows = rows + grows
        errs = [f"{label(r)} {k[8:]}: {v:.2e}" for r in rows for k, v in r.items() if k.startswith("rel_err")]
        fails = [f"{label(r)} {k[6:]}: {v}" for r in rows for k, v in r.items() if k.startswith("error_")]
        if fails:
            parts.append("Failures:\n" + "\n".join(f"- {f}" for f in fails))
        parts.append("\n".join(f"- {n}" for n in res["anchors"]["notes"]) +
                     "\n- relative error vs the chunk level (float32) on the same bf16 inputs: " + "; ".join(errs))
    if "chunks" in res:
        ch = res["chunks"]
        cols = ["C", "c", "inter", "intra", "total", "fused"]
        parts.append(f"GLA by chunk size (states mode, T={ch['T']}, B={ch['B']}), ms:\n\n" +
                     bench.markdown_table(cols, [[r[c] for c in cols] for r in ch["rows"]]))
    if "train" in res:
        rows = res["train"]["rows"]
        cols = ["op", "T", "B", "triton", "triton:keep", "fla", "ratio_fla", "sdpa", "ratio_sdpa"]
        parts.append(f"Forward + backward, ms (median), H={size['H']}, K=V={size['K']}, bf16, {size['tokens']} "
                     "tokens, mild gates:\n\n" + bench.markdown_table(cols, [[r.get(c) for c in cols] for r in rows]))
        for gs, grows in res["train"].get("by_gates", {}).items():
            parts.append(f"Forward + backward with {gs} gates, ms:\n\n" + bench.markdown_table(
                cols[:7], [[r.get(c) for c in cols[:7]] for r in grows]))
            rows = rows + grows
        mem = ["op", "T", "mem_triton", "mem_triton:keep", "mem_fla", "mem_sdpa"]
        mem = ["op", "T", "gates"] + mem[2:]
        mib = [[r["op"], r["T"], r.get("gates")] + [r[c] / 2**20 if r.get(c) is not None else None for c in mem[3:]]
               for r in rows]
        parts.append("Peak memory of forward + backward, MiB:\n\n" + bench.markdown_table(mem, mib))
        fails = [f"{label(r)} {k[6:]}: {v}" for r in rows for k, v in r.items() if k.startswith("error_")]
        if fails:
            parts.append("Failures and refusals:\n" + "\n".join(f"- {f}" for f in fails))
        for op, st in res["train"]["stages"].items():
            if "ms" in st:
                parts.append(f"Backward stages of {op} at T={st['T']}, ms:\n\n" + bench.markdown_table(
                    ["stage", "ms"], [[n, ms] for n, ms in st["ms"].items()]))
        errs = [f"{label(r)}: {r['rel_err_grad']:.2e}" for r in rows if r.get("rel_err_grad") is not None]
        parts.append("\n".join(f"- {n}" for n in res["train"]["notes"]) + "\n- gradient check: " + "; ".join(errs))
    if res.get("resources"):
        cols = ["op", "mode", "kernel", "n_regs", "n_spills", "shared_bytes", "num_warps"]
        parts.append("Compiled kernels:\n\n" + bench.markdown_table(cols, [[r[c] for c in cols]
                                                                         for r in res["resources"]]))
    return "\n\n".join(parts) + "\n"


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["anchors"]["rows"]
    ops = sorted({r["op"] for r in rows}, key=list(bench.OPS).index)
    fig, axes = plt.subplots(1, len(ops), figsize=(3.2 * len(ops), 3.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        mine = [r for r in rows if r["op"] == op]
        Ts = [r["T"] for r in mine]
        bench.plot_times(ax, Ts, {k: [r.get(k) for r in mine] for k in ("triton", "fla", "sdpa")}, title=op)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", default="all", choices=["anchors", "chunks", "resources", "train", "all"],
                   help="all = anchors, chunks, resources (train is run on its own)")
    p.add_argument("--T", type=int, nargs="*", default=TS)
    p.add_argument("--chunk-T", type=int, default=8192)
    p.add_argument("--out", default="_build/bench")
    p.add_argument("--tokens", type=int, default=32768, help="B·T (smaller only to try the script on a CPU)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="K = V")
    p.add_argument("--all-levels", action="store_true", help="time the chunk level at every T too")
    p.add_argument("--ops", nargs="*", choices=list(bench.OPS), help="only these ops (default: all)")
    p.add_argument("--gates", nargs="*", choices=list(bench.GATE_SWEEP), default=list(bench.GATE_SWEEP),
                   help="gate distributions of the gated ops (anchors, train; default: all of "
                        "bench.GATE_SWEEP; 'normal', the mild one, fills the rows the chapters read)")
    p.add_argument("--warm", action="store_true",
                   help="anchors, train: only run every call once (compile), time and write nothing; run one "
                        "process per op in parallel before the timing run")
    p.add_argument("--resume", nargs="*", default=[], metavar="DIR",
                   help="anchors, train: keep the rows these runs' bench.json already hold and time only "
                        "the others")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: times below are the Triton interpreter's and mean nothing about kernels "
              "(the chapters show recorded GPU results from book/data/)")
    size = dict(tokens=a.tokens, H=a.heads, K=a.dim, V=a.dim, device="cuda" if torch.cuda.is_available() else "cpu")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    if a.warm and a.suite == "anchors":     # compile only: nothing timed, nothing written
        suite_anchors(a.T, log, size, only=a.ops, gates=a.gates, warm=True, done=done_rows(a.resume, "anchors"))
        return
    res = {"env": bench.environment(), "size": {n: x for n, x in size.items() if n != "device"}}
    if a.suite in ("anchors", "all"):
        def partial(anchors):
            bench.save_json(out / "bench.json", {**res, "anchors": anchors})
        res["anchors"] = suite_anchors(a.T, log, size, a.all_levels, save=partial, only=a.ops, gates=a.gates,
                                       done=done_rows(a.resume, "anchors"))
        bench.save_json(out / "bench.json", res)
        plot(res, out / "bench.png")
    if a.suite in ("chunks", "all"):
        res["chunks"] = suite_chunks(a.chunk_T, [C for C in (16, 32, 64, 128, 256) if C <= a.chunk_T], log, size)
        bench.save_json(out / "bench.json", res)
    if a.suite in ("resources", "all"):
        res["resources"] = suite_resources(log, size)
    if a.suite == "train" and a.warm:
        suite_train(a.T, log, size, only=a.ops, gates=a.gates, done=done_rows(a.resume), warm=True)
        return
    if a.suite == "train":
        res["train"] = suite_train(a.T, log, size, only=a.ops, gates=a.gates, done=done_rows(a.resume),
                                   save=lambda train: bench.save_json(out / "bench.json", {**res, "train": train}))
    bench.save_json(out / "bench.json", res)
    (out / "bench.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
