"""tools/state_pass_sweep.py on the CPU at a toy size (its timings mean something on a GPU only):
every launch given runs both passes, and a launch that computes the same states reads 0 difference."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import state_pass_sweep  # noqa: E402


def test_launch_text_is_parsed_or_refused():
    assert state_pass_sweep.parse_launch("32x128:4:4") == (32, 128, 4, 4)
    with pytest.raises(SystemExit, match="BKxBV:STAGES:WARPS"):
        state_pass_sweep.parse_launch("32x128:4")


def test_sweep_times_every_launch_of_both_passes():
    rows = state_pass_sweep.sweep([130], ["dim", "head"], [(32, 32, 1, 4), (32, 64, 2, 4)],
                                  {"tokens": 130, "H": 1, "K": 32, "V": 32})
    assert len(rows) == 2 * 2 * 3                                  # gate kinds × passes × (library + 2)
    assert {r[0] for r in rows} == {"recomputed states", "reverse pass"}
    assert all(r[3] > 0 for r in rows)                             # a time for each
    assert all(r[4] == 0.0 for r in rows)                          # block shapes change no state here


def test_a_wrong_state_shows_as_a_difference(monkeypatch):
    """The difference column can fail: a launch whose states differ from the library launch's is
    reported (here a stand-in pass that is off by 1 % under one launch)."""
    from linattn.triton import gated
    real = gated.chunk_states

    def off_under_one_launch(*args, config=None, **kw):
        h, sT = real(*args, config=config, **kw)
        return (h * 1.01 if config == (32, 64, 2, 4) else h), sT
    monkeypatch.setattr(gated, "chunk_states", off_under_one_launch)
    rows = state_pass_sweep.sweep([130], ["dim"], [(32, 32, 1, 4), (32, 64, 2, 4)],
                                  {"tokens": 130, "H": 1, "K": 32, "V": 32})
    diff = {(r[0], r[2]): r[4] for r in rows}
    assert diff["recomputed states", "32×64, 2 stages, 4 warps"] == pytest.approx(0.01, rel=1e-3)
    assert diff["recomputed states", "32×32, 1 stages, 4 warps"] == 0.0
    assert diff["reverse pass", "32×64, 2 stages, 4 warps"] == 0.0
