"""mqar.warm_up: chapter 14 compiles every model's kernels in parallel processes before training.
On the CPU it must do nothing (nothing there is compiled); its process pool is checked here
with CPU jobs, which run the same step a GPU job runs."""
import pytest

from linattn import mqar

JOB = dict(mixer="deltanet", vocab=64, d_model=16, n_heads=2, layers=1, n_pairs=4, batch_size=4)


def test_nothing_runs_on_a_cpu(monkeypatch):
    def spawned(*a):
        raise AssertionError("no process should start for a CPU run")
    monkeypatch.setattr(mqar, "_in_processes", spawned)
    assert mqar.warm_up({"deltanet": JOB}, device="cpu") == {}


def test_a_pool_that_cannot_start_is_reported_for_every_job(monkeypatch):
    def no_pool(*a):
        raise OSError("no processes here")
    monkeypatch.setattr(mqar, "_in_processes", no_pool)
    assert mqar.warm_up({"a": JOB, "b": JOB}, device="cuda") == {"a": "OSError: no processes here",
                                                                  "b": "OSError: no processes here"}


def test_each_job_runs_in_its_own_process_and_failures_are_reported():
    out = mqar._in_processes({"deltanet": JOB, "linear": dict(JOB, mixer="linear"),
                              "typo": dict(JOB, mixer="deltanett")}, "cpu", 2)
    assert list(out) == ["deltanet", "linear", "typo"]          # the caller's labels, in order
    assert all(isinstance(out[k], float) and out[k] > 0 for k in ("deltanet", "linear"))
    assert out["typo"].startswith("InputError: mixer must be one of")


@pytest.mark.parametrize("mixer", ["deltanet", "kda"])
def test_the_step_is_what_training_and_evaluation_run(mixer, monkeypatch):
    """The batch it trains on has the run's batch size (blocks follow B·H), and it evaluates as
    `accuracy` does."""
    seen = {"batches": []}
    real_batch, real_accuracy = mqar.batch, mqar.accuracy

    def batch(n, size, *a, **k):
        seen["batches"].append((n, size))
        return real_batch(n, size, *a, **k)

    def accuracy(model, *a, **k):
        seen["training"] = model.training
        return real_accuracy(model, *a, **k)
    monkeypatch.setattr(mqar, "batch", batch)
    monkeypatch.setattr(mqar, "accuracy", accuracy)
    job = dict(JOB, mixer=mixer, batch_size=6)
    assert mqar.first_step(job, "cpu") > 0
    assert seen["batches"][0] == (job["n_pairs"], 6)                # the training step's batch
    assert seen["training"] is False                              # evaluated in eval mode
