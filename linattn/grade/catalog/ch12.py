"""Chapter 12 — the backward pass: the closed-form gate gradient, the reverse-time recurrence, the
chunkwise GLA backward, a torch.autograd.Function of one's own, and the chunkwise delta-rule
backward through the WY/UT transform.

The backward exercises return (dq, dk, dv, dg, dinitial_state) — the delta rule (dq, dk, dv,
dbeta, dinitial_state) — for an incoming output gradient `do` and, where a case passes one, an
incoming final-state gradient `dfinal_state`; their ground truth is float64 autograd through the
naive recurrence. The gate-gradient exercise gets dq and dk from that same float64 backward
(rounded to the case's dtype); its truth is the closed form in float64 on those inputs, which
tests/test_grade_ch12.py checks equals autograd's dg. The Function exercise is graded through
`gradients_through`: the reader's differentiable `(o, final_state)` function, run by autograd.

Tolerance: gradients are graded at 1e-4 in float32 (the library's gradient tolerance): the
closed form's suffix sum over a whole sequence adds up terms that largely cancel under strong
gates (chapter 12, section 5.1, measures it), and a reader may sum it either way.

Diagnoses. Each classic mistake is modelled from the float64 truth: the seed's sign (−dg), a
prefix sum where the suffix sum belongs (the same per-token terms, recovered as differences of
the true dg, summed the other way), the final-state term left out (the truth without
dfinal_state), an off-by-one state (dq reading the state after the step or chunk instead of the
one before), and an overflowing e^b · e^{−b} (non-finite exactly where the absorbed products
overflow float32, the truth elsewhere). For the delta rule the chain through (I + A)⁻¹ is modelled
by autograd through a chunk-form forward in which one path is flipped or cut.
"""
from __future__ import annotations

import random

import torch

from ... import chunk, naive, testing
from ...naive import backward
from ...validate import check_inputs
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
# The delta rule: (B, T, H, K, V, dtype, initial_state, final-state gradient).
DELTA_SHAPES = [
    (1, 37, 2, 16, 16, F32, True, True),
    (2, 45, 1, 8, 16, F32, False, True),
    (1, 40, 2, 8, 8, F64, True, False),
    (1, 9, 1, 8, 8, F32, True, True),
    (2, 33, 2, 8, 12, F32, False, False),
]


def _acc(dtype):
    return F64 if dtype == F64 else F32


def _note(B, T, H, K, V, dtype, init, dfinal):
    return (f"B={B} T={T} H={H} K={K} V={V} {str(dtype).replace('torch.', '')}"
            + (", initial state" if init else "") + (", final-state gradient" if dfinal else ""))


def _setting(seed, i, shape):
    B, T, H, K, V, dtype, gate, strength, init, dfinal = shape
    T = max(1, T + random.Random(seed * 7 + i).randint(-3, 3))
    kw = testing.make_inputs("gla", B=B, T=T, H=H, K=K, V=V, dtype=dtype, gate=gate,
                             strength=strength, initial_state=init, seed=seed * 31 + i)
    _gradients_in(kw, seed * 31 + i + 1, dtype, dfinal)
    note = (f"B={B} T={T} H={H} K={K} V={V} {str(dtype).replace('torch.', '')}, {gate} gates "
            f"({strength})" + (", initial state" if init else "")
            + (", final-state gradient" if dfinal else ""))
    return kw, note, dtype


def _gradients_in(kw, seed, dtype, dfinal):
    """The incoming gradients: do [B, T, H, V] and, if asked, dfinal_state [B, H, K, V] (S_T's dtype)."""
    B, T, H, K = kw["q"].shape
    V = kw["v"].shape[-1]
    gen = torch.Generator().manual_seed(seed)
    kw["do"] = torch.randn(B, T, H, V, generator=gen).to(dtype)
    if dfinal:
        kw["dfinal_state"] = torch.randn(B, H, K, V, generator=gen).to(_acc(dtype))


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


def function_cases(seed):
    """The backward cases without chunk_size: what a differentiable GLA is called with, plus do."""
    return backward_cases(seed)


