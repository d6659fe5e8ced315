"""linattn.bench_packing's reading of a recorded run: the equal rows' forward times, which chapters 10
and 11 set beside the older forward record, are the forward benchmark's own setting."""
from linattn import bench, bench_packing


def test_equal_rows_forward_reads_the_forward_rows_at_the_benchmark_setting():
    rec = {"setting": {"lengths": [16384, 8192, 4096, 2048, 1024, 512, 256, 256]},
           "rows": [{"op": "gla", "mode": "forward", "equal": 1.1}, {"op": "gla", "mode": "train", "equal": 5.9},
                    {"op": "kda", "mode": "forward", "equal": None}]}
    assert bench_packing.equal_rows_forward(rec) == (4096, {"gla": 1.1})


def test_the_recorded_runs_meet_at_one_length_for_every_op():
    # chapters 10 and 11 set each op's row of the forward record beside the packing run's
    packing, forward = bench.recorded_run("packing_gpu.json"), bench.recorded_run("bench.json")
    times, text = bench_packing.forward_since(forward, packing, {op: op for op in bench.OPS})
    T, now = bench_packing.equal_rows_forward(packing)
    row = {r["op"]: r for r in forward["anchors"]["rows"] if r["T"] == T}
    assert times == {op: (row[op]["triton"], now[op], row[op]["fla"]) for op in bench.OPS}
    assert f"T = {T}" in text and len(text.splitlines()) == 1 + len(bench.OPS)
