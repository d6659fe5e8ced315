"""Chunkwise gated linear attention: decay absorption at the chunk level, secondary chunking inside.

Split T into chunks of C tokens. With b the prefix sum of the log-gates *inside* a chunk and the
chunk-level factors of `linattn.decay` (Λ = exp b_t, Γ = exp(b_C − b_t), γ = exp b_C):
    O_[n] = scale · ((Q_[n] ⊙ Λ) S_[n-1] + P_[n] V_[n])              inter + intra
    S_[n] = diag(γ) S_[n-1] + (K_[n] ⊙ Γ)ᵀ V_[n]                     state pass
P_[n] is the gated attention matrix of the chunk, P_ij = Σ_κ q_iκ k_jκ exp(b_iκ − b_jκ), i ≥ j.
For per-dimension gates P is built from c × c tiles (secondary chunking): tiles below the
diagonal are matmuls after absorbing the decay relative to the query sub-chunk's start (both
exponents ≤ 0); the diagonal tiles are computed in float32 log space (`intra_chunk_matrix`, the
two-level form). The forward itself uses `gla_tiles.intra_matrix`, which applies the same split
again inside the diagonal tiles, down to single tokens: the same numbers from matmuls only,
without a [c, c, K] tensor of exponentials per sub-chunk (C·K exponentials per chunk instead of
C·c·K), and blocks smaller than c stay in float32, as the diagonal tiles do. For per-head (scalar) gates
the decay factors out of the dot product, P = (Q Kᵀ) ⊙ D with the causal decay mask D, and no
secondary chunking is needed (sub_chunk_size is then validated but unused).

Where every chunk of a group decays by less than e^60 in every dimension (`decay.split`; always
for the gates of trained models) either gate shape takes one shortcut: exp(b_i − b_j) =
Λ_i e^{−b_j} with e^{−b_j} ≤ e^60, so P = (Q̂ ⊙ Λ)(K ⊙ e^{−b})ᵀ masked, one matmul, and
K ⊙ Γ = (K ⊙ e^{−b}) γ.
Chunks are taken in groups (`decay.group_size`) so that on a CPU a group's work runs from cache.

`inter_dtype` is the dtype the matmul operands are rounded to (the tensor-core tiles: Q̃K̃ᵀ, P V,
Q̃ S, K̃ᵀ V); products are accumulated in float32, as tensor cores do. None → the input dtype.
The backward (`gla_backward`) reads the forward's chunk states, rounding included, and otherwise
computes in float32 (float64 for float64 inputs) without rounding operands.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import decay, outputs, packing
from . import gla_tiles
from ..naive.linear import initial
from ..validate import (FLOAT_DTYPES, Dims, InputError, autocast_off, check_chunk, check_inputs,
                        refuse_func_transforms)


@autocast_off
def gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
        sub_chunk_size=16, inter_dtype=None, recompute=True, cu_seqlens=None):
    """Chunkwise GLA; same results as `linattn.naive.gla`.

    With grad enabled and an input that requires it, the hand-written chunkwise backward of
    `linattn.chunk.gla_backward` runs (recompute=True: it recomputes the chunk states, as the GLA
    paper does; False: the forward keeps them, [B, H, N, K, V] more memory and less work).
    Otherwise the plain forward runs, with no autograd bookkeeping.

    A NaN or inf input is refused when the value checks run (CPU tensors, by default); unchecked it
    makes the outputs of its whole chunk non-finite, earlier tokens included (linattn.validate).
    """
    if cu_seqlens is not None:                                        # packed: each sequence alone
        return packing.per_sequence(gla, dict(q=q, k=k, v=v, g=g), cu_seqlens, scale=scale,
                                    initial_state=initial_state, output_final_state=output_final_state,
                                    chunk_size=chunk_size, sub_chunk_size=sub_chunk_size,
                                    inter_dtype=inter_dtype, recompute=recompute)
    d = check_inputs(q, k, v, g=g, scale=scale, initial_state=initial_state, gate=True)
    check_chunk(chunk_size, sub_chunk_size)
    refuse_func_transforms("linattn.chunk.gla")
    mm = _matmul_dtype(inter_dtype, q.dtype)
    # Every chunk size gives the same result, so a sequence shorter than one chunk is padded only
    # to whole sub-chunks (chunk_size=4096 on 10 tokens must not build 4096 × 4096 tiles), and a
    # sub-chunk longer than the sequence is cut to the next power of two ≥ T (then C = c).
    c = min(sub_chunk_size, 1 << (d.T - 1).bit_length())
    C = min(chunk_size, -(-d.T // c) * c)
    plan = Plan(d, C, c, mm, bool(recompute))
    if needs_grad(q, k, v, g, initial_state):
        o, S = ChunkwiseGated.apply(q, k, v, g, initial_state, plan)
    else:
        o, S, _ = forward(q, k, v, g, initial_state, plan, keep_states=False)
    return o, (S if output_final_state else None)


@dataclass(frozen=True)
class Plan:
    """What one call computes with: its sizes (validated), chunk and sub-chunk size, matmul dtype."""
    d: Dims
    C: int
    c: int
    mm: torch.dtype
    recompute: bool = True


def needs_grad(*tensors) -> bool:
    """The hand-written backward is used only when autograd will call it."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                           for x in tensors)


