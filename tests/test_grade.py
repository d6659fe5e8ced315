"""The grading engine: verdicts, progress, routing the library through the reader's code, CLI."""
import os
import textwrap

import pytest
import torch

import linattn
from linattn import chunk, naive
from linattn.grade import check, exercises, progress, progress_text, reference
from linattn.grade.cli import main as cli
from planted import fork_as_on_a_cpu  # noqa: F401  (autouse: these tests fork even beside a GPU)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_HOME", str(tmp_path))
    yield tmp_path
    linattn.set_impl("linear_attn", "auto")


def verdict(fn, name="ch01.recurrent"):
    return check(name, fn, seed=5, record=False, quiet=True)


def test_catalog_lists_exercises_in_book_order():
    names = exercises()
    assert names[:3] == ["ch01.recurrent", "ch01.parallel", "ch02.chunkwise"]
    assert names == sorted(names, key=lambda n: int(n[2:4]))
    assert reference("ch02.chunkwise") is chunk.linear_attn


def test_reference_passes_and_records_progress(home):
    r = check("ch01.recurrent", naive.linear_attn, seed=1, quiet=True)
    assert r.passed and r.cases >= 5
    assert progress.passed("ch01.recurrent")
    assert (home / "mine" / "ch01.recurrent.py").exists()
    assert "✓ ch01.recurrent" in progress_text()


def test_exception_is_reported_with_its_line():
    def broken(q, k, v, **kw):
        return q @ v  # shapes do not fit

    r = verdict(broken)
    assert not r.passed
    assert "raised RuntimeError" in r.message and "in broken" in r.message and "q @ v" in r.message


def test_stub_is_not_written_yet():
    def stub(q, k, v, **kw):
        raise NotImplementedError("write me")

    assert "not written yet" in verdict(stub).message


def test_wrong_shape_dtype_nan_and_error_are_named():
    def shape(q, k, v, **kw):
        o, s = naive.linear_attn(q, k, v, **kw)
        return o[:, 1:], s

    def dtype(q, k, v, **kw):
        o, s = naive.linear_attn(q, k, v, **kw)
        return o.double(), s

    def unwritten(q, k, v, **kw):  # leaves the last position as allocated (poisoned)
        o, s = naive.linear_attn(q, k, v, **kw)
        out = linattn.outputs.empty(o.shape, dtype=o.dtype, device=o.device)
        out[:, :-1] = o[:, :-1]
        return out, s

    def wrong(q, k, v, **kw):
        o, s = naive.linear_attn(q, k, v, **kw)
        return o * 1.01, s

    assert "has shape" in verdict(shape).message
    assert "has dtype torch.float64, expected" in verdict(dtype).message
    assert "NaN/inf" in verdict(unwritten).message
    msg = verdict(wrong).message
    assert "relative error" in msg and "worst at" in msg and "hint:" in msg


def test_wrong_number_of_outputs():
    assert "returned 1 value(s), expected 2" in verdict(lambda q, k, v, **kw: naive.linear_attn(q, k, v, **kw)[0]).message


def test_fresh_cases_each_check():
    a = check("ch01.recurrent", naive.linear_attn, record=False, quiet=True)
    b = check("ch01.recurrent", naive.linear_attn, record=False, quiet=True)
    assert a.passed and b.passed and a.seed != b.seed


def test_mine_routes_the_library_through_passed_code(home):
    ns = {}
    exec(textwrap.dedent('''
        import torch
        SCALE_FIX = 1
        def helper(q, k):
            return q @ k.transpose(-1, -2)
        def my_parallel(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
            from linattn.naive import linear_attn
            return linear_attn(q, k, v, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state)
    '''), ns)
    with pytest.raises(linattn.InputError, match="you have not passed"):
        linattn.linear_attn(*torch.randn(3, 1, 4, 1, 8), impl="mine")
    assert check("ch01.recurrent", naive.linear_attn, seed=2, quiet=True).passed
    linattn.set_impl("linear_attn", "mine")
    q = k = v = torch.randn(1, 5, 1, 8)
    linattn.linear_attn(q, k, v)
    assert linattn.which("linear_attn").startswith("your ch01.recurrent")
    linattn.set_impl("linear_attn", "auto")
    linattn.linear_attn(q, k, v)
    assert linattn.which("linear_attn") == "linattn.chunk.linear_attn (reference)"


def test_cli_grades_a_workbook(tmp_path, capsys):
    wb = tmp_path / "01_demo.py"
    wb.write_text(textwrap.dedent('''
        # %%
        from linattn.grade import check
        from linattn import naive

        # %% exercise="ch01.recurrent"
        def recurrent(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
            return naive.linear_attn(q, k, v, scale=scale, initial_state=initial_state,
                                     output_final_state=output_final_state)

        # %%
        check("ch01.recurrent", recurrent);

        # %% exercise="ch01.parallel"
        def parallel(q, k, v, *, scale=None, initial_state=None, output_final_state=False):
            raise NotImplementedError("write me")

        # %%
        check("ch01.parallel", parallel);
    '''))
    assert cli([str(wb)]) == 1
    out = capsys.readouterr().out
    assert "PASS  ch01.recurrent" in out and "FAIL  ch01.parallel" in out
    assert "score: 1/2 exercises passed" in out
    assert cli([str(wb), "--solved"]) == 0