def delta_cases(seed):
    """Delta-rule backward cases: q, k (L2-normalised), v, beta, do (+ initial_state,
    dfinal_state, scale), chunk_size = CHUNK."""
    cases = []
    for i, (B, T, H, K, V, dtype, init, dfinal) in enumerate(DELTA_SHAPES):
        T = max(1, T + random.Random(seed * 5 + i).randint(-3, 3))
        kw = testing.make_inputs("delta_rule", B=B, T=T, H=H, K=K, V=V, dtype=dtype,
                                 initial_state=init, seed=seed * 37 + i)
        _gradients_in(kw, seed * 37 + i + 1, dtype, dfinal)
        note = _note(B, T, H, K, V, dtype, init, dfinal)
        if i == 1:
            kw["scale"] = 0.5
            note += ", scale=0.5"
        kw["chunk_size"] = CHUNK
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


# ---------------------------------------------------------------- references and truths
def _autograd(fn, tensors, do, dfinal_state, **options):
    """(o, S, gradients of the tensors in order) of <o, do> + <S, dS> through fn(**tensors, ...)."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in tensors.items() if x is not None}
    o, S = fn(**{**tensors, **leaves}, **options)
    outs, douts = [o], [do]
    if dfinal_state is not None:
        outs.append(S)
        douts.append(dfinal_state.to(S.dtype))
    grads = dict(zip(leaves, torch.autograd.grad(outs, list(leaves.values()), douts)))
    return o.detach(), S.detach(), tuple(grads.get(n) for n in tensors)


def _gla_grads(fn, q, k, v, g, do, scale, initial_state, dfinal_state, **options):
    o, S, grads = _autograd(fn, dict(q=q, k=k, v=v, g=g, initial_state=initial_state), do,
                            dfinal_state, scale=scale, output_final_state=True, **options)
    return o, S, grads


def autograd_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None):
    """The ground truth: autograd through the naive GLA recurrence (run it on float64 inputs)."""
    return _gla_grads(naive.gla, q, k, v, g, do, scale, initial_state, dfinal_state)[2]


def recurrent_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None):
    """The library's reverse-time recurrence, as the exercise's tuple."""
    r = backward.gla_backward(q, k, v, g, do, scale=scale, initial_state=initial_state,
                              dfinal_state=dfinal_state)
    return r["dq"], r["dk"], r["dv"], r["dg"], r["dinitial_state"]


def chunk_backward(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None,
                   chunk_size=64):
    """The library's chunkwise backward (chunk.gla's autograd.Function), as the exercise's tuple."""
    return _gla_grads(chunk.gla, q, k, v, g, do, scale, initial_state, dfinal_state,
                      chunk_size=chunk_size)[2]


def gradients_through(fn):
    """A differentiable GLA `fn(q, k, v, g, *, scale=None, initial_state=None) -> (o, final_state)`
    turned into what the Function exercise grades: (q, k, v, g, do, *, scale=None,
    initial_state=None, dfinal_state=None) -> (o, final_state, dq, dk, dv, dg, dinitial_state),
    the gradients by autograd — that is, by fn's own backward."""
    def graded(q, k, v, g, do, *, scale=None, initial_state=None, dfinal_state=None):
        o, S, grads = _autograd(lambda **kw: fn(**kw), dict(q=q, k=k, v=v, g=g, initial_state=initial_state),
                                do, dfinal_state, scale=scale)
        return (o, S, *grads)
    return graded


def gla_function(q, k, v, g, do=None, *, scale=None, initial_state=None, dfinal_state=None):
    """The library's differentiable GLA (chunk.gla, whose backward is an autograd.Function).

    Called as the reader's function is called — without `do` — it returns (o, final_state) with
    the library's backward attached. Called with `do`, as the grader calls the graded function, it
    returns what `gradients_through` makes of itself."""
    if do is None:
        return chunk.gla(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=True)
    return gradients_through(gla_function)(q, k, v, g, do, scale=scale, initial_state=initial_state,
                                           dfinal_state=dfinal_state)


def _naive_gla(q, k, v, g, *, scale=None, initial_state=None):
    return naive.gla(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=True)


function_truth = gradients_through(_naive_gla)


def delta_truth(q, k, v, beta, do, *, scale=None, initial_state=None, dfinal_state=None):
    """The ground truth: autograd through the naive delta rule (run it on float64 inputs)."""
    return _autograd(naive.delta_rule, dict(q=q, k=k, v=v, beta=beta, initial_state=initial_state),
                     do, dfinal_state, scale=scale, output_final_state=True)[2]


def chunk_delta_backward(q, k, v, beta, do, *, scale=None, initial_state=None, dfinal_state=None,
                         chunk_size=64):
    """The library's chunkwise delta-rule backward (chunk.delta_rule's Function), as a tuple."""
    return _autograd(chunk.delta_rule, dict(q=q, k=k, v=v, beta=beta, initial_state=initial_state),
                     do, dfinal_state, scale=scale, output_final_state=True,
                     chunk_size=chunk_size)[2]


