"""The benchmark's inputs: the mild anchor gates every recorded table was measured with, and the gate
distributions a benchmark sweeps (bench.GATE_SWEEP), one per call, drawn by testing.log_gates."""
import pytest
import torch
import torch.nn.functional as F

from linattn import bench


def test_mild_gates_are_the_recorded_anchor_draw():
    # the recorded runs drew q, k, v, then g = logsigmoid(randn)/16 from one generator
    a = bench.anchor_inputs("gla", 64, tokens=128, H=2, K=8, V=8, device="cpu")
    gen = torch.Generator().manual_seed(0)
    draws = [torch.randn(2, 64, 2, 8, generator=gen) for _ in range(4)]
    assert torch.equal(a["g"], F.logsigmoid(draws[3]) / 16)


@pytest.mark.parametrize("op", ["kda", "simple_gla"])
def test_each_distribution_is_what_it_says(op):
    g = {gs: bench.anchor_inputs(op, 256, tokens=512, H=4, K=16, V=16, device="cpu", gates=gs)["g"]
         for gs in bench.GATE_SWEEP}
    assert g["normal"].min() > -1.0                       # mild: at most about −0.3 a token here
    assert g["logsigmoid"].mean() < 4 * g["normal"].mean()
    assert g["mamba"].min() < -3.0                        # A up to 16: strong tokens exist
    assert all((x <= 0).all() for x in g.values())
    with pytest.raises(ValueError, match="strength"):
        bench.anchor_inputs(op, 64, tokens=64, H=1, K=8, V=8, device="cpu", gates="fast")
