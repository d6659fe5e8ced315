"""Properties of the Triton level, checked natively on small shapes (the case's `check`):

    causality      a loss on the outputs before t: its gradients of the tokens before t (and of the
                   initial state) do not change when the tokens from t on are replaced, neither do
                   the outputs before t, and every gradient of a token from t on is zero
    prefix_suffix  [0, t) with output_final_state, then [t, T) from that state = the whole sequence:
                   outputs, final state, and every gradient through the chained pair of calls
    batch_rows     each batch row alone = that row of the batch (outputs, final state, gradients)
    chunk_size     every chunk size (and GLA sub-chunk size) the level accepts gives the float64
                   reference's outputs and gradients to tolerance
(decode steps = whole sequence runs inside every regular case: case.decode.)

Each fills row['err'] / row['tol'] with keys '<what>.<tensor>' and row['guards']; the verdict is
case.verdict's. Outputs are compared to the dtype's tolerance, gradients to its gradient tolerance;
where the two runs should agree exactly (the same kernels on the same numbers), the row records
whether they did ('identical').
"""
from __future__ import annotations

import torch

from .. import outputs, testing
from . import case as C
from .matrix import chunk_options


def run(case, device, row):
    row["err"], row["tol"], row["guards"], row["identical"] = {}, {}, [], {}
    {"causality": causality, "prefix_suffix": prefix_suffix, "batch_rows": batch_rows,
     "chunk_size": chunk_size}[case["check"]](case, device, row)


def _tols(case):
    dt = C.dtype_of(case["dtype"])
    return testing.tolerance(dt), testing.GRAD_TOLERANCE[dt]


def _err(got, ref):
    """testing.rel_err, with a missing gradient (None) as an infinite error."""
    return float("inf") if got is None or ref is None else testing.rel_err(got, ref)


def _put(row, key, err, tol):
    row["err"][key], row["tol"][key] = err, tol


def causality(case, device, row):
    T = case["T"]
    t = T * 2 // 5 + 1                                                  # not a chunk boundary
    a = C.make(case, device)
    other = C.make(case, device, seed_offset=7919)
    b = {n: x.clone() for n, x in a.items()}
    for n in b:
        if n != "initial_state":
            b[n][:, t:] = other[n][:, t:]                               # the future, replaced
    dO, dS = C.upstream(case, device)
    before = lambda x: x[:, :t]                                        # noqa: E731
    o1, _, g1, bad1 = C.ours(case, a, dO, dS, final=False, dht=False, loss_on=before)
    o2, _, g2, bad2 = C.ours(case, b, dO, dS, final=False, dht=False, loss_on=before)
    row["guards"] += bad1 + bad2
    tol, gtol = _tols(case)
    _put(row, "causality.o<t", testing.rel_err(o2[:, :t], o1[:, :t]), tol)
    row["identical"]["o<t"] = bool(torch.equal(o1[:, :t], o2[:, :t]))
    for n, x in g1.items():
        k = C.GRAD_KEY[n]
        if x is None or g2[n] is None:                                  # a gradient not computed
            _put(row, f"causality.{k}", float("inf"), gtol)
            continue
        if n == "initial_state":
            _put(row, f"causality.{k}", _err(g2[n], x), gtol)
            continue
        _put(row, f"causality.{k}<t", testing.rel_err(g2[n][:, :t], x[:, :t]), gtol)
        # a loss on outputs before t has no gradient from t on: its size against the earlier part
        scale = x[:, :t].double().norm().item() or 1.0
        for tag, y in (("a", x), ("b", g2[n])):
            late = y[:, t:].double()
            _put(row, f"causality.{k}>=t.{tag}", (late.norm().item() / scale) if torch.isfinite(late).all()
                 else float("inf"), gtol)


def _whole(case, device, row):
    """The case's inputs, upstream gradients and our whole-sequence result (o, S, gradients)."""
    a = C.make(case, device)
    dO, dS = C.upstream(case, device)
    o, S, g, bad = C.ours(case, a, dO, dS, final=True, dht=True)
    row["guards"] += bad
    return a, dO, dS, (o, S, g)


def prefix_suffix(case, device, row):
    a, dO, dS, (o, S, g) = _whole(case, device, row)
    tol, gtol = _tols(case)
    fn = C.triton_fn(case)
    for t in sorted({case["chunk_size"], case["T"] * 3 // 8 + 1}):      # a chunk boundary, and not
        if not 0 < t < case["T"]:
            continue
        leaves = {n: x.detach().clone().requires_grad_(True) for n, x in a.items()}
        with outputs.guarded() as guards, testing.poisoned():
            first = {n: x[:, :t] for n, x in leaves.items() if n != "initial_state"}
            second = {n: x[:, t:] for n, x in leaves.items() if n != "initial_state"}
            o1, S1 = fn(**first, initial_state=leaves.get("initial_state"), output_final_state=True)
            o2, S2 = fn(**second, initial_state=S1, output_final_state=True)
            oc = torch.cat([o1, o2], 1)
            ((oc.double() * dO).sum() + (S2.double() * dS).sum()).backward()
        C.sync(oc)
        row["guards"] += guards.overwritten()
        _put(row, f"split@{t}.o", testing.rel_err(oc, o.double()), tol)
        _put(row, f"split@{t}.S", testing.rel_err(S2, S.double()), tol)
        for n, x in g.items():
            _put(row, f"split@{t}.{C.GRAD_KEY[n]}", _err(leaves[n].grad, x), gtol)


def batch_rows(case, device, row):
    a, dO, dS, (o, S, g) = _whole(case, device, row)
    tol, gtol = _tols(case)
    same = True
    for b in range(case["B"]):
        one = {n: x[b:b + 1].contiguous() for n, x in a.items()}
        ob, Sb, gb, bad = C.ours(case, one, dO[b:b + 1], dS[b:b + 1], final=True, dht=True)
        row["guards"] += bad
        _put(row, f"row{b}.o", testing.rel_err(ob, o[b:b + 1]), tol)
        _put(row, f"row{b}.S", testing.rel_err(Sb, S[b:b + 1]), tol)
        same &= torch.equal(ob, o[b:b + 1]) and torch.equal(Sb, S[b:b + 1])
        for n, x in gb.items():
            _put(row, f"row{b}.{C.GRAD_KEY[n]}", _err(x, g[n][b:b + 1] if g[n] is not None else None), gtol)
            same &= x is not None and g[n] is not None and torch.equal(x, g[n][b:b + 1])
    row["identical"]["rows"] = bool(same)


def chunk_size(case, device, row):
    a = C.make(case, device)
    dO, dS = C.upstream(case, device)
    o_ref, S_ref, g_ref = C.reference(case, a, dO, dS)
    for chunk, sub in chunk_options(case["variant"], case["dtype"]):
        c = dict(case, chunk_size=chunk, sub_chunk_size=sub)
        o, S, g, bad = C.ours(c, a, dO, dS, final=True, dht=True)
        row["guards"] += bad
        errs, tols = {}, {}
        row.setdefault("_bad", []).extend(
            C.compare(c, errs, tols, o, S, g, o_ref, S_ref, g_ref, a, prefix=f"C={chunk}" + (f",c={sub}." if sub else ".")))
        row["err"].update(errs)
        row["tol"].update(tols)