# ---------------------------------------------------------------- models of the classic mistakes
# Each takes the case's arguments and returns what a reader making the mistake returns: computed
# in float64 from the truth, given back in the inputs' dtypes.
def _typed(grads, kw, names):
    """The float64 gradients in the dtypes of the inputs they belong to (None stays None)."""
    return tuple(None if x is None or kw.get(n) is None else x.to(kw[n].dtype)
                 for x, n in zip(grads, names))


GLA_NAMES = ("q", "k", "v", "g", "initial_state")


def _gla_truth(kw, **change):
    a = testing.to_float64({**kw, **change})
    return list(autograd_backward(a["q"], a["k"], a["v"], a["g"], a["do"], scale=a.get("scale"),
                                  initial_state=a.get("initial_state"),
                                  dfinal_state=a.get("dfinal_state")))


def _differences(dg, spans):
    """The per-token terms ∂L/∂b_t whose suffix sums (inside each span) the true dg is."""
    db = dg.clone()
    for s, e in spans:
        db[:, s:e - 1] -= dg[:, s + 1:e]
    return db


def _prefix(dg, spans):
    db = _differences(dg, spans)
    return torch.cat([db[:, s:e].cumsum(1) for s, e in spans], 1)


def _spans(T, C=None):
    C = C or T
    return [(s, min(s + C, T)) for s in range(0, T, C)]


def _flip_gate_sign(**kw):
    d = _gla_truth(kw)
    d[3] = -d[3]
    return _typed(d, kw, GLA_NAMES)


def _without_final(**kw):
    return _typed(_gla_truth(kw, dfinal_state=None), kw, GLA_NAMES)


def _prefix_sum(chunked):
    def model(**kw):
        d = _gla_truth(kw)
        d[3] = _prefix(d[3], _spans(kw["q"].shape[1], kw.get("chunk_size") if chunked else None))
        return _typed(d, kw, GLA_NAMES)
    return model


def _states(a, beta=None):
    """Every state S_0 … S_T [T + 1, B, H, K, V] of the float64 forward (the library's walk)."""
    d = check_inputs(a["q"], a["k"], a["v"], g=a.get("g"), beta=beta, scale=a.get("scale"),
                     initial_state=a.get("initial_state"), gate=a.get("g") is not None,
                     delta=beta is not None)
    return backward.states(a["q"], a["k"], a["v"], a.get("g"), beta, d, a.get("initial_state")), d


def _dq_reads_state_after(**kw):
    """Token by token: dq_t = scale · do_t S_{t−1}ᵀ read as the stored S[t] of S_0 … S_T."""
    a = testing.to_float64(kw)
    d = _gla_truth(kw)
    S, dims = _states(a)
    d[0] = dims.scale * torch.einsum("bthv,tbhkv->bthk", a["do"], S[:-1])
    return _typed(d, kw, GLA_NAMES)


def _chunk_state_shift(a, beta=None):
    """Per token, scale · Λ_t ⊙ (do_t (S_[n] − S_[n−1])ᵀ): what dq gains by reading the state
    after its chunk instead of the one entering it (Λ = 1 without gates)."""
    S, dims = _states(a, beta)
    T, C = dims.T, a["chunk_size"]
    shift = torch.zeros_like(a["q"])
    for s, e in _spans(T, C):
        diff = S[e] - S[s]                                            # [B, H, K, V]
        shift[:, s:e] = dims.scale * torch.einsum("bthv,bhkv->bthk", a["do"][:, s:e], diff)
        if a.get("g") is not None:
            g = a["g"][:, s:e]
            shift[:, s:e] *= (g if g.dim() == 4 else g[..., None]).cumsum(1).exp()
    return shift


def _dq_reads_chunk_state_after(**kw):
    """Chunkwise: the read term of dq uses S_[n] instead of S_[n−1]; the closed-form dg, taken
    from that dq, follows it (q ⊙ Δdq, summed from the end of the chunk)."""
    a = testing.to_float64(kw)
    d = _gla_truth(kw)
    shift = _chunk_state_shift(a)
    d[0] = d[0] + shift
    ddb = a["q"] * shift
    ddb = ddb.sum(-1) if a["g"].dim() == 3 else ddb
    d[3] = d[3] + torch.cat([ddb[:, s:e].flip(1).cumsum(1).flip(1)
                             for s, e in _spans(a["q"].shape[1], a["chunk_size"])], 1)
    return _typed(d, kw, GLA_NAMES)


