"""The graders cannot be faked, hung or crashed by what they grade, nor by damaged progress files.

Tests that could hang if the time limit broke run inside `bounded`, a forked copy of the test
killed after a few seconds, so a regression fails instead of stalling CI.
"""
import json
import os
import pickle
import select
import signal
import sys
import textwrap
import time

import pytest
import torch

import linattn
from linattn import naive
from linattn.grade import check, grading, isolate, progress, progress_text
from linattn.grade.cli import main as cli
from planted import fork_as_on_a_cpu  # noqa: F401  (autouse: these tests fork even beside a GPU)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LINATTN_TIME_LIMIT", raising=False)
    yield tmp_path / "home"
    linattn.set_impl("linear_attn", "auto")


@pytest.fixture(params=["forked", "in-process"])
def where(request, monkeypatch):
    """Both ways a check runs: in a forked child (CPU) and in this process (the GPU's way)."""
    if request.param == "in-process":
        monkeypatch.setattr(grading, "_isolated", lambda dev: False)
    return request.param


def bounded(fn, seconds=60):
    """fn() in a forked copy of this test process, killed after `seconds`: a hang fails the test."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            torch.set_num_threads(1)  # OpenMP's pool does not survive a fork
            try:
                out = ("ok", fn())
            except BaseException as e:  # noqa: BLE001
                out = ("error", f"{type(e).__name__}: {e}")
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    data, end = b"", time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([r], [], [], end - time.monotonic())
            if not ready:
                continue
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            data += chunk
        else:
            pytest.fail(f"hung: still running after {seconds} s")
    finally:
        os.close(r)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        os.waitpid(pid, 0)
    assert data, "the test's process ended without a result"
    kind, value = pickle.loads(data)
    assert kind == "ok", value
    return value


def right(q, k, v, **kw):
    return naive.linear_attn(q, k, v, **kw)


def grade(fn, name="ch01.recurrent", **kw):
    return check(name, fn, seed=5, quiet=True, **kw)


QUICK = "ch01.parallel"  # same cases as ch01.recurrent, a faster reference: for tests that only need a pass


# ---- time limits -------------------------------------------------------------------------------

def test_catching_base_exception_does_not_beat_the_limit(where, home):
    """Right answers, but the function swallows the time limit's interrupt and runs on: it fails
    and is not recorded."""
    def stubborn(q, k, v, **kw):
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            try:
                time.sleep(0.01)
            except BaseException:  # noqa: BLE001
                pass
        return naive.linear_attn(q, k, v, **kw)

    r = bounded(lambda: grade(stubborn, time_limit=0.3))
    assert not r.passed and "ran past the 0.3 s limit" in r.message
    assert not progress.passed("ch01.recurrent")


def test_endless_loop_catching_base_exception_is_stopped():
    def endless(q, k, v, **kw):
        while True:
            try:
                while True:
                    pass
            except BaseException:  # noqa: BLE001
                pass

    started = time.monotonic()
    r = bounded(lambda: grade(endless, time_limit=0.5, record=False), seconds=20)
    assert not r.passed and "ran past the 0.5 s limit" in r.message and "in endless" in r.message
    assert time.monotonic() - started < 15


def _dead(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"  # a zombie is dead too
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def test_a_function_that_forks_leaves_no_process_behind(tmp_path, capfd):
    """The forked copies of the function neither report nor keep grading; all of them end."""
    pids = tmp_path / "pids"

    def forker(q, k, v, **kw):
        if os.fork() == 0:
            with open(pids, "a") as f:
                f.write(f"{os.getpid()}\n")
            while True:  # the copy would keep running (and grading) forever
                time.sleep(0.05)
        return naive.linear_attn(q, k, v, **kw)

    r = bounded(lambda: check("ch01.recurrent", forker, seed=5, record=False), seconds=60)
    assert r.passed
    time.sleep(0.5)
    left = [int(p) for p in pids.read_text().split()]
    assert left and all(_dead(p) for p in left), left
    assert capfd.readouterr().out.count("ch01.recurrent") == 1   # one verdict, from this process


def test_a_function_that_ends_the_process_is_a_verdict():
    def quits(q, k, v, **kw):
        os._exit(3)

    r = bounded(lambda: grade(quits, record=False), seconds=30)
    assert not r.passed and "ended the process grading it (exit status 3)" in r.message


@pytest.mark.parametrize("limit", [float("inf"), 0])
def test_no_limit_passes_the_reference(where, limit):
    assert grade(right, QUICK, time_limit=limit, record=False).passed


@pytest.mark.parametrize("value, said", [("inf", False), ("abc", True), ("nan", True), ("0", False)])
def test_limit_from_a_bad_or_infinite_environment(monkeypatch, capsys, value, said):
    monkeypatch.setenv("LINATTN_TIME_LIMIT", value)
    assert grade(right, QUICK, record=False).passed
    out = capsys.readouterr().out
    assert ("LINATTN_TIME_LIMIT" in out and "is not a number of seconds" in out) == said


def test_bad_time_limit_argument_names_it():
    with pytest.raises(ValueError, match="time_limit"):
        grade(right, time_limit="abc")


# ---- whatever the function returns or raises is a verdict -------------------------------------

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no")


def _meta(q, k, v, **kw):
    o, s = naive.linear_attn(q, k, v, **kw)
    return o.to("meta"), s


def _sparse(q, k, v, **kw):
    o, s = naive.linear_attn(q, k, v, **kw)
    return o.to_sparse(), s


def _generator_exit(q, k, v, **kw):
    raise GeneratorExit


def _unprintable(q, k, v, **kw):
    raise Unprintable()


def _not_a_tensor(q, k, v, **kw):
    return object(), None


@pytest.mark.parametrize("fn, says", [
    (_meta, "meta device"),
    (_sparse, "sparse_coo tensor"),
    (_generator_exit, "raised GeneratorExit"),
    (_unprintable, "raised Unprintable: (its message cannot be shown"),
    (_not_a_tensor, "got an object"),
])
def test_odd_results_and_exceptions_are_verdicts(where, fn, says):
    r = grade(fn, record=False)
    assert not r.passed and says in r.message, r.message


# ---- global state ------------------------------------------------------------------------------

def _state():
    return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_default_device(),
            torch.get_num_threads(), torch.random.get_rng_state().clone(),
            torch.empty(1).device, torch.are_deterministic_algorithms_enabled())


def test_a_function_changing_global_torch_state_leaves_it_as_it_was(where):
    def meddler(q, k, v, **kw):
        out = naive.linear_attn(q, k, v, **kw)
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.set_default_device("meta")
        torch.manual_seed(1234)
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        return out

    before = _state()
    r = grade(meddler, QUICK, record=False)
    after = _state()
    assert r.passed, r.message
    assert after[:4] == before[:4] and after[5:] == before[5:]
    assert torch.equal(after[4], before[4])   # the random state: not reseeded


# ---- who may record a pass ---------------------------------------------------------------------

def test_a_check_inside_the_graded_function_records_nothing(where):
    def cheat(q, k, v, **kw):
        check("ch01.parallel", naive.linear_attn, quiet=True)   # would record a pass
        return naive.linear_attn(q, k, v, **kw)

    assert grade(cheat).passed
    assert progress.passed("ch01.recurrent") and not progress.passed("ch01.parallel")


def test_progress_cannot_be_written_from_the_grading_process():
    def writer(q, k, v, **kw):
        progress.record(linattn.grade.catalog.get("ch01.parallel"), None)
        return naive.linear_attn(q, k, v, **kw)

    r = grade(writer, record=False)
    assert not r.passed and "recorded by the notebook's process only" in r.message
    assert not progress.passed("ch01.parallel")


def test_a_machine_with_a_gpu_grades_in_process(monkeypatch):
    """Where PyTorch sees a GPU, autograd's engine keeps a thread per GPU: a child forked after
    this process ran a backward cannot run one (it raises or dies), so a backward exercise would
    fail for no fault of the reader's. There every function runs in this process."""
    monkeypatch.setattr(isolate, "accelerators", lambda: 1)
    pids = []

    def recurrent(q, k, v, **kw):
        pids.append(os.getpid())
        return naive.linear_attn(q, k, v, **kw)

    assert grade(recurrent, record=False).passed
    assert pids and set(pids) == {os.getpid()}
    monkeypatch.setattr(isolate, "accelerators", lambda: 0)        # a CPU machine forks
    pids.clear()
    assert grade(recurrent, record=False).passed and not pids


