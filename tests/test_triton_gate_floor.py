"""Very negative log-gates at the Triton level: a decay of e^{−1e4} or e^{−1e8} (a full reset) must be
as exact as any other gate. The kernels take differences of float32 prefix sums inside a chunk, so
without `common.GATE_FLOOR` one such gate left every later sum near −1e4 … −1e8 (relative errors
7.6e-4 to 0.76). Natively on a GPU and through the interpreter on a CPU."""
import pytest
import torch

from linattn import device, naive, testing
import linattn.triton as tri

DEV = device.default_device()
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.mark.parametrize("at, value", [(21, -1e4), (21, -1e8), (0, -80.0)])
@pytest.mark.parametrize("op, gate", [("gla", "per_head"), ("gla", "per_dim"), ("kda", "per_head"), ("kda", "per_dim")])
def test_reset_gate_is_exact(op, gate, at, value):
    # at 21: one reset inside the first chunk, every later prefix sum behind it; at 0: the initial
    # state reaches every output only through e^{−80} (float32 normal numbers reach e^{−87}), so its
    # gradient is made of decayed terms alone
    a = testing.make_inputs(op, B=1, T=70, H=2, K=32, V=32, dtype=torch.float32, device=DEV, gate=gate,
                            initial_state=True, seed=1)
    a["g"][:, at] = value
    leaves = {n: a[n].clone().requires_grad_(True) for n in NAMES if n in a}
    with testing.poisoned():
        o, S = getattr(tri, op)(**{**a, **leaves}, output_final_state=True, chunk_size=64)
    ref64 = {n: x.double().detach().requires_grad_(True) for n, x in leaves.items()}
    o_ref, S_ref = getattr(naive, op)(**{**a, **ref64}, output_final_state=True)
    dO = torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEV)
    (o.double() * dO).sum().add((S.double() * 0.5).sum()).backward()
    (o_ref * dO).sum().add((S_ref * 0.5).sum()).backward()
    assert testing.rel_err(o, o_ref) <= testing.tolerance(torch.float32)
    assert testing.rel_err(S, S_ref) <= testing.tolerance(torch.float32)
    for n in leaves:
        assert testing.rel_err(leaves[n].grad, ref64[n].grad) <= testing.GRAD_TOLERANCE[torch.float32], n