def _without_chunk_state_term(**kw):
    """Chunkwise dg restarted at every chunk without rowsum(S_[n] ⊙ dS_[n]) at the chunk's end."""
    a = testing.to_float64(kw)
    d = _gla_truth(kw)
    S, dims = _states(a)
    for s, e in _spans(dims.T, a["chunk_size"]):
        if e == dims.T:
            dS = a.get("dfinal_state")
        else:   # the gradient reaching the state after the chunk: that of the rest's initial state
            dS = backward.gla_backward(*(a[n][:, e:] for n in ("q", "k", "v", "g", "do")),
                                       scale=a.get("scale"), initial_state=S[e],
                                       dfinal_state=a.get("dfinal_state"))["dinitial_state"]
        if dS is not None:
            term = (S[e] * dS).sum(-1)                                # [B, H, K]
            d[3][:, s:e] -= (term.sum(-1) if a["g"].dim() == 3 else term)[:, None]
    return _typed(d, kw, GLA_NAMES)


def _absorbed_overflow(**kw):
    """dq, dk through e^{b} and e^{−b} in the case's dtype: non-finite wherever those products
    overflow (and so dg, wherever its in-chunk suffix sum meets them); the truth elsewhere."""
    d = _gla_truth(kw)
    q, k, v, g, do = (kw[n].to(_acc(kw["q"].dtype)) for n in ("q", "k", "v", "g", "do"))
    g = g if g.dim() == 4 else g[..., None].expand_as(q)
    bad_q, bad_k = torch.zeros_like(q, dtype=torch.bool), torch.zeros_like(q, dtype=torch.bool)
    for s, e in _spans(q.shape[1], kw["chunk_size"]):
        b = g[:, s:e].cumsum(1).transpose(1, 2)                       # [B, H, c, K]
        dP = (do[:, s:e].transpose(1, 2) @ v[:, s:e].transpose(1, 2).transpose(-1, -2)).tril()
        qc, kc = q[:, s:e].transpose(1, 2), k[:, s:e].transpose(1, 2)
        with torch.no_grad():
            dq_abs = b.exp() * (dP @ (kc * (-b).exp()))
            dk_abs = (-b).exp() * (dP.transpose(-1, -2) @ (qc * b.exp()))
        bad_q[:, s:e] = ~torch.isfinite(dq_abs).transpose(1, 2)
        bad_k[:, s:e] = ~torch.isfinite(dk_abs).transpose(1, 2)
    bad_b = bad_q | bad_k
    bad_g = bad_b.any(-1) if kw["g"].dim() == 3 else bad_b
    bad_g = torch.cat([bad_g[:, s:e].flip(1).cummax(1).values.flip(1)
                       for s, e in _spans(q.shape[1], kw["chunk_size"])], 1)
    nan = float("nan")
    d[0], d[1], d[3] = d[0].masked_fill(bad_q, nan), d[1].masked_fill(bad_k, nan), d[3].masked_fill(bad_g, nan)
    return _typed(d, kw, GLA_NAMES)


SIGN = ("take the seed's sign, k ⊙ dk − q ⊙ dq (the gradient with respect to −b): the gate enters "
        "+ on the query side, − on the key side", _flip_gate_sign)
PREFIX = ("sum ∂L/∂b from the start (a prefix sum): g_t is inside every b_s with s ≥ t, so dg_t "
          "sums from t to the END — x.flip(1).cumsum(1).flip(1)", _prefix_sum(False))
PREFIX_CHUNK = ("sum ∂L/∂b from the chunk's start (a prefix sum): inside each chunk dg sums from "
                "t to the chunk's END", _prefix_sum(True))
FINAL = ("leave out the final-state term: a gradient arriving at S_T (dfinal_state) is where the "
         "reverse pass starts, and it adds rowsum(S_T ⊙ dS_T) to ∂L/∂b at the last step",
         _without_final)
OFF_BY_ONE = ("read the state before the step for dq (the stored S[t] when row t is step t + 1): "
              "o_t = scale · q_t S_t reads the state AFTER step t's write — S[t + 1]; only the gate "
              "gradient reads the state before it", _dq_reads_state_after)
OFF_BY_ONE_CHUNK = ("read the state after the chunk, S_[n], for dq: the read term is "
                    "scale · Λ_i ⊙ (dO_i S_[n−1]ᵀ), with the state ENTERING the chunk",
                    _dq_reads_chunk_state_after)
