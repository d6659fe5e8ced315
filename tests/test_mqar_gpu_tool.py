"""tools/mqar_gpu.py and tools/mqar_probe.py at toy size on the CPU: one file holds several tasks and learning rates, --append keeps
earlier runs and refuses a file made with other settings."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import mqar_gpu  # noqa: E402
import mqar_probe  # noqa: E402
from linattn import mqar  # noqa: E402
from linattn.validate import InputError  # noqa: E402

TOY = ["--steps", "2", "--dims", "16", "--models", "linear", "--vocab", "16", "--batch", "4", "--impl", "chunk"]


def test_tasks_append_and_refuse_other_settings(tmp_path):
    out = tmp_path / "mqar.json"
    mqar_gpu.main(TOY + ["--pairs", "4", "--out", str(out)])
    mqar_gpu.main(TOY + ["--pairs", "8", "--lr", "1e-3,1e-2", "--out", str(out), "--append"])
    rec = json.loads(out.read_text())
    assert [(r["pairs"], r["lr"]) for r in rec["runs"]] == [(4, 3e-3), (8, 1e-3), (8, 1e-2)]
    assert rec["runs"][0]["test_pairs"] == [1, 2, 4, 6, 8]             # up to twice the training list
    assert rec["runs"][1]["test_pairs"] == [1, 2, 4, 8]                # capped at vocab // 2 = 8
    assert set(rec["runs"][1]["accuracy"]) == {"1", "2", "4", "8"}
    assert "pairs" not in rec["config"] and "lr" not in rec["config"] and rec["env"]["date"]
    with pytest.raises(SystemExit, match="--batch|batch"):
        mqar_gpu.main(TOY[:-4] + ["--batch", "8", "--impl", "chunk", "--pairs", "4", "--out", str(out), "--append"])
    assert len(json.loads(out.read_text())["runs"]) == 3              # the refused call wrote nothing

PROBE = ["--steps", "2", "--d-model", "16", "--vocab", "16", "--batch", "4", "--pairs", "4", "--impl", "chunk"]


def test_probe_records_each_gate_variant(tmp_path):
    out = tmp_path / "probe.json"
    mqar_probe.main(PROBE + ["--gates", "learned,fixed", "--out", str(out)])
    mqar_probe.main(PROBE + ["--gates", "bias=12", "--out", str(out), "--append"])
    rec = json.loads(out.read_text())
    assert [r["gates"] for r in rec["runs"]] == ["learned", "fixed", "bias=12"]
    assert all(set(r["accuracy"]) == {"2", "4", "8"} for r in rec["runs"])   # half, all, twice the pairs
    assert rec["runs"][2]["steps"] == 2 and rec["env"]["date"]


def test_probe_fixed_gates_are_one_and_untrained():
    model = mqar.RecallModel("kda", 16, d_model=16, n_heads=2, layers=1, impl="chunk")
    mqar_probe.set_gates(model, "fixed")
    gate = model.blocks[0].mixer.gate
    assert not any(p.requires_grad for p in gate.parameters())
    assert gate(torch.randn(2, 5, 16)).exp().eq(1).all()                # α = 1 in float32


def test_probe_refuses_unknown_variants_and_ungated_layers():
    with pytest.raises(InputError, match="--gates"):
        mqar_probe.set_gates(mqar.RecallModel("kda", 16, d_model=16, n_heads=2, layers=1), "open")
    with pytest.raises(InputError, match="no forget gate"):
        mqar_probe.set_gates(mqar.RecallModel("deltanet", 16, d_model=16, n_heads=2, layers=1), "fixed")
