"""Chapter 14 — the GLA layer built piece by piece, then decoded one token at a time.

The reader writes each piece of `linattn.nn.GatedLinearAttention` as a function of its weights:
the split of the projection into heads, the low-rank log-space gate, the short causal
convolution with its cache, the per-head norm, the output gate; then the whole layer, and a
decode loop that carries the state from token to token. Every truth is the library layer itself
(or the very module it uses for that piece), in float64 with the same weights: the split into heads
and the output gate are read off a running float64 layer (`_spy`, `_replace_norm`), the gate, the
convolution and the norm are the layer's own modules, the whole layer and the decode loop are
compared with the whole-sequence forward.

The planted mistakes each grader names are written out below as small functions (tests/
test_grade_ch14.py plants each one in an otherwise correct solution and checks the verdict).
"""
from __future__ import annotations

import contextlib
import random

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ... import mqar, testing
from ... import nn as lnn
from ...nn.conv import ShortConv
from ...nn.gates import LogGate
from ...nn.state import LayerState
from ..exercise import Case, Exercise

F32, F64 = torch.float32, torch.float64
TAU = 16.0


# ------------------------------------------------------------------------ layers and weights
def make_layer(d_model=16, n_heads=2, head_k=4, *, conv_width=4, gate_rank=4, seed=0, dtype=F64,
               impl="naive"):
    """A GLA layer with random weights, none at its neutral initial value: the norm's scale and
    shift, the output gate's bias and the gate's bias are drawn too, so a piece that skips one of
    them shows. Heads: head_v = d_model / n_heads (the GLA paper's d_v = d)."""
    torch.manual_seed(seed)
    layer = lnn.GatedLinearAttention(d_model, n_heads, head_k=head_k, conv_width=conv_width,
                                     gate_rank=gate_rank, impl=impl)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        layer.norm.weight.copy_(1 + 0.3 * torch.randn(layer.norm.weight.shape, generator=gen))
        layer.norm.bias.copy_(0.2 * torch.randn(layer.norm.bias.shape, generator=gen))
        layer.out_gate.bias.copy_(0.5 * torch.randn(layer.out_gate.bias.shape, generator=gen))
        bias = layer.gate.out_layer.bias
        bias.copy_(torch.randn(bias.shape, generator=gen) * 2.0)       # strong and weak gates
        if layer.conv is not None:
            layer.conv.conv.weight.mul_(2.0)                           # taps that matter
    return layer.to(dtype).eval()


def layer_from(params, n_heads, *, dtype=F64, impl="naive"):
    """The library layer with the weights `params` (names as in its state_dict), in `dtype`."""
    d_model = params["qkv.weight"].shape[1]
    head_v = params["norm.weight"].numel()
    head_k = params["gate.proj.1.weight"].shape[0] // n_heads
    rank = params["gate.proj.0.weight"].shape[0]
    width = params["conv.conv.weight"].shape[-1] if "conv.conv.weight" in params else 1
    layer = lnn.GatedLinearAttention(d_model, n_heads, head_k=head_k, head_v=head_v,
                                     conv_width=width, gate_rank=rank, impl=impl)
    layer.load_state_dict({n: p.detach() for n, p in params.items()})
    return layer.to(dtype).eval()


def params_of(layer, dtype=None):
    """The layer's weights as a dict of plain tensors (what the exercises take)."""
    return {n: p.detach().clone().to(dtype or p.dtype) for n, p in layer.state_dict().items()}


def _state(layer, S0, cache0):
    if S0 is None and cache0 is None:
        return None
    B = (S0 if S0 is not None else cache0).shape[0]
    H, K, V = layer.n_heads, layer.head_k, layer.head_v
    S0 = S0 if S0 is not None else torch.zeros(B, H, K, V, dtype=cache0.dtype)
    return LayerState(S0, cache0, layer.owner, 0)


def _run(layer, x, S0=None, cache0=None):
    """(y, final state, conv cache) of the library layer on x from (S0, cache0)."""
    y, st = layer(x, _state(layer, S0, cache0))
    return y, st.memory, st.conv