CHUNK_TERM = ("restart the gate gradient at every chunk without rowsum(S_[n] ⊙ dS_[n]) at the "
              "chunk's last position: a token's gate decays everything after it, across chunk "
              "borders, and that term carries it", _without_chunk_state_term)
OVERFLOW = ("absorb the decay as e^{b} and e^{−b} (q ⊙ e^{b}, k ⊙ e^{−b}): e^{−b} OVERFLOWS float32 "
            "once b < −88.7 inside a chunk (strong gates get there in a few tokens), and inf · 0 = "
            "NaN — keep e^{b_i − b_j} in log space, masked to −inf above the diagonal before exp",
            _absorbed_overflow)


# ---------------------------------------------------------------- the delta rule's mistakes
DELTA_NAMES = ("q", "k", "v", "beta", "initial_state")


def _delta_truth(kw, **change):
    a = testing.to_float64({**kw, **change})
    return list(delta_truth(a["q"], a["k"], a["v"], a["beta"], a["do"], scale=a.get("scale"),
                            initial_state=a.get("initial_state"), dfinal_state=a.get("dfinal_state")))


def _delta_without_final(**kw):
    return _typed(_delta_truth(kw, dfinal_state=None), kw, DELTA_NAMES)


def _delta_dq_reads_state_after(**kw):
    a = testing.to_float64(kw)
    d = _delta_truth(kw)
    d[0] = d[0] + _chunk_state_shift(a, beta=a["beta"])
    return _typed(d, kw, DELTA_NAMES)


