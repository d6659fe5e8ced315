"""Random inputs, the error metric and tolerances: the one place tests, graders and chapters use.

Error metric: relative error ‖a − b‖ / ‖b‖ in float64 against a float64 reference. Tolerances depend
on the dtype the *inputs* came in: the reference runs on the same (rounded) inputs upcast to
float64, so input rounding is not counted, only arithmetic and output rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .outputs import poisoned  # noqa: F401  (re-exported: tests write `with testing.poisoned():`)

TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 1e-2,
}

# Gradients against float64 autograd through the naive level: a gradient sums over the whole sequence
# (dk_j collects every later query, dg a suffix of the sequence), so it carries more rounding than an
# output; half precision is judged on its inputs' rounding, which the gradients amplify.
GRAD_TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.float16: 2e-2,
    torch.bfloat16: 2e-2,
}

# Log-decay strengths, per step. "normal" is the benchmark setting (logsigmoid(randn)/16, as in
# ANCHORS.md); "strong" reaches −20 per step, where a bare cumulative product underflows at once.
# The last three are gates real models produce: "logsigmoid" is GLA's gate without the /16 (≈ −0.8
# per step), "mamba" the Mamba-2 / Gated DeltaNet / KDA parametrisation at its initialisation,
# −exp(A_log)·softplus(x + dt_bias), and "reset" normal gates where about one token in twenty (per
# batch row and head, every key dimension) forgets almost everything (g from −100 to −30).
GATE_STRENGTHS = ("weak", "normal", "strong", "logsigmoid", "mamba", "reset")


# The six variants the book and the benchmarks name (FLA's names, linattn.bench.OPS) → (linattn
# function, gate shape for make_inputs' `gate`).
VARIANTS = {
    "linear_attn": ("linear_attn", None),
    "gla": ("gla", "per_dim"),
    "simple_gla": ("gla", "per_head"),
    "delta_rule": ("delta_rule", None),
    "gated_delta_rule": ("kda", "per_head"),
    "kda": ("kda", "per_dim"),
}


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE[dtype]


# The smallest norm a relative error is taken against: float32's smallest normal number per element.
# A reference below it (the gradient of an initial state behind a gate of −95 at the first token is
# about 1e-42) is beneath what float32 arithmetic represents on a GPU, which flushes denormals to
# zero; there an output of 0 is right, and its error counts against this floor instead.
NORM_FLOOR = torch.finfo(torch.float32).tiny


def rel_err(out: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    """‖out − ref‖ / max(‖ref‖, NORM_FLOOR · √n) in float64; inf when out holds NaN/inf or the
    shapes differ. Where ‖ref‖ is below that floor (an exact zero), the error is taken against
    `scale` instead if larger: the size of the terms the result is a difference of. A gate's gradient
    at T = 1 without an initial state is exactly 0, while any kernel computes it as a sum of
    q ⊙ dq − k ⊙ dk whose rounding leaves about 1e-8 of them: against the floor that read as an
    error of 1e30, against the terms it is what it is, a rounding residue."""
    if out.shape != ref.shape:
        return float("inf")
    a, b = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    floor = NORM_FLOOR * max(b.numel(), 1) ** 0.5
    den = b.norm().item()
    if den < floor:
        den = max(floor, scale)
    return (a - b).norm().item() / den


def worst_position(out: torch.Tensor, ref: torch.Tensor):
    """Index of the largest absolute difference (NaN counts as largest), as a tuple."""
    diff = (out.detach().double().cpu() - ref.detach().double().cpu()).abs()
    diff = torch.nan_to_num(diff, nan=float("inf"))
    flat = int(diff.argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))


def log_gates(shape, strength="normal", *, generator=None, device="cpu") -> torch.Tensor:
    """float32 log-decays ≤ 0 of the given strength."""
    x = torch.randn(shape, generator=generator, device=device)
    if strength == "weak":
        return F.logsigmoid(x + 8.0) / 16  # ≈ −2e-5 per step: almost no decay
    if strength == "normal":
        return F.logsigmoid(x) / 16
    if strength == "strong":
        return -20.0 * torch.rand(shape, generator=generator, device=device)  # down to −20 per step
    if strength == "logsigmoid":
        return F.logsigmoid(x)
    if strength == "mamba":
        return _mamba_gates(x, generator)
    if strength == "reset":
        g = F.logsigmoid(x) / 16
        token = shape[:3] if len(shape) > 3 else shape                 # [B, T, H]: all K dims reset
        hit = torch.rand(token, generator=generator, device=device) < 0.05
        depth = 30.0 + 70.0 * torch.rand(token, generator=generator, device=device)
        hit, depth = (t.reshape(*token, *(1,) * (len(shape) - len(token))) for t in (hit, depth))
        return torch.where(hit, -depth, g)
    raise ValueError(f"strength must be one of {GATE_STRENGTHS}, got {strength!r}")


def _mamba_gates(x, generator):
    """−exp(A_log)·softplus(x + dt_bias) with the initialisation of Mamba-2 and KDA: A = e^{A_log}
    uniform in [1, 16] per head, dt log-uniform in [1e-3, 0.1] per head (and key dimension for
    per-dimension gates), dt_bias = softplus⁻¹(dt). Per step from about −1e-3 to about −20.
    x: [B, T, H] or [B, T, H, K] (other shapes: the parameters run over the last axis)."""
    par = x.shape[2:] if x.dim() >= 3 else x.shape[-1:]                # [H] or [H, K]
    dev = x.device
    A = 1.0 + 15.0 * torch.rand(par[:1], generator=generator, device=dev)                 # [H]
    lo, hi = torch.log(torch.tensor(1e-3)), torch.log(torch.tensor(0.1))
    dt = torch.exp(lo + (hi - lo) * torch.rand(par, generator=generator, device=dev))      # [H(, K)]
    dt_bias = dt + torch.log(-torch.expm1(-dt))                        # softplus(dt_bias) = dt
    A = A.reshape(*A.shape, *(1,) * (len(par) - 1))
    return -A * F.softplus(x + dt_bias)


def make_inputs(op: str, *, B=2, T=100, H=2, K=32, V=48, dtype=torch.float32, device="cpu",
                gate="per_dim", strength="normal", initial_state=False, seed=0,
                gate_dtype=torch.float32) -> dict:
    """Keyword arguments for `op` ('linear_attn', 'gla', 'delta_rule', 'kda') with random values.

    gate='per_head' gives g of shape [B,T,H] (RetNet/Mamba-2, Gated DeltaNet), 'per_dim' [B,T,H,K]
    (GLA, KDA). Delta-rule keys are L2-normalised and β ∈ (0, 1), as those models produce them.
    g and β come in gate_dtype: float32 unless a test passes them as a bf16 model does, in its dtype.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=gen)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    args = {}
    if op in ("delta_rule", "kda"):
        k = F.normalize(k, dim=-1)
        args["beta"] = torch.rand(B, T, H, generator=gen).to(device, gate_dtype)
    elif op not in ("linear_attn", "gla"):
        raise ValueError(f"op must be linear_attn, gla, delta_rule or kda, got {op!r}")
    if op in ("gla", "kda"):
        shape = (B, T, H) if gate == "per_head" else (B, T, H, K)
        args["g"] = log_gates(shape, strength, generator=gen).to(device, gate_dtype)
    args.update(q=q.to(device, dtype), k=k.to(device, dtype), v=v.to(device, dtype))
    if initial_state:
        args["initial_state"] = rnd(B, H, K, V).to(device)
    return args


