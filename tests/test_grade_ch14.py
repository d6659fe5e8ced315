"""Graders of chapter 14: the references pass, the stubs fail, and each planted mistake is named.

The functions below are a reader's solution of workbook 14, written from the chapter (plain
torch and `linattn.gla`, not the library's layer), each with one bug that `bug=` switches on;
the bug-free version passes too, so a rejection is caused by the bug alone. Every mutant must be
rejected, with its diagnosis, for several seeds, since a reader gets a fresh seed at every check.
"""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.grade import catalog, check, workbook
from linattn.grade.catalog import ch14
from planted import assert_named, verdicts

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_HOME", str(tmp_path))


# ---------------------------------------------------------------- a reader's solution, with bugs
def split_heads(qkv, n_heads, head_k, head_v, *, bug=None):
    H, K, V = n_heads, head_k, head_v
    q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
    if bug == "q and k swapped":
        q, k = k, q
    if bug == "v first":
        v, q, k = qkv.split([H * V, H * K, H * K], dim=-1)
    if bug == "heads interleaved":
        return (q.unflatten(-1, (K, H)).transpose(-1, -2), k.unflatten(-1, (K, H)).transpose(-1, -2),
                v.unflatten(-1, (V, H)).transpose(-1, -2))
    return q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), v.unflatten(-1, (H, V))


def low_rank_gate(x, w1, w2, bias, n_heads, tau=16.0, *, bug=None):
    z = x @ w1.T @ w2.T + bias
    g = {None: lambda: F.logsigmoid(z) / tau,
         "log of the sigmoid": lambda: torch.sigmoid(z).log() / tau,
         "no log-sigmoid": lambda: z / tau,
         "sign of z flipped": lambda: F.logsigmoid(-z) / tau,
         "sign of g flipped": lambda: -F.logsigmoid(z) / tau,
         "alpha, not log alpha": lambda: torch.sigmoid(z) ** (1 / tau),
         "no temperature": lambda: F.logsigmoid(z),
         "temperature inside": lambda: F.logsigmoid(z / tau)}[bug]()
    return g.unflatten(-1, (n_heads, -1))


def short_conv(u, weight, cache=None, *, bug=None):
    B, T, C = u.shape
    w = weight.shape[-1]
    if cache is None or bug == "cache ignored":
        cache = u.new_zeros(B, w - 1, C)
    full = torch.cat([cache, u], dim=1)                                   # [B, w − 1 + T, C]
    if bug == "padding on both sides":
        y = F.conv1d(u.transpose(1, 2), weight, groups=C, padding="same")
    elif bug == "padding on the right":
        y = F.conv1d(F.pad(u.transpose(1, 2), (0, w - 1)), weight, groups=C)
    else:
        y = F.conv1d(full.transpose(1, 2), weight.flip(-1) if bug == "taps reversed" else weight,
                     groups=C)
    y = y.transpose(1, 2)
    new_cache = full[:, :w - 1] if bug == "oldest inputs cached" else full[:, -(w - 1):]
    return (y if bug == "no SiLU" else F.silu(y)), new_cache


def head_norm(o, weight, bias, eps=1e-5, *, bug=None):
    axes = {None: (-1,), "over all heads": (-2, -1), "over time": (1,), "across heads": (2,),
            "RMSNorm": (-1,), "no scale and shift": (-1,)}[bug]
    mean = 0 if bug == "RMSNorm" else o.mean(axes, keepdim=True)
    var = ((o - mean) ** 2).mean(axes, keepdim=True)
    n = (o - mean) / torch.sqrt(var + eps)
    return n if bug == "no scale and shift" else n * weight + bias


def output_gate(o, x, w_r, b_r, w_o, *, bug=None):
    o = o.flatten(-2)                                                     # [B, T, H·V]
    r = x @ w_r.T + (0 if bug == "no gate bias" else b_r)
    if bug == "output gate missing":
        return o @ w_o.T
    if bug == "gate after the projection":
        return (o @ w_o.T) * F.silu(r)
    gate = torch.sigmoid(r) if bug == "sigmoid gate" else F.silu(r)
    return (o * gate) @ w_o.T


