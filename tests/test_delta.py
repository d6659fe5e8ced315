"""Delta rule, Gated DeltaNet and KDA at the naive and chunk levels against the float64 recurrence."""
import pytest
import torch
import torch.nn.functional as F

from linattn import InputError, chunk, naive, testing, validate
from linattn.chunk.delta import unit_lower_inverse

CASES = [  # B, T, H, K, V, chunk_size
    (1, 1, 1, 4, 4, 16),
    (2, 37, 2, 16, 24, 16),     # T not a multiple of C, K != V
    (1, 64, 2, 32, 8, 64),      # exactly one chunk
    (2, 100, 1, 8, 20, 32),     # partial last chunk
]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
GATES = [("per_dim", "normal"), ("per_head", "normal"), ("per_dim", "strong"), ("per_head", "strong")]
# The naive level run on float64 *is* the reference: comparing it with itself checks nothing.
LEVELS_DTYPES = [(lvl, dt) for lvl in ("naive", "chunk") for dt in DTYPES
                 if not (lvl == "naive" and dt == torch.float64)]


def state_tol(dtype):
    return testing.tolerance(torch.float64 if dtype == torch.float64 else torch.float32)


def check(fn, args, ref_fn, dtype, **extra):
    with testing.poisoned():
        o, S = fn(**args, output_final_state=True, **extra)
    o_ref, S_ref = ref_fn(**testing.to_float64(args), output_final_state=True)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert S.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(dtype)
    assert testing.rel_err(S, S_ref) <= state_tol(dtype)


@pytest.mark.parametrize("level,dtype", LEVELS_DTYPES, ids=str)
@pytest.mark.parametrize("B,T,H,K,V,C", CASES)
@pytest.mark.parametrize("init", [False, True], ids=["zero", "init"])
def test_delta_rule_matches_float64(level, B, T, H, K, V, C, dtype, init):
    args = testing.make_inputs("delta_rule", B=B, T=T, H=H, K=K, V=V, dtype=dtype,
                               initial_state=init, seed=T + K)
    extra = {"chunk_size": C} if level == "chunk" else {}
    check(getattr(chunk if level == "chunk" else naive, "delta_rule"), args, naive.delta_rule,
          dtype, **extra)


@pytest.mark.parametrize("level,dtype", [x for x in LEVELS_DTYPES if x[1] != torch.float16], ids=str)
@pytest.mark.parametrize("B,T,H,K,V,C", CASES)
@pytest.mark.parametrize("gate,strength", GATES)
def test_kda_matches_float64(level, B, T, H, K, V, C, gate, strength, dtype):
    args = testing.make_inputs("kda", B=B, T=T, H=H, K=K, V=V, dtype=dtype, gate=gate,
                               strength=strength, initial_state=True, seed=T + K + 1)
    extra = {"chunk_size": C} if level == "chunk" else {}
    check(getattr(chunk if level == "chunk" else naive, "kda"), args, naive.kda, dtype, **extra)


def test_naive_is_the_householder_recurrence():
    """An independent form of the same update: S_t = (I − β kᵀk) S_{t−1} + β kᵀ v, matrices only."""
    a = testing.make_inputs("delta_rule", B=1, T=30, H=1, K=6, V=5, dtype=torch.float64,
                            initial_state=True, seed=3)
    q, k, v, beta = a["q"][0, :, 0], a["k"][0, :, 0], a["v"][0, :, 0], a["beta"][0, :, 0]
    a["initial_state"] = a["initial_state"].double()
    S, outs = a["initial_state"][0, 0].clone(), []
    for t in range(30):
        kt = k[t:t + 1]                                                # [1, K]
        S = (torch.eye(6, dtype=S.dtype) - beta[t] * kt.T @ kt) @ S + beta[t] * kt.T @ v[t:t + 1]
        outs.append(6 ** -0.5 * q[t] @ S)
    o, S_end = naive.delta_rule(**a, output_final_state=True)
    assert testing.rel_err(o[0, :, 0], torch.stack(outs)) < 1e-13
    assert testing.rel_err(S_end[0, 0], S) < 1e-13