@contextlib.contextmanager
def _spy(layer, seen):
    """Record the q, k, v and log-gate the layer hands its operation."""
    run = layer.run

    def spy(q, k, v, args, S0):
        seen.update(q=q, k=k, v=v, g=args[0])
        return run(q, k, v, args, S0)

    layer.run = spy
    try:
        yield seen
    finally:
        del layer.run


# ------------------------------------------------------------------------ ch14.heads
def split_heads(qkv, n_heads, head_k, head_v):
    """The library layer's own split: run a float64 layer whose projection is the identity (and
    with no convolution) on qkv, and read the q, k, v it hands to the operation."""
    C = qkv.shape[-1]
    layer = lnn.GatedLinearAttention(C, n_heads, head_k=head_k, head_v=head_v, conv_width=1,
                                     gate_rank=4, impl="naive").to(qkv.dtype)
    with torch.no_grad():
        layer.qkv.weight.copy_(torch.eye(C, dtype=qkv.dtype))
        with _spy(layer, {}) as seen:
            layer(qkv)
    return seen["q"], seen["k"], seen["v"]


def heads_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (B, T, H, K, V) in enumerate([(2, 9, 2, 4, 8), (1, 13, 4, 8, 4), (3, 5, 3, 2, 6)]):
        T = max(1, T + rng.randint(-2, 2))
        qkv = torch.randn(B, T, H * (2 * K + V), generator=torch.Generator().manual_seed(seed * 11 + i),
                          dtype=F64)
        cases.append(Case(args=(qkv, H, K, V), dtype=F64, note=f"qkv [{B}, {T}, {H * (2 * K + V)}], "
                          f"H={H} K={K} V={V}"))
    return cases


def _heads_mistake(kind):
    def mistake(qkv, H, K, V):
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        if kind == "qk swapped":
            q, k = k, q
        if kind == "v first":
            v, q, k = qkv.split([H * V, H * K, H * K], dim=-1)
        if kind == "interleaved":
            return (q.unflatten(-1, (K, H)).transpose(-1, -2), k.unflatten(-1, (K, H)).transpose(-1, -2),
                    v.unflatten(-1, (V, H)).transpose(-1, -2))
        return q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), v.unflatten(-1, (H, V))
    return mistake


HEADS_MISTAKES = (
    ("take k from the first H·K channels and q from the next: the projection holds [q | k | v]",
     _heads_mistake("qk swapped")),
    ("take v from the front: the projection holds [q | k | v], v last", _heads_mistake("v first")),
    ("reshape a head's channels as [K, H] (head index fastest): each head's channels are "
     "contiguous, so unflatten the last axis as (H, K)", _heads_mistake("interleaved")),
)