def to_float64(args: dict) -> dict:
    """The same arguments with every floating tensor upcast to float64 (for the reference)."""
    return {n: a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for n, a in args.items()}


def leaves(args: dict) -> dict:
    """Detached copies of the arguments that autograd differentiates (their .grad is the gradient)."""
    return {n: a.detach().clone().requires_grad_() for n, a in args.items()}


def packed_call(fn, args: dict, cu_seqlens, w_o, w_S, **kw) -> tuple:
    """(o, final states, gradients by name) of fn on a packed row, with incoming gradients w_o on
    the outputs and w_S on the final states, every buffer NaN-poisoned (tests of cu_seqlens)."""
    x = leaves(args)
    with poisoned():
        o, S = fn(**x, cu_seqlens=cu_seqlens, output_final_state=True, **kw)
        ((o * w_o.to(o.dtype)).sum() + (S * w_S.to(S.dtype)).sum()).backward()
    return o.detach(), S.detach(), {n: a.grad for n, a in x.items()}


def assert_same_results(got: tuple, want: tuple, tol: float, what: str) -> None:
    """Two (o, final states, gradients by name) within relative error tol, every tensor named."""
    errs = {"o": rel_err(got[0], want[0]), "final state": rel_err(got[1], want[1])}
    errs.update({f"d{n}": rel_err(got[2][n], want[2][n]) for n in want[2]})
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: relative errors over {tol:g}: {bad}"


def assert_within_tolerance(got: tuple, ref: tuple, dtype) -> None:
    """`packed_call`'s (o, S, grads) within dtype's output and gradient tolerances of a float64 ref."""
    assert rel_err(got[0], ref[0]) <= TOLERANCE[dtype], "o"
    assert rel_err(got[1], ref[1]) <= TOLERANCE[dtype], "final state"
    for n in got[2]:
        assert rel_err(got[2][n], ref[2][n]) <= GRAD_TOLERANCE[dtype], n