def test_kda_reduces_to_gated_deltanet_and_deltanet():
    a = testing.make_inputs("kda", T=40, dtype=torch.float64, gate="per_head", initial_state=True)
    per_dim = a["g"][..., None].expand(*a["g"].shape, a["q"].shape[-1])
    for fn in (naive.kda, chunk.kda):
        o1, S1 = fn(**a, output_final_state=True)
        o2, S2 = fn(**{**a, "g": per_dim.contiguous()}, output_final_state=True)
        assert testing.rel_err(o1, o2) < 1e-12 and testing.rel_err(S1, S2) < 1e-12
        o3, _ = fn(**{**a, "g": torch.zeros_like(a["g"])})
        o4, _ = naive.delta_rule(**{n: x for n, x in a.items() if n != "g"})
        assert testing.rel_err(o3, o4) < 1e-12


def test_decay_comes_before_the_residual():
    """One token, state S₀: the residual reads the *decayed* state, v − k (D S₀)."""
    a = testing.to_float64(testing.make_inputs("kda", B=1, T=1, H=1, K=4, V=3, initial_state=True))
    D = a["g"][0, 0, 0].exp()[:, None]                                # [K, 1]
    k, v, beta, S0 = a["k"][0, 0, 0], a["v"][0, 0, 0], a["beta"][0, 0, 0], a["initial_state"][0, 0]
    want = D * S0 + beta * k[:, None] * (v - k @ (D * S0))[None, :]
    for fn in (naive.kda, chunk.kda):
        _, S = fn(**a, output_final_state=True)
        assert testing.rel_err(S[0, 0], want) < 1e-13


