"""Progress survives damage and concurrent writers: no pass is ever lost silently."""
import json
import multiprocessing as mp

import pytest

from linattn import chunk, naive
from linattn.grade import catalog, check, progress


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_HOME", str(tmp_path))
    return tmp_path


def pass_two():
    assert check("ch01.recurrent", naive.linear_attn, seed=1, quiet=True).passed  # saves mine/
    progress.record(catalog.get("ch01.parallel"), naive.linear_attn)


@pytest.mark.parametrize("damage", ["truncated", "invalid JSON", "wrong structure", "empty",
                                    "nested too deep"])
def test_damaged_file_is_kept_aside_and_passes_recovered(home, damage, capsys):
    pass_two()
    path = home / "progress.json"
    text = path.read_text()
    path.write_text({"truncated": text[: len(text) // 2], "invalid JSON": "{'passed': oops",
                     "wrong structure": json.dumps({"passed": ["ch01.recurrent"]}),
                     "empty": "", "nested too deep": "[" * 100000}[damage])
    assert progress.passed("ch01.recurrent") and progress.passed("ch01.parallel")
    out = capsys.readouterr().out
    assert "was damaged" in out and "progress.json.damaged-1" in out
    assert "ch01.parallel" in out and "ch01.recurrent" in out
    assert (home / "progress.json.damaged-1").read_text() != text   # the damaged copy kept
    assert json.loads(path.read_text())["passed"].keys() == {"ch01.recurrent", "ch01.parallel"}
    # grading goes on and records into the rebuilt file
    assert check("ch02.chunkwise", chunk.linear_attn, seed=3, quiet=True).passed
    assert set(progress.load()["passed"]) == {"ch01.recurrent", "ch01.parallel", "ch02.chunkwise"}


def test_second_damage_gets_a_new_name(home, capsys):
    pass_two()
    for n in (1, 2):
        (home / "progress.json").write_text("{")
        progress.load()
        assert (home / f"progress.json.damaged-{n}").exists()
    assert progress.passed("ch01.parallel")


def test_without_the_log_the_saved_code_still_recovers_passes(home, capsys):
    pass_two()
    (home / "passes.log").unlink()
    (home / "progress.json").write_text("not json")
    done = progress.load()["passed"]
    assert "ch01.recurrent" in done          # it unlocks, so its code was saved in mine/
    assert "ch01.parallel" not in done       # nothing left of it: the message lists what was found
    assert "passes recovered: ch01.recurrent" in capsys.readouterr().out


def test_reset_forgets_everything(home):
    pass_two()
    progress.reset()
    assert progress.load() == {"passed": {}}


def _record_many(home, names):
    import os
    os.environ["LINATTN_HOME"] = home
    from linattn.grade import catalog as cat, progress as prog
    for name in names:
        prog.record(cat.get(name), None)


def test_concurrent_writers_lose_no_pass(home):
    names = [ex.name for ex in catalog.all_exercises()]
    groups = [names[i::4] for i in range(4)]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_record_many, args=(str(home), g)) for g in groups]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert set(progress.load()["passed"]) == set(names)
    assert not list(home.glob("*.tmp")) and not list(home.glob("*.damaged-*"))


def test_unwritable_home_keeps_the_verdict(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LINATTN_HOME", str(blocker / "home"))   # a path under a file
    r = check("ch01.recurrent", naive.linear_attn, seed=1, quiet=True)
    assert r.passed and "could not be recorded" in r.message
