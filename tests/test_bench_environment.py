"""What a recorded run stores beside its results (bench.environment) and the line printed above its
table (bench.run_label): on a GPU, how busy it was while the run's process was idle. NVML's readings
are stubbed here (torch.cuda.utilization, device_memory_used), so the CPU checks the logic; on a GPU
machine the same functions read the driver."""
import pytest
import torch

from linattn import bench

ENV = {"device": "NVIDIA H200", "date": "2026-11-28", "torch": "2.11.0+cu130", "triton": "3.6.0",
       "fla": "0.6.0", "python": "3.12.3"}


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU that NVML says was busy `state["busy"]` % of the idle wait, with 3 GiB in use of which
    our allocator reserved 1 GiB; no real sleep."""
    state = {"busy": 0, "slept": 0.0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "utilization", lambda *a: state["busy"])
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda *a: 3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 1 << 30)
    monkeypatch.setattr(bench.time, "sleep", lambda s: state.__setitem__("slept", state["slept"] + s))
    return state


def test_an_idle_gpu_is_recorded_and_the_label_stays_plain(fake_gpu):
    env = bench.environment()
    assert env["gpu_without_us"] == {"busy_pct": 0, "outside_mib": 2048}
    assert fake_gpu["slept"] >= bench.IDLE_S      # read after a whole sample period without our kernels
    plain = {k: v for k, v in env.items() if k != "gpu_without_us"}
    assert bench.run_label(env) == bench.run_label(plain)
    assert "busy" not in bench.run_label(env)


def test_a_busy_gpu_warns_and_the_label_says_so(fake_gpu, capsys):
    fake_gpu["busy"] = 37
    env = bench.environment()
    assert env["gpu_without_us"]["busy_pct"] == 37
    assert "37 %" in capsys.readouterr().err
    label = bench.run_label(env)
    plain = bench.run_label({k: v for k, v in env.items() if k != "gpu_without_us"})
    assert label.startswith(plain) and "GPU 37 % busy without this run" in label


def test_no_reading_without_nvml(fake_gpu, monkeypatch):
    def no_pynvml(*a):
        raise ModuleNotFoundError("pynvml does not seem to be installed")
    monkeypatch.setattr(torch.cuda, "utilization", no_pynvml)
    assert bench.gpu_without_us() is None
    assert "gpu_without_us" not in bench.environment()


def test_nothing_read_on_a_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.gpu_without_us() is None
    env = bench.environment()
    assert "gpu_without_us" not in env
    assert set(ENV) <= set(env)


def test_recorded_runs_without_the_reading_keep_their_label():
    """book/data/'s runs predate the reading: their label is what it was."""
    assert bench.run_label(ENV) == "NVIDIA H200, 2026-11-28, torch 2.11.0+cu130, triton 3.6.0, FLA 0.6.0"
