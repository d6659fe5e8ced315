"""FLA's input options (linattn.prepare): use_qk_l2norm_in_kernel, use_gate_in_kernel with A_log,
dt_bias and lower_bound, use_beta_sigmoid_in_kernel and allow_neg_eigval. Each must give exactly what
doing it outside gives — outputs, final states and the gradients of the raw inputs and of A_log and
dt_bias — at every level; the formulas below are written out here, independently of the library's."""
import math

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import device, testing
from linattn.validate import InputError

DEV = device.default_device()
LEVELS = ["naive", "chunk", "triton"]
B, T, H, K, V = 1, 37, 2, 16, 16


def raw_inputs(per_dim=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V),
             g=r(B, T, H, K) if per_dim else r(B, T, H), beta=r(B, T, H),
             A_log=torch.log(torch.rand(H, generator=g, dtype=torch.float64) * 15 + 1),
             dt_bias=r(H * K) * 0.5 if per_dim else r(H) * 0.5,
             initial_state=r(B, H, K, V) * 0.1)
    return {n: t.to(DEV, dtype if n not in ("A_log", "dt_bias") else torch.float32) for n, t in x.items()}


def outside(x, *, lower_bound=None, with_A=True, neg=False):
    """The options written out by hand, in float64."""
    w = {n: t.double() for n, t in x.items()}
    nrm = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    per_dim = w["g"].dim() == 4
    bias = w["dt_bias"].view(H, K) if per_dim else w["dt_bias"]
    a = w["A_log"].exp().view((1, 1, H, 1) if per_dim else (1, 1, H)) if with_A else None
    z = w["g"] + bias
    if lower_bound is None:
        g = -a * F.softplus(z)
    else:
        g = lower_bound * torch.sigmoid(a * z if with_A else z)
    beta = torch.sigmoid(w["beta"]) * (2 if neg else 1)
    return nrm(w["q"]), nrm(w["k"]), g, beta


def run_and_grads(fn, leaves, dO, dS):
    o, S = fn(leaves)
    ((o.double() * dO).sum() + (S.double() * dS).sum()).backward()
    return o.detach().double(), S.detach().double(), {n: t.grad.double() for n, t in leaves.items()}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", ["softplus", "lower_bound", "lower_bound_no_A", "per_head"])
def test_kda_options_equal_doing_it_outside(level, case):
    per_dim = case != "per_head"
    dtype = torch.float32 if level == "triton" else torch.float64
    x = raw_inputs(per_dim, dtype)
    lb = -5.0 if case.startswith("lower_bound") else None
    with_A = case != "lower_bound_no_A"
    gen = torch.Generator().manual_seed(1)
    dO = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64).to(DEV)
    dS = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64).to(DEV)

    def inside(l):
        return linattn.kda(l["q"], l["k"], l["v"], l["g"], l["beta"], impl=level, initial_state=l["initial_state"],
                           output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           A_log=l["A_log"] if with_A else None, dt_bias=l["dt_bias"], lower_bound=lb,
                           use_beta_sigmoid_in_kernel=True)

    def by_hand(l):       # the same level and dtype, the options done first (in float64, then rounded)
        q, k, g, beta = outside(l, lower_bound=lb, with_A=with_A)
        return linattn.kda(q.to(dtype), k.to(dtype), l["v"], g.float() if level == "triton" else g, beta.to(dtype),
                           impl=level, initial_state=l["initial_state"], output_final_state=True)

    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items() if with_A or n != "A_log"}
    ref_leaves = {n: x[n].clone().requires_grad_(True) for n in leaves}
    o, S, got = run_and_grads(inside, leaves, dO, dS)
    o_r, S_r, want = run_and_grads(by_hand, ref_leaves, dO, dS)
    tol = testing.tolerance(dtype)
    assert testing.rel_err(o, o_r) <= tol and testing.rel_err(S, S_r) <= tol
    for n in want:        # A_log and dt_bias are float32 parameters: their gradients are float32
        lim = max(4 * tol, testing.tolerance(x[n].dtype))
        if level == "triton" and n in ("A_log", "dt_bias"):
            # sums over the tokens (and keys) of terms of both signs, |Σ| far below Σ|terms|: the
            # float32 kernels' dg differences (two float32 roundings of the same gate) grow by that
            lim = 1e-3
        assert testing.rel_err(got[n], want[n]) <= lim, f"d{n}: {testing.rel_err(got[n], want[n]):.2e}"


