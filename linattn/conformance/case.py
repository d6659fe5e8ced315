"""Running one conformance case: the Triton level's outputs and every input's gradient against
float64 autograd through linattn.naive on the same device, the decode step token by token, and
FLA beside ours on the same inputs when it is importable.

`run(case, device)` returns a result row (JSON-serialisable): the case's parameters plus
    status   'pass' | 'fail' | 'error'
    err      {tensor: relative error}   o, S (final state), dq, dk, dv, dg, dbeta, dh0, decode.o, decode.S
    tol      {tensor: tolerance}        testing.TOLERANCE / GRAD_TOLERANCE of the input dtype
    failed   the tensors over tolerance, 'guard' (an out-of-bounds write), 'dtype' (a gradient in the
             wrong dtype), or the error message
    guards   the overwritten buffers (outputs.Guards), when any
    fla_result  {'status': 'ran' | 'refused' | 'absent', 'err': {...}, 'msg': ...} when case['fla']
    seconds  wall time of the case, and of its parts
A CUDA error (an illegal memory access kills the process's CUDA context) is raised as CudaError
for the worker to report as a crash and exit.
"""
from __future__ import annotations

import time

import torch

from .. import bench, naive, outputs, testing
from .matrix import VARIANTS

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
GRAD_KEY = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
# the float64 reference: the token loop (ground truth); 'chunk' is the chunkwise level in float64,
# validated against it by the tests, for lengths where the loop is too slow
REFERENCES = ("naive", "chunk")


class CudaError(RuntimeError):
    """The CUDA context of this process is unusable (illegal memory access, device-side assert)."""


def cuda_broken(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("CUDA error", "illegal memory access", "device-side assert",
                                   "AcceleratorError", "cudaError", "CUDA_ERROR"))


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def make(case: dict, device, *, seed_offset: int = 0) -> dict:
    """The library's keyword arguments for the case, on device."""
    op, gate = VARIANTS[case["variant"]]
    return testing.make_inputs(op, B=case["B"], T=case["T"], H=case["H"], K=case["K"], V=case["V"],
                               dtype=dtype_of(case["dtype"]), device=device, gate=gate or "per_dim",
                               strength=case["strength"] or "normal", initial_state=case["h0"],
                               seed=case["seed"] + seed_offset)


def upstream(case: dict, device, seed_offset: int = 0):
    """Incoming gradients dO [B, T, H, V] (exact in the input dtype, so ours and the reference see
    the same numbers) and dS [B, H, K, V] (exact in float32), as float64 on device."""
    gen = torch.Generator().manual_seed(10_000 + case["seed"] + seed_offset)
    B, T, H, K, V = (case[n] for n in "BTHKV")
    dO = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64).to(dtype_of(case["dtype"])).double()
    dS = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64).float().double()
    return dO.to(device), dS.to(device)


def triton_fn(case: dict):
    import linattn.triton as lt
    op = VARIANTS[case["variant"]][0]
    fn = getattr(lt, op)
    kw = {"chunk_size": case["chunk_size"]}
    if op == "gla" and case["sub_chunk_size"] is not None:
        kw["sub_chunk_size"] = case["sub_chunk_size"]
    return lambda **a: fn(**a, **kw)


def reference_fn(case: dict, reference: str = "naive"):
    op = VARIANTS[case["variant"]][0]
    if reference == "chunk":
        from .. import chunk
        return getattr(chunk, op)
    return getattr(naive, op)


def grads(fn, args: dict, dO, dS, *, final: bool, dht: bool, loss_on=None):
    """(o, S, {input name: gradient}) of Σ o·dO [+ Σ S·dS] through fn; loss_on(o) → the part of o
    the loss reads (default all of it)."""
    leaves = {n: args[n].detach().clone().requires_grad_(True) for n in NAMES if n in args}
    o, S = fn(**{**args, **leaves}, output_final_state=final)
    part = o if loss_on is None else loss_on(o)
    dpart = dO if loss_on is None else loss_on(dO)
    loss = (part.double() * dpart).sum()
    if dht:
        loss = loss + (S.double() * dS).sum()
    loss.backward()
    return o, S, {n: x.grad for n, x in leaves.items()}