def test_changing_an_input_in_place_is_named():
    def sneaky(q, k, v, **kw):
        out = naive.linear_attn(q, k, v, **kw)
        k.mul_(2)  # the values returned are right, but the caller's k is not k any more
        return out

    r = verdict(sneaky)
    assert not r.passed and "changed its input `k` in place" in r.message

    def sneaky_state(q, k, v, *, initial_state=None, **kw):
        out = naive.linear_attn(q, k, v, initial_state=initial_state, **kw)
        if initial_state is not None:
            initial_state.zero_()
        return out

    assert "changed its input `initial_state` in place" in verdict(sneaky_state).message


def test_sys_exit_is_a_verdict():
    import sys

    def quitter(q, k, v, **kw):
        sys.exit(3)

    msg = verdict(quitter).message
    assert "called sys.exit(3)" in msg and "sys.exit(3)" in msg and "in quitter" in msg


@pytest.mark.parametrize("forked", [True, False])
def test_endless_loop_hits_the_time_limit(forked, monkeypatch):
    from linattn.grade import grading
    if not forked:  # the in-process way (kernel exercises on a GPU): an alarm
        monkeypatch.setattr(grading, "_isolated", lambda dev: False)

    def spin(q, k, v, **kw):
        while True:
            pass

    r = check("ch01.recurrent", spin, seed=5, record=False, quiet=True, time_limit=0.3)
    assert not r.passed and "ran past the 0.3 s limit" in r.message and "in spin" in r.message
    # the reader's `except Exception` cannot swallow the time limit
    def stubborn(q, k, v, **kw):
        while True:
            try:
                while True:
                    pass
            except Exception:
                pass

    r = check("ch01.recurrent", stubborn, seed=5, record=False, quiet=True, time_limit=0.3)
    assert "ran past the 0.3 s limit" in r.message


@pytest.mark.parametrize("forked", [True, False])
def test_time_limit_outside_the_main_thread(forked, monkeypatch):
    import threading

    from linattn.grade import grading
    if not forked:  # the in-process way (kernel exercises on a GPU): a watcher thread
        monkeypatch.setattr(grading, "_isolated", lambda dev: False)

    def spin(q, k, v, **kw):
        while True:
            pass

    box = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "r", check("ch01.recurrent", spin, seed=5, record=False, quiet=True, time_limit=0.3)))
    t.start()
    t.join(30)
    assert "ran past the 0.3 s limit" in box["r"].message


def test_time_limit_from_the_environment(monkeypatch):
    def slow(q, k, v, **kw):
        import time
        time.sleep(5)

    monkeypatch.setenv("LINATTN_TIME_LIMIT", "0.2")
    assert "ran past the 0.2 s limit" in verdict(slow).message


def test_triton_kernel_capture_round_trip(home):
    """A passed launcher's @triton.jit kernel (and its grid lambda's names) is saved and runs."""
    from linattn.grade import progress as prog
    ns = {"__name__": "reader_nb"}
    src = textwrap.dedent('''
        import torch
        import triton
        import triton.language as tl
        BLOCK = 16

        @triton.jit
        def double_kernel(x, y, n, B: tl.constexpr):
            offs = tl.program_id(0) * B + tl.arange(0, B)
            tl.store(y + offs, 2 * tl.load(x + offs, mask=offs < n), mask=offs < n)

        def double(x):
            y = torch.empty_like(x)
            double_kernel[lambda meta: (triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), B=BLOCK)
            return y
    ''')
    path = home / "reader_nb.py"
    path.write_text(src)
    exec(compile(src, str(path), "exec"), ns)
    saved = prog.capture_source(ns["double"])
    assert "@triton.jit" in saved and "def double_kernel" in saved and "BLOCK = 16" in saved
    (home / "saved.py").write_text(saved + "\nSOLUTION = double\n")
    out = {"__name__": "saved"}
    exec(compile(saved + "\nSOLUTION = double\n", str(home / "saved.py"), "exec"), out)
    x = torch.randn(37, device=linattn.device.default_device())  # natively: a CUDA tensor
    assert torch.equal(out["SOLUTION"](x), 2 * x)


def test_keyboard_interrupt_is_not_swallowed():
    def pressed_stop(q, k, v, **kw):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        verdict(pressed_stop)


def test_an_abandoned_call_leaves_torch_empty_alone(monkeypatch):
    """In-process (kernel exercises on a GPU) and outside the main thread, a call past its limit is
    abandoned, still running: the grader's NaN-filled torch.empty must not outlive the check."""
    import threading

    from linattn.grade import grading
    monkeypatch.setattr(grading, "_isolated", lambda dev: False)
    import time as clock

    def spin(q, k, v, **kw):
        end = clock.monotonic() + 3
        while clock.monotonic() < end:
            pass

    t = threading.Thread(target=lambda: check("ch01.recurrent", spin, seed=5, record=False,
                                              quiet=True, time_limit=0.2))
    t.start()
    t.join(30)
    assert torch.empty.__module__ == "torch"          # the real one, not the grader's lambda