@pytest.mark.parametrize("neg", [False, True])
def test_delta_rule_options_equal_doing_it_outside(neg):
    x = raw_inputs()
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "beta")}
    o = linattn.delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], impl="chunk",
                           use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)[0]
    ref = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "beta")}
    q, k, _, beta = outside(dict(x, **ref), neg=neg)
    o_r = linattn.delta_rule(q, k, ref["v"], beta, impl="naive")[0]
    assert testing.rel_err(o, o_r) <= 1e-12
    w = torch.randn_like(o)
    (o * w).sum().backward()
    (o_r * w).sum().backward()
    for n in leaves:
        assert testing.rel_err(leaves[n].grad, ref[n].grad) <= 1e-10, n


def test_options_do_nothing_unasked():
    x = raw_inputs()
    q = x["q"] / x["q"].norm(dim=-1, keepdim=True)
    k = x["k"] / x["k"].norm(dim=-1, keepdim=True)
    g, beta = -F.softplus(x["g"]), torch.sigmoid(x["beta"])
    a = linattn.kda(q, k, x["v"], g, beta, impl="chunk")[0]
    b = linattn.kda(q, k, x["v"], g, beta, impl="chunk", use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                    use_beta_sigmoid_in_kernel=False)[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("kw, match", [
    (dict(use_gate_in_kernel=True), "A_log"),
    (dict(use_gate_in_kernel=True, A_log="x"), "A_log must be a tensor"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(H + 1)), r"A_log must be a tensor of shape \[H\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(H), dt_bias=torch.zeros(K)), "dt_bias must be"),
    (dict(use_gate_in_kernel=True, lower_bound=5.0), "lower_bound must be a finite negative"),
    (dict(use_gate_in_kernel=True, lower_bound=math.nan), "lower_bound must be a finite negative"),
    (dict(A_log=torch.zeros(H)), "A_log: given without use_gate_in_kernel"),
    (dict(lower_bound=-5.0), "lower_bound: given without use_gate_in_kernel"),
    (dict(allow_neg_eigval=True), "allow_neg_eigval: takes effect only"),
    (dict(use_qk_l2norm_in_kernel=1), "use_qk_l2norm_in_kernel must be True or False"),
])
def test_bad_options_are_named(kw, match):
    x = raw_inputs()
    kw = {n: (v.to(DEV) if torch.is_tensor(v) else v) for n, v in kw.items()}
    with pytest.raises(InputError, match=match):
        linattn.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], impl="chunk", **kw)


def test_options_of_other_ops_are_unknown_keywords():
    x = raw_inputs()
    with pytest.raises(linattn.KeywordError, match="use_gate_in_kernel"):
        linattn.delta_rule(x["q"], x["k"], x["v"], x["beta"], impl="chunk", use_gate_in_kernel=True)
    with pytest.raises(linattn.KeywordError, match="use_qk_l2norm_in_kernel"):
        linattn.gla(x["q"], x["k"], x["v"], -F.softplus(x["g"]), impl="chunk", use_qk_l2norm_in_kernel=True)


def test_options_under_torch_compile():
    """The options are plain PyTorch operations before the op's custom op: no graph break, eager's result."""
    x = raw_inputs(dtype=torch.float32)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
              use_beta_sigmoid_in_kernel=True, impl="chunk")

    def f(q, k, v, g, beta):
        return linattn.kda(q, k, v, g, beta, **kw)[0]

    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True)(*args)
    assert testing.rel_err(compiled, eager) <= testing.tolerance(torch.float32)
