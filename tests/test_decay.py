"""The decay machinery against brute-force float64 sums and products, including the cases where
a difference of prefix sums would cancel (a huge decay followed by tiny ones)."""
import pytest
import torch

from linattn import decay, testing


def brute_segment(g, i, j):
    """Σ_{j < s ≤ i} g_s in float64, one term at a time."""
    return sum(float(g[s]) for s in range(j + 1, i + 1))


@pytest.fixture
def g():
    return testing.log_gates((3, 13), "strong", generator=torch.Generator().manual_seed(0))


def test_prefix_suffix_total(g):
    b, s, tot = decay.prefix(g, -1), decay.suffix(g, -1), decay.total_decay(g, -1)
    g64 = g.double()
    assert torch.allclose(b.double(), g64.cumsum(-1), rtol=1e-6)
    want = torch.stack([g64[:, t + 1:].sum(-1) for t in range(g.shape[-1])], -1)
    assert torch.allclose(s.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(tot.double(), g64.sum(-1).exp(), rtol=1e-5)
    assert (b <= 0).all() and (s <= 0).all()


def test_absorption_identity(g):
    """Λ_i Γ_j / γ = exp(b_i − b_j): the query side and key side together give the pair decay."""
    g = g[:, :6].double() / 8  # mild enough that 1/γ is representable
    lam, gam, tot = decay.query_decay(g, -1), decay.key_decay(g, -1), decay.total_decay(g, -1)
    pair = lam[:, :, None] * gam[:, None, :] / tot[:, None, None]
    assert torch.allclose(pair.tril(), decay.decay_mask(g), rtol=1e-12)


def test_segment_sums_brute_force(g):
    seg = decay.segment_sums(g)
    assert seg.shape == (3, 13, 13) and seg.dtype == torch.float32
    for i in range(13):
        for j in range(13):
            if i >= j:
                assert abs(seg[1, i, j].item() - brute_segment(g[1], i, j)) <= 1e-5 * (1 + abs(seg[1, i, j].item()))
            else:
                assert seg[1, i, j].item() == float("-inf")


def test_short_segments_exact_after_a_huge_decay():
    """After one gate of −1e4, the prefix sums are ≈ −1e4 (ulp ≈ 1e-3 in float32); a difference of
    two of them would lose the tiny gates that follow. Segment sums and suffixes must not."""
    g = torch.full((20,), -1e-4)
    g[0] = -1e4
    truth = torch.tensor([[brute_segment(g.double(), i, j) if i >= j else 0.0 for j in range(20)]
                          for i in range(20)], dtype=torch.float64)
    seg = decay.segment_sums(g).double()
    low = torch.ones(20, 20, dtype=torch.bool).tril()
    assert testing.rel_err(seg[low], truth[low]) < 1e-6
    naive_diff = decay.prefix(g, -1)[:, None] - decay.prefix(g, -1)[None, :]
    assert testing.rel_err(naive_diff.double()[low], truth[low]) > 1e-2  # what the cure avoids
    suffix64 = torch.stack([g.double()[t + 1:].sum() for t in range(20)])
    assert testing.rel_err(decay.suffix(g, -1).double(), suffix64) < 1e-6


def test_masks_vanish_above_diagonal_without_nan():
    g = torch.full((2, 9), -1e4)
    D = decay.decay_mask(g)
    assert torch.isfinite(D).all()
    assert (D.triu(1) == 0).all() and (D.diagonal(dim1=-2, dim2=-1) == 1).all()
    pw = decay.pairwise_decay(torch.full((2, 9, 4), -50.0))
    assert pw.shape == (2, 9, 9, 4) and torch.isfinite(pw).all()
    assert (pw[:, 0, 1] == 0).all() and (pw[:, 3, 3] == 1).all()


def test_pairwise_decay_matches_per_dimension_masks():
    g = testing.log_gates((2, 7, 5), "normal", generator=torch.Generator().manual_seed(3))
    pw = decay.pairwise_decay(g)
    for kappa in range(5):
        assert torch.allclose(pw[..., kappa], decay.decay_mask(g[..., kappa]), rtol=1e-6)


@pytest.mark.parametrize("T,C", [(1, 4), (8, 4), (10, 4), (3, 16)])
def test_chunked_round_trip(T, C):
    x = torch.randn(2, T, 3, 5)
    c = decay.chunked(x, C, value=7.0)
    N = -(-T // C)
    assert c.shape == (2, 3, N, C, 5)
    assert torch.equal(decay.unchunked(c, T), x)
    assert (c.reshape(2, 3, N * C, 5)[:, :, T:] == 7.0).all()
    g = torch.randn(2, T, 3)
    assert torch.equal(decay.unchunked(decay.chunked(g, C), T), g)


def test_per_dim_broadcast_shape():
    q = torch.randn(2, 5, 3, 4)
    assert decay.per_dim(torch.zeros(2, 5, 3), q).shape == (2, 5, 3, 1)
    assert decay.per_dim(torch.zeros(2, 5, 3, 4), q).shape == (2, 5, 3, 4)


@pytest.mark.parametrize("shape", [(2, 37, 3), (1, 37, 2, 5)])
def test_chunk_local_prefix(shape):
    g = testing.log_gates(shape, "normal", generator=torch.Generator().manual_seed(4))
    b = decay.chunk_local_prefix(g, 16)
    assert b.shape == g.shape and b.dtype == torch.float32
    for s in range(0, 37, 16):
        want = g[:, s:s + 16].double().cumsum(1)
        assert torch.allclose(b[:, s:s + 16].double(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("per_token, split", [(-0.92, True), (-0.97, False)])
def test_split_bound(per_token, split):
    """Chunks of 64 decaying by 58.9 (inside e^60: factors returned) or by 62.1 (None)."""
    g = torch.full((2, 3, 64, 5), per_token)                            # [.., C, K]
    fast = decay.split(g)
    assert (fast is not None) == split
    if split:
        lam, inv, gam = fast
        E = lam[..., :, None, :] * inv[..., None, :, :]               # e^{b_i} e^{−b_j}
        want = decay.pairwise_decay(g.double())                        # exp of segment sums
        lower = torch.ones(64, 64, dtype=torch.bool).tril()[..., None]
        assert testing.rel_err(E * lower, want) < 1e-5                  # the split's float32 error
        assert testing.rel_err(gam, decay.total_decay(g.double())) < 1e-6


def test_split_never_for_float16_operands():
    g = torch.full((1, 16, 4), -0.01)
    assert decay.split(g) is not None and decay.split(g, torch.float16) is None