def ours(case, args, dO, dS, *, final=None, dht=None, fn=None, loss_on=None):
    """Our Triton level under outputs.guarded() and testing.poisoned(): (o, S, grads, guard report)."""
    fn = fn or triton_fn(case)
    final = case["final"] if final is None else final
    dht = case["dht"] if dht is None else dht
    with outputs.guarded() as guards, testing.poisoned():
        o, S, g = grads(fn, args, dO, dS, final=final, dht=dht, loss_on=loss_on)
    sync(o)
    return o, S, g, guards.overwritten()


def reference(case, args, dO, dS, reference="naive", *, loss_on=None):
    """float64 autograd on the same (rounded) inputs: (o, S_final, grads); S always computed."""
    fn = reference_fn(case, reference)
    kw = {}
    if reference == "chunk":
        kw = {"chunk_size": 64}
    a = testing.to_float64(args)
    return grads(lambda **x: fn(**x, **kw), a, dO, dS, final=True, dht=case["dht"], loss_on=loss_on)


def sync(x):
    if isinstance(x, torch.Tensor) and x.is_cuda:
        torch.cuda.synchronize(x.device)


def decode(case, args):
    """The fused Triton step token by token from the initial state: (o [B, T, H, V], S_T), under
    guards; the state is written in place after the first token, as a decoder does."""
    from ..triton import step
    op = VARIANTS[case["variant"]][0]
    fn = getattr(step, op + "_step")
    state = args.get("initial_state")
    outs = []
    with outputs.guarded() as guards, testing.poisoned():
        for t in range(case["T"]):
            tok = {n: args[n][:, t] for n in ("q", "k", "v", "g", "beta") if n in args}
            o, state = fn(**tok, state=state, inplace=t > 0)
            outs.append(o)
    o = torch.stack(outs, 1)
    sync(o)
    return o, state, guards.overwritten()


def gate_terms(name, args, g_ref) -> float:
    """For the gate's gradient: the size of the terms it sums, ‖q ⊙ dq‖ + ‖k ⊙ dk‖ (float64, the
    reference's gradients), the scale of its error where the exact gradient is 0 (`testing.rel_err`)."""
    if name != "g" or "q" not in g_ref or "k" not in g_ref:
        return 0.0
    return sum((args[n].double().cpu() * g_ref[n].double().cpu()).norm().item() for n in ("q", "k"))


def compare(case, errs, tols, o, S, g, o_ref, S_ref, g_ref, args, prefix=""):
    """Fill errs/tols for one result against the reference; returns dtype problems."""
    dt = dtype_of(case["dtype"])
    bad = []
    errs[prefix + "o"], tols[prefix + "o"] = testing.rel_err(o, o_ref), testing.tolerance(dt)
    if S is not None:
        errs[prefix + "S"], tols[prefix + "S"] = testing.rel_err(S, S_ref), testing.tolerance(dt)
    for n, ref in g_ref.items():
        key = prefix + GRAD_KEY[n]
        got = g.get(n)
        errs[key] = float("inf") if got is None else testing.rel_err(got, ref, scale=gate_terms(n, args, g_ref))
        tols[key] = testing.GRAD_TOLERANCE[dt]
        if got is not None and got.dtype != args[n].dtype:
            bad.append(f"{key} dtype {got.dtype} != {args[n].dtype}")
    return bad


def collapse(lines):
    """Repeated guard reports (one buffer per decoded token, say) as one line with a count."""
    out = {}
    for x in lines:
        out[x] = out.get(x, 0) + 1
    return [x if n == 1 else f"{x} (×{n})" for x, n in out.items()]


def verdict(row):
    failed = [k for k, e in row["err"].items() if not e <= row["tol"][k]]    # NaN fails too
    failed += row.pop("_bad", [])
    if row.get("guards"):
        row["guards"] = collapse(row["guards"])
        failed.append("guard")
    row["failed"] = failed
    row["status"] = "fail" if failed else "pass"
    return row