def _pieces(x, params, n_heads, conv_cache):
    """q, k, v, log-gate and the new conv cache: everything before the operation."""
    H = n_heads
    V = params["norm.weight"].numel()
    K = params["gate.proj.1.weight"].shape[0] // H
    u, cache = short_conv(x @ params["qkv.weight"].T, params["conv.conv.weight"], conv_cache)
    q, k, v = split_heads(u, H, K, V)
    g = low_rank_gate(x, params["gate.proj.0.weight"], params["gate.proj.1.weight"],
                      params["gate.proj.1.bias"], H)
    return q, k, v, g, cache


def _finish(o, x, params):
    o = head_norm(o, params["norm.weight"], params["norm.bias"])
    return output_gate(o, x, params["out_gate.weight"], params["out_gate.bias"], params["out.weight"])


def gla_layer(x, params, n_heads, *, initial_state=None, conv_cache=None, bug=None):
    if bug == "initial state ignored":
        initial_state = None
    if bug == "conv cache ignored":
        conv_cache = None
    q, k, v, g, cache = _pieces(x, params, n_heads, conv_cache)
    o, S = linattn.gla(q, k, v, g.to(q.dtype), initial_state=initial_state, output_final_state=True)
    return _finish(o, x, params), S, cache


def gla_step(x_t, params, n_heads, S, cache):
    """One token: x_t [B, 1, d], S [B, H, K, V], cache [B, w − 1, C] -> (y_t, S, cache)."""
    q, k, v, g, cache = _pieces(x_t, params, n_heads, cache)
    q, k, v, g = q[:, 0], k[:, 0], v[:, 0], g[:, 0]
    S = g.exp()[..., None] * S + k[..., None] * v[..., None, :]
    o = (q[..., None] * S).sum(-2) * q.shape[-1] ** -0.5                 # [B, H, V]
    return _finish(o[:, None], x_t, params), S, cache


def gla_decode(x, params, n_heads, *, initial_state=None, conv_cache=None, bug=None):
    B, T, _ = x.shape
    H, V = n_heads, params["norm.weight"].numel()
    K = params["gate.proj.1.weight"].shape[0] // H
    C, w = params["conv.conv.weight"].shape[0], params["conv.conv.weight"].shape[-1]
    empty = (x.new_zeros(B, H, K, V), x.new_zeros(B, w - 1, C))
    S0 = initial_state if initial_state is not None else empty[0]
    c0 = conv_cache if conv_cache is not None else empty[1]
    S, cache, ys = S0, c0, []
    for t in range(T):
        x_t = x[:, t:t + 1]
        if bug == "state not carried":
            y, S, cache = gla_step(x_t, params, n_heads, *empty)
        elif bug == "state never updated":
            y, S_new, c_new = gla_step(x_t, params, n_heads, S, cache)
        elif bug == "state updated twice":
            y, S, cache = gla_step(x_t, params, n_heads, S, cache)
            _, S, cache = gla_step(x_t, params, n_heads, S, cache)
        elif bug == "conv cache not carried":
            y, S, cache = gla_step(x_t, params, n_heads, S, empty[1])
        else:
            y, S, cache = gla_step(x_t, params, n_heads, S, cache)
        ys.append(y)
    return torch.cat(ys, dim=1), S, cache


# ---------------------------------------------------------------- the verdicts
def test_solutions_pass():
    for name, fn in [("ch14.heads", split_heads), ("ch14.gate", low_rank_gate),
                     ("ch14.short_conv", short_conv), ("ch14.head_norm", head_norm),
                     ("ch14.output_gate", output_gate), ("ch14.gla_layer", gla_layer),
                     ("ch14.decode", gla_decode)]:
        assert all(verdicts(name, fn)), name


@pytest.mark.parametrize("name", [ex.name for ex in ch14.EXERCISES])
def test_reference_passes(name):
    assert all(verdicts(name, catalog.get(name).reference))