# ------------------------------------------------------------------------ ch14.gate
def low_rank_gate(x, w1, w2, bias, n_heads, tau=TAU):
    """The layer's gate module (LogGate) with these weights."""
    gate = LogGate(x.shape[-1], n_heads, w2.shape[0] // n_heads, rank=w1.shape[0], tau=tau).to(x.dtype)
    with torch.no_grad():
        gate.proj[0].weight.copy_(w1)
        gate.proj[1].weight.copy_(w2)
        gate.proj[1].bias.copy_(bias)
        return gate(x)


def gate_cases(seed):
    """Float64 gates of three layers (random weights, biases from strong to weak forgetting), one
    float32 case with biases down to −200, where σ(z) rounds to 0 in float32, and one τ ≠ 16."""
    rng = random.Random(seed)
    cases = []
    for i, (B, T, d, H, K, rank, dtype, tau, shift) in enumerate(
            [(2, 9, 16, 2, 4, 4, F64, TAU, 0.0), (1, 14, 32, 4, 8, 16, F64, TAU, 0.0),
             (2, 6, 16, 2, 8, 4, F64, 4.0, 0.0), (1, 5, 16, 2, 4, 4, F32, TAU, -200.0)]):
        T = max(1, T + rng.randint(-2, 2))
        gen = torch.Generator().manual_seed(seed * 13 + i)
        x = torch.randn(B, T, d, generator=gen, dtype=F64)
        w1 = torch.randn(rank, d, generator=gen, dtype=F64) / d ** 0.5
        w2 = torch.randn(H * K, rank, generator=gen, dtype=F64) / rank ** 0.5
        bias = 3 * torch.randn(H * K, generator=gen, dtype=F64) + shift
        if shift:
            bias[: H * K // 2] = torch.linspace(-200.0, -110.0, H * K // 2, dtype=F64)
            bias[H * K // 2:] = torch.linspace(-3.0, 5.0, H * K - H * K // 2, dtype=F64)
        note = f"x [{B}, {T}, {d}], H={H} K={K} rank {rank}, τ = {tau:g}, {str(dtype)[6:]}" + \
            (", biases down to −200 (saturated gates)" if shift else "")
        cases.append(Case(args=tuple(a.to(dtype) for a in (x, w1, w2, bias)) + (H,),
                          kwargs={"tau": tau}, dtype=dtype, note=note))
    return cases


def _gate_mistake(kind):
    def mistake(x, w1, w2, bias, n_heads, tau=TAU):
        z = (x @ w1.T) @ w2.T + bias
        g = {"log of sigmoid": lambda: torch.sigmoid(z).log() / tau,
             "no logsigmoid": lambda: z / tau,
             "sign of z": lambda: F.logsigmoid(-z) / tau,
             "sign of g": lambda: -F.logsigmoid(z) / tau,
             "sigmoid": lambda: torch.sigmoid(z) ** (1 / tau),
             "no tau": lambda: F.logsigmoid(z),
             "tau inside": lambda: F.logsigmoid(z / tau)}[kind]()
        return g.unflatten(-1, (n_heads, -1))
    return mistake


GATE_MISTAKES = (
    ("take log(sigmoid(z)): σ(z) rounds to 0 for z below about −104 in float32 and its log is "
     "−inf; F.logsigmoid(z) computes log σ(z) = −softplus(−z) without forming σ(z)",
     _gate_mistake("log of sigmoid")),
    ("leave out the log-sigmoid (g = z / τ): g must be log σ(z) / τ ≤ 0, a decay, whatever z is",
     _gate_mistake("no logsigmoid")),
    ("flip the sign of z (log σ(−z)): a large z must mean α near 1, keep the state",
     _gate_mistake("sign of z")),
    ("flip the sign of the result (−log σ(z) ≥ 0): a log-decay is ≤ 0, or the state grows "
     "without bound", _gate_mistake("sign of g")),
    ("return α = σ(z)^{1/τ} instead of its log: the kernels take log α", _gate_mistake("sigmoid")),
    ("leave out the temperature: divide log σ(z) by τ", _gate_mistake("no tau")),
    ("put the temperature inside the sigmoid (log σ(z/τ)): it divides the log",
     _gate_mistake("tau inside")),
)


# ------------------------------------------------------------------------ ch14.short_conv
def short_conv(u, weight, cache=None):
    """The layer's ShortConv module with this weight."""
    conv = ShortConv(u.shape[-1], weight.shape[-1]).to(u.dtype)
    with torch.no_grad():
        conv.conv.weight.copy_(weight)
        return conv(u, cache)


def conv_cases(seed):
    """Float64 channels; from the start of a sequence, and continuing one from a cache with a
    sequence of one token (decoding) and one of fewer tokens than the cache holds."""
    rng = random.Random(seed)
    cases = []
    for i, (B, T, C, w, cached) in enumerate([(2, 11, 12, 4, False), (1, 7, 8, 3, True),
                                              (2, 1, 6, 4, True), (1, 2, 10, 4, True)]):
        T = T if T <= 2 else max(3, T + rng.randint(-2, 2))
        gen = torch.Generator().manual_seed(seed * 17 + i)
        u = torch.randn(B, T, C, generator=gen, dtype=F64)
        weight = torch.randn(C, 1, w, generator=gen, dtype=F64)
        kw = {"cache": torch.randn(B, w - 1, C, generator=gen, dtype=F64)} if cached else {}
        cases.append(Case(args=(u, weight), kwargs=kw, dtype=F64,
                          note=f"u [{B}, {T}, {C}], width {w}" + (", with a cache" if cached else
                                                                  ", from the start")))
    return cases


def _conv_mistake(kind):
    def mistake(u, weight, cache=None):
        B, T, C = u.shape
        w = weight.shape[-1]
        cache = u.new_zeros(B, w - 1, C) if cache is None or kind == "cache ignored" else cache
        full = torch.cat([cache, u], dim=1)
        new_cache = full[:, :w - 1] if kind == "first cache" else full[:, -(w - 1):]
        taps = weight.flip(-1) if kind == "reversed" else weight
        if kind in ("centred", "right"):
            left = (w - 1) // 2 if kind == "centred" else 0
            padded = F.pad(u.transpose(1, 2), (left, w - 1 - left))
            y = F.conv1d(padded, weight, groups=C).transpose(1, 2)
            return F.silu(y), new_cache
        y = F.conv1d(full.transpose(1, 2), taps, groups=C).transpose(1, 2)
        return (y if kind == "no silu" else F.silu(y)), new_cache
    return mistake


CONV_MISTAKES = (
    ("pad on both sides (padding='same'): output t then reads inputs after t — the layer sees "
     "the future. Pad w − 1 positions on the left only", _conv_mistake("centred")),
    ("pad on the right: output t reads t … t + w − 1, the future. Pad w − 1 positions on the "
     "left only", _conv_mistake("right")),
    ("reverse the taps: F.conv1d computes a cross-correlation, y_t = Σ_i W[i] · x_{t−(w−1)+i}; "
     "use the weight as it is", _conv_mistake("reversed")),
    ("leave out the SiLU after the convolution", _conv_mistake("no silu")),
    ("ignore the cache: a continued sequence starts from the w − 1 inputs before it, not zeros",
     _conv_mistake("cache ignored")),
    ("return the oldest w − 1 inputs as the cache: the next call needs the last w − 1",
     _conv_mistake("first cache")),
)


# ------------------------------------------------------------------------ ch14.head_norm
def head_norm(o, weight, bias, eps=1e-5):
    """The layer's per-head norm module (LayerNorm over a head's V features, weights shared by
    the heads) with these weights."""
    norm = lnn.GatedLinearAttention.norm_cls(o.shape[-1], eps=eps).to(o.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        norm.bias.copy_(bias)
        return norm(o)


def norm_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (B, T, H, V) in enumerate([(2, 7, 2, 8), (1, 12, 4, 4), (2, 5, 3, 16)]):
        T = max(2, T + rng.randint(-2, 2))
        gen = torch.Generator().manual_seed(seed * 19 + i)
        # heads at different scales and offsets: a norm over the wrong axis mixes them
        scale = torch.linspace(0.5, 4.0, H, dtype=F64)[:, None]
        shift = torch.linspace(-2.0, 2.0, H, dtype=F64)[:, None]
        o = torch.randn(B, T, H, V, generator=gen, dtype=F64) * scale + shift
        weight = 1 + 0.3 * torch.randn(V, generator=gen, dtype=F64)
        bias = 0.3 * torch.randn(V, generator=gen, dtype=F64)
        cases.append(Case(args=(o, weight, bias), dtype=F64, note=f"o [{B}, {T}, {H}, {V}]"))
    return cases


def _norm_mistake(kind):
    def mistake(o, weight, bias, eps=1e-5):
        if kind == "all heads":
            flat = o.flatten(-2)
            n = F.layer_norm(flat, flat.shape[-1:], eps=eps).unflatten(-1, o.shape[-2:])
            return n * weight + bias
        if kind == "time":
            mu, var = o.mean(1, keepdim=True), o.var(1, unbiased=False, keepdim=True)
            return (o - mu) / (var + eps).sqrt() * weight + bias
        if kind == "heads axis":
            mu, var = o.mean(2, keepdim=True), o.var(2, unbiased=False, keepdim=True)
            return (o - mu) / (var + eps).sqrt() * weight + bias
        if kind == "rms":
            return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight + bias
        return F.layer_norm(o, o.shape[-1:], eps=eps)                   # "no affine"
    return mistake


NORM_MISTAKES = (
    ("normalise over all heads together (the last two axes): the GLA paper's LayerNorm is "
     "applied to each head's output separately, over its V features", _norm_mistake("all heads")),
    ("normalise over the time axis: the statistics are a token's own (one head, V features), "
     "never other tokens'", _norm_mistake("time")),
    ("normalise across the heads (axis 2): each head is normalised over its own V features",
     _norm_mistake("heads axis")),
    ("leave out the mean (an RMSNorm): the GLA layer's norm is a LayerNorm", _norm_mistake("rms")),
    ("leave out the learned scale and shift (weight, bias)", _norm_mistake("no affine")),
)


# ------------------------------------------------------------------------ ch14.output_gate
@contextlib.contextmanager
def _replace_norm(layer, o):
    """Make the layer's per-head norm output `o`: what follows it is then the output gate alone."""
    handle = layer.norm.register_forward_hook(lambda module, inputs, output: o)
    try:
        yield
    finally:
        handle.remove()


def output_gate(o, x, w_r, b_r, w_o):
    """The library layer's output stage, read off a float64 layer with these weights whose norm
    is made to output o."""
    B, T, H, V = o.shape
    layer = lnn.GatedLinearAttention(x.shape[-1], H, head_k=4, head_v=V, conv_width=1, gate_rank=4,
                                     impl="naive").to(o.dtype)
    with torch.no_grad():
        layer.out_gate.weight.copy_(w_r)
        layer.out_gate.bias.copy_(b_r)
        layer.out.weight.copy_(w_o)
        with _replace_norm(layer, o):
            return layer(x)[0]


def output_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (B, T, d, H) in enumerate([(2, 7, 16, 2), (1, 11, 24, 4), (2, 4, 12, 3)]):
        T = max(1, T + rng.randint(-2, 2))
        V = d // H
        gen = torch.Generator().manual_seed(seed * 23 + i)
        o = torch.randn(B, T, H, V, generator=gen, dtype=F64)
        x = torch.randn(B, T, d, generator=gen, dtype=F64)
        w_r = torch.randn(H * V, d, generator=gen, dtype=F64) / d ** 0.5
        b_r = torch.randn(H * V, generator=gen, dtype=F64)
        w_o = torch.randn(d, H * V, generator=gen, dtype=F64) / (H * V) ** 0.5
        cases.append(Case(args=(o, x, w_r, b_r, w_o), dtype=F64,
                          note=f"o [{B}, {T}, {H}, {V}], x [{B}, {T}, {d}]"))
    return cases


def _output_mistake(kind):
    def mistake(o, x, w_r, b_r, w_o):
        o = o.flatten(-2)
        r = x @ w_r.T + b_r
        gate = {"missing": 1.0, "sigmoid": torch.sigmoid(r), "no bias": F.silu(x @ w_r.T),
                "from o": F.silu(o @ w_r.T + b_r) if o.shape[-1] == x.shape[-1] else None,
                "after": 1.0}[kind]
        if gate is None:
            raise ValueError("shapes do not allow this mistake")
        y = (o * gate) @ w_o.T
        return y * F.silu(r) if kind == "after" else y
    return mistake


OUTPUT_MISTAKES = (
    ("leave out the output gate: y = (R_t ⊙ LN(O_t)) W_O, R_t = Swish(x_t W_r + b_r)",
     _output_mistake("missing")),
    ("gate with a sigmoid: R_t is Swish(z) = z · σ(z) (F.silu)", _output_mistake("sigmoid")),
    ("leave out the gate's bias b_r", _output_mistake("no bias")),
    ("compute the gate from the attention output: R_t comes from the layer's input x_t",
     _output_mistake("from o")),
    ("multiply by the gate after the output projection: the gate acts on the concatenated heads, "
     "before W_O", _output_mistake("after")),
)


# ------------------------------------------------------------------------ ch14.gla_layer
def gla_layer(x, params, n_heads, *, initial_state=None, conv_cache=None):
    """The library layer run with `params` as its weights (differentiable in them: torch.func's
    functional_call), from (initial_state, conv_cache); returns (y, final state, conv cache)."""
    layer = layer_from(params, n_heads, dtype=x.dtype, impl="auto")
    y, st = functional_call(layer, params, (x,), {"state": _state(layer, initial_state, conv_cache)})
    return y, st.memory, st.conv


def whole_layer(x, params, n_heads, *, initial_state=None, conv_cache=None):
    """The truth: the float64 library layer (naive operation) over the whole sequence at once."""
    return _run(layer_from(params, n_heads), x, initial_state, conv_cache)


LAYER_MISTAKES = (
    ("ignore initial_state: a continued sequence starts from the state it is given",
     lambda x, params, n_heads, *, initial_state=None, conv_cache=None:
         whole_layer(x, params, n_heads, conv_cache=conv_cache)),
    ("ignore conv_cache: the convolution of a continued sequence reads the last inputs before it",
     lambda x, params, n_heads, *, initial_state=None, conv_cache=None:
         whole_layer(x, params, n_heads, initial_state=initial_state)),
)


def layer_cases(seed):
    """Random float64 GLA layers on sequences of odd lengths, from the start and continuing from a
    state (the state and conv cache of a random prefix); one float32 case."""
    rng = random.Random(seed)
    cases = []
    for i, (d, H, K, B, T, prefix, dtype) in enumerate(
            [(16, 2, 4, 2, 13, 0, F64), (16, 2, 4, 1, 9, 6, F64), (24, 3, 4, 2, 7, 5, F64),
             (16, 2, 4, 1, 10, 3, F32)]):
        T = max(2, T + rng.randint(-3, 3))
        layer = make_layer(d, H, K, seed=seed * 29 + i)
        gen = torch.Generator().manual_seed(seed * 29 + i)
        x = torch.randn(B, T, d, generator=gen, dtype=F64)
        kw, note = {}, f"x [{B}, {T}, {d}], H={H} K={K} V={d // H}, {str(dtype)[6:]}"
        if prefix:
            with torch.no_grad():
                _, S0, cache0 = _run(layer, torch.randn(B, prefix, d, generator=gen, dtype=F64))
            kw = {"initial_state": S0.to(dtype), "conv_cache": cache0.to(dtype)}
            note += f", continuing after {prefix} tokens"
        cases.append(Case(args=(x.to(dtype), params_of(layer, dtype), H), kwargs=kw, dtype=dtype,
                          note=note))
    return cases


# ------------------------------------------------------------------------ ch14.decode
@torch.no_grad()
def decode(x, params, n_heads, *, initial_state=None, conv_cache=None):
    """The library layer one token per call, each call from the state the previous one returned."""
    layer = layer_from(params, n_heads, dtype=x.dtype, impl="auto")
    state, ys = _state(layer, initial_state, conv_cache), []
    for t in range(x.shape[1]):
        y, state = layer(x[:, t:t + 1], state)
        ys.append(y)
    return torch.cat(ys, dim=1), state.memory, state.conv


def _decode_mistake(kind):
    @torch.no_grad()
    def mistake(x, params, n_heads, *, initial_state=None, conv_cache=None):
        layer = layer_from(params, n_heads, dtype=x.dtype, impl="auto")
        start = state = _state(layer, initial_state, conv_cache)
        ys = []
        for t in range(x.shape[1]):
            token = x[:, t:t + 1]
            if kind == "not carried":
                y, state = layer(token, None)
            elif kind in ("stale", "stale, start returned"):
                y, state = layer(token, start)
            elif kind == "twice":
                y, state = layer(token, state)
                _, state = layer(token, state)
            elif kind == "cache not carried":
                y, state = layer(token, state and LayerState(state.memory, None, layer.owner, state.seen))
            ys.append(y)
        if kind == "stale, start returned":
            B, C = x.shape[0], layer.qkv.out_features
            S = initial_state if initial_state is not None else \
                x.new_zeros(B, layer.n_heads, layer.head_k, layer.head_v)
            cache = conv_cache if conv_cache is not None else x.new_zeros(B, layer.conv.width - 1, C)
            return torch.cat(ys, dim=1), S, cache
        return torch.cat(ys, dim=1), state.memory, state.conv
    return mistake


DECODE_MISTAKES = (
    ("decode without carrying the state: every token starts from an empty state (pass each "
     "step the state the previous step returned)", _decode_mistake("not carried")),
    ("keep a stale state: every token starts from the state you were given, which is never "
     "updated (assign the step's new state back before the next token)", _decode_mistake("stale")),
    ("keep a stale state: the state is never updated, so the one you were given comes back",
     _decode_mistake("stale, start returned")),
    ("update the state twice per token: each token's kᵀv is written, and the decay applied, "
     "twice (one step per token)", _decode_mistake("twice")),
    ("carry S but not the short convolution's cache: each token's convolution starts from zeros",
     _decode_mistake("cache not carried")),
)


# ------------------------------------------------------------------------ training with it
class FunctionalLayer(torch.nn.Module):
    """A GLA layer whose forward is a function `fn(x, params, n_heads) -> (y, S, cache)` of the
    weights of a library layer it wraps (so a model can train the reader's layer)."""

    def __init__(self, layer, fn):
        super().__init__()
        self.layer, self.fn = layer, fn

    def forward(self, x, state=None):
        params = dict(self.layer.named_parameters())
        return self.fn(x, params, self.layer.n_heads)[0], None

    def state_size(self):
        return self.layer.state_size()


def recall_model(fn=None, *, vocab=32, d_model=32, n_heads=4, seed=0):
    """A one-block MQAR model with a GLA layer (head_k = d/(2H), as the GLA paper's d_k = d/2);
    with `fn`, the block's layer runs `fn` on the library layer's weights."""
    torch.manual_seed(seed)
    model = mqar.RecallModel("gla", vocab, d_model=d_model, n_heads=n_heads, layers=1,
                             head_k=d_model // (2 * n_heads))
    if fn is not None:
        block = model.blocks[0]
        block.mixer = FunctionalLayer(block.mixer, fn)
    return model


def gradient_error(fn, *, vocab=32, n_pairs=6, seed=0):
    """Largest relative error, over the weights, between the gradients of one MQAR loss through
    the model with the reader's layer and through the same model with the library's."""
    tokens, targets = mqar.batch(n_pairs, 8, vocab, generator=torch.Generator().manual_seed(seed))
    grads = []
    for f in (fn, None):
        model = recall_model(f, vocab=vocab, seed=seed)
        mqar.loss_fn(model, tokens, targets).backward()
        grads.append({n.replace("mixer.layer.", "mixer."): p.grad for n, p in model.named_parameters()})
    mine, ref = grads
    return max(testing.rel_err(mine[n], ref[n]) if mine.get(n) is not None else float("inf")
               for n in ref)


def train(fn, *, steps=60, vocab=32, n_pairs=6, seed=0):
    """A few AdamW steps of the one-block MQAR model whose GLA layer runs `fn` (mqar.train)."""
    return mqar.train(recall_model(fn, vocab=vocab, seed=seed), n_pairs=n_pairs, vocab=vocab,
                      steps=steps, batch_size=16, lr=1e-2, seed=seed, progress=False,
                      name="your GLA layer")


# ------------------------------------------------------------------------ the exercises
def _layer_sig(name):
    return (f"{name}(x, params, n_heads, *, initial_state=None, conv_cache=None) -> "
            "(y, final_state, conv_cache)   # x [B, T, d]; params: the layer's weights by name")


EXERCISES = [
    Exercise(
        name="ch14.heads",
        chapter=14,
        title="Projections: split the projected channels into q, k, v heads",
        signature="split_heads(qkv, n_heads, head_k, head_v) -> (q, k, v)  # qkv [B, T, H·(2K+V)]",
        reference=split_heads,
        cases=heads_cases,
        outputs=("q", "k", "v"),
        hint="the channels are [q | k | v] with H·K, H·K, H·V of them; each head's channels are "
             "contiguous: q [B, T, H·K] → [B, T, H, K].",
        diagnoses=HEADS_MISTAKES,
    ),
    Exercise(
        name="ch14.gate",
        chapter=14,
        title="The GLA paper's low-rank forget gate, in log space",
        signature="low_rank_gate(x, w1, w2, bias, n_heads, tau=16.0) -> g  # g [B, T, H, K] ≤ 0",
        reference=low_rank_gate,
        cases=gate_cases,
        outputs=("g",),
        hint="the two matrices are nn.Linear weights (out × in), so z = x w1ᵀ w2ᵀ + bias; then the "
             "log of α = σ(z)^{1/τ}, computed without forming σ(z); then split the last axis into heads.",
        diagnoses=GATE_MISTAKES,
    ),
    Exercise(
        name="ch14.short_conv",
        chapter=14,
        title="The short causal convolution, with the cache that continues a sequence",
        signature="short_conv(u, weight, cache=None) -> (y, new_cache)  # u [B, T, C], "
                  "weight [C, 1, w], cache [B, w−1, C]",
        reference=short_conv,
        cases=conv_cases,
        outputs=("y", "new_cache"),
        hint="output t may read inputs t−w+1 … t only: which w − 1 inputs must stand before u's "
             "first token (from the start, and when a cache is given), and what padding is left for "
             "F.conv1d to add then?",
        diagnoses=CONV_MISTAKES,
    ),
    Exercise(
        name="ch14.head_norm",
        chapter=14,
        title="The per-head LayerNorm",
        signature="head_norm(o, weight, bias, eps=1e-5) -> o_normed  # o [B, T, H, V]; weight, bias [V]",
        reference=head_norm,
        cases=norm_cases,
        outputs=("o_normed",),
        hint="statistics per token and per head, over the V features of that head only; the "
             "variance is the biased one (divide by V), then scale and shift.",
        diagnoses=NORM_MISTAKES,
    ),
    Exercise(
        name="ch14.output_gate",
        chapter=14,
        title="The output gate and the output projection",
        signature="output_gate(o, x, w_r, b_r, w_o) -> y  # o [B, T, H, V] (normed), x [B, T, d]",
        reference=output_gate,
        cases=output_cases,
        outputs=("y",),
        hint="concatenate the heads, multiply by a gate computed from the layer's input x, then "
             "project; which activation does the GLA paper's eq. (10) use?",
        diagnoses=OUTPUT_MISTAKES,
    ),
    Exercise(
        name="ch14.gla_layer",
        chapter=14,
        title="The whole GLA layer, from its weights",
        signature=_layer_sig("gla_layer"),
        reference=gla_layer,
        truth=whole_layer,
        cases=layer_cases,
        outputs=("y", "final_state", "conv_cache"),
        hint="x W_qkvᵀ → short_conv (from conv_cache) → split_heads; the gate from x; linattn.gla "
             "with initial_state and output_final_state=True; head_norm; output_gate.",
        diagnoses=LAYER_MISTAKES,
    ),
    Exercise(
        name="ch14.decode",
        chapter=14,
        title="Decoding: one token per step, the state carried",
        signature=_layer_sig("gla_decode") + "; one step per token",
        reference=decode,
        truth=whole_layer,
        cases=layer_cases,
        outputs=("y", "final_state", "conv_cache"),
        hint="a step takes one token and the state (S, conv cache) and returns the token's output "
             "and the new state; what must the loop do with that new state?",
        diagnoses=DECODE_MISTAKES,
    ),
]