def run(case: dict, device, *, reference_mode: str = "naive", fla_hook=None) -> dict:
    """One case (regular or property) → result row; see the module doc. fla_hook(row) is called
    with our finished row before FLA runs (the runner records it, so a crash inside FLA is FLA's)."""
    t0 = time.perf_counter()
    row = dict(case)
    try:
        if case.get("check"):
            from . import properties
            properties.run(case, device, row)
            verdict(row)
        else:
            _regular(case, device, row, reference_mode)
            verdict(row)
    except Exception as exc:  # noqa: BLE001  (any failure of a case is its verdict)
        if cuda_broken(exc):
            raise CudaError(f"{type(exc).__name__}: {exc}".split("\n")[0][:500]) from exc
        row.update(status="error", failed=[f"{type(exc).__name__}: {exc}".split("\n")[0][:500]])
    row["seconds"] = round(time.perf_counter() - t0, 3)
    ref = row.pop("_ref", None)
    if case.get("fla") and not case.get("check"):
        if bench.fla_fn(case["variant"]) is None:
            row["fla_result"] = {"status": "absent"}
        else:
            if fla_hook is not None:
                fla_hook(dict(row))
            row["fla_result"] = fla(case, device, ref)
    return row


def _regular(case, device, row, reference_mode):
    args = make(case, device)
    dO, dS = upstream(case, device)
    ref_mode = reference_mode
    if reference_mode == "auto":
        ref_mode = "chunk" if case["T"] > 1024 else "naive"
    t = time.perf_counter()
    o_ref, S_ref, g_ref = reference(case, args, dO, dS, ref_mode)
    sync(o_ref)
    t_ref = time.perf_counter() - t
    t = time.perf_counter()
    o, S, g, bad_guards = ours(case, args, dO, dS)
    t_ours = time.perf_counter() - t
    errs, tols = {}, {}
    row["_bad"] = compare(case, errs, tols, o, S, g, o_ref, S_ref, g_ref, args)
    row["guards"] = bad_guards
    row["reference"] = ref_mode
    row["parts"] = {"reference": round(t_ref, 3), "ours": round(t_ours, 3)}
    if case.get("decode"):
        t = time.perf_counter()
        step_args = {n: a.detach() for n, a in args.items()}
        od, Sd, bad = decode(case, step_args)
        row["guards"] += bad
        dt = dtype_of(case["dtype"])
        errs["decode.o"], tols["decode.o"] = testing.rel_err(od, o_ref), testing.tolerance(dt)
        errs["decode.S"], tols["decode.S"] = testing.rel_err(Sd, S_ref), testing.tolerance(dt)
        row["parts"]["decode"] = round(time.perf_counter() - t, 3)
    row["err"], row["tol"] = errs, tols
    row["_ref"] = (args, dO, dS, o_ref, S_ref, g_ref)


# ---------------------------------------------------------------- FLA beside ours

def fla(case, device, ref) -> dict:
    """FLA on the same inputs, against the same float64 reference: {'status', 'err', 'msg'}."""
    fn = bench.fla_fn(case["variant"])
    if fn is None:
        return {"status": "absent"}
    if ref is None:
        return {"status": "skipped", "msg": "our run did not finish"}
    args, dO, dS, o_ref, S_ref, g_ref = ref
    t = time.perf_counter()
    try:
        o, S, g = grads(fn, args, dO, dS, final=case["final"], dht=case["dht"])
        sync(o)
    except Exception as exc:  # noqa: BLE001  (FLA refusing a case is recorded, not a failure)
        if cuda_broken(exc):
            raise CudaError("FLA: " + f"{type(exc).__name__}: {exc}".split("\n")[0][:500]) from exc
        return {"status": "refused", "msg": f"{type(exc).__name__}: {exc}".split("\n")[0][:300]}
    errs, tols = {}, {}
    compare(case, errs, tols, o, S, g, o_ref, S_ref, g_ref, args)
    return {"status": "ran", "err": errs, "seconds": round(time.perf_counter() - t, 3)}
