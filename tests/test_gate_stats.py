"""linattn.gate_stats: chunk decays, their summary, the Mamba-2/KDA gate."""
import torch
import torch.nn.functional as F

from linattn import gate_stats


def test_chunk_decays_sum_whole_chunks_only():
    g = -torch.ones(1, 130, 2, 3)                        # two whole chunks of 64 and a tail of 2
    g[:, 64:128, 1, 2] = -2.0
    d = gate_stats.chunk_decays(g, 64)
    assert d.shape == (2, 2, 3)
    assert d[0].eq(64).all() and d[1, 1, 2] == 128 and d[1, 0].eq(64).all()
    assert gate_stats.chunk_decays(-torch.ones(1, 128, 2), 64).shape == (2, 2, 1)   # per-head gates


def test_summary_counts_chunks_by_their_strongest_dimension():
    d = torch.zeros(4, 1, 8)
    d[1, 0, 3] = 61.0                                     # one dimension of one chunk past e^60
    s = gate_stats.summary(d)
    assert s["frac_chunks_past_bound"] == 0.25 and s["frac_entries_past_bound"] == 1 / 32
    assert s["max"] == 61.0


def test_frac_past_bound_counts_runs_by_their_strongest_dimension():
    g = torch.zeros(1, 128, 2, 4)                         # two chunks of 64, eight blocks of 16, 2 heads
    g[0, 70, 1, 3] = -61.0                                # one token of head 1 past e^60 on its own
    g[0, 0:32, 0, 0] = -2.0                               # head 0: 64 over its first chunk, 32 per block
    assert gate_stats.frac_past_bound(g, 64) == 2 / 4     # chunk 0 of head 0, chunk 1 of head 1
    assert gate_stats.frac_past_bound(g, 16) == 1 / 16    # only the block holding the −61
    assert gate_stats.frac_past_bound(g[..., 0], 64) == 1 / 4                       # per-head gates


def test_softplus_gate():
    y = torch.tensor([1e-4, 1e-2, 0.1, 3.0])
    assert torch.allclose(F.softplus(gate_stats.inverse_softplus(y)), y, rtol=1e-5)
    for head_k, shape in ((8, (2, 5, 3, 8)), (None, (2, 5, 3))):
        gate = gate_stats.SoftplusGate(16, 3, head_k, generator=torch.Generator().manual_seed(0))
        g = gate(torch.randn(2, 5, 16))
        assert g.shape == shape and (g <= 0).all()
        A = gate.A_log.exp()
        assert ((A >= 1) & (A <= 16)).all()
