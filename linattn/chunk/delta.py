"""Chunkwise delta rule, Gated DeltaNet and KDA: the WY/UT transform, then a pass over chunk states.

Inside a chunk of C tokens with state S at its start, write G_i = g_1 + … + g_i (log-decays summed
from the chunk start, per key dimension) and let Ṽ hold the β-weighted residuals
ṽ_i = β_i (v_i − k_i D_i s_{i-1}). Unrolling the recurrence gives a unit lower-triangular system

    (I + A) Ṽ = diag(β) V − diag(β) (K ⊙ e^G) S,   A_ij = β_i Σ_d k_id k_jd e^{G_id − G_jd}  (i > j)

so with T = (I + A)⁻¹ (a triangular solve, `solve_unit_lower`), U = T diag(β) V and W = T diag(β) (K ⊙ e^G),
both independent of S:  Ṽ = U − W S. Then, per chunk,

    O  = scale · ((Q ⊙ e^G) S + tril(A_qk) Ṽ),      (A_qk)_ij = Σ_d q_id k_jd e^{G_id − G_jd}, j ≤ i
    S' = diag(e^{G_C}) S + (K ⊙ e^{G_C − G})ᵀ Ṽ.

Stability: every exponential above is of a *difference* G_i − G_j with i ≥ j, or G_i − 0, or
G_C − G_i, all ≤ 0 — decays are measured from the chunk boundary or between two tokens in causal
order, never as e^{+G}. The factorised form (K ⊙ e^G)(K ⊙ e^{−G})ᵀ would overflow once the
summed log-decay passes ≈ −88 (float32); here log-gates of −20 per token are harmless. (Where every
chunk decays by less than e^60 the factorised form is safe and is what runs: `SplitGates`.) A segment
(j, i] or a tail (i, C] is summed on its own (or from pieces that are all ≤ 0) rather than as the
difference of two prefix sums, whose rounding (≈ 1e-4 at a prefix of −1000 in float32) would
swamp a short segment.

Scores. Where every chunk decays by less than e^60 in every key dimension, e^{G_i − G_j} =
e^{G_i} · e^{−G_j} with both factors in range (`decay.split`) and each score matrix is one matmul
for either gate shape (`SplitGates`, chapter 11's split). Otherwise, exactly:
with one gate per head (or none) the decay leaves the dot product: A_qk = (Q Kᵀ) ⊙ D
with the C×C causal decay mask D. With one gate per key dimension it cannot, and a pairwise
[C, C, K] decay tensor would cost K times the scores themselves; `SubChunkGates` splits the chunk
into sub-chunks of 16 tokens instead (secondary chunking, as the Triton kernels do): blocks below
the diagonal are matmuls after absorbing the decay relative to the sub-chunk boundary, the
diagonal 16×16 blocks one bounded matmul each, or column by column where the gates are steep.

Groups: the plain forward takes the chunks a group at a time (`decay.group_size`, a few hundred
KB per tensor, so that on a CPU a group's factors and outputs run from cache) and hands the state
from group to group; every chunk computes what it would in one batch of all chunks. With no
backward to feed, it applies T diag(β) inside the state pass instead of forming U and W
(`_forward_group`): one C-row product fewer per chunk.

Training: with a gradient wanted, the same forward runs inside the autograd.Function of
linattn.chunk.delta_backward, whose backward is chunkwise too; `recompute` says whether it
recomputes the chunk states (default) or the forward keeps them.

Any T: the sequence is padded to whole chunks with k = v = q = 0, β = 0, g = 0, tokens whose
transition is the identity and whose write is zero, and the padded outputs are dropped.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from .. import decay, outputs, packing
from ..naive.delta import check_keys
from ..naive.linear import initial
from ..validate import autocast_off, check_chunk, check_inputs, refuse_func_transforms
from .gla_tiles import _blocks


@autocast_off
def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               chunk_size=64, recompute=True, cu_seqlens=None):
    """Chunkwise DeltaNet; same results as `linattn.naive.delta_rule`.

    recompute: for training, whether the backward recomputes the chunk states (True, less memory)
    or the forward keeps them (False, [B, H, N, K, V] more memory, a faster backward).

    A NaN or inf input is refused when the value checks run (CPU tensors, by default); unchecked it
    makes the outputs of its whole chunk non-finite, earlier tokens included (linattn.validate).
    """
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence(delta_rule, dict(q=q, k=k, v=v, beta=beta), cu_seqlens, scale=scale,
                                    initial_state=initial_state, output_final_state=output_final_state,
                                    chunk_size=chunk_size, recompute=recompute)
    d = check_inputs(q, k, v, beta=beta, scale=scale, initial_state=initial_state, delta=True)
    check_chunk(chunk_size)
    check_keys(k, beta)
    refuse_func_transforms("linattn.chunk.delta_rule")
    return _run(q, k, v, None, beta, d, initial_state, output_final_state, _clamp(chunk_size, d.T),
                recompute)


@autocast_off
def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        chunk_size=64, recompute=True, cu_seqlens=None):
    """Chunkwise KDA (g [B,T,H,K]) / Gated DeltaNet (g [B,T,H]); same results as `naive.kda`.

    recompute and non-finite inputs: see `delta_rule`.
    """
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence(kda, dict(q=q, k=k, v=v, g=g, beta=beta), cu_seqlens, scale=scale,
                                    initial_state=initial_state, output_final_state=output_final_state,
                                    chunk_size=chunk_size, recompute=recompute)
    d = check_inputs(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                     gate=True, delta=True)
    check_chunk(chunk_size)
    check_keys(k, beta)
    refuse_func_transforms("linattn.chunk.kda")
    return _run(q, k, v, g, beta, d, initial_state, output_final_state, _clamp(chunk_size, d.T),
                recompute)


def _clamp(chunk_size, T):
    """The chunk size that runs: every chunk size gives the same result, so a sequence shorter
    than one chunk gets a chunk of the next power of two ≥ T (chunk_size=2**20 on 20 tokens must
    not build [.., 2^20, 2^20] matrices)."""
    return min(chunk_size, 1 << (T - 1).bit_length())


def _run(q, k, v, g, beta, d, initial_state, output_final_state, C, recompute):
    """The plain forward, or, when a gradient is wanted, the same forward inside the
    autograd.Function whose backward is the chunkwise one (linattn.chunk.delta_backward)."""
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                       for x in (q, k, v, g, beta, initial_state)):
        from .delta_backward import DeltaChunkFunction   # imports this module: no cycle at load
        o, S = DeltaChunkFunction.apply(q, k, v, g, beta, initial_state, d, C, recompute)
        return o, (S if output_final_state else None)
    # Groups of chunks (decay.group_size), each a batch small enough for the CPU's cache, the
    # state carried from one to the next: the same numbers as all chunks in one batch.
    S = initial(initial_state, d, q.device)                            # [B, H, K, V]
    o = outputs.empty((d.B, d.T, d.H, d.V), dtype=v.dtype, device=q.device)
    span = C * decay.group_size(d.B, d.H, C, max(d.K, d.V), q.device)
    for t in (slice(s, min(s + span, d.T)) for s in range(0, d.T, span)):
        part = (lambda x: None if x is None else x[:, t])
        S = _forward_group(*map(part, (q, k, v, g, beta)), replace(d, T=t.stop - t.start), C, S, o[:, t])
    return o, (S if output_final_state else None)


def _forward_group(q, k, v, g, beta, d, C, S, o):
    """One group of chunks with no backward to feed: write o [B, t, H, V], return the state after.

    The same chunk algebra as `factors` + `entering_states`, with T diag(β) applied inside the state
    pass, Ṽ = T diag(β)(V − (K ⊙ Λ) S), instead of forming U = T diag(β) V and W = T diag(β)(K ⊙ Λ)
    first: Ṽ = U − W S costs three C-row products per chunk, this two. (The backward needs U and W
    themselves, so `factors` keeps them.) On a CPU each product is a good part of the call.
    """
    qc, kc, vc = (to_chunks(x.to(d.acc), C) for x in (q, k, v))      # [B, H, N, C, *]
    geo = gate_geometry(None if g is None else chunk_gates(g, d, C, q.device))
    Lam, Gam, gam = geo.decays()                                       # e^{G_i}, e^{G_C − G_i}, e^{G_C}
    b = to_chunks(beta.to(d.acc)[..., None], C)                        # [B, H, N, C, 1]
    Tb = solve_unit_lower(b * geo.scores(kc, kc, strict=True)) * b.transpose(-1, -2)   # T diag(β)
    Aqk = geo.scores(qc, kc, strict=False)                             # [B, H, N, C, C]
    flat = (lambda x: x.flatten(0, 1))                                 # [B·H, N, ...]
    Tb, vf, kl = flat(Tb), flat(vc), flat(decayed(kc, Lam))
    kd_t = flat(decayed(kc, Gam)).transpose(-1, -2)                    # [B·H, N, K, C]
    last = None if gam is None else flat(gam)[..., None]               # [B·H, N, K, 1]
    S = S.flatten(0, 1)                                                # [B·H, K, V]
    entering, Vts = [], []
    for n in range(qc.shape[2]):
        entering.append(S)
        Vt = Tb[:, n] @ torch.baddbmm(vf[:, n], kl[:, n], S, alpha=-1)   # [B·H, C, V]
        Vts.append(Vt)
        S = torch.baddbmm(S if last is None else last[:, n] * S, kd_t[:, n], Vt)
    Sin, Vt = (torch.stack(x, 1).unflatten(0, qc.shape[:2]) for x in (entering, Vts))
    _write(o, decayed(qc, Lam), Aqk, Sin, Vt, d.scale)
    return S.unflatten(0, qc.shape[:2])


# ---------------------------------------------------------------- chunk layout and gates
# The gate algebra (segment sums, query/key-side decays) is linattn.decay, shared with GLA.

def to_chunks(x, C):
    """[B, T, H, *] → [B, H, N, C, *], zero-padded to N = ⌈T / C⌉ whole chunks.

    Contiguous: the chunks feed many batched matmuls, each of which would copy a strided view.
    """
    return decay.chunked(x, C).contiguous()


def from_chunks(x, T):
    """[B, H, N, C, V] → [B, T, H, V] (drops the padding)."""
    return decay.unchunked(x, T)


def chunk_gates(g, d, C, device):
    """Raw log-gates per chunk, [B, H, N, C, K or 1] (a per-head gate broadcasts over K).

    Without gates (DeltaNet, linear attention) they are 0: every decay factor below becomes 1.
    """
    if g is None:
        return torch.zeros(d.B, d.H, -(-d.T // C), C, 1, dtype=d.acc, device=device)
    g = g[..., None] if g.dim() == 3 else g                            # [B, T, H, K or 1]
    return decay.chunked(g.to(d.acc), C).contiguous()


def decayed_scores(a, b, gc, *, strict):
    """(a_i · b_j) e^{G_i − G_j} on the lower triangle (strict: i > j, else i ≥ j), 0 above.

    a, b [.., C, K]; gc the chunk's raw log-gates [.., C, K or 1]. Every exponent is ≤ 0 or, on
    the diagonal sub-chunk blocks of per-dimension gates, bounded (see `SubChunkGates`).
    """
    return gate_geometry(gc).scores(a, b, strict=strict)


def gate_geometry(gc):
    """The decay structure of the chunks with log-gates gc [.., C, K or 1] (None: no gates), built
    once for the decays, several score matrices and their gradients: the split at the chunk
    start where every chunk decays by less than e^60 (`SplitGates`), else the exact forms."""
    if gc is None:
        return NoGates()
    fast = decay.split(gc)
    if fast is not None:
        return SplitGates(*fast)
    return HeadGates(gc) if gc.shape[-1] == 1 else SubChunkGates(gc)


class NoGates:
    """DeltaNet: every decay is 1, the scores are plain causal dot products."""

    def decays(self):
        return None, None, None

    def scores(self, a, b, *, strict):
        P = a @ b.transpose(-1, -2)                                    # [.., C, C]
        return P.mul_(decay.causal_mask(P.shape[-1], P.dtype, P.device, strict))

    def grad(self, M, a, b):
        return M @ b, M.transpose(-1, -2) @ a


class SplitGates:
    """Every chunk decays by less than e^{decay.SPLIT_RANGE}: e^{G_i − G_j} = Λ_i · e^{−G_j} with
    e^{−G_j} ≤ e^60, so each score matrix is one plain matmul, (a ⊙ Λ)(b ⊙ e^{−G})ᵀ, for either gate
    shape (chapter 11's split; the gates of trained models stay far inside the bound)."""

    def __init__(self, lam, inv, gam):
        self.lam, self.inv, self.gam = lam, inv, gam                   # [.., C, K or 1] ×2, [.., K or 1]

    def decays(self):
        return self.lam, self.inv * self.gam[..., None, :], self.gam  # Γ = e^{G_C − G} = e^{−G} γ

    def scores(self, a, b, *, strict):
        C = a.shape[-2]
        P = (a * self.lam) @ (b * self.inv).transpose(-1, -2)
        return P.mul_(decay.causal_mask(C, P.dtype, P.device, strict))

    def grad(self, M, a, b):
        """(da, db) of Σ_ij M_ij P_ij: da = (M (b ⊙ e^{−G})) ⊙ Λ, db = (Mᵀ (a ⊙ Λ)) ⊙ e^{−G}."""
        return ((M @ (b * self.inv)).mul_(self.lam),
                (M.transpose(-1, -2) @ (a * self.lam)).mul_(self.inv))


class HeadGates:
    """One decay per head: e^{G_i − G_j} leaves the dot product as a C×C factor (the causal decay
    mask, each segment (j, i] summed on its own by decay.segment_sums)."""

    def __init__(self, gc):
        C = gc.shape[-2]
        self.gc = gc
        self.E = decay.decay_mask(gc[..., 0])                          # [.., C, C], 0 above
        self.strict = torch.ones(C, C, dtype=torch.bool, device=gc.device).tril(-1)

    def decays(self):
        """Λ = e^{G_i}, Γ = e^{G_C − G_i} [.., C, 1] and γ = e^{G_C} [.., 1] (see linattn.decay)."""
        return (decay.query_decay(self.gc), decay.key_decay(self.gc),
                decay.total_decay(self.gc))

    def scores(self, a, b, *, strict):
        E = self.E * self.strict if strict else self.E
        return (a @ b.transpose(-1, -2)) * E                           # [.., C, C]

    def grad(self, M, a, b):
        """(da, db) of Σ_ij M_ij P_ij, P = scores(a, b): da = (M ⊙ E) b, db = (M ⊙ E)ᵀ a."""
        Md = M * self.E                                                # [.., C, C]
        return Md @ b, Md.transpose(-1, -2) @ a


SUB = 16              # sub-chunk size for per-dimension gates (the largest divisor of C up to this)
DIAG_DOT_RANGE = decay.SPLIT_RANGE  # a diagonal block decaying by more goes column by column


class SubChunkGates:
    """Per-dimension gates: secondary chunking, as linattn.triton.wy does, so that no [.., C, C, K]
    pairwise-decay tensor is ever formed.

    Split the chunk into sub-chunks of c tokens. For query i in sub-chunk I and key j in an earlier
    sub-chunk J, split the segment (j, i] at the last token p before I:
        e^{G_i − G_j} = e^{G_i − G_p} · e^{G_p − G_j},
    the first a prefix inside I, the second the rest of J after j plus the whole sub-chunks in
    between — both sums of log-gates ≤ 0, so the block is a plain matmul of decayed a and b.
    Inside a diagonal block both tokens share a sub-chunk: with s_i ≤ 0 the log-decay from just
    after i to the sub-chunk's end, e^{G_i − G_j} = e^{−s_i} e^{s_j}, a matmul whose first factor
    is ≥ 1 but at most e^{DIAG_DOT_RANGE}. Sub-chunks whose gates decay more than that (strong
    gates) are done column by column with each segment summed on its own, all exponents ≤ 0.
    """

    def __init__(self, gc):
        C = gc.shape[-2]
        self.c = c = max(s for s in range(1, min(SUB, C) + 1) if C % s == 0)
        self.ns = C // c
        self.g = g = gc.unflatten(-2, (self.ns, c))                    # [.., ns, c, K]
        # the inclusive prefix and the exclusive suffix inside each sub-chunk, as matmuls with 0/1
        # matrices: sums of log-gates ≤ 0, so any summation order is accurate
        ones = torch.ones(c, c, dtype=g.dtype, device=g.device)
        self.pre = ones.tril() @ g                                     # [.., ns, c, K] G_i − G_p
        self.suf = ones.triu(1) @ g                                    # Σ of the rest after i
        self.tot = self.pre[..., -1, :]                                # [.., ns, K] whole sub-chunks
        self.into, self.esuf = self.pre.exp(), self.suf.exp()          # both ≤ 1
        # diagonal blocks: e^{G_i − G_j} = e^{−suf_i} e^{suf_j}, the first factor ≤ e^{range}
        self.steep = self.suf[..., 0, :].amin(-1) < -DIAG_DOT_RANGE   # [.., ns]: column by column
        self.any_steep = bool(self.steep.any())                       # one host sync
        self.enx = self.esuf.clamp(min=math.exp(-DIAG_DOT_RANGE)).reciprocal()  # e^{−suf} ≤ e^60
        self._keys = None

    def decays(self):
        """Λ = e^{G_i}, Γ = e^{G_C − G_i} [.., C, K] and γ = e^{G_C} [.., K] from the sub-chunk sums:
        the whole sub-chunks before / after a token's own are added as sums ≤ 0."""
        before = torch.cat([torch.zeros_like(self.tot[..., :1, :]),
                            self.tot[..., :-1, :].cumsum(-2)], -2)   # [.., ns, K]
        after = decay.suffix(self.tot)                                 # [.., ns, K]
        Lam = (self.into * before.exp()[..., None, :]).flatten(-3, -2)  # [.., C, K]
        Gam = (self.esuf * after.exp()[..., None, :]).flatten(-3, -2)
        return Lam, Gam, self.tot.sum(-2).exp()

    def _between(self):
        """Yield (δ, e^{G_p − G_e} [.., ns − δ, 1, K]): the decay over the whole sub-chunks between
        key sub-chunk J = 0..ns−δ−1 and query sub-chunk I = J + δ (e: J's last token)."""
        between = torch.zeros_like(self.tot[..., :self.ns - 1, :])     # [.., ns − δ, K]
        for dlt in range(1, self.ns):
            if dlt > 1:
                between = between[..., :self.ns - dlt, :] + self.tot[..., dlt - 1:self.ns - 1, :]
            yield dlt, between.exp()[..., None, :]

    def _key_side(self, b):
        """b ⊙ e^{suf} (keys decayed to their sub-chunk's end), kept for the next score matrix with
        the same keys (Aqk and Akk share K)."""
        if self._keys is None or self._keys[0] is not b:
            self._keys = (b, b.unflatten(-2, (self.ns, self.c)) * self.esuf)   # [.., ns, c, K]
        return self._keys[1]

    def _blocks(self, P, dlt):
        """The blocks (I, I − δ) of P [.., C, C] as a view [.., c, c, ns − δ]."""
        P6 = P.unflatten(-1, (self.ns, self.c)).unflatten(-3, (self.ns, self.c))  # [.., I, i, J, j]
        return torch.diagonal(P6, offset=-dlt, dim1=-4, dim2=-2)

    def scores(self, a, b, *, strict):
        c, ns = self.c, self.ns
        bs = self._key_side(b)                                         # decayed to J's end
        a, b = a.unflatten(-2, (ns, c)), b.unflatten(-2, (ns, c))      # [.., ns, c, K]
        P = torch.zeros(a.shape[:-3] + (ns * c, ns * c), dtype=a.dtype, device=a.device)
        ah = a * self.into                                             # decayed from I's start
        for dlt, eb in self._between():                                # blocks left of the diagonal
            blk = ah[..., dlt:, :, :] @ (bs[..., :ns - dlt, :, :] * eb).transpose(-1, -2)
            self._blocks(P, dlt).copy_(blk.movedim(-3, -1))            # [.., ns − δ, c, c]
        keep = torch.ones(c, c, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
        diag = ((a * self.enx) @ bs.transpose(-1, -2)) * keep          # [.., ns, c, c]
        if self.any_steep:
            diag[self.steep] = self._columns(a[self.steep], b[self.steep], self.g[self.steep],
                                             strict)
        self._blocks(P, 0).copy_(diag.movedim(-3, -1))
        return P

    def _columns(self, a, b, g, strict, M=None):
        """Diagonal blocks column by column: a, b, g [m, c, K]. Without M the scores [m, c, c];
        with M [m, c, c] the gradients (da, db) of Σ M ⊙ scores."""
        c = self.c
        rows = torch.arange(c, device=a.device)[:, None]               # [c, 1]
        out = [] if M is None else (torch.zeros_like(a), torch.zeros_like(b))
        for j in range(c):
            seg = g.masked_fill(rows <= j, 0).cumsum(-2)               # Σ_{j < s ≤ i} g_s, [m, c, K]
            E = seg.exp().masked_fill(rows < (j + 1 if strict else j), 0)
            if M is None:
                out.append((a * E * b[:, j:j + 1, :]).sum(-1))          # column j, [m, c]
            else:
                w = M[:, :, j:j + 1] * E                               # [m, c, K]
                out[0].add_(w * b[:, j:j + 1, :])
                out[1][:, j] = (w * a).sum(-2)
        return torch.stack(out, -1) if M is None else out

    def grad(self, M, a, b):
        """(da, db) of Σ_ij M_ij P_ij with P = scores(a, b); M [.., C, C] zero above the diagonal."""
        c, ns = self.c, self.ns
        bs = self._key_side(b)
        a, b = a.unflatten(-2, (ns, c)), b.unflatten(-2, (ns, c))      # [.., ns, c, K]
        ah = a * self.into
        dah, dbs = torch.zeros_like(a), torch.zeros_like(b)            # w.r.t. ah and bs
        for dlt, eb in self._between():
            Mb = self._blocks(M, dlt).movedim(-1, -3)                  # [.., ns − δ, c, c]
            dah[..., dlt:, :, :] += Mb @ (bs[..., :ns - dlt, :, :] * eb)
            dbs[..., :ns - dlt, :, :] += (Mb.transpose(-1, -2) @ ah[..., dlt:, :, :]) * eb
        Md = self._blocks(M, 0).movedim(-1, -3)                        # [.., ns, c, c]
        Mf = Md.masked_fill(self.steep[..., None, None], 0) if self.any_steep else Md
        da = dah * self.into + (Mf @ bs) * self.enx
        db = (dbs + Mf.transpose(-1, -2) @ (a * self.enx)) * self.esuf
        if self.any_steep:
            m = self.steep
            da_s, db_s = self._columns(a[m], b[m], self.g[m], False, M=Md[m])
            da[m] += da_s
            db[m] += db_s
        return da.flatten(-3, -2), db.flatten(-3, -2)


def solve_unit_lower(A):
    """(I + A)⁻¹ for strictly lower-triangular A [.., C, C], as the chunk level computes it: a
    triangular solve against I (forward substitution in LAPACK / cuBLAS; `unitriangular` reads only
    the strict lower triangle, so A itself is passed). The method written out in PyTorch, and as
    chapter 11's kernel does it, is `unit_lower_inverse`: the same matrix; one compiled call instead
    of a few dozen tensor operations per group of chunks. Differentiable.

    Solved as its transpose, X (I + A)ᵀ = I with (I + A)ᵀ unit upper: the same numbers (bit for bit
    on the CPU measured) in 1.14–1.19 ms against 1.43–1.68 for the direct solve (2 cores, 256 chunks
    of 64, float32), likely because a row-major A read as its transpose is already in LAPACK's
    column-major order."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand(A.shape)
    X = torch.linalg.solve_triangular(A.transpose(-1, -2), eye, upper=True, unitriangular=True, left=False)
    return X.transpose(-1, -2)


def unit_lower_inverse(A):
    """(I + A)⁻¹ for strictly lower-triangular A [.., C, C], by joining halves.

    A unit lower-triangular L = [[L11, 0], [L21, L22]] has the inverse [[X11, 0], [X21, X22]] with
    X11 = L11⁻¹, X22 = L22⁻¹ and X21 = −X22 L21 X11 (multiply it out: L21 X11 + L22 X21 = 0).
    Start from single tokens (X = I) and join neighbouring blocks level by level, s = 1, 2, 4, …:
    log₂ C levels of batched matmuls in place of C − 1 row steps of forward substitution. C is
    padded to a power of two with I.

    Inside the diagonal blocks of JOIN tokens, a level's joins are one product of whole blocks,
    X ← X − X (A ⊙ M_s) X, M_s selecting the level's lower-left s × s blocks (then X (A ⊙ M_s) X
    holds exactly the blocks X22 L21 X11): a few products of JOIN × JOIN blocks instead of
    thousands of tiny ones, as chapter 11's kernel does in registers. The joined blocks are
    written into views of a fresh X, which autograd records: the inverse can be differentiated.
    """
    C = A.shape[-1]
    C2 = 1 << (C - 1).bit_length()
    if C2 != C:                                                        # I + 0 on the padding
        A = torch.nn.functional.pad(A, (0, C2 - C, 0, C2 - C))
    c = min(JOIN, C2)
    masks = _join_masks(c, A.dtype, A.device)                          # [c, c] per level s < c
    Ad = _diagonal_blocks(A, c).contiguous()                           # [.., C2/c, c, c]
    Xd = torch.eye(c, dtype=A.dtype, device=A.device) - Ad * masks[0]  # level 1: X21 = −L21
    for M in masks[1:]:
        Xd = Xd - Xd @ (Ad * M) @ Xd                                   # [.., C2/c, c, c]
    X = torch.zeros_like(A)                                            # [.., C2, C2]
    _diagonal_blocks(X, c).copy_(Xd)
    s = c
    while s < C2:                                                      # join whole blocks
        # copies of the blocks read (a matmul would copy these strided views anyway): what
        # autograd saves must not change when X is written
        X11, X22 = _blocks(X, s, 0, 0).contiguous(), _blocks(X, s, 1, 1).contiguous()
        _blocks(X, s).copy_(-(X22 @ (_blocks(A, s) @ X11)))            # [.., C2/2s, s, s]
        s *= 2
    return X[..., :C, :C]


JOIN = 16   # below this block size the joins are whole-block products (`unit_lower_inverse`)


def _diagonal_blocks(A, c):
    """A view [.., C/c, c, c] of the c × c blocks on the diagonal of A [.., C, C]."""
    n = A.shape[-1] // c
    return A.unflatten(-1, (n, c)).unflatten(-3, (n, c)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


@functools.lru_cache(maxsize=32)
def _join_masks(c, dtype, device):
    """M_s [c, c] for s = 1, 2, …, c/2: 1 on the lower-left s × s block of each 2s × 2s diagonal block.
    Cached: made once per size, dtype and device, read by every call."""
    i = torch.arange(c, device=device)
    out, s = [], 1
    while s < c:
        pair = (i[:, None] // (2 * s)) == (i[None, :] // (2 * s))
        lower_left = ((i[:, None] // s) % 2 == 1) & ((i[None, :] // s) % 2 == 0)
        out.append((pair & lower_left).to(dtype))
        s *= 2
    return out or [torch.zeros(c, c, dtype=dtype, device=device)]


# ---------------------------------------------------------------- the per-chunk factors

@dataclass
class Factors:
    """Everything about each chunk that does not depend on the state entering it.

    With S the state at a chunk's start and Ṽ = U − W S (W = 0 without the delta rule):
        O = scale · (Qg S + Aqk Ṽ),     S' = last · S + Kdecᵀ Ṽ.
    """
    Qg: torch.Tensor     # [B, H, N, C, K]  q_i ⊙ e^{G_i}
    Kdec: torch.Tensor   # [B, H, N, C, K]  k_i ⊙ e^{G_C − G_i}   (β lives in U, W)
    last: torch.Tensor   # [B, H, N, K, 1]  e^{G_C}, the decay across the whole chunk
    Aqk: torch.Tensor    # [B, H, N, C, C]  causal decayed q·k scores, diagonal included
    U: torch.Tensor      # [B, H, N, C, V]
    W: torch.Tensor | None  # [B, H, N, C, K]; None when there is no delta rule


def factors(q, k, v, g, beta, d, C, *, delta):
    """The WY factors of every chunk at once (for linear attention / GLA: U = V, W = None)."""
    return chunk_factors(q, k, v, g, beta, d, C, delta=delta)[0]


def chunk_factors(q, k, v, g, beta, d, C, *, delta):
    """`factors`, plus what the backward reuses: Akk (the key scores without β) and
    T = (I + A)⁻¹, both [B, H, N, C, C] (None without the delta rule)."""
    q, k, v_ = (to_chunks(x.to(d.acc), C) for x in (q, k, v))        # [B, H, N, C, *]
    geo = gate_geometry(None if g is None else chunk_gates(g, d, C, q.device))
    Lam, Gam, gam = geo.decays()                                       # e^{G_i}, e^{G_C − G_i}, e^{G_C}
    Qg, Kdec = decayed(q, Lam), decayed(k, Gam)                        # [B, H, N, C, K]
    shape = (d.B, d.H, q.shape[2], d.K, 1)
    last = q.new_ones(shape) if gam is None else gam[..., None].expand(shape)  # [B, H, N, K, 1]
    Aqk = geo.scores(q, k, strict=False)                               # [B, H, N, C, C]
    if not delta:
        return Factors(Qg, Kdec, last, Aqk, v_, None), None, None
    U, W, Akk, Tinv = _wy(geo, k, v_, Lam, to_chunks(beta.to(d.acc)[..., None], C))
    return Factors(Qg, Kdec, last, Aqk, U, W), Akk, Tinv


def decayed(x, e):
    """x ⊙ e, where e = None means no decay."""
    return x if e is None else x * e


def wy_factors(k, v, g, beta):
    """U, W of one chunk (any leading dims): Ṽ = U − W S for every state S entering the chunk.

    k [.., C, K]; v [.., C, V]; g [.., C, K or 1] the chunk's raw log-gates; beta [.., C].
    (I + A) Ṽ = diag(β)(V − (K ⊙ e^G) S) with A_ij = β_i (k_i ⊙ e^{G_i − G_j}) · k_j for i > j.
    """
    geo = gate_geometry(g)
    return _wy(geo, k, v, geo.decays()[0], beta[..., None])[:2]


def _wy(geo, k, v, Lam, b):
    """U = T diag(β) V, W = T diag(β)(K ⊙ Λ) with T = (I + A)⁻¹, A = diag(β) Akk; b = β [.., C, 1]
    on row i. Returns U [.., C, V], W [.., C, K], Akk and T [.., C, C]."""
    Akk = geo.scores(k, k, strict=True)                                # [.., C, C]
    Tinv = solve_unit_lower(b * Akk)
    Tb = Tinv * b.transpose(-1, -2)                                    # T diag(β): β_j on column j
    return Tb @ v, Tb @ decayed(k, Lam), Akk, Tinv


def entering_states(f: Factors, S):
    """The only sequential part: the state entering every chunk [B, H, N, K, V], the last state,
    and the residuals Ṽ [B, H, N, C, V].

    Per chunk two small matmuls, Ṽ = U − W S and S' = e^{G_C} S + Kdecᵀ Ṽ; the outputs, which
    need only the entering state and Ṽ, follow for all chunks at once (`write_outputs`).
    """
    B, H, N = f.U.shape[:3]
    U, W, Kdec, last = (x.flatten(0, 1) if x is not None else None
                        for x in (f.U, f.W, f.Kdec, f.last))           # [B·H, N, ...]
    S = S.flatten(0, 1)                                                # [B·H, K, V]
    entering, Vts = [], []
    for n in range(N):
        entering.append(S)
        Vt = U[:, n] if W is None else torch.baddbmm(U[:, n], W[:, n], S, alpha=-1)   # [B·H, C, V]
        Vts.append(Vt)
        S = torch.baddbmm(last[:, n] * S, Kdec[:, n].transpose(-1, -2), Vt)          # [B·H, K, V]
    unflat = (lambda x: x.unflatten(0, (B, H)))
    return unflat(torch.stack(entering, 1)), unflat(S), unflat(torch.stack(Vts, 1))


def residuals(f: Factors, Sin):
    """Ṽ = U − W S of every chunk [B, H, N, C, V], from the entering states Sin [B, H, N, K, V]."""
    return f.U if f.W is None else f.U - f.W @ Sin


def write_outputs(o, f: Factors, Sin, Vt, scale):
    """o [B, T, H, V] ← scale · (Qg S + Aqk Ṽ): scaling, layout and dtype in one pass."""
    _write(o, f.Qg, f.Aqk, Sin, Vt, scale)


def _write(o, Qg, Aqk, Sin, Vt, scale):
    flat = (lambda x: x.flatten(0, -3))                                # [B·H·N, rows, cols]
    P = torch.bmm(flat(Qg), flat(Sin))                                 # Qg S
    P.baddbmm_(flat(Aqk), flat(Vt), beta=scale, alpha=scale)           # scale · (Qg S + Aqk Ṽ), one pass
    o.copy_(from_chunks(P.unflatten(0, Qg.shape[:-2]), o.shape[1]))    # [B, H, N, C, V] → o
