"""linattn.bench_packing's reading of a recorded run: the equal rows' forward times, which chapters 10
and 11 set beside the older forward record, are the forward benchmark's own setting."""
from linattn import bench, bench_packing


def test_equal_rows_forward_reads_the_forward_rows_at_the_benchmark_setting():
    rec = {"setting": {"lengths": [16384, 8192, 4096, 2048, 1024, 512, 256, 256]},
           "rows": [{"op": "gla", "mode": "forward", "equal": 1.1}, {"op": "gla", "mode": "train", "equal": 5.9},
                    {"op": "kda", "mode": "forward", "equal": None}]}
    assert bench_packing.equal_rows_forward(rec) == (4096, {"gla": 1.1})


def test_the_recorded_runs_meet_at_one_length_for_every_op():
    # chapters 10 and 11 look up each op's row of the forward record at the packing run's T
    T, ms = bench_packing.equal_rows_forward(bench.recorded_run("packing_gpu.json"))
    assert set(ms) == set(bench.OPS) and all(m > 0 for m in ms.values())
    forward = bench.recorded_run("bench.json")["anchors"]["rows"]
    assert {r["op"] for r in forward if r["T"] == T} == set(bench.OPS)
