"""Chapter 12 — the backward pass: the closed-form gate gradient, the reverse-time recurrence, and
the chunkwise GLA backward.

The backward exercises return (dq, dk, dv, dg, dinitial_state) for an incoming output gradient
`do` and, where a case passes one, an incoming final-state gradient `dfinal_state`; their ground
truth is float64 autograd through the naive recurrence. The gate-gradient exercise gets dq and dk
from that same float64 backward (rounded to the case's dtype); its truth is the closed form in
float64 on those inputs, which tests/test_grade_ch12.py checks equals autograd's dg.

Tolerance: gradients are graded at 1e-4 in float32 (the library's gradient tolerance): the
closed form's suffix sum over a whole sequence adds up terms that largely cancel under strong
gates (relative error about 2e-5 in float32 against float64 at T ≈ 100).
"""
from __future__ import annotations

import random

import torch

from ... import chunk, naive, testing
from ...naive import backward
from ..exercise import Case, Exercise

F32, F64 = torch.float32, torch.float64
GRAD_TOL = 1e-4
CHUNK = 16

# (B, T, H, K, V, dtype, gate, strength, initial_state, final-state gradient). Lengths vary by a
# few tokens per seed (rarely a multiple of CHUNK); the T = 7 case is shorter than one chunk.
SHAPES = [
    (1, 37, 2, 16, 16, F32, "per_dim", "normal", False, True),
    (2, 50, 2, 16, 8, F32, "per_dim", "strong", True, True),
    (1, 45, 1, 8, 16, F32, "per_head", "strong", True, False),
    (1, 40, 2, 8, 8, F64, "per_dim", "weak", True, True),
    (1, 7, 1, 8, 8, F32, "per_dim", "normal", True, True),
    (2, 33, 2, 8, 12, F32, "per_head", "normal", False, False),
]


def _setting(seed, i, shape):
    B, T, H, K, V, dtype, gate, strength, init, dfinal = shape
    T = max(1, T + random.Random(seed * 7 + i).randint(-3, 3))
    kw = testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, dtype=dtype, gate=gate,
                             strength=strength, initial_state=init, seed=seed * 31 + i)
    gen = torch.Generator().manual_seed(seed * 31 + i + 1)
    kw["do"] = torch.randn(B, T, H, V, generator=gen).to(dtype)
    if dfinal:
        kw["dfinal_state"] = torch.randn(B, H, K, V, generator=gen).to(_acc(dtype))  # S_T's dtype
    note = (f"B={B} T={T} H={H} K={K} V={V} {str(dtype).replace('torch.', '')}, {gate} gates "
            f"({strength})" + (", initial state" if init else "")
            + (", final-state gradient" if dfinal else ""))
    return kw, note, dtype


def _acc(dtype):
    return F64 if dtype == F64 else F32


def backward_cases(seed, *, chunk_size=None):
    """GLA backward cases: q, k, v, g, do (+ initial_state, dfinal_state, scale, chunk_size)."""
    cases = []
    for i, shape in enumerate(SHAPES):
        kw, note, dtype = _setting(seed, i, shape)
        if i == 1:
            kw["scale"] = 0.5
            note += ", scale=0.5"
        if chunk_size is not None:
            kw["chunk_size"] = chunk_size
        cases.append(Case(kwargs=kw, note=note, dtype=dtype))
    return cases


def gate_grad_cases(seed):
    """q, k, g and the float64 backward's dq, dk rounded to the case dtype (+ S_T and dS_T)."""
    cases = []
    for i, shape in enumerate(SHAPES):
        kw, note, dtype = _setting(seed, i, shape)
        a = testing.to_float64(kw)
        grads = backward.gla_backward(a["q"], a["k"], a["v"], a["g"], a["do"],
                                      initial_state=a.get("initial_state"),
                                      dfinal_state=a.get("dfinal_state"))
        args = dict(q=kw["q"], k=kw["k"], dq=grads["dq"].to(dtype), dk=grads["dk"].to(dtype), g=kw["g"])
        if "dfinal_state" in kw:
            args["final_state"] = naive.gla(a["q"], a["k"], a["v"], a["g"], output_final_state=True,
                                            initial_state=a.get("initial_state"))[1].to(_acc(dtype))
            args["dfinal_state"] = kw["dfinal_state"]
        cases.append(Case(kwargs=args, note=note, dtype=dtype))
    return cases


