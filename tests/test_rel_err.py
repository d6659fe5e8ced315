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


def test_an_exact_zero_is_measured_against_the_terms_it_sums():
    """Natively (conformance case gla-extra-120: fp16, T = 1, no initial state) the exact gate
    gradient is 0, and ours, computed as Σ q ⊙ dq − k ⊙ dk, left a residue of 1e-8 of those terms,
    read as an error of 9e30 against the floor. Against the terms' size the residue passes and a
    wrong gradient (a tenth of the terms) still fails."""
    ref = torch.zeros(1, 1, 3, 64, dtype=torch.float64)
    residue = torch.full(ref.shape, 1e-9)
    assert testing.rel_err(residue, ref) > 1e20                                # the floor alone
    assert testing.rel_err(residue, ref, scale=1.0) < 1e-7
    assert testing.rel_err(torch.full(ref.shape, 0.1), ref, scale=1.0) > testing.GRAD_TOLERANCE[torch.float16]
    nonzero = torch.full(ref.shape, 1e-3, dtype=torch.float64)                 # relative as ever
    assert testing.rel_err(nonzero * 1.5, nonzero, scale=1.0) == pytest_approx(0.5)


def test_the_conformance_case_gives_the_gate_gradient_its_terms():
    from linattn.conformance import case
    args = {"q": torch.ones(2, 3), "k": torch.ones(2, 3)}
    grads = {"q": torch.full((2, 3), 2.0), "k": torch.full((2, 3), 3.0), "g": torch.zeros(2, 3)}
    assert case.gate_terms("g", args, grads) == pytest_approx(6 ** 0.5 * 5)
    assert case.gate_terms("q", args, grads) == 0.0


def pytest_approx(x):
    import pytest
    return pytest.approx(x, rel=1e-6)
