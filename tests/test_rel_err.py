"""testing.rel_err: the error metric every test, grader and the conformance suite use."""
import torch

from linattn import testing


def test_relative_and_poisoned():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert testing.rel_err(ref * (1 + 1e-3), ref) == pytest_approx(1e-3)
    assert testing.rel_err(torch.tensor([float("nan"), 4.0]), ref) == float("inf")
    assert testing.rel_err(torch.zeros(3), ref) == float("inf")                # shapes differ


def test_reference_below_float32_range_counts_against_the_floor():
    """The GLA initial-state gradient behind a −95 gate at the first token is about 1e-42: a GPU's
    float32 flushes it to 0 (natively dh0 = 0 gave relative error 1.0). Against the floor, 0 passes,
    while a wrong value of ordinary size still fails."""
    ref = torch.full((64, 16), 5e-42, dtype=torch.float64)
    assert testing.rel_err(torch.zeros(64, 16), ref) < 1e-3
    assert testing.rel_err(torch.full((64, 16), 1e-3), ref) > 1e30
    big = torch.full((64, 16), 1e-30, dtype=torch.float64)                    # representable: relative
    assert testing.rel_err(torch.zeros(64, 16), big) == 1.0


def pytest_approx(x):
    import pytest
    return pytest.approx(x, rel=1e-6)
