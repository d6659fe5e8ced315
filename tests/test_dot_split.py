"""`common.dot_split`: a computed float32 tile times a bf16 input tile to about float32 precision as
two bf16 products (a = hi + lo, both bf16). Against float64 the product must be far below one bf16
rounding of a (2⁻⁹ relative), which is what a product of bf16(a) alone gives — so dropping the low
part fails here. Natively only: the interpreter does not multiply bf16 tiles as bf16 (a product of
two bf16 tiles came out 10⁹ off under Triton 3.7's interpreter), which is why the library computes
in float32 there (`common.compute_dtype`) and never takes this branch on a CPU."""
import pytest
import torch

import linattn  # noqa: F401  (decides Triton's interpreter mode before triton is imported)
import triton
import triton.language as tl

from linattn import device, testing
from linattn.triton.common import dot_split, interpreting

DEV = device.default_device()
N = 32


@triton.jit
def _split_kernel(a, b, c, N: tl.constexpr, ONE: tl.constexpr):
    i = tl.arange(0, N)
    A = tl.load(a + i[:, None] * N + i[None, :])                    # [N, N] float32
    Bm = tl.load(b + i[:, None] * N + i[None, :])                   # [N, N] bf16
    if ONE:
        C = tl.dot(A.to(tl.bfloat16), Bm)                           # one bf16 product: the foil
    else:
        C = dot_split(A, Bm, False)
    tl.store(c + i[:, None] * N + i[None, :], C)


def run(one: bool):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(N, N, generator=g) * torch.logspace(-3, 3, N)).float()
    b = torch.randn(N, N, generator=g).bfloat16()
    c = torch.full((N, N), float("nan"))
    a_d, b_d, c_d = a.to(DEV), b.to(DEV), c.to(DEV)
    _split_kernel[(1,)](a_d, b_d, c_d, N=N, ONE=one)
    return testing.rel_err(c_d.cpu().double(), a.double() @ b.double())


@pytest.mark.skipif(interpreting(), reason="bf16 tile products: natively only (module docstring)")
def test_two_bf16_products_reach_about_float32():
    split, one = run(False), run(True)
    assert one > 2.0 ** -12, one                     # one bf16 rounding of a shows
    assert split < 2.0 ** -15, split                 # hi + lo: a to ~2⁻¹⁷, accumulation in float32
    assert split < one / 50