def test_strong_decays_stay_finite_in_long_chunks():
    a = testing.make_inputs("kda", B=1, T=200, H=2, K=32, V=16, strength="strong", seed=5)
    a["g"] = torch.full_like(a["g"], -20.0)                            # −1280 summed over a chunk
    o, S = chunk.kda(**a, output_final_state=True, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    o_ref, S_ref = naive.kda(**testing.to_float64(a), output_final_state=True)
    assert testing.rel_err(o, o_ref) <= testing.tolerance(torch.float32)


def test_final_state_only_when_asked():
    a = testing.make_inputs("kda", T=10)
    assert chunk.kda(**a)[1] is None and naive.kda(**a)[1] is None
    b = testing.make_inputs("delta_rule", T=10)
    assert chunk.delta_rule(**b)[1] is None and naive.delta_rule(**b)[1] is None


@pytest.mark.parametrize("C", [1, 2, 5, 16, 37, 64])   # 5, 37: padded to a power of two
def test_unit_lower_inverse(C):
    gen = torch.Generator().manual_seed(C)
    A = torch.randn(3, C, C, generator=gen, dtype=torch.float64).tril(-1) / C
    X = unit_lower_inverse(A)
    eye = torch.eye(C, dtype=torch.float64).expand(3, C, C)
    want = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
    assert testing.rel_err(X, want) < 1e-13
    assert torch.equal(X.triu(1), torch.zeros_like(X))                 # unit lower-triangular


@pytest.mark.parametrize("fn", [naive.delta_rule, chunk.delta_rule, naive.kda, chunk.kda],
                         ids=["naive.delta_rule", "chunk.delta_rule", "naive.kda", "chunk.kda"])
def test_bad_inputs_name_the_argument(fn):
    op = fn.__name__                                                   # "delta_rule" or "kda"
    a = testing.make_inputs(op, T=12)
    with pytest.raises(InputError, match="beta"):
        fn(**{**a, "beta": a["beta"] + 2.5})
    with pytest.raises(InputError, match="beta"):
        fn(**{**a, "beta": a["beta"][..., :1]})
    with pytest.raises(InputError, match=r"^k: .*L2-normalised"):
        fn(**{**a, "k": 3 * a["k"]})
    if op == "kda":
        with pytest.raises(InputError, match="g"):
            fn(**{**a, "g": -a["g"] + 0.1})
    if fn in (chunk.delta_rule, chunk.kda):
        with pytest.raises(InputError, match="chunk_size"):
            fn(**a, chunk_size=0)


def test_key_check_allows_short_keys_and_can_be_switched_off():
    a = testing.make_inputs("delta_rule", T=12, dtype=torch.float64)
    chunk.delta_rule(**{**a, "k": 0.5 * a["k"]})                       # ‖k‖ < 1: a contraction, fine
    b = {**a, "k": F.normalize(torch.randn_like(a["k"]), dim=-1) * 1.5}
    with pytest.raises(InputError, match="^k: "):
        naive.delta_rule(**b)
    with validate.value_checks(False):                                 # explicit opt-out
        o_n, _ = naive.delta_rule(**b)
        o_c, _ = chunk.delta_rule(**b, chunk_size=4)
    assert testing.rel_err(o_c, o_n) < 1e-10                           # still the same math


def test_beta_above_one_gives_a_negative_eigenvalue():
    k = F.normalize(torch.randn(8, dtype=torch.float64), dim=0)[None]  # [1, K]
    for beta, lowest in [(0.5, 0.5), (1.5, -0.5), (2.0, -1.0)]:
        ev = torch.linalg.eigvalsh(torch.eye(8, dtype=torch.float64) - beta * k.T @ k)
        assert abs(ev.min().item() - lowest) < 1e-12 and abs(ev.max().item() - 1) < 1e-12


@pytest.mark.parametrize("op,gate", [("delta_rule", None), ("kda", "per_head"), ("kda", "per_dim")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_groups_of_chunks(monkeypatch, op, gate, dtype):
    """Two chunks per group: the state handed from group to group, a short last group, and groups
    that split next to groups that run the exact paths (strong gates from token 80 on)."""
    monkeypatch.setattr(chunk.delta.decay, "group_size", lambda *a: 2)
    kw = {"gate": gate} if gate else {}
    args = testing.make_inputs(op, B=2, T=150, H=2, K=16, V=24, dtype=dtype, initial_state=True,
                               seed=7, **kw)
    if gate:
        strong = testing.log_gates(tuple(args["g"].shape), "strong", generator=torch.Generator().manual_seed(1))
        args["g"] = torch.cat([args["g"][:, :80], strong[:, 80:].to(dtype)], 1)
    check(getattr(chunk, op), args, getattr(naive, op), dtype, chunk_size=16)


@pytest.mark.parametrize("gate", ["per_head", "per_dim"])
@pytest.mark.parametrize("per_token", [-0.92, -0.97])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_bound(gate, per_token, dtype):
    """Every gate decaying by 58.9 over a chunk of 64 (the split, factors up to e^58.9) or by 62.1
    (past the bound: sub-chunks, or the per-head decay mask)."""
    args = testing.make_inputs("kda", B=1, T=128, H=2, K=32, V=32, dtype=dtype, gate=gate, seed=4)
    args["g"] = torch.full_like(args["g"], per_token)
    check(chunk.kda, args, naive.kda, dtype, chunk_size=64)


@pytest.mark.parametrize("op,gate", [("delta_rule", "per_dim"), ("kda", "per_dim"), ("kda", "per_head")])
def test_huge_chunk_size_is_clamped_to_the_sequence(op, gate):
    # chunk_size=2**20 on 20 tokens tried to build [.., 2^20, 2^20] matrices (4.4 TB); every chunk
    # size gives the same result, so the level runs a chunk of the next power of two ≥ T.
    args = testing.make_inputs(op, B=1, T=20, H=2, K=16, V=16, gate=gate, dtype=torch.float64)
    o, S = getattr(chunk, op)(**args, chunk_size=2**20, output_final_state=True)
    ref, S_ref = getattr(naive, op)(**args, output_final_state=True)
    assert testing.rel_err(o, ref) < testing.tolerance(torch.float64)
    assert testing.rel_err(S, S_ref) < testing.tolerance(torch.float64)
