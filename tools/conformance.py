"""The native conformance suite's command line (linattn/conformance): the generated matrix of cases
at the Triton level against float64 references on the same device, in worker processes.

    python tools/conformance.py --size native --workers 14 --out DIR [--record] [--only VARIANT ...]
                                [--max-seconds S] [--timeout S] [--reference naive|chunk|auto]
                                [--per-variant N] [--no-fla] [--resume DIR …]
    python tools/conformance.py --summarize DIR        (the summary again, from DIR/results.jsonl)
    python tools/conformance.py --summarize DIR1 DIR2 … --out DIR [--record]
                                                       (one summary and budget over runs split by --only,
                                                        e.g. one device call per group of variants, or
                                                        continued with --resume)
    python tools/conformance.py --size native --resume DIR1 [DIR2 …] --out DIR …
                                                       (the cases those runs did not finish: not reached,
                                                        or cut by their time limit)
    python tools/conformance.py --size native --list   (the cases, one line each, and the coverage)

Prints a line per case as it finishes; writes DIR/results.jsonl row by row, DIR/summary.json and
DIR/summary.md; with --record also book/data/error_budget.json (device, versions, date, command).
Exits 1 if any case failed, raised, crashed its worker or timed out.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from linattn.conformance import matrix, runner  # noqa: E402

RECORD = ROOT / "book" / "data" / "error_budget.json"


def environment(devices) -> dict:
    import torch
    import triton

    from linattn import bench

    dev = "cpu (Triton interpreter)"
    if torch.cuda.is_available():
        dev = f"{torch.cuda.get_device_name(0)} × {torch.cuda.device_count()}"
    return {"device": dev, "torch": torch.__version__, "triton": triton.__version__, "fla": bench.fla_version(),
            "python": platform.python_version(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "command": " ".join(["python", "tools/conformance.py", *sys.argv[1:]]), "workers_on": sorted(devices)}


def write_summary(out: Path, rows, *, cut=None, not_run=0, total=None, env=None):
    s = runner.summarize(rows, cut=cut, not_run=not_run, total=total)
    if env:
        s["env"] = env
    (out / "summary.json").write_text(json.dumps(s, indent=1))
    md = runner.markdown(s)
    (out / "summary.md").write_text(md)
    return s, md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=matrix.SIZES, default="native")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--out", default="_build/conformance")
    ap.add_argument("--only", nargs="*", choices=list(matrix.VARIANTS), help="these variants only")
    ap.add_argument("--per-variant", type=int, default=matrix.NATIVE_PER_VARIANT,
                    help="regular native cases per variant: the covering part (61 ungated, 79 gated) plus random extras "
                    "on the same specialisations (more extras cost run time, not compilation)")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop handing out cases after S seconds")
    ap.add_argument("--timeout", type=float, default=600.0, help="per case, seconds (the first case of a "
                    "specialisation includes its compilation)")
    ap.add_argument("--reference", choices=["naive", "chunk", "auto"], default="naive",
                    help="float64 reference: the token loop, the chunk level, or the chunk level past T = 1024")
    ap.add_argument("--record", action="store_true", help=f"write the error budget to {RECORD.relative_to(ROOT)}")
    ap.add_argument("--list", action="store_true", help="print the cases and the coverage, run nothing")
    ap.add_argument("--no-fla", action="store_true",
                    help="run FLA beside ours on no case (FLA's autotuned kernels compile for minutes per shape)")
    ap.add_argument("--resume", metavar="DIR", nargs="+", default=(),
                    help="run only the cases these runs' results.jsonl do not hold finished (cut ones again)")
    ap.add_argument("--summarize", metavar="DIR", nargs="+",
                    help="rebuild the summary from these runs' results.jsonl (several: merged into --out)")
    a = ap.parse_args(argv)

    if a.summarize:
        return summarize([Path(d) for d in a.summarize], Path(a.out), a)

    cases = matrix.cases(a.size, only=a.only, per_variant=a.per_variant)
    done = {r["id"] for d in a.resume for r in runner.read_jsonl(Path(d) / "results.jsonl") if r.get("status") != "cut"}
    cases = [dict(c, fla=c["fla"] and not a.no_fla) for c in cases if c["id"] not in done]
    if a.list:
        for c in cases:
            print(f"{c['id']:28s} {runner.describe(c)}{' fla' if c['fla'] else ''}")
        by = {}
        for c in cases:
            by.setdefault(c["variant"], []).append(c)
        for v, cs in by.items():
            dt = {d: sum(c["dtype"] == d for c in cs) for d in matrix.DTYPES}
            print(f"{v}: {len(cs)} cases {dt}, {len(matrix.specialisations(cs))} Triton specialisations")
        print("missing:", {v: {k: x for k, x in r.items() if x} for v, r in matrix.coverage(cases).items()})
        return 0

    out = Path(a.out)
    run = runner.Runner(cases, workers=a.workers, out=out, timeout=a.timeout, max_seconds=a.max_seconds,
                        reference=a.reference)
    try:
        rows = run.run()
        cut, not_run = run.cut, len(run.not_run)
    except Exception as exc:  # noqa: BLE001  (the runner itself broke: still summarise what finished)
        traceback.print_exc()
        rows, cut, not_run = list(run.rows.values()), f"runner error: {type(exc).__name__}: {exc}", None
        rows.append({"id": "runner", "variant": "-", "status": "error", "failed": [cut]})
    env = environment(getattr(run, "devices", ()))
    s, md = write_summary(out, rows, cut=cut, not_run=not_run, total=len(cases), env=env)
    print(md)
    print(f"results: {out / 'results.jsonl'}, summary: {out / 'summary.md'}")
    if a.record:
        record(RECORD, env, s, size=a.size, only=a.only, total=len(cases))
        print(f"recorded: {RECORD.relative_to(ROOT)}")
    return 1 if any(r.get("status") in runner.FAILED for r in rows) else 0


def summarize(dirs: list[Path], out: Path, a) -> int:
    """The summary (and with --record the budget) of finished runs: one directory again, or several
    runs of disjoint variants merged, so the matrix can be split over several device calls."""
    rows = [r for d in dirs for r in runner.read_jsonl(d / "results.jsonl")]
    if len(dirs) > 1:
        finished = {r["id"] for r in rows if r.get("status") != "cut"}
        cut = {r["id"]: r for r in rows if r.get("status") == "cut" and r["id"] not in finished}
        rows = [r for r in rows if r.get("status") != "cut"] + list(cut.values())   # a cut case: its resumed row
        ids = [r["id"] for r in rows]
        if len(set(ids)) != len(ids):
            raise SystemExit("--summarize: the runs share cases; merge runs of disjoint --only groups, "
                             "or a run and its --resume")
    else:
        out = dirs[0]
    envs = [json.loads((d / "summary.json").read_text()).get("env") for d in dirs if (d / "summary.json").exists()]
    env = dict(envs[0], command=" + ".join(e["command"] for e in envs)) if envs and all(envs) else None
    out.mkdir(parents=True, exist_ok=True)
    total = len(matrix.cases(a.size, only=a.only, per_variant=a.per_variant)) if len(dirs) > 1 or a.record else None
    s, md = write_summary(out, rows, total=total, not_run=max(total - len(rows), 0) if total else 0, env=env)
    print(md)
    if a.record:
        if env is None:
            raise SystemExit("--record needs each run's summary.json (device, versions, command)")
        record(RECORD, env, s, size=a.size, only=a.only, total=total)
        print(f"recorded: {RECORD.relative_to(ROOT)}")
    return 1 if any(r.get("status") in runner.FAILED for r in rows) else 0


def record(path: Path, env: dict, s: dict, **how):
    """The error budget as book/data keeps recorded runs: the day, device and versions, no clock time
    and nothing that reads as a commit (tests/test_chapters.py scans book/data for both), so
    messages quoted from FLA's refusals lose their hexadecimal addresses."""
    def plain(x):
        if isinstance(x, str):
            return HEXLIKE.sub("…", x).replace("UTC", "")
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, list):
            return [plain(v) for v in x]
        return x
    data = {"env": env, **how, "counts": s["counts"], "not_run": s["not_run"], "cut": s["cut"],
            "failures": [{k: f.get(k) for k in ("id", "status", "failed")} for f in s["failures"]],
            "tolerance": tolerances(), "budget": s["budget"]}
    path.write_text(json.dumps(plain(data), indent=1) + "\n")


HEXLIKE = re.compile(r"\b[0-9a-f]{7,40}\b")


def tolerances():
    from linattn import testing
    return {str(d).replace("torch.", ""): {"outputs": testing.TOLERANCE[d], "gradients": testing.GRAD_TOLERANCE[d]}
            for d in testing.TOLERANCE}


if __name__ == "__main__":
    sys.exit(main())
