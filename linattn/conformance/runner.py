"""Running the conformance matrix in worker processes: crash isolation, time limits, JSONL results,
the summary and the error budget.

An illegal memory access on a GPU kills the process's CUDA context, and every later case in that
process would fail with it. So each case runs in a worker process (spawned: a fresh interpreter that
imports torch and linattn once, then runs many cases, talking to the runner over its own pipe); a
worker that dies, reports a CUDA error or overruns the per-case time limit is replaced, its case
recorded as 'crash' or 'timeout' with its parameters, and the run goes on. Rows are appended to results.jsonl as cases finish, so a run cut
short (by --max-seconds, or a SIGTERM from an outer `timeout`) keeps what it did; the summary is
written at the end (`summarize` rebuilds it from the JSONL alone).

Compilation dominates a cold native run, so the cases are grouped by Triton specialisation (variant,
K, V, dtype, chunk size): a worker keeps taking cases of its group (compiled once, in its process),
groups are handed out largest first, and idle workers then share the groups left.

Statuses: pass, fail (a tolerance, a guard or a dtype), error (an exception in our code), crash,
timeout — the last four count as failures — and cut (in flight when the time ran out; not run).
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import multiprocessing.connection  # noqa: F401  (mp.connection.wait)
import os
import signal
import time
from collections import OrderedDict, defaultdict
from pathlib import Path

FAILED = ("fail", "error", "crash", "timeout")
TENSORS = ("o", "S", "dq", "dk", "dv", "dg", "dbeta", "dh0", "decode.o", "decode.S")
# relative compile cost per variant (docs/performance.md: KDA's kernels ≈ 3.6 s each, DeltaNet's 1.2)
COMPILE_WEIGHT = {"linear_attn": 1.0, "gla": 1.5, "simple_gla": 1.2, "delta_rule": 2.0,
                  "gated_delta_rule": 2.5, "kda": 5.0}
# the runner's own checks (tests/test_conformance.py): a case whose `check` names one of these makes
# its worker exit without a word (as a segfault would), hang, report a broken CUDA context, or exit
# after handing in our result, while FLA would be running (the crash is then FLA's, not the case's)
SELFTESTS = ("selftest_exit", "selftest_hang", "selftest_cuda", "selftest_exit_in_fla")


def group_key(case: dict) -> tuple:
    if case.get("check"):
        return (case["variant"], "property", case["dtype"], case["check"] == "chunk_size")
    return (case["variant"], case["K"], case["V"], case["dtype"], case["chunk_size"], case["sub_chunk_size"])


def _cost(cases: list[dict]) -> float:
    v = cases[0]["variant"]
    return 30 * COMPILE_WEIGHT.get(v, 1.0) + sum(c["T"] * c["B"] * c["H"] / 500 + 1 for c in cases)


# ---------------------------------------------------------------- worker

def _worker(wid: int, conn, opts: dict):
    """One worker process: cases arrive on `conn`, messages (kind, case id, payload) go back on it.
    A pipe per worker, not one shared queue: a worker killed while writing can break only its own."""
    # an outer `timeout` signals the whole process group: the runner alone decides when workers end
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch
    if torch.cuda.is_available():
        idx = wid % torch.cuda.device_count()
        torch.cuda.set_device(idx)
        device = f"cuda:{idx}"
    else:
        device = "cpu"
    from . import case as C

    def send(*msg):
        conn.send(msg)                                                  # synchronous: no feeder thread

    send("ready", None, device)
    while True:
        try:
            c = conn.recv()
        except EOFError:                                                # the runner is gone
            break
        if c is None:
            break
        send("start", c["id"], None)
        check = c.get("check")
        if check == "selftest_exit":
            os._exit(7)                                                 # no message: like a segfault
        if check == "selftest_hang":
            time.sleep(3600)
        if check == "selftest_exit_in_fla":
            send("ours", c["id"], dict(c, status="pass", err={}, tol={}, failed=[], seconds=0.0))
            os._exit(9)
        try:
            if check == "selftest_cuda":
                raise C.CudaError("CUDA error: an illegal memory access was encountered (self-test)")
            row = C.run(c, device, reference_mode=opts.get("reference", "naive"),
                        fla_hook=lambda r: send("ours", c["id"], r))
        except C.CudaError as exc:
            send("crash", c["id"], str(exc))
            os._exit(3)                                                 # this CUDA context is lost
        send("done", c["id"], row)
        if device != "cpu":
            torch.cuda.empty_cache()            # 14 workers' cached blocks would crowd one GPU out
    os._exit(0)


# ---------------------------------------------------------------- parent

class _Stop(Exception):
    pass


class Runner:
    def __init__(self, cases, *, workers=2, out=None, timeout=600.0, max_seconds=None,
                 reference="naive", log=print):
        self.cases = list(cases)
        self.n_workers = max(1, min(workers, len(self.cases)))
        self.out = Path(out) if out else None
        self.timeout, self.max_seconds = timeout, max_seconds
        self.opts = {"reference": reference}
        self.log = log
        self.rows = {}
        self.pending = {}                                                 # id → our row before FLA ran
        self.cut, self.not_run, self.devices = None, [], set()

    # bookkeeping
    def _write(self, row):
        self.rows[row["id"]] = row
        if self.out:
            with open(self.out / "results.jsonl", "a") as f:
                f.write(json.dumps(_clean(row)) + "\n")
        self.log(progress_line(row, len(self.rows), len(self.cases), time.time() - self.t0))

    def _lost(self, c, status, msg):
        """The case of a worker that died or overran: our row if FLA was what broke, else the case."""
        mine = self.pending.pop(c["id"], None)
        if mine is not None:
            mine["fla_result"] = {"status": "crashed" if status == "crash" else status, "msg": msg}
            self._write(mine)
        else:
            self._write(dict(c, status=status, failed=[msg],
                             seconds=round(time.time() - self.started.get(c["id"], self.t0), 3)))

    def _spawn(self, wid):
        mine, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(wid, theirs, self.opts), daemon=True)
        p.start()
        theirs.close()                                                  # EOF on `mine` once it exits
        return {"proc": p, "conn": mine, "case": None, "group": None, "wid": wid, "ready": False,
                "dying": False, "eof": False}

    def _next_case(self, w):
        g = w["group"]
        if g is not None and self.groups.get(g):
            return self.groups[g].pop(0)
        for key, left in self.groups.items():                          # an untaken group, largest first
            if left and key not in self.taken:
                self.taken.add(key)
                w["group"] = key
                return left.pop(0)
        best = max(self.groups, key=lambda k: len(self.groups[k]), default=None)   # share one
        if best is not None and self.groups[best]:
            w["group"] = best
            return self.groups[best].pop(0)
        return None

    def _receive(self, w):
        """Handle every message waiting on w's pipe; marks w['eof'] once the worker has exited."""
        while not w["eof"]:
            try:
                if not w["conn"].poll():
                    return
                kind, cid, payload = w["conn"].recv()
            except (EOFError, OSError):
                w["eof"] = True
                return
            if kind == "ready":
                w["ready"] = True
                self.devices.add(payload)
            elif kind == "start":
                self.started[cid] = time.time()
            elif kind == "ours":
                self.pending[cid] = payload
            elif kind == "done" and w["case"] is not None:
                w["case"] = None
                self.pending.pop(cid, None)
                self._write(payload)
            elif kind == "crash" and w["case"] is not None:
                c, w["case"], w["dying"] = w["case"], None, True           # it exits: no new case
                self._lost(c, "crash", payload)

    def run(self) -> list[dict]:
        self.t0 = time.time()
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "results.jsonl").write_text("")
        grouped = defaultdict(list)
        for c in self.cases:
            grouped[group_key(c)].append(c)
        self.groups = OrderedDict(sorted(grouped.items(), key=lambda kv: -_cost(kv[1])))
        self.taken, self.started, self.startup_failures = set(), {}, 0
        self.ctx = mp.get_context("spawn")
        stop = {"why": None}
        old = signal.signal(signal.SIGTERM, lambda *a: stop.__setitem__("why", "SIGTERM"))
        workers = {i: self._spawn(i) for i in range(self.n_workers)}
        next_wid = self.n_workers
        self.log(f"conformance: {len(self.cases)} cases in {len(self.groups)} groups, "
                 f"{self.n_workers} workers, reference {self.opts['reference']}")
        try:
            while True:
                for w in workers.values():                              # keep every worker busy
                    if w["case"] is None and w["ready"] and not w["dying"] and not w["eof"]:
                        c = self._next_case(w)
                        if c is not None:
                            w["case"] = c
                            self.started[c["id"]] = time.time()
                            try:
                                w["conn"].send(c)
                            except (BrokenPipeError, OSError):
                                w["eof"] = True                         # handled as a death below
                if not workers or (all(w["case"] is None for w in workers.values())
                                   and not any(self.groups.values())):
                    break
                mp.connection.wait([w["conn"] for w in workers.values() if not w["eof"]], timeout=0.5)
                for w in workers.values():
                    self._receive(w)
                now = time.time()
                for wid, w in list(workers.items()):
                    c = w["case"]
                    dead = w["eof"] or not w["proc"].is_alive()
                    late = c is not None and now - self.started[c["id"]] > c.get("timeout", self.timeout)
                    if not (dead or late):
                        continue
                    if dead:
                        w["proc"].join(5)
                        self._receive(w)                                # its last words, if any
                        c = w["case"]
                    if c is not None:
                        w["case"] = None
                        if dead:
                            self._lost(c, "crash", f"worker died (exit code {w['proc'].exitcode})")
                        else:
                            self._lost(c, "timeout", f"timeout after {c.get('timeout', self.timeout):g} s")
                    w["proc"].kill()
                    w["conn"].close()
                    del workers[wid]
                    if not w["ready"]:
                        self.startup_failures += 1
                        if self.startup_failures >= 3:
                            raise _Stop(f"workers die before they start (exit code {w['proc'].exitcode})")
                    if any(self.groups.values()):
                        workers[next_wid] = self._spawn(next_wid)
                        workers[next_wid]["group"] = w["group"]
                        next_wid += 1
                if self.max_seconds is not None and now - self.t0 > self.max_seconds:
                    stop["why"] = f"--max-seconds {self.max_seconds:g}"
                if stop["why"]:
                    raise _Stop(stop["why"])
        except (_Stop, KeyboardInterrupt) as e:
            why = str(e) or "interrupted"
            for w in workers.values():
                if w["case"] is not None:
                    c = w["case"]
                    mine = self.pending.pop(c["id"], None)
                    if mine is not None:
                        mine["fla_result"] = {"status": "cut", "msg": why}
                        self._write(mine)
                    else:
                        self._write(dict(c, status="cut", failed=[why]))
                    w["case"] = None
            self.cut = why
        finally:
            signal.signal(signal.SIGTERM, old)
            for w in workers.values():
                try:
                    w["conn"].send(None)
                except Exception:  # noqa: BLE001  (already gone)
                    pass
            deadline = time.time() + 5
            for w in workers.values():
                w["proc"].join(max(0.0, deadline - time.time()))
                if w["proc"].is_alive():
                    w["proc"].kill()
        self.not_run = [c for left in self.groups.values() for c in left]
        return list(self.rows.values())