def autograd_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None):
    """The ground truth: autograd through the naive GLA recurrence (run it on float64 inputs)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    S0 = None if initial_state is None else initial_state.detach().clone().requires_grad_()
    o, S = naive.gla(*leaves, scale=scale, initial_state=S0, output_final_state=True)
    loss = (o * do).sum() + (0 if dfinal_state is None else (S * dfinal_state).sum())
    grads = torch.autograd.grad(loss, leaves + ([S0] if S0 is not None else []))
    return tuple(grads[:4]) + (grads[4] if S0 is not None else None,)


def recurrent_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None):
    """The library's reverse-time recurrence, as the exercise's tuple."""
    r = backward.gla_backward(q, k, v, g, do, scale=scale, initial_state=initial_state,
                              dfinal_state=dfinal_state)
    return r["dq"], r["dk"], r["dv"], r["dg"], r["dinitial_state"]


def chunk_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None,
                   chunk_size=64):
    """The library's chunkwise backward (chunk.gla's autograd.Function), as the exercise's tuple."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    S0 = None if initial_state is None else initial_state.detach().clone().requires_grad_()
    o, S = chunk.gla(*leaves, scale=scale, initial_state=S0, output_final_state=True,
                     chunk_size=chunk_size)
    outs, douts = [o], [do]
    if dfinal_state is not None:
        outs.append(S)
        douts.append(dfinal_state)
    grads = torch.autograd.grad(outs, leaves + ([S0] if S0 is not None else []), douts)
    return tuple(grads[:4]) + (grads[4] if S0 is not None else None,)


GRADS = ("dq", "dk", "dv", "dg", "dinitial_state")
BACKWARD_SIG = ("(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None{}) "
                "-> (dq, dk, dv, dg, dinitial_state)  # dinitial_state None without initial_state")

EXERCISES = [
    Exercise(
        name="ch12.gate_grad",
        chapter=12,
        title="The gate gradient in closed form: q ⊙ dq − k ⊙ dk, summed from the end",
        signature="gate_grad(q, k, dq, dk, g, *, final_state=None, dfinal_state=None) -> dg",
        reference=backward.gate_grad_closed_form,
        cases=gate_grad_cases,
        tol=GRAD_TOL,
        outputs=("dg",),
        hint="∂L/∂b_t = q_t ⊙ dq_t − k_t ⊙ dk_t (b enters + on the query side, − on the key side), "
             "plus rowsum(S_T ⊙ dS_T) at the last step when a final-state gradient is given; "
             "dg_t = Σ_{s ≥ t} ∂L/∂b_s (a suffix sum: flip, cumsum, flip); sum over K for [B,T,H] gates.",
    ),
    Exercise(
        name="ch12.recurrent_backward",
        chapter=12,
        title="GLA backward, token by token in reverse time",
        signature="recurrent_gla_backward" + BACKWARD_SIG.format(""),
        reference=recurrent_backward,
        truth=autograd_backward,
        cases=backward_cases,
        tol=GRAD_TOL,
        outputs=GRADS,
        hint="Recompute and keep S_0..S_T; then for t = T−1 … 0: dS += scale·q_tᵀ do_t, dq_t = "
             "scale·do_t S_tᵀ, dk_t = v_t dSᵀ, dv_t = k_t dS, dg_t = e^{g_t} ⊙ rowsum(S_{t−1} ⊙ dS), "
             "dS ← diag(e^{g_t}) dS. Start from dfinal_state (or zeros); the last dS is dinitial_state.",
    ),
    Exercise(
        name="ch12.chunk_backward",
        chapter=12,
        title="Chunkwise GLA backward: reverse pass over chunk states, intra-chunk tiles, closed-form dg",
        signature="chunk_gla_backward" + BACKWARD_SIG.format(", chunk_size=64"),
        reference=chunk_backward,
        truth=autograd_backward,
        cases=lambda seed: backward_cases(seed, chunk_size=CHUNK),
        tol=GRAD_TOL,
        outputs=GRADS,
        hint="States S_[n−1] by a forward pass; dS_[n−1] = diag(γ) dS_[n] + (Q̂ ⊙ Λ)ᵀ dO_[n] from "
             "dfinal_state; per chunk dP = tril(dO Vᵀ), dq̂_i = Σ_j dP_ij k_j ⊙ e^{b_i−b_j} + Λ_i ⊙ "
             "dO_i S_[n−1]ᵀ, dk_j = Σ_i dP_ij q̂_i ⊙ e^{b_i−b_j} + Γ_j ⊙ v_j dS_[n]ᵀ; keep the last "
             "partial chunk; dg by the closed form with rowsum(S_[n] ⊙ dS_[n]) at each chunk's end.",
    ),
]
