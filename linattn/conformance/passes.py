"""The delta family's two sequential passes checked on their own, natively, against float64.

The state pass (`delta._state_kernel`: S ← e^{G_C} S + Kdᵀ(U − W S), storing every entering state
and Ṽ) and the reverse pass (`delta_backward._dstate_kernel`: dṼ = Aqkᵀ dO + Kd dS,
dS ← e^{G_C} dS + Qsᵀ dO − Wᵀ dṼ) are the loops Triton compiles most differently from the
interpreter (software pipelining across chunks). The whole-op matrix reaches them only through
stage 1, whose float32 kernels take minutes to compile; here they run on synthetic stage inputs
(random W, U, Kd, Qs, Aqk and decays of the right scale), so a grid of every head dim × chunk size
× dtype × gate kind compiles only these two kernels. The references below restate each pass in
float64 PyTorch; the CPU test runs them against the interpreter, so the references themselves are
checked.

    python tools/pass_sweep.py --out DIR          (natively: the whole grid, worker processes)
"""
from __future__ import annotations

import itertools

import torch

from .. import outputs, testing
from ..triton import common, delta
from ..triton import wy as wy_
from ..triton import delta_backward as backward
from ..validate import check_inputs

HEAD_DIMS = (16, 32, 64, 128, 256)
CHUNKS = (16, 32, 64)
# (B, H, T, with initial state and final-state gradient): one chunk and a partial one, three chunks,
# a long sequence with an odd head count, and no initial state (HAS_H0 / HAS_DHT compile apart)
SHAPES = ((3, 2, 33, True), (3, 2, 65, True), (1, 3, 300, True), (3, 2, 33, False), (3, 2, 65, False))
KINDS = (("bfloat16", 0), ("bfloat16", 2), ("float32", 0), ("float32", 2), ("bfloat16", 1), ("float16", 2))


def _rows(x, n, C, T):
    return x[:, n * C:min((n + 1) * C, T)]


def state_ref(wy: dict, h0, p, g=None) -> dict:
    """The state pass in float64: hs [B,H,NT,K,V], vnew [B,T,H,V], ht [B,H,K,V]. g: Gated DeltaNet's
    per-head gates, whose stored w is W from each chunk's first token (`wy.absolute_w`)."""
    w = wy_.absolute_w(wy["w"].double(), g, p.C)
    u, kd = (wy[n].double() for n in ("u", "kd"))
    B, T, H, K = w.shape
    V = u.shape[-1]
    S = torch.zeros(B, H, K, V, dtype=torch.float64, device=w.device) if h0 is None else h0.double().clone()
    hs = torch.zeros(B, H, p.NT, K, V, dtype=torch.float64, device=w.device)
    vnew = torch.zeros(B, T, H, V, dtype=torch.float64, device=w.device)
    for n in range(p.NT):
        hs[:, :, n] = S
        Wn, Un, Kn = (_rows(x, n, p.C, T) for x in (w, u, kd))                  # [B, c, H, ·]
        Vt = Un - torch.einsum("bchk,bhkv->bchv", Wn, S)
        vnew[:, n * p.C:n * p.C + Vt.shape[1]] = Vt
        if p.gate:
            S = S * wy["dl"].double()[:, :, n, :, None]
        S = S + torch.einsum("bchk,bchv->bhkv", Kn, Vt)
    return dict(hs=hs, vnew=vnew, ht=S)


def dstate_ref(q, g, wy: dict, do, dht, p) -> dict:
    """The reverse pass in float64: dhs [B,H,NT,K,V], dvnew [B,T,H,V], dh0 [B,H,K,V]."""
    qs = (wy["qg"] if p.gate == 2 else q).double()
    kd, aqk, dO = wy["kd"].double(), wy["aqk"].double(), do.double()
    w = wy_.absolute_w(wy["w"].double(), g, p.C)
    B, T, H, K = kd.shape
    V = dO.shape[-1]
    dS = torch.zeros(B, H, K, V, dtype=torch.float64, device=kd.device) if dht is None else dht.double().clone()
    dhs = torch.zeros(B, H, p.NT, K, V, dtype=torch.float64, device=kd.device)
    dvnew = torch.zeros(B, T, H, V, dtype=torch.float64, device=kd.device)
    for n in reversed(range(p.NT)):
        dhs[:, :, n] = dS
        dOn, A, Kn, Qn, Wn = (_rows(x, n, p.C, T) for x in (dO, aqk, kd, qs, w))
        c = dOn.shape[1]
        A = A[..., :c]                                   # columns past T meet zero rows of dO
        if p.gate == 0:
            Qn = Qn * p.scale
        if p.gate == 1:                                  # e^G of a per-head gate, from its chunk prefix sum
            G = torch.cumsum(torch.clamp(_rows(g, n, p.C, T).double(), min=common.GATE_FLOOR.value), dim=1)
            Qn = Qn * (torch.exp(G) * p.scale)[..., None]
        dVt = torch.einsum("bihj,bihv->bjhv", A, dOn) + torch.einsum("bjhk,bhkv->bjhv", Kn, dS)
        dvnew[:, n * p.C:n * p.C + c] = dVt
        if p.gate:
            dS = dS * wy["dl"].double()[:, :, n, :, None]
        dS = dS + torch.einsum("bihk,bihv->bhkv", Qn, dOn) - torch.einsum("bihk,bihv->bhkv", Wn, dVt)
    return dict(dhs=dhs, dvnew=dvnew, dh0=dS)


