"""linattn.nn: the layers of chapter 14.

- The whole sequence at once and a prefill of odd length followed by one-token steps give the same
  outputs (float32, rel err ≤ 1e-5): prefill + decode is one code path.
- Bad input (wrong d_model, a state from another batch size or another layer) fails by name.
- Gradients reach every parameter; a few optimiser steps on a fixed batch lower the loss.
- The GLA gate is computed in log space with τ = 16.
"""
import pytest
import torch
import torch.nn.functional as F

from linattn import device, nn as lnn, testing
from linattn.nn.gates import LogGate
from linattn.validate import InputError

D, H = 32, 2
NAMES = list(lnn.LAYERS)


def make(name, seed=0, **kw):
    torch.manual_seed(seed)
    return lnn.LAYERS[name](D, H, **kw)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("prefill", [1, 7])
def test_whole_sequence_equals_prefill_then_steps(name, prefill):
    layer = make(name)
    x = torch.randn(2, 13, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), testing.poisoned():
        y, final = layer(x)
        y_pre, state = layer(x[:, :prefill])
        ys = [y_pre]
        for t in range(prefill, x.shape[1]):
            y_t, state = layer(x[:, t:t + 1], state)
            ys.append(y_t)
    assert testing.rel_err(torch.cat(ys, 1), y) <= testing.tolerance(torch.float32)
    assert testing.rel_err(state.memory, final.memory) <= testing.tolerance(torch.float32)
    assert state.seen == final.seen == x.shape[1]


@pytest.mark.parametrize("name", NAMES)
def test_two_prefills_equal_one(name):
    """A state handed to a multi-token call (a second prompt) continues the sequence too."""
    layer = make(name)
    x = torch.randn(1, 11, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), testing.poisoned():
        y, _ = layer(x)
        y1, s = layer(x[:, :4])
        y2, _ = layer(x[:, 4:], s)
    assert testing.rel_err(torch.cat([y1, y2], 1), y) <= testing.tolerance(torch.float32)


def test_state_size_is_constant_but_kv_cache_grows():
    rec, soft = make("gla"), make("softmax")
    x = torch.randn(1, 6, D)
    with torch.no_grad():
        _, s_rec = rec(x)
        _, s_soft = soft(x)
        before = (s_rec.nbytes(), s_soft.nbytes())
        _, s_rec = rec(x[:, :1], s_rec)
        _, s_soft = soft(x[:, :1], s_soft)
    assert s_rec.nbytes() == before[0]
    assert s_soft.nbytes() == before[1] + 2 * D * 4          # one key and one value row, float32


@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs_fail_by_name(name):
    layer, other = make(name), make(name, seed=1)
    x = torch.randn(2, 5, D)
    with pytest.raises(InputError, match="d_model"):
        layer(torch.randn(2, 5, D + 1))
    with pytest.raises(InputError, match="x must"):
        layer(torch.randn(5, D))
    with torch.no_grad():
        _, state = layer(x)
        _, foreign = other(x)
    with pytest.raises(InputError, match="state.*batch"):
        layer(x[:1], state)
    with pytest.raises(InputError, match="state.*another layer"):
        layer(x, foreign)
    with pytest.raises(InputError, match="n_heads"):
        lnn.LAYERS[name](D, 3)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_every_parameter_and_training_lowers_the_loss(name):
    layer = make(name)                       # impl="auto": the chunkwise level and its backward
    gen = torch.Generator().manual_seed(3)
    x, target = torch.randn(2, 9, D, generator=gen), torch.randn(2, 9, D, generator=gen)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for step in range(6):
        opt.zero_grad()
        with testing.poisoned():
            y, _ = layer(x)
        loss = F.mse_loss(y, target)
        loss.backward()
        if step == 0:
            dead = [n for n, p in layer.named_parameters()
                    if p.grad is None or not torch.isfinite(p.grad).all() or p.grad.abs().sum() == 0]
            assert not dead, f"no gradient for {dead}"
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_gla_gate_is_log_space_with_temperature_16():
    gate = LogGate(D, H, 8)
    x = torch.randn(1, 4, D)
    z = gate.proj(x)
    g = gate(x)
    assert g.shape == (1, 4, H, 8) and g.dtype == torch.float32
    assert testing.rel_err(g, (F.logsigmoid(z) / 16).unflatten(-1, (H, 8))) <= 1e-6
    # Far in the saturated range log(sigmoid(z)) rounds to log 0 = −inf; logsigmoid stays finite.
    with torch.no_grad():
        gate.proj[1].bias.fill_(-200.0)
    g = gate(torch.zeros(1, 1, D))
    assert torch.isfinite(g).all() and (g <= 0).all()
    assert abs(g.max().item() + 200 / 16) < 1e-3
    per_head = LogGate(D, H, 8, per_dim=False)
    assert per_head(x).shape == (1, 4, H)


@pytest.mark.parametrize("name", ["linear", "gla", "deltanet", "gated_deltanet", "kda"])
def test_fused_step_path_of_the_layers(name, monkeypatch):
    """On CUDA a layer's one-token calls go through the fused Triton step; here the same path runs
    in the interpreter (fused_step forced on) and must match the whole sequence."""
    dev = device.default_device()                   # natively on a GPU, the interpreter on a CPU
    layer = make(name).to(dev)
    calls = []
    monkeypatch.setattr(type(layer), "fused_step", lambda self, q, *t: calls.append(1) or True)
    x = torch.randn(1, 6, D, generator=torch.Generator().manual_seed(4)).to(dev)
    with torch.no_grad(), testing.poisoned():
        y, _ = layer(x)
        y_pre, state = layer(x[:, :3])
        ys = [y_pre]
        for t in range(3, 6):
            y_t, state = layer(x[:, t:t + 1], state)
            ys.append(y_t)
    assert len(calls) == 3
    assert testing.rel_err(torch.cat(ys, 1), y) <= testing.tolerance(torch.float32)


@pytest.mark.parametrize("grad", [False, True])
def test_softmax_prefill_uses_a_memory_efficient_sdpa_kernel(grad):
    # After the short convolution q, k, v were transposed views, and on the CPU SDPA then fell back
    # to its math kernel: B·H·T² scores (2.9 GB at T = 8192). With SDPA restricted to its flash
    # kernel (O(T) memory) a prefill, a prefill after a cache, and a decode step must all run.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    layer = lnn.SoftmaxAttention(64, 4)
    x = torch.randn(2, 50, 64, requires_grad=grad)
    with torch.set_grad_enabled(grad), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        y, state = layer(x[:, :30])
        y2, state = layer(x[:, 30:49], state)
        y3, _ = layer(x[:, 49:], state)
    if grad:
        torch.cat([y, y2, y3], 1).sum().backward()
        assert torch.isfinite(x.grad).all()
