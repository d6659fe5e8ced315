"""Computed float32 dot operands of half-precision inputs are rounded to tf32 (`common.tf32`,
`common.operand`): the tensor cores truncate a float32 operand to its top 19 bits, which is up to
2⁻¹⁰ of error, always towards zero — more than an fp16 input's own 2⁻¹¹. The rounding is checked
bit for bit through the interpreter on a CPU and natively on a GPU; natively also the fact it
corrects (a tf32 product of 1 + 2⁻¹¹ + 2⁻¹² and 1 gives 1)."""
import pytest
import torch

import linattn  # noqa: F401  (decides Triton's interpreter mode before triton is imported)
import triton
import triton.language as tl

from linattn import device
from linattn.triton.common import operand, tf32

DEV = device.default_device()


def tf32_reference(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero, to 10 mantissa bits, on the bits (float64 maths)."""
    m, e = torch.frexp(x.double())                     # x = m · 2^e, 0.5 ≤ |m| < 1
    r = torch.sign(m) * torch.floor(m.abs() * 2.0 ** 11 + 0.5) / 2.0 ** 11
    return torch.ldexp(r, e).float()


@triton.jit
def _round_kernel(x, y, n, MODE: tl.constexpr):
    i = tl.arange(0, 1024)
    v = tl.load(x + i, mask=i < n, other=0.0)
    if MODE == 0:
        v = tf32(v)
    elif MODE == 1:
        v = operand(v, tl.float32, False)           # half inputs: rounded
    elif MODE == 2:
        v = operand(v, tl.float32, False, False)    # half inputs, RND off: as it is
    else:
        v = operand(v, tl.float32, True)            # float32 inputs (IEEE products): as it is
    tl.store(y + i, v, mask=i < n)


def values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(900, generator=g) * torch.logspace(-30, 30, 900)
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 1 + 2**-11 + 2**-12, 1 + 2**-11 - 2**-20,
                         2.0 ** -126, 3e38, 0.0, -0.0, 1.0, float("inf"), float("-inf")])
    return torch.cat([x, ties]).float().to(DEV)


@pytest.mark.parametrize("mode", [0, 1])
def test_rounds_to_nearest_tf32(mode):
    x = values()
    y = torch.full_like(x, float("nan"))
    _round_kernel[(1,)](x, y, x.numel(), MODE=mode)
    want = tf32_reference(x.cpu())
    assert torch.equal(y.cpu(), want), (x.cpu()[y.cpu() != want][:5], y.cpu()[y.cpu() != want][:5])
    # and it is a rounding: at most half a tf32 unit (2⁻¹¹ relative) from x, both signs of error
    fin = torch.isfinite(x.cpu()) & (x.cpu() != 0)
    rel = ((y.cpu() - x.cpu()) / x.cpu())[fin].double()
    assert rel.abs().max() <= 2.0 ** -11
    assert (rel > 0).any() and (rel < 0).any()


@pytest.mark.parametrize("mode", [2, 3])
def test_unrounded_where_asked(mode):
    x = values()
    y = torch.full_like(x, float("nan"))
    _round_kernel[(1,)](x, y, x.numel(), MODE=mode)
    assert torch.equal(y, x)


@triton.jit
def _tf32_dot_kernel(a, o, ROUND: tl.constexpr):
    r = tl.arange(0, 16)
    x = tl.load(a + r[:, None] * 16 + r[None, :])
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    if ROUND:
        x = tf32(x)
    tl.store(o + r[:, None] * 16 + r[None, :], tl.dot(x, eye, input_precision="tf32"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a fact about the tensor cores (the interpreter "
                    "multiplies in float32)")
def test_tensor_cores_truncate_and_rounding_corrects():
    x = torch.tensor([1 + 2**-11 + 2**-12, -(1 + 2**-11 + 2**-12), 1 + 2**-10 + 2**-11 + 2**-13])
    a = torch.zeros(16, 16, device="cuda")
    a[0, :3] = x.cuda()
    out = {}
    for rnd in (False, True):
        o = torch.empty_like(a)
        _tf32_dot_kernel[(1,)](a, o, ROUND=rnd)
        out[rnd] = o[0, :3].cpu()
    assert torch.equal(out[False], torch.tensor([1.0, -1.0, 1 + 2**-10]))           # truncated
    assert torch.equal(out[True], tf32_reference(x))                                  # rounded