@pytest.mark.parametrize("bug, named", [
    ("q and k swapped", "take k from the first"),
    ("v first", "take v from the front"),
    ("heads interleaved", "head index fastest"),
])
def test_heads_mistakes(bug, named):
    assert_named("ch14.heads", lambda *a: split_heads(*a, bug=bug), named)


@pytest.mark.parametrize("bug, named", [
    ("log of the sigmoid", "take log(sigmoid(z))"),
    ("no log-sigmoid", "leave out the log-sigmoid"),
    ("sign of z flipped", "flip the sign of z"),
    ("sign of g flipped", "flip the sign of the result"),
    ("alpha, not log alpha", "instead of its log"),
    ("no temperature", "leave out the temperature"),
    ("temperature inside", "temperature inside the sigmoid"),
])
def test_gate_mistakes(bug, named):
    assert_named("ch14.gate", lambda *a, **kw: low_rank_gate(*a, **kw, bug=bug), named)


@pytest.mark.parametrize("bug, named", [
    ("padding on both sides", "the layer sees the future"),
    ("padding on the right", "pad on the right"),
    ("taps reversed", "reverse the taps"),
    ("no SiLU", "leave out the SiLU"),
    ("cache ignored", "ignore the cache"),
    ("oldest inputs cached", "oldest w − 1 inputs"),
])
def test_conv_mistakes(bug, named):
    assert_named("ch14.short_conv", lambda *a, **kw: short_conv(*a, **kw, bug=bug), named)


@pytest.mark.parametrize("bug, named", [
    ("over all heads", "over all heads together"),
    ("over time", "over the time axis"),
    ("across heads", "across the heads"),
    ("RMSNorm", "an RMSNorm"),
    ("no scale and shift", "learned scale and shift"),
])
def test_norm_mistakes(bug, named):
    assert_named("ch14.head_norm", lambda *a: head_norm(*a, bug=bug), named)


@pytest.mark.parametrize("bug, named", [
    ("output gate missing", "leave out the output gate"),
    ("sigmoid gate", "gate with a sigmoid"),
    ("no gate bias", "gate's bias"),
    ("gate after the projection", "after the output projection"),
])
def test_output_gate_mistakes(bug, named):
    assert_named("ch14.output_gate", lambda *a: output_gate(*a, bug=bug), named)


@pytest.mark.parametrize("bug, named", [
    ("initial state ignored", "ignore initial_state"),
    ("conv cache ignored", "ignore conv_cache"),
])
def test_layer_mistakes(bug, named):
    assert_named("ch14.gla_layer", lambda *a, **kw: gla_layer(*a, **kw, bug=bug), named)


@pytest.mark.parametrize("bug, named", [
    ("state not carried", "without carrying the state"),
    ("state never updated", "stale state"),
    ("state updated twice", "update the state twice"),
    ("conv cache not carried", "not the short convolution's cache"),
])
def test_decode_mistakes(bug, named):
    assert_named("ch14.decode", lambda *a, **kw: gla_decode(*a, **kw, bug=bug), named)


def test_gradients_and_training_through_a_readers_layer():
    """The workbook's last check: the reader's layer has the library layer's gradients, and a
    model built on it learns MQAR (its loss falls)."""
    assert ch14.gradient_error(gla_layer) < 1e-4
    run = ch14.train(gla_layer)
    assert sum(run.losses[-10:]) < 0.9 * sum(run.losses[:10])


def test_stub_fails_its_grader():
    nb = workbook.read(ROOT / "exercises" / "14_layers.py")
    cells = workbook.exercise_cells(nb)
    assert [name for _, name, _ in cells] == [ex.name for ex in ch14.EXERCISES]
    for cell, name, fn_name in cells:
        namespace = {}
        exec(cell.source, namespace)
        result = check(name, namespace[fn_name], seed=0, record=False, quiet=True)
        assert not result.passed and "not written yet" in result.message
