"""The recorded GPU runs (book/data/), made over as many device calls as they take.

    python tools/record_runs.py --out DIR [--resume DIR ...] [--suites train packing long]
                                [--seconds 540] [--jobs 8] [--size small|full]
    python tools/record_runs.py --merge DIR ... --into book/data         (after the last call)

A device call has a time limit and a fresh machine compiles for minutes, so each suite runs in two
phases, op by op: every op not yet recorded compiles first, one process per op in parallel (the
suites' own `--warm`; compiling is CPU-bound), then one process at a time times it with the GPU to
itself (`bench.environment` records whether it was). An op counts as recorded once its JSON exists
in --out or in a --resume directory, so the next call goes on where a cut one stopped; the training
and forward suites keep their rows one by one (`tools/bench.py --resume`). Nothing starts after
--seconds, and what runs is stopped then.

suites (the per-op files in DIR):
    anchors  tools/bench.py --suite anchors (forward, every gate distribution)   anchors_OP/bench.json
    train    tools/bench.py --suite train (every gate distribution)   train_OP/bench.json
    packing  tools/bench_packing.py                                   packing_OP.json
    long     tools/bench_long.py                                      long_OP.json

--merge joins the per-op files of the calls, in the library's op order, into the files the chapters
read: bench.json (its forward rows; the chunk sweep already there keeps its own run's environment),
bench_train.json, packing_gpu.json, long_sequence.json. Each takes the first file's environment and
lists every file's under "calls"."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from linattn import bench  # noqa: E402

SUITES = {   # suite: (script, file of one op's result in the output directory, the recorded file)
    "anchors": ("tools/bench.py", "anchors_{op}/bench.json", "bench.json"),
    "train": ("tools/bench.py", "train_{op}/bench.json", "bench_train.json"),
    "packing": ("tools/bench_packing.py", "packing_{op}.json", "packing_gpu.json"),
    "long": ("tools/bench_long.py", "long_{op}.json", "long_sequence.json"),
}


def command(suite: str, op: str, out: Path | None, size: str | None, resume=()) -> list:
    """The suite's command line for one op: compile only (out None), else time into out."""
    script = [sys.executable, str(ROOT / SUITES[suite][0])]
    if suite in ("anchors", "train"):
        cmd = script + ["--suite", suite, "--ops", op]
        if size == "small":
            cmd += ["--tokens", "256", "--heads", "2", "--dim", "32", "--T", "64", "128"]
        # both keep a cut run's rows (tools/bench.py --resume): the next call compiles and times the others
        keep = ["--resume", *map(str, resume)] if resume else []
        return cmd + (["--warm"] if out is None else ["--out", str(out.parent)]) + keep
    cmd = script + ["--only", op] + (["--size", size] if size else [])
    return cmd + (["--warm"] if out is None else ["--out", str(out)])


def recorded(suite: str, op: str, dirs) -> Path | None:
    """The first directory's result of this op, if a call recorded it whole."""
    for d in dirs:
        path = Path(d) / SUITES[suite][1].format(op=op)
        # tools/bench.py saves a cut run's rows so far with empty notes; a whole one has its notes
        if path.exists() and (suite not in ("anchors", "train") or bench.load_json(path).get(suite, {}).get("notes")):
            return path
    return None


def run(cmd, deadline: float, log: Path) -> int:
    """cmd with its output in log, stopped at the deadline; its exit status (124 when stopped)."""
    left = deadline - time.monotonic()
    if left < 5:
        return 124
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=left, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            return 124


