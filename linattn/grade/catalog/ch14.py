"""Chapter 14 — layers: the GLA gate in log space, and the prefill-then-decode loop."""
from __future__ import annotations

import random

import torch

from ... import nn as lnn
from ...nn.gates import log_gate
from ...nn.generate import prefill_then_decode
from ..exercise import Case, Exercise

F32 = torch.float32


def gate_cases(seed):
    """Gate pre-activations z of several sizes, one case deep in the saturated range (z ≈ −200),
    where log(sigmoid(z)) is −inf in float32, one in bfloat16 (the result is float32), one in
    float64, and temperatures other than 16."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for shape, spread, dtype, tau in [((2, 9, 2, 8), 3.0, F32, 16.0), ((1, 40, 4, 16), 30.0, F32, 16.0),
                                      ((3, 5, 2, 4), 3.0, torch.bfloat16, 4.0), ((2, 7, 3), 3.0, F32, 1.0),
                                      ((2, 11, 2, 8), 5.0, torch.float64, 16.0)]:
        shape = (shape[0], max(1, shape[1] + rng.randint(-2, 2))) + shape[2:]
        z = (spread * torch.randn(shape, generator=gen)).to(dtype)
        cases.append(Case(args=(z,), kwargs={"tau": tau}, dtype=F32 if dtype != torch.float64 else dtype,
                          note=f"z {list(shape)} {str(dtype)[6:]}, spread {spread}, τ = {tau:g}"))
    z = torch.full((1, 3, 2, 4), -200.0)
    z[0, 1] = torch.linspace(-150.0, 30.0, 8).view(2, 4)
    cases.append(Case(args=(z,), kwargs={"tau": 16.0}, dtype=F32, note="saturated gates, z down to −200"))
    return cases


def layer_cases(seed):
    """Small layers of three kinds with random weights, sequences of odd lengths, prefills of one
    token, of a few, and of all but one."""
    rng = random.Random(seed)
    cases = []
    for i, (name, prefill) in enumerate([("gla", 1), ("kda", 5), ("deltanet", 0), ("softmax", 3),
                                         ("gated_deltanet", 7)]):
        torch.manual_seed(seed * 10 + i)
        layer = lnn.LAYERS[name](16, 2).eval()
        T = rng.randint(9, 17)
        prefill = prefill or T - 1
        x = torch.randn(rng.randint(1, 2), T, 16, generator=torch.Generator().manual_seed(seed + i))
        cases.append(Case(args=(layer, x, prefill), dtype=F32,
                          note=f"{type(layer).__name__}, x {list(x.shape)}, prefill {prefill}"))
    return cases


@torch.no_grad()
def whole_sequence(layer, x, prefill):
    """The truth: the layer run over the whole sequence at once (float32, as the layer's weights)."""
    return layer(x.to(F32))[0]


EXERCISES = [
    Exercise(
        name="ch14.log_gate",
        chapter=14,
        title="The GLA gate in log space, with temperature τ",
        signature="log_gate(z, tau=16.0) -> g  # g = log α = log σ(z) / τ, float32 (float64 stays float64)",
        reference=log_gate,
        cases=gate_cases,
        outputs=("g",),
        hint="log σ(z) = −softplus(−z): F.logsigmoid(z) — never torch.sigmoid(z).log(), which is "
             "−inf for z below about −104; divide the *log* by τ; compute in float32.",
    ),
    Exercise(
        name="ch14.decode",
        chapter=14,
        title="Prefill, then decode one token at a time",
        signature="prefill_then_decode(layer, x, prefill) -> y  # y [B, T, d] = layer(x)[0]",
        reference=prefill_then_decode,
        truth=whole_sequence,
        cases=layer_cases,
        outputs=("y",),
        hint="y, state = layer(x[:, :prefill]); then for each later t: y_t, state = layer(x[:, t:t+1], "
             "state) — pass the state each call returned to the next; concatenate along time.",
    ),
]
