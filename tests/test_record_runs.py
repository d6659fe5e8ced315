"""tools/record_runs.py: the recorded GPU runs over several device calls. The suites' processes are
replaced by a stub here (the suites themselves have their own tests); what is checked is the order
(every op compiles before any is timed), resuming from earlier calls, the deadline, and the merge
into the files the chapters read."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import record_runs as rr  # noqa: E402
from linattn import bench  # noqa: E402


def env(date="2026-11-28"):
    return {"device": "NVIDIA H200", "date": date, "torch": "2.11.0+cu130", "triton": "3.6.0", "fla": "0.6.0"}


def write(path: Path, data: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def packing_result(op):
    return {"env": env(), "size": "full", "setting": {"H": 16}, "rows": [{"op": op, "mode": "forward", "packed": 1.0}]}


def test_every_op_compiles_before_any_is_timed_and_recorded_ops_are_skipped(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, deadline, log):
        calls.append(("time" if "--out" in cmd else "warm", cmd[cmd.index("--only") + 1]))
        if "--out" in cmd:
            write(Path(cmd[cmd.index("--out") + 1]), packing_result(cmd[cmd.index("--only") + 1]))
        return 0
    monkeypatch.setattr(rr, "run", fake_run)
    earlier = tmp_path / "call1"
    write(earlier / "packing_gla.json", packing_result("gla"))
    status = rr.record(["packing"], tmp_path / "call2", [earlier], 100, 4, None, ops=["gla", "kda", "delta_rule"],
                       say=lambda *a: None)
    assert status["packing"] == {"gla": "recorded earlier", "delta_rule": "timed", "kda": "timed"}
    # the compiles run in parallel threads, so they may reach the stub in either order
    assert sorted(calls[:2]) == [("warm", "delta_rule"), ("warm", "kda")]
    assert calls[2:] == [("time", "delta_rule"), ("time", "kda")]          # timed after all compiled


def test_nothing_starts_after_the_deadline(tmp_path):
    out = tmp_path / "call"
    status = rr.record(["packing"], out, [], 0, 2, "small", ops=["kda"], say=lambda *a: None)
    assert status["packing"] == {"kda": "cut or failed (124)"}
    assert not (out / "packing_kda.json").exists()


def test_a_cut_training_run_is_resumed_not_counted_as_recorded(tmp_path):
    """tools/bench.py saves a cut run's rows with empty notes: the next call resumes from them."""
    cut = tmp_path / "call1"
    write(cut / "train_kda" / "bench.json", {"env": env(), "size": {}, "train": {"rows": [{"op": "kda"}], "notes": []}})
    assert rr.recorded("train", "kda", [cut]) is None
    cmd = rr.command("train", "kda", tmp_path / "call2" / "train_kda" / "bench.json", None,
                     [cut / "train_kda" / "bench.json"])
    assert cmd[cmd.index("--resume") + 1] == str(cut / "train_kda" / "bench.json")
    assert cmd[cmd.index("--out") + 1] == str(tmp_path / "call2" / "train_kda")
    forward = rr.command("anchors", "kda", tmp_path / "call2" / "anchors_kda" / "bench.json", None,
                         [cut / "anchors_kda" / "bench.json"])
    assert forward[forward.index("--resume") + 1] == str(cut / "anchors_kda" / "bench.json")   # keeps rows too
    warm = rr.command("anchors", "kda", None, None, [cut / "anchors_kda" / "bench.json"])
    assert "--warm" in warm and "--resume" in warm and "--out" not in warm      # compiles only the rest
    write(cut / "train_kda" / "bench.json", {"env": env(), "size": {}, "train": {"rows": [], "notes": ["whole"]}})
    assert rr.recorded("train", "kda", [cut]) == cut / "train_kda" / "bench.json"


def test_merge_joins_the_calls_in_the_library_op_order(tmp_path):
    one, two = tmp_path / "call1", tmp_path / "call2"
    write(one / "packing_kda.json", packing_result("kda"))
    write(two / "packing_linear_attn.json", dict(packing_result("linear_attn"), env=env("2026-11-29")))
    for d, op in ((one, "gla"), (two, "delta_rule")):
        write(d / f"train_{op}" / "bench.json", {
            "env": env(), "size": {"H": 16},
            "train": {"rows": [{"op": op, "T": 1024}], "by_gates": {"mamba": [{"op": op, "T": 1024}]},
                      "stages": {op: {"T": 8192}}, "notes": ["n"]}})
    into = tmp_path / "data"
    into.mkdir()
    rr.merge([one, two], into, say=lambda *a: None)
    packing = json.loads((into / "packing_gpu.json").read_text())
    order = [op for op in bench.OPS if op in ("kda", "linear_attn")]
    assert [r["op"] for r in packing["rows"]] == order
    assert [c["ops"] for c in packing["calls"]] == [[op] for op in order]
    assert {c["date"] for c in packing["calls"]} == {"2026-11-28", "2026-11-29"}
    train = json.loads((into / "bench_train.json").read_text())["train"]
    assert [r["op"] for r in train["rows"]] == [op for op in bench.OPS if op in ("gla", "delta_rule")]
    assert len(train["by_gates"]["mamba"]) == 2 and set(train["stages"]) == {"gla", "delta_rule"}
    assert not (into / "long_sequence.json").exists()                     # no call recorded it


def test_the_forward_rows_replace_bench_json_s_and_its_chunk_sweep_keeps_its_run(tmp_path):
    call = tmp_path / "call1"
    for op in ("kda", "gla"):
        write(call / f"anchors_{op}" / "bench.json", {
            "env": env("2026-11-29"), "size": {"H": 16},
            "anchors": {"rows": [{"op": op, "T": 1024}], "by_gates": {}, "notes": ["n"], "bandwidth": 4.2e12}})
    into = tmp_path / "data"
    write(into / "bench.json", {"env": env("2026-11-21"), "size": {"H": 16},
                                "anchors": {"rows": [{"op": "old"}]}, "chunks": {"rows": [{"C": 64}]}})
    rr.merge([call], into, say=lambda *a: None)
    merged = json.loads((into / "bench.json").read_text())
    assert [r["op"] for r in merged["anchors"]["rows"]] == [op for op in bench.OPS if op in ("kda", "gla")]
    assert merged["env"]["date"] == "2026-11-29" and merged["anchors"]["bandwidth"] == 4.2e12
    assert "stages" not in merged["anchors"]                           # backward stages: training only
    assert merged["chunks"]["rows"] == [{"C": 64}] and merged["chunks"]["env"]["date"] == "2026-11-21"