def record(suites, out: Path, resume, seconds: float, jobs: int, size, ops=None, say=print) -> dict:
    """Compile, then time, every op of every suite that no directory has yet: {suite: {op: status}}."""
    deadline = time.monotonic() + seconds
    status = {}
    for suite in suites:
        todo = [op for op in bench.selected_ops(ops) if recorded(suite, op, [out, *resume]) is None]
        status[suite] = {op: "recorded earlier" for op in bench.selected_ops(ops) if op not in todo}

        def earlier(op):                                          # cut runs of this op in earlier calls
            return [p for d in resume if (p := Path(d) / SUITES[suite][1].format(op=op)).exists()]

        with ThreadPoolExecutor(max(1, jobs)) as pool:            # compile: one process per op
            warm = dict(zip(todo, pool.map(lambda op: run(command(suite, op, None, size, earlier(op)), deadline,
                                                          out / "logs" / f"{suite}_{op}_warm.log"), todo)))
        say(f"{suite}: compiled {', '.join(f'{op} ({rc})' for op, rc in warm.items()) or 'nothing'}")
        for op in todo:                                           # time: one process at a time
            target = out / SUITES[suite][1].format(op=op)
            rc = run(command(suite, op, target, size, earlier(op)), deadline, out / "logs" / f"{suite}_{op}.log")
            status[suite][op] = "timed" if rc == 0 and target.exists() else f"cut or failed ({rc})"
            say(f"{suite} {op}: {status[suite][op]}")
    return status


def merge(dirs, into: Path, say=print) -> list:
    """Join the per-op results of `dirs` (earliest call first) into the chapters' files in `into`."""
    written = []
    for suite, (_, _, name) in SUITES.items():
        parts = [(op, path) for op in bench.OPS if (path := recorded(suite, op, dirs)) is not None]
        if not parts:
            continue
        results = [(op, bench.load_json(path)) for op, path in parts]
        first = results[0][1]
        calls = [dict(r["env"], ops=[op]) for op, r in results]
        if suite in ("anchors", "train"):
            part = dict(first[suite], rows=[], by_gates={})          # notes, bandwidth: the first call's
            for _, r in results:
                part["rows"] += r[suite]["rows"]
                for gates, rows in r[suite].get("by_gates", {}).items():
                    part["by_gates"].setdefault(gates, []).extend(rows)
            if suite == "train":                                       # each op's backward stages
                part["stages"] = {op: ms for _, r in results for op, ms in r[suite].get("stages", {}).items()}
            merged = {"env": first["env"], "size": first["size"], suite: part, "calls": calls}
            if suite == "anchors" and (into / name).exists():
                # bench.json also holds the chunk sweep of an earlier run: it keeps that run's environment
                old = bench.load_json(into / name)
                merged.update({k: v for k, v in old.items() if k not in merged and k != "calls"})
                if "chunks" in old:
                    merged["chunks"] = dict(old["chunks"], env=old["chunks"].get("env", old["env"]))
        else:
            merged = dict(first, rows=[row for _, r in results for row in r["rows"]], calls=calls,
                          command=f"python tools/record_runs.py --suites {suite} (one process per op, "
                                  "compiled first in parallel), then --merge")
        bench.save_json(into / name, merged)
        written.append(into / name)
        say(f"wrote {into / name}: {', '.join(op for op, _ in parts)}")
    return written


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--resume", nargs="*", default=[], type=Path, metavar="DIR")
    p.add_argument("--suites", nargs="+", choices=sorted(SUITES), default=["train", "packing", "long", "anchors"])
    p.add_argument("--ops", nargs="+", choices=sorted(bench.OPS), default=None)
    p.add_argument("--seconds", type=float, default=540, help="start nothing after this; stop what runs")
    p.add_argument("--jobs", type=int, default=8, help="compiling processes at once")
    p.add_argument("--size", choices=("small", "full"), default=None, help="default: the suites' own choice")
    p.add_argument("--merge", nargs="+", type=Path, metavar="DIR", help="join these calls' results")
    p.add_argument("--into", type=Path, default=ROOT / "book" / "data")
    a = p.parse_args(argv)
    if a.merge:
        merge(a.merge, a.into)
        return
    if a.out is None:
        p.error("--out is required unless --merge")
    a.out.mkdir(parents=True, exist_ok=True)
    status = record(a.suites, a.out, a.resume, a.seconds, a.jobs, a.size, a.ops)
    bench.save_json(a.out / "status.json", status)


if __name__ == "__main__":
    main()
