"""bench.memory_use on the CPU: peak and held bytes of the storages a call creates (no timing)."""
import torch

from linattn import bench

MB4 = 4 * (1 << 20)  # bytes of 2**20 float32


def test_peak_and_held_follow_the_storages():
    def fn():
        a = torch.randn(1 << 20)
        b = a + 1                          # peak: a and b alive at once
        del a
        c = b * 2                          # b and c
        d = c[10:]                         # a view: no new storage
        d.add_(1)                          # in place: nothing new
        del b, c
        return d                           # held: c's storage, through the view
    peak, held = bench.memory_use(fn, device="cpu")
    assert peak == 2 * MB4
    assert held == MB4


def test_existing_tensors_and_their_views_are_not_counted():
    x = torch.randn(1 << 20)
    peak, held = bench.memory_use(lambda: x.view(-1)[1:].unsqueeze(0), device="cpu")
    assert peak == 0 and held == 0


def test_backward_allocations_are_counted():
    w = torch.randn(1 << 18, requires_grad=True)
    def step():
        (w * 2).sum().backward()
    peak, _ = bench.memory_use(step, device="cpu")
    assert peak >= w.numel() * 4           # at least w.grad