def test_the_notebook_process_never_runs_the_graded_object(home):
    """An object that computes the right answer but records a pass whenever an attribute it lacks
    is looked up: only the child calls it; the parent saves its code by static lookups only."""
    class Sly:
        def __call__(self, q, k, v, **kw):
            return naive.linear_attn(q, k, v, **kw)

        def __getattr__(self, name):
            progress.record(linattn.grade.catalog.get("ch01.parallel"), None)
            raise AttributeError(name)

    assert grade(Sly()).passed
    assert progress.passed("ch01.recurrent") and not progress.passed("ch01.parallel")


def test_garbage_written_into_the_grader_pipe_is_a_failed_case():
    """A function that finds the pipe its results go back through and writes into it: the
    parent reads plain data only, so the case fails; nothing is run, nothing raised."""
    def forger(q, k, v, **kw):
        f = sys._getframe()
        while f is not None and f.f_code.co_name != "_child":
            f = f.f_back
        os.write(f.f_locals["fd"], b"\x00" * 8 + b"\xff" * 8 + b"garbage")
        return naive.linear_attn(q, k, v, **kw)

    r = grade(forger, record=False)
    assert not r.passed and "sent back something unreadable" in r.message


def test_solution_calling_the_library_can_stand_in_for_it(home):
    """A passed function that calls linattn.<op> itself, routed with set_impl(op, "mine"): the
    inner call runs the reference instead of calling the reader's function again without end."""
    ns = {"__name__": "reader_nb"}
    src = textwrap.dedent('''
        import linattn

        def wrapped(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
            return linattn.linear_attn(q, k, v, scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state)
    ''')
    path = home.parent / "reader_nb.py"
    path.write_text(src)
    exec(compile(src, str(path), "exec"), ns)
    assert grade(ns["wrapped"]).passed
    linattn.set_impl("linear_attn", "mine")
    q = k = v = torch.randn(1, 5, 1, 8)
    o, _ = linattn.linear_attn(q, k, v)
    assert torch.allclose(o, naive.linear_attn(q, k, v)[0], atol=1e-5)
    assert linattn.which("linear_attn").startswith("your ch01.recurrent")


