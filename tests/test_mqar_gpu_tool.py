"""tools/mqar_gpu.py at toy size on the CPU: one file holds several tasks and learning rates, --append keeps
earlier runs and refuses a file made with other settings."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import mqar_gpu  # noqa: E402

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
