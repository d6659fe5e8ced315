"""The delta family's sequential passes against their float64 restatements (linattn/conformance/passes.py).

On the CPU the interpreter runs a few points: that checks the references themselves (same inputs,
same semantics). Natively it runs the points where the compiled loops went wrong on an H200 while
the interpreter was right (docs/native_correctness.md); `tools/pass_sweep.py` runs the whole grid."""
import pytest
import torch

from linattn import device
from linattn.conformance import passes
from linattn.triton import delta
from linattn.triton import delta_backward as backward

DEV = device.default_device()
GPU = DEV == "cuda"

POINTS = [dict(dtype=d, gate=g, K=K, V=V, C=C, B=2, H=2, T=T, with_h0=h)
          for (d, g, K, V, C, T, h) in [("float32", 0, 16, 48, 16, 40, True), ("float32", 1, 32, 16, 32, 70, False),
                                        ("bfloat16", 2, 32, 32, 16, 33, True), ("float32", 2, 64, 32, 32, 65, False)]]
if GPU:
    POINTS = [
        # float32 reverse pass with a padded key tile (K = 16 in 32), chunk 16: dstate_stages
        *[dict(dtype="float32", gate=g, K=16, V=V, C=16, B=1, H=3, T=300, with_h0=True) for g in (0, 2) for V in (64, 256)],
        # one chunk (NT = 1) at chunk 64 with V ≤ 32: the specialised variant faulted (T, NT not specialised)
        *[dict(dtype="bfloat16", gate=g, K=K, V=16, C=64, B=3, H=2, T=33, with_h0=True) for g in (0, 2) for K in (64, 256)],
        # K = 256, V = 32, chunk 32, no initial state: states left unwritten when pipelined (state_stages)
        *[dict(dtype=d, gate=2, K=256, V=32, C=32, B=3, H=2, T=T, with_h0=False) for d in ("bfloat16", "float16") for T in (33, 65)],
        dict(dtype="bfloat16", gate=0, K=128, V=128, C=64, B=1, H=3, T=300, with_h0=True),
    ]


@pytest.mark.parametrize("point", POINTS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_pass_matches_float64(point):
    r = passes.check(**point, device=DEV)
    assert not r["failed"], r["err"]


def test_check_sees_an_unwritten_chunk_and_a_wrong_gradient(monkeypatch):
    """Planted: the state pass leaves a chunk's state unwritten (poison stays), the reverse pass
    returns dh0 1 % off: both named."""
    point = dict(dtype="float32", gate=2, K=32, V=32, C=16, B=1, H=1, T=40, with_h0=True, device=DEV)
    real_state, real_dstate = delta.state_stage, backward.dstate_stage

    def unwritten(*a, **k):
        hs, vnew, ht = real_state(*a, **k)
        hs[:, :, 1] = float("nan")
        return hs, vnew, ht

    def off(*a, **k):
        dhs, dvnew, dh0 = real_dstate(*a, **k)
        return dhs, dvnew, dh0 * 1.01

    monkeypatch.setattr(delta, "state_stage", unwritten)
    monkeypatch.setattr(backward, "dstate_stage", off)
    r = passes.check(**point)
    assert r["failed"] == ["dh0", "hs"], r


def test_grid_covers_every_head_dim_chunk_and_kind():
    groups = list(passes.grid())
    assert len(groups) == len(passes.KINDS) * len(passes.HEAD_DIMS) ** 2
    pts = [p for g in groups for p in g]
    assert {p["K"] for p in pts} == {p["V"] for p in pts} == set(passes.HEAD_DIMS)
    assert {p["C"] for p in pts} == {16, 32, 64} and {p["with_h0"] for p in pts} == {True, False}
    assert any(p["T"] > 64 * 4 for p in pts) and any(p["T"] <= 64 for p in pts)


def test_stage_rules_stay_as_narrow_as_the_faults(monkeypatch):
    """One pipeline stage only where the compiled loop was measured wrong: elsewhere a stage is
    speed, and at float32, chunk 64, a 128-wide key tile one stage does not fit any GPU."""
    from types import SimpleNamespace as P
    monkeypatch.setattr(backward, "precise", lambda p: p.ieee)          # as natively (X3 products)
    assert delta.state_stages(P(BK=256, C=32)) == 1 and delta.state_stages(P(BK=256, C=16)) == 1
    assert delta.state_stages(P(BK=256, C=64)) == delta.TUNING["stages_state"]
    assert delta.state_stages(P(BK=128, C=32)) == delta.TUNING["stages_state"]
    assert backward.dstate_stages(P(ieee=True, K=16, BK=32, C=16)) == 1
    assert backward.dstate_stages(P(ieee=True, K=96, BK=128, C=64)) == 3      # padded, but chunk 64
    assert backward.dstate_stages(P(ieee=True, K=32, BK=32, C=16)) == 3
    assert backward.dstate_stages(P(ieee=False, K=16, BK=32, C=16)) == 3


def test_wide_chunk_blocks_only_where_verified(monkeypatch):
    """The per-chunk kernel's 64-wide V-blocks (8 warps) only at 64- and 128-wide key tiles in
    bf16/fp16, packed rows too: at K = 16 and K = 256 they failed natively, and float32 keeps the
    blocks verified natively before."""
    from types import SimpleNamespace as P
    from linattn.triton import wy_backward
    monkeypatch.setattr(backward, "precise", lambda p: p.ieee)          # as natively (X3 products)
    wide, narrow = backward.TUNING["bv_chunk_wide"], backward.TUNING["bv_chunk"]
    assert wide > narrow
    def block(ieee=False, BK=128, V=128, seqs=None):
        return backward.chunk_block(P(ieee=ieee, BK=BK, V=V, seqs=seqs))
    assert block() == wide and block(BK=64, V=256) == wide
    assert block(BK=32, V=64) == narrow                 # K = 16: faulted
    assert block(BK=256, V=256) == narrow               # K = 256: wrong dk
    assert block(ieee=True) == narrow                   # float32
    assert block(seqs=object()) == wide                 # packed rows: the same rule (test_triton_packing)
    assert block(V=32) == 32                            # all of a narrow V
    monkeypatch.setattr(wy_backward, "precise", lambda p: p.ieee)
    assert wy_backward.gate_warps(P(ieee=False, gate=0)) == wy_backward.TUNING["warps_no_gate"]
    assert wy_backward.gate_warps(P(ieee=False, gate=1)) == wy_backward.TUNING["warps"]
    assert wy_backward.gate_warps(P(ieee=True, gate=0)) == wy_backward.TUNING["warps"]