# ---- damaged progress --------------------------------------------------------------------------

def _passes_and_shows(home, capsys):
    assert grade(right, QUICK).passed
    assert progress.passed(QUICK)
    assert cli(["--progress"]) == 0
    return capsys.readouterr().out


def test_progress_json_that_is_not_utf8(home, capsys):
    home.mkdir()
    (home / "progress.json").write_bytes(b'{"passed": {"\xff\xfe": {}}}')
    out = _passes_and_shows(home, capsys)
    assert "not valid UTF-8" in out and "kept aside as" in out
    assert (home / "progress.json.damaged-1").read_bytes().startswith(b'{"passed"')


@pytest.mark.parametrize("bad", [b'{"name": 5}', b"\xff\xfe", b"[" * 100000,
                                 b'[1, 2]\n{"name": ["x"]}'],
                         ids=["number for a name", "not UTF-8", "nested too deep", "not an entry"])
def test_bad_lines_in_passes_log(home, capsys, bad):
    home.mkdir()
    (home / "passes.log").write_bytes(bad + b'\n{"name": "ch02.chunkwise", "at": 3}\n')
    (home / "progress.json").write_text("{")   # damaged: rebuilt from the log
    out = _passes_and_shows(home, capsys)
    recovered = out.split("passes recovered: ")[1].split(". Grading")[0]
    assert "ch02.chunkwise" in recovered
    assert progress.passed("ch02.chunkwise")


def test_progress_json_that_is_a_folder(home, capsys):
    (home / "progress.json").mkdir(parents=True)
    out = _passes_and_shows(home, capsys)
    assert "a folder, not a file" in out and (home / "progress.json.damaged-1").is_dir()


def test_linattn_home_that_is_a_file(home, capsys):
    home.write_text("")
    r = grade(right, QUICK)
    assert r.passed and "could not be recorded" in r.message
    assert cli(["--progress"]) == 0
    out = capsys.readouterr().out
    assert "is a file, not a folder" in out and "· ch01.recurrent" in out


# ---- the command line --------------------------------------------------------------------------

def test_cli_refuses_a_file_that_is_not_a_workbook(tmp_path, capsys):
    readme = os.path.join(os.path.dirname(__file__), "..", "README.md")
    assert cli([readme]) == 2
    assert "is not a workbook" in capsys.readouterr().out
    assert cli([str(tmp_path / "missing.py")]) == 2
    assert "no such file" in capsys.readouterr().out


def test_cli_solved_records_nothing(tmp_path, home):
    wb = tmp_path / "01_demo.py"
    wb.write_text(textwrap.dedent('''
        # %%
        from linattn.grade import check

        # %% exercise="ch01.recurrent"
        def recurrent(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
            raise NotImplementedError("write me")

        # %%
        check("ch01.recurrent", recurrent);
    '''))
    assert cli([str(wb), "--solved"]) == 0
    assert progress.load() == {"passed": {}}
    assert not (home / "passes.log").exists()


def test_what_the_function_prints_is_shown_even_when_it_hangs(capfd):
    def chatty(q, k, v, **kw):
        print("step 1 done")
        while True:
            pass

    r = bounded(lambda: check("ch01.recurrent", chatty, seed=5, record=False, time_limit=0.5),
                seconds=30)
    out = capfd.readouterr().out
    assert "ran past the 0.5 s limit" in r.message
    assert "step 1 done" in out and out.index("step 1 done") < out.index("ran past")