def forward(q, k, v, g, initial_state, plan, keep_states=True):
    """The chunkwise forward. g=None means no gate (linear attention). Returns the output in
    v's dtype [B, T, H, V], the final state and, with keep_states, the states entering each chunk
    [B, H, N, K, V] (else None).

    The chunks go in groups (`decay.group_size`: a few hundred KB per tensor, so that a group's
    matmuls run from the CPU's cache), the state carried from group to group exactly as from chunk
    to chunk; every chunk computes what it would in one batch of all chunks."""
    d, C = plan.d, plan.C
    N, G = -(-d.T // C), decay.group_size(d.B, d.H, C, max(d.K, d.V), q.device)
    S = initial(initial_state, d, q.device)                           # [B, H, K, V]
    out = outputs.empty((d.B, d.T, d.H, d.V), dtype=v.dtype, device=q.device)
    Sin = q.new_empty((d.B, d.H, N, d.K, d.V), dtype=d.acc) if keep_states else None
    for n in range(0, N, G):
        t = slice(n * C, min((n + G) * C, d.T))
        o, S, S_group = _forward_group(q[:, t], k[:, t], v[:, t], None if g is None else g[:, t], S, plan)
        out[:, t] = decay.unchunked(o, t.stop - t.start)
        if keep_states:
            Sin[:, :, n:n + G] = S_group
    return out, S, Sin


def _forward_group(q, k, v, g, S, plan):
    """One group of whole chunks (the last may be padded): q, k, v, g [B, t, H, ...] from the
    state S [B, H, K, V]. Returns o [B, H, n, C, V], the state after the group and the states
    entering its chunks [B, H, n, K, V]."""
    d, C = plan.d, plan.C
    # Padding (zeros for q, k, v; log-gate 0 = no decay) makes any T exact: see decay.chunked.
    # Fresh dense copies: the matmuls run on dense batches, and they are overwritten below.
    qc = dense_chunks(q, C, d.acc).mul_(d.scale)                      # [B, H, n, C, K]  Q̂
    kc = dense_chunks(k, C, d.acc)                                    # [B, H, n, C, K]
    vc = dense_chunks(v, C, d.acc)                                    # [B, H, n, C, V]
    gc = None if g is None else decay.per_dim(dense_chunks(g, C, d.acc), qc)  # [B, H, n, C, K or 1]
    gamma = None
    fast = None if gc is None else decay.split(gc, plan.mm)           # (Λ, e^{−b}, γ) or None
    causal = decay.causal_mask(C, qc.dtype, qc.device)                # [C, C]
    if gc is None:
        P = _mm(qc, kc.transpose(-1, -2), plan.mm).mul_(causal)       # [B, H, n, C, C]
    elif fast is not None:                                            # every chunk decays < e^60
        lam, inv, gamma = fast                                        # Λ, e^{−b}, γ
        qc.mul_(lam), kc.mul_(inv)                                    # Q̂ ⊙ Λ, K ⊙ e^{−b}
        P = _mm(qc, kc.transpose(-1, -2), plan.mm).mul_(causal)       # e^{b_i − b_j} inside
        kc.mul_(gamma[..., None, :])                                  # K ⊙ Γ = K ⊙ e^{−b} γ
    elif gc.shape[-1] > 1:
        sweep = gla_tiles.Sweep(gc.exp_())                            # per dimension: halving tiles
        P = gla_tiles.intra_matrix(qc, kc, sweep, plan.c, plan.mm)   # [B, H, n, C, C]
        qc.mul_(sweep.query), kc.mul_(sweep.key)                      # Q̂ ⊙ Λ, K ⊙ Γ
        gamma = sweep.total                                           # [B, H, n, K]
    else:
        P = intra_chunk_matrix(qc, kc, gc[..., 0], inter_dtype=plan.mm)  # per head: (Q Kᵀ) ⊙ D
        lam, Gam, gamma = chunk_decays(gc[..., 0], qc)                # [B, H, n, C, 1] ×2, [.., 1]
        qc.mul_(lam), kc.mul_(Gam)                                    # Q̂ ⊙ Λ, K ⊙ Γ
    Sin, S = _state_pass(kc, vc, gamma, S, plan.mm)                   # [B, H, n, K, V], [B, H, K, V]
    o = _mm(P, vc, plan.mm)                                           # [B, H, n, C, V] intra
    _mm_add_(o, qc, Sin, plan.mm)                                     # + inter: (Q̂ ⊙ Λ) S_[n-1]
    return o, S, Sin


def dense_chunks(x, C, dtype):
    """decay.chunked(x, C) as a fresh dense [B, H, N, C, ...] tensor of `dtype`, owned by the caller
    (decay.chunked may return a strided view of x itself)."""
    y = decay.chunked(x, C)
    return torch.empty(y.shape, dtype=dtype, device=y.device).copy_(y)


def chunk_decays(gc, qc):
    """Per-head gates gc [B, H, N, C]: Λ, Γ (the chunk's query and key decays, [B, H, N, C, 1]) and
    γ ([B, H, N, 1]). (Per-dimension gates get theirs from `gla_tiles.Sweep`.)"""
    gd = decay.per_dim(gc, qc)                                        # [B, H, N, C, 1]
    return decay.query_decay(gd), decay.key_decay(gd), decay.total_decay(gd)


def _state_pass(k_abs, vc, gamma, S, mm):
    """The only sequential part: S_[n] = diag(γ_n) S_[n-1] + (K_[n] ⊙ Γ)ᵀ V_[n].

    k_abs [B, H, N, C, K] keys with Γ absorbed; gamma [B, H, N, K or 1], or None (no decay). Returns
    the state entering each chunk [B, H, N, K, V] and the state after the last chunk.
    """
    kv = _mm(k_abs.transpose(-1, -2), vc, mm)                         # [B, H, N, K, V], all chunks at once
    return kv, scan_(kv, gamma, S)


def scan_(buf, gamma, S, reverse=False):
    """X_[n] = diag(γ_n) X_[n-1] + buf[n] over the chunks (last to first when reverse), from X = S.

    buf [B, H, N, K, V] holds what each chunk adds; it is overwritten, in place, by the X entering
    each chunk (the state pass: S_[n-1]; the backward's reverse pass: dS_[n]). Returns the last X.
    """
    N = buf.shape[2]
    for n in (reversed(range(N)) if reverse else range(N)):
        # the next X into a fresh tensor, then the entering X over buf[n]: one copy per chunk
        # (cloning buf[n] to add into would be a second, and on a CPU each is a call of its own)
        nxt = buf[:, :, n] + S if gamma is None else torch.addcmul(buf[:, :, n], gamma[:, :, n, :, None], S)
        buf[:, :, n] = S                                              # [B, H, K, V]
        S = nxt
    return S


def intra_chunk_matrix(q, k, g, *, sub_chunk_size=16, inter_dtype=None):
    """The gated attention matrix of one chunk, P_ij = Σ_κ q_iκ k_jκ exp(b_iκ − b_jκ) (i ≥ j), 0 above.

    q, k [..., C, K]; g [..., C, K] per-dimension or [..., C] per-head log-gates of *this chunk*
    (b is their prefix sum from the chunk start). Returns [..., C, C] in q's dtype (float32 for
    lower-precision inputs); no scale is applied. Per-dimension gates use secondary chunking with
    sub-chunks of `sub_chunk_size` tokens, which must divide C.
    """
    _check_chunk_tensors(q, k, g)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    mm = _matmul_dtype(inter_dtype, q.dtype)
    q, k, g = q.to(acc), k.to(acc), g.to(acc)                          # gates in float64 for references
    if g.dim() == q.dim() - 1:
        # Scalar gates: exp(b_i − b_j) does not depend on κ, so it leaves the sum: (Q Kᵀ) ⊙ D.
        return _mm(q, k.transpose(-1, -2), mm) * decay.decay_mask(g).to(acc)
    C, c = q.shape[-2], sub_chunk_size
    check_chunk(C, c)
    n_sub = C // c
    qs, ks, gs = (x.unflatten(-2, (n_sub, c)) for x in (q, k, g))   # [..., n_sub, c, K]
    P = torch.zeros(*q.shape[:-1], C, dtype=acc, device=q.device)     # [..., C, C]

    # Diagonal tiles: the decay sits inside the dot product → elementwise, float32, log space.
    diag = torch.einsum("...ik,...jk,...ijk->...ij", qs, ks, decay.pairwise_decay(gs).to(acc))
    # Tiles below the diagonal, one row of tiles per query sub-chunk i, split at r = i·c:
    # exp(b_m − b_n) = exp(Σ_{r ≤ s ≤ m} g_s) · exp(Σ_{n < s < r} g_s), both exponents ≤ 0.
    q_abs = qs * decay.query_decay(gs).to(acc)                        # [..., n_sub, c, K]
    for i in range(n_sub):
        r = i * c
        P[..., r:r + c, r:r + c] = diag[..., i, :, :]
        if i:
            k_abs = k[..., :r, :] * decay.key_decay(g[..., :r, :]).to(acc)  # [..., r, K]
            P[..., r:r + c, :r] = _mm(q_abs[..., i, :, :], k_abs.transpose(-1, -2), mm)
    return P


def _check_chunk_tensors(q, k, g):
    for name, x in (("q", q), ("k", k), ("g", g)):
        if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
            raise InputError(f"{name} must be a floating-point torch.Tensor, got "
                             f"{getattr(x, 'dtype', type(x).__name__)}")
    if q.dim() < 2 or k.shape != q.shape:
        raise InputError(f"q and k must have one shape [..., C, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    if tuple(g.shape) not in (tuple(q.shape), tuple(q.shape[:-1])):
        raise InputError(f"g must have shape [..., C, K] = {tuple(q.shape)} (per dimension) or "
                         f"[..., C] = {tuple(q.shape[:-1])} (per head), got {tuple(g.shape)}")


def _matmul_dtype(inter_dtype, input_dtype):
    if inter_dtype is None:
        return input_dtype
    if inter_dtype not in FLOAT_DTYPES:
        raise InputError(f"inter_dtype must be None (→ the input dtype) or one of "
                         f"{[str(t) for t in FLOAT_DTYPES]}, got {inter_dtype!r}")
    return inter_dtype


def _mm_add_(out, a, b, dtype):
    """out += a @ b (operands rounded to `dtype`); in place, without a temporary, when unrounded."""
    if dtype == a.dtype or a.dtype.itemsize <= dtype.itemsize:
        out.view(-1, *out.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    else:
        out += _mm(a, b, dtype)


def _mm(a, b, dtype):
    """a @ b with both operands rounded to `dtype` and the products summed in a's (wider) dtype.

    This is what a tensor core does with bf16/fp16 tiles and a float32 accumulator: the rounding of
    the operands is the only error it adds (a bf16 × bf16 product is exact in float32).
    """
    if dtype == a.dtype or a.dtype.itemsize <= dtype.itemsize:
        return a @ b
    return a.to(dtype).to(a.dtype) @ b.to(dtype).to(a.dtype)


# The backward builds on the forward above (it recomputes the chunk states with it).
from .gla_backward import ChunkwiseGated  # noqa: E402