# ---------------------------------------------------------------- reporting

def _num(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    return x


def _clean(obj):
    """JSON-safe: non-finite floats as strings."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return _num(obj)


def _float(x):
    return float(x) if isinstance(x, str) else x


def describe(c: dict) -> str:
    if "K" not in c:
        return str(c.get("variant", ""))
    chunk = f"C={c['chunk_size']}" + (f"/{c['sub_chunk_size']}" if c.get("sub_chunk_size") else "")
    s = (f"{c['variant']} B={c['B']} T={c['T']} H={c['H']} K={c['K']} V={c['V']} {c['dtype']} {chunk}"
         f"{' ' + c['strength'] if c.get('strength') else ''} h0={int(c['h0'])} final={int(c['final'])} "
         f"dht={int(c['dht'])} seed={c['seed']}")
    return s + (f" check={c['check']}" if c.get("check") else "")


def progress_line(row, done, total, elapsed) -> str:
    worst = ""
    errs = {k: _float(v) for k, v in (row.get("err") or {}).items()}
    if errs:
        k = max(errs, key=lambda n: (errs[n] / row["tol"][n]) if errs[n] == errs[n] else math.inf)
        worst = f" worst {k} {errs[k]:.1e}/{row['tol'][k]:.0e}"
    fla = row.get("fla_result") or {}
    extra = f" fla:{fla['status']}" if fla else ""
    failed = f" FAILED {row['failed'][:4]}" if row.get("status") != "pass" and row.get("failed") else ""
    return (f"[{done:4d}/{total}] {elapsed:6.0f}s {row.get('status', '?'):7s} {row['id']:28s} {describe(row)}"
            f"{worst}{extra}{failed} ({row.get('seconds', 0):.1f}s)")


def budget(rows) -> dict:
    """{variant: {dtype: {tensor: {...}}}}: the worst relative error of ours over the matrix (and the
    case that gave it), of ours over the cases where FLA ran, and of FLA there."""
    table = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r.get("check") or r.get("status") not in ("pass", "fail"):
            continue
        fla = r.get("fla_result") or {}
        ran = fla.get("status") == "ran"
        for name, e in (r.get("err") or {}).items():
            e = _float(e)
            cell = table[r["variant"]][r["dtype"]].setdefault(
                name, {"ours": 0.0, "case": None, "n": 0, "ours_on_fla": None, "fla": None, "n_fla": 0,
                       "tol": r["tol"][name]})
            cell["n"] += 1
            if not e <= cell["ours"]:
                cell["ours"], cell["case"] = e, r["id"]
            if ran and name in fla.get("err", {}):
                f = _float(fla["err"][name])
                cell["n_fla"] += 1
                cell["ours_on_fla"] = e if cell["ours_on_fla"] is None else max(cell["ours_on_fla"], e)
                cell["fla"] = f if cell["fla"] is None else max(cell["fla"], f)
        if fla.get("status") in ("refused", "crashed"):
            cell = table[r["variant"]][r["dtype"]].setdefault("_fla", {"refused": 0, "crashed": 0, "msg": None})
            cell["refused" if fla["status"] == "refused" else "crashed"] += 1
            cell["msg"] = cell["msg"] or fla.get("msg")
    return {v: dict(d) for v, d in table.items()}


def summarize(rows, *, cut=None, not_run=0, total=None) -> dict:
    counts = defaultdict(int)
    per_variant = defaultdict(lambda: defaultdict(int))
    for r in rows:
        counts[r.get("status", "?")] += 1
        per_variant[r["variant"]][r.get("status", "?")] += 1
    bad = [r for r in rows if r.get("status") in FAILED]
    props = defaultdict(lambda: defaultdict(int))
    for r in rows:
        if r.get("check"):
            props[f"{r['variant']}:{r['check']}"][r.get("status")] += 1
    slow = sorted((r for r in rows if r.get("seconds")), key=lambda r: -r["seconds"])[:10]
    return {
        "total": total if total is not None else len(rows), "counts": dict(counts), "not_run": not_run,
        "cut": cut, "per_variant": {v: dict(c) for v, c in per_variant.items()},
        "failures": [{"id": r["id"], "status": r["status"], "case": describe(r),
                      "failed": r.get("failed", []),
                      "errors": {k: _num(_float(r["err"][k])) for k in r.get("failed", []) if k in (r.get("err") or {})}}
                     for r in bad],
        "properties": {k: dict(v) for k, v in props.items()},
        "budget": _clean(budget(rows)),
        "slowest": [{"id": r["id"], "seconds": r["seconds"], "case": describe(r)} for r in slow],
        "case_seconds": round(sum(r.get("seconds", 0) for r in rows), 1),
    }


def markdown(s: dict, *, title="Native conformance") -> str:
    c = s["counts"]
    lines = [f"### {title}: {s['total']} cases — " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
             + (f", not run {s['not_run']}" if s["not_run"] else "")]
    if s.get("cut"):
        lines.append(f"Cut by {s['cut']}.")
    if s["failures"]:
        lines += ["", "Failures:", ""]
        for f in s["failures"][:60]:
            errs = ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in f["errors"].items())
            lines.append(f"- `{f['id']}` {f['status']}: {f['case']} — {', '.join(map(str, f['failed'][:6]))}"
                         + (f" ({errs})" if errs else ""))
        if len(s["failures"]) > 60:
            lines.append(f"- … {len(s['failures']) - 60} more (results.jsonl)")
    if s["properties"]:
        lines += ["", "Properties: " + ", ".join(f"{k} " + "/".join(f"{st} {n}" for st, n in v.items())
                                                for k, v in sorted(s["properties"].items()))]
    lines += ["", "Error budget: worst relative error over the matrix, ours (FLA's on the cases it ran, "
              "beside ours on the same cases).", "",
              "| variant | dtype | " + " | ".join(TENSORS) + " |", "|---|---|" + "---|" * len(TENSORS)]
    for v, by_dtype in s["budget"].items():
        for dt, cells in by_dtype.items():
            row = []
            for t in TENSORS:
                cell = cells.get(t)
                if not cell:
                    row.append("")
                    continue
                txt = _fmt(cell["ours"])
                if cell.get("fla") is not None:
                    txt += f" (FLA {_fmt(cell['fla'])} vs {_fmt(cell['ours_on_fla'])})"
                row.append(txt)
            fla = cells.get("_fla")
            note = f" (FLA refused {fla['refused']}, crashed {fla['crashed']})" if fla else ""
            lines.append(f"| {v} | {dt}{note} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _fmt(x):
    x = _float(x)
    return f"{x:.1e}" if isinstance(x, float) and math.isfinite(x) else str(x)


def read_jsonl(path) -> list[dict]:
    rows = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[r["id"]] = r
    return list(rows.values())