def _wy_forward(q, k, v, beta, S, scale, path):
    """One chunk of the delta rule in WY/UT form, [B, H, c, ·], with one gradient path altered:
    'A+' the gradient through A flipped (its value kept), 'betaA' β's place in A cut."""
    kk = (k @ k.transpose(-1, -2)).tril(-1)
    bA = beta.detach() if path == "betaA" else beta
    A = bA[..., None] * kk
    if path == "A+":
        A = 2 * A.detach() - A                                        # same value, gradient −dA
    eye = torch.eye(q.shape[-2], dtype=q.dtype)
    U = torch.linalg.solve_triangular(eye + A, beta[..., None] * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(eye + A, beta[..., None] * k, upper=False, unitriangular=True)
    Vt = U - W @ S
    o = scale * (q @ S + (q @ k.transpose(-1, -2)).tril() @ Vt)
    return o, S + k.transpose(-1, -2) @ Vt


def _wy_model(path):
    def model(**kw):
        a = testing.to_float64(kw)
        B, T, H, K = a["q"].shape
        scale = K ** -0.5 if a.get("scale") is None else a["scale"]

        def run(q, k, v, beta, initial_state=None, **_):
            S = torch.zeros(B, H, K, v.shape[-1], dtype=F64) if initial_state is None else initial_state
            qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
            bs, outs = beta.transpose(1, 2), []
            for s, e in _spans(T, a["chunk_size"]):
                o, S = _wy_forward(qs[:, :, s:e], ks[:, :, s:e], vs[:, :, s:e], bs[:, :, s:e], S, scale, path)
                outs.append(o)
            return torch.cat(outs, 2).transpose(1, 2), S

        grads = _autograd(run, {n: a.get(n) for n in DELTA_NAMES}, a["do"], a.get("dfinal_state"))[2]
        return _typed(grads, kw, DELTA_NAMES)
    return model


DELTA_FINAL = ("ignore the incoming final-state gradient: the reverse pass over the chunks starts "
               "from dfinal_state, not from zero", _delta_without_final)
DELTA_OFF_BY_ONE = ("read the state after the chunk for dq: the query reads the state ENTERING its "
                    "chunk, scale · dO S_[n−1]ᵀ", _delta_dq_reads_state_after)
INVERSE_SIGN = ("drop the minus sign of the inverse's gradient: from d𝒯 = −𝒯 dA 𝒯, dA = "
                "−tril₋₁(dY_U Uᵀ + dY_W Wᵀ)", _wy_model("A+"))
BETA_IN_A = ("leave out β's third place, A = diag(β) A^kk: dβ_i collects Σ_j dA_ij A^kk_ij too",
             _wy_model("betaA"))


def _through_function(mistake):
    """A backward exercise's mistake as the Function exercise returns it: the forward's (o, S) and
    the mistaken gradients of a backward that chunks as the workbook's default does (64 tokens)."""
    what, model = mistake

    def made(**kw):
        a = testing.to_float64(kw)
        o, S = _naive_gla(a["q"], a["k"], a["v"], a["g"], scale=a.get("scale"),
                          initial_state=a.get("initial_state"))
        return (o.to(kw["v"].dtype), S.to(_acc(kw["q"].dtype)), *model(**kw, chunk_size=64))
    return what, made


FUNCTION_FINAL = _through_function(
    ("drop the gradient arriving at the final state: backward(ctx, do, dS) gets it as its second "
     "argument — pass it to your backward as dfinal_state", _without_final))
FUNCTION_MISTAKES = (FUNCTION_FINAL, *map(_through_function, (OVERFLOW, OFF_BY_ONE_CHUNK, SIGN,
                                                               PREFIX_CHUNK)))


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
        diagnoses=(
            (SIGN[0], lambda **kw: -backward.gate_grad_closed_form(**testing.to_float64(kw)).to(kw["g"].dtype)),
            (PREFIX[0], lambda **kw: _prefix(backward.gate_grad_closed_form(**testing.to_float64(kw)),
                                             _spans(kw["q"].shape[1])).to(kw["g"].dtype)),
            (FINAL[0], lambda **kw: backward.gate_grad_closed_form(
                **testing.to_float64({**kw, "final_state": None, "dfinal_state": None})).to(kw["g"].dtype)),
        ),
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
        hint="Keep S[0] … S[T] (S[t] = the state after step t); for row t = T−1 … 0 (step t + 1): "
             "dS += scale·q_tᵀ do_t; dq_t = scale·do_t S[t+1]ᵀ (after the write); dk_t = v_t dSᵀ; "
             "dv_t = k_t dS; dg_t = e^{g_t} ⊙ rowsum(S[t] ⊙ dS) (before it); dS ← diag(e^{g_t}) dS. "
             "Start from dfinal_state (or zeros); the last dS is dinitial_state.",
        diagnoses=(OFF_BY_ONE, FINAL, SIGN, PREFIX),
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
        diagnoses=(OVERFLOW, OFF_BY_ONE_CHUNK, CHUNK_TERM, FINAL, SIGN, PREFIX_CHUNK, PREFIX),
    ),
    Exercise(
        name="ch12.autograd_function",
        chapter=12,
        title="Your own torch.autograd.Function: the library's forward, your backward",
        signature="gla_function(q, k, v, g, *, scale=None, initial_state=None) -> (o, final_state), "
                  "differentiable through your Function; graded as gradients_through(gla_function)"
                  "(q, k, v, g, do, ...) -> (o, final_state, dq, dk, dv, dg, dinitial_state)",
        reference=gla_function,
        truth=function_truth,
        cases=function_cases,
        tol=GRAD_TOL,
        outputs=("o", "final_state") + GRADS,
        hint="forward(ctx, q, k, v, g, initial_state, scale): o, S = linattn.chunk.gla(..., "
             "output_final_state=True) (autograd is off inside forward), ctx.save_for_backward(q, "
             "k, v, g, initial_state), ctx.scale = scale, return o, S; backward(ctx, do, dS): your "
             "chunk_gla_backward(..., dfinal_state=dS) — one gradient per forward input, None for scale.",
        diagnoses=FUNCTION_MISTAKES,
    ),
    Exercise(
        name="ch12.delta_backward",
        chapter=12,
        title="The delta rule's chunkwise backward, through the WY/UT transform",
        signature="chunk_delta_backward(q, k, v, beta, do, *, scale=None, initial_state=None, "
                  "dfinal_state=None, chunk_size=64) -> (dq, dk, dv, dbeta, dinitial_state)",
        reference=chunk_delta_backward,
        truth=delta_truth,
        cases=delta_cases,
        tol=GRAD_TOL,
        outputs=("dq", "dk", "dv", "dbeta", "dinitial_state"),
        hint="Per chunk: dṼ = Aqkᵀ dO + K dS', dS = Qᵀ dO − Wᵀ dṼ + dS'; dU = dṼ, dW = −dṼ Sᵀ; "
             "dY_U = 𝒯ᵀ dU, dY_W = 𝒯ᵀ dW, dA = −tril₋₁(dY_U Uᵀ + dY_W Wᵀ); dβ from U, W and A; "
             "dk from Aqk's columns, A^kk's rows and columns, W and the write (dO carries scale).",
        diagnoses=(DELTA_FINAL, DELTA_OFF_BY_ONE, INVERSE_SIGN, BETA_IN_A),
    ),
]