def inputs(dtype, gate, K, V, C, B, H, T, device, seed=0):
    """Synthetic stage inputs: (q, g, wy, plan, h0, dO, dht). Keys and W scaled by 0.3/√K so the
    chunk maps stay contractive (values of the size stage 1 produces)."""
    gen = torch.Generator().manual_seed(seed + 1000 * V + 10 * C + T)
    r = lambda *s: torch.randn(*s, generator=gen)                          # noqa: E731
    q = r(B, T, H, K).to(device, dtype)
    g = None
    if gate == 1:
        g = (-torch.rand(B, T, H, generator=gen) * 0.3).to(device)
    elif gate == 2:
        g = (-torch.rand(B, T, H, K, generator=gen) * 0.3).to(device)
    d = check_inputs(q, q, r(B, T, H, V).to(device, dtype), g=g, beta=torch.rand(B, T, H, generator=gen).to(device),
                     gate=gate > 0, delta=True)
    p = delta.plan(q, g, d, C)
    s = 0.3 / K ** 0.5
    wy = dict(w=(r(B, T, H, K) * s).to(device, p.work), u=r(B, T, H, V).to(device, p.work),
              kd=(r(B, T, H, K) * s).to(device, p.work), aqk=(r(B, T, H, C) * 0.1).to(device, p.work),
              qg=(r(B, T, H, K) * s).to(device, p.work),
              dl=torch.exp(-torch.rand(B, H, p.NT, K, generator=gen) * 0.5).to(device))
    return q, g, wy, p, r(B, H, K, V).to(device), r(B, T, H, V).to(device, dtype), r(B, H, K, V).to(device)


def _rel(x, ref) -> tuple[int, float]:
    """(non-finite entries, testing.rel_err): a NaN-poisoned entry the kernel never wrote is counted,
    and makes the error inf."""
    return int((~torch.isfinite(x)).sum()), testing.rel_err(x, ref)


def check(dtype: str, gate: int, K: int, V: int, C: int, B: int, H: int, T: int, with_h0: bool,
          device="cuda") -> dict:
    """Both passes at one point of the grid: {tensor: [non-finite, relative error]}, 'failed'."""
    dt = getattr(torch, dtype)
    q, g, wy, p, h0, do, dht = inputs(dt, gate, K, V, C, B, H, T, device)
    if not with_h0:
        h0 = dht = None
    with outputs.poisoned():
        hs, vnew, ht = delta.state_stage(wy, h0, p, True, over_u=False, g=g)
        dhs, dvnew, dh0 = backward.dstate_stage(q, g, wy, do, dht, p)
    ours = dict(hs=hs, vnew=vnew, ht=ht, dhs=dhs, dvnew=dvnew, dh0=dh0)
    ref = dict(state_ref(wy, h0, p, g), **dstate_ref(q, g, wy, do, dht, p))
    err = {n: _rel(ours[n], ref[n]) for n in ours}
    failed = sorted(n for n, (bad, e) in err.items() if bad or e > testing.GRAD_TOLERANCE[dt])
    return dict(err={n: [bad, float(f"{e:.3g}")] for n, (bad, e) in err.items()}, failed=failed,
                stages=[delta.state_stages(p), backward.dstate_stages(p)])


def grid(kinds=KINDS, head_dims=HEAD_DIMS, chunks=CHUNKS, shapes=SHAPES, values=None):
    """Every point: dict(dtype, gate, K, V, C, B, H, T, with_h0), grouped by (dtype, gate, K, V) so one
    worker compiles one kernel pair per chunk size and shape class. values: the V to take (default
    head_dims)."""
    for (dtype, gate), K, V in itertools.product(kinds, head_dims, values or head_dims):
        yield [dict(dtype=dtype, gate=gate, K=K, V=V, C=C, B=B, H=H, T=T, with_h0=h)
               for C in chunks for (B, H, T, h) in shapes]
