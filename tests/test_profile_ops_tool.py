"""tools/profile_ops.py's --launch overrides on the CPU (the profile itself needs CUDA): a named
kernel's launches through common.launch get the argument, every linattn.triton module's `launch`
is rerouted, and a misspelt kernel or an argument the kernel is not launched with stops the run;
--packed profiles the packing benchmark's own calls."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import profile_ops  # noqa: E402
from linattn.triton import common, delta_backward, gated_backward  # noqa: E402


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.setattr(profile_ops, "LAUNCH", {})
    monkeypatch.setattr(profile_ops, "SEEN", set())
    for module in (common, gated_backward, delta_backward):                   # restored after the test
        monkeypatch.setattr(module, "launch", module.launch)


def _dqk_kernel():                 # stands for a jitted kernel: only its name is read
    pass


def test_override_reaches_the_named_kernel_only():
    calls = []
    fake = profile_ops.overriding(lambda kernel, grid, *args, **kw: calls.append((kernel.__name__, kw)))
    profile_ops.set_launch("_dqk_kernel.num_warps=8")
    profile_ops.set_launch("_dqk_kernel.BV=32")
    fake(_dqk_kernel, (1,), num_warps=4, BV=64)
    fake(lambda: None, (1,), num_warps=4, BV=64)
    assert calls[0] == ("_dqk_kernel", {"num_warps": 8, "BV": 32})
    assert calls[1][1] == {"num_warps": 4, "BV": 64}
    profile_ops.check_launch_overrides()                                      # both were applied


def test_modules_launch_through_the_override():
    profile_ops.set_launch("_dv_kernel.num_warps=8")
    original = common.launch
    profile_ops.install_launch_overrides()
    for module in (common, gated_backward, delta_backward):
        assert module.launch is not original and module.launch.__name__ == "launch_with"


def test_a_wrong_name_or_argument_stops_the_run():
    with pytest.raises(SystemExit, match="KERNEL.ARG=N"):
        profile_ops.set_launch("_dqk_kernel=4")
    profile_ops.set_launch("_dqk_kernel.BR=16")
    fake = profile_ops.overriding(lambda kernel, grid, *args, **kw: None)
    with pytest.raises(SystemExit, match="not launched with BR"):
        fake(_dqk_kernel, (1,), num_warps=4)
    profile_ops.LAUNCH.clear()
    profile_ops.set_launch("_dqk_kernl.num_warps=4")                           # misspelt: never launched
    with pytest.raises(SystemExit, match="_dqk_kernl.num_warps"):
        profile_ops.check_launch_overrides()


def test_packed_profiles_the_packing_benchmark_s_own_calls(monkeypatch, capsys):
    """--packed times the callables tools/bench_packing.py times, layout by layout, FLA left out
    with --no-fla, and a layout without a call (FLA absent) skipped."""
    from linattn import bench_packing
    made = []

    def callables(op, mode, cfg, dev):
        made.append((op, mode, cfg["lengths"]))
        return {"packed": lambda: "p", "longest": lambda: "l", "equal": lambda: "e", "fla": lambda: "f",
                "padded": None}
    monkeypatch.setattr(bench_packing, "callables", callables)
    monkeypatch.setattr(profile_ops, "kernel_times", lambda fn, calls: {f"_{fn()}_kernel": 0.5})
    monkeypatch.setattr(profile_ops.torch.cuda, "empty_cache", lambda: None)
    profile_ops.profile_packed(["delta_rule"], ["packed", "longest", "padded", "fla"], True, 3, no_fla=True)
    assert made == [("delta_rule", "train", bench_packing.SIZES["full"]["lengths"])]
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["delta_rule packed forward + backward: 0.500 ms = _p_kernel 0.500",
                     "delta_rule longest forward + backward: 0.500 ms = _l_kernel 0.500"]
