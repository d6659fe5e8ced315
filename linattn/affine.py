"""Affine chunk maps: every operation's chunk is S' = M S + B, and those maps compose.

For a chunk with state S at its start (chunk/delta.py holds the factors; W = 0 without the delta rule):
    S' = M S + B,   M = diag(e^{G_C}) − Kdecᵀ W   [K, K],   B = Kdecᵀ U   [K, V]
    O  = P S + O₀,  P = scale (Qg − Aqk W)        [C, K],   O₀ = scale Aqk U   [C, V]
linear attention: M = I, B = KᵀV; GLA / Mamba-2: M = diag(e^{G_C}); DeltaNet: M = I − Kᵀ W;
Gated DeltaNet / KDA: M = diag(e^{G_C}) − Kdecᵀ W.

Composition (first, then second): (M₂, B₂) ∘ (M₁, B₁) = (M₂ M₁, M₂ B₁ + B₂). It is associative,
which is the blocked-matrix statement [[M, B], [0, I]] (a (K+V)×(K+V) matrix acting on the
stacked [S; I]): composing maps is multiplying those matrices, in right-to-left order.
So the states entering all chunks come either from a sequential fold (N steps) or from a parallel
prefix scan (⌈log₂ N⌉ rounds of batched matmuls, Hillis–Steele), and outputs follow from O = P S + O₀.

Shapes: maps carry a chunk axis n: M [B, H, N, K, K], B [B, H, N, K, V].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import decay
from .chunk.delta import factors, from_chunks, wy_factors
from .naive.delta import check_keys
from .naive.linear import initial
from .validate import InputError, check_chunk, check_inputs

OPS = ("linear_attn", "gla", "delta_rule", "kda")


@dataclass
class ChunkMaps:
    M: torch.Tensor      # [B, H, N, K, K]  state transition of each chunk
    B: torch.Tensor      # [B, H, N, K, V]  what each chunk writes, from a zero state
    P: torch.Tensor      # [B, H, N, C, K]  how the entering state reaches the outputs (scale in)
    O0: torch.Tensor     # [B, H, N, C, V]  the outputs from a zero entering state (scale in)
    T: int               # tokens before padding to whole chunks


def split_args(op, args):
    """(q, k, v, g, beta) from the positional arguments of `op`'s library signature."""
    names = {"linear_attn": "qkv", "gla": "qkvg", "delta_rule": "qkvb", "kda": "qkvgb"}
    if op not in names:
        raise InputError(f"op must be one of {OPS}, got {op!r}")
    if len(args) != len(names[op]):
        raise InputError(f"{op} takes {len(names[op])} tensors ({', '.join(names[op])}), "
                         f"got {len(args)}")
    got = dict(zip(names[op], args))
    return got["q"], got["k"], got["v"], got.get("g"), got.get("b")


def validate(op, q, k, v, g, beta, scale, initial_state):
    """check_inputs as the library function `op` would call it (plus the key check)."""
    gate, delta = op in ("gla", "kda"), op in ("delta_rule", "kda")
    d = check_inputs(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                     gate=gate, delta=delta)
    if delta:
        check_keys(k, beta)
    return d


def chunk_maps(op, *args, scale=None, chunk_size=64):
    """(ChunkMaps, Dims) for every chunk of the sequence, all independent of the state."""
    q, k, v, g, beta = split_args(op, args)
    d = validate(op, q, k, v, g, beta, scale, None)
    check_chunk(chunk_size)
    f = factors(q, k, v, g, beta, d, chunk_size, delta=op in ("delta_rule", "kda"))
    Kt = f.Kdec.transpose(-1, -2)                                      # [B, H, N, K, C]
    eye = torch.eye(d.K, dtype=d.acc, device=q.device)
    M = f.last * eye                                                   # diag(e^{G_C})  [.., K, K]
    P = f.Qg
    if f.W is not None:
        M = M - Kt @ f.W
        P = P - f.Aqk @ f.W
    return ChunkMaps(M, Kt @ f.U, d.scale * P, d.scale * (f.Aqk @ f.U), d.T), d


def kda_chunk_map(k, v, g, beta):
    """(M, B) of one KDA chunk (any leading dims): k [.., C, K], v [.., C, V], g [.., C, K] raw
    log-gates, beta [.., C]. M = diag(e^{G_C}) − Kdecᵀ W [.., K, K], B = Kdecᵀ U [.., K, V]."""
    U, W = wy_factors(k, v, g, beta)
    Kt = (k * decay.key_decay(g)).transpose(-1, -2)                    # [.., K, C]
    M = torch.diag_embed(decay.total_decay(g).expand(k.shape[:-2] + k.shape[-1:])) - Kt @ W
    return M, Kt @ U


# ---------------------------------------------------------------- the algebra of maps

def apply(M, B, S):
    """S' = M S + B."""
    return M @ S + B


def compose(second, first):
    """The map 'first, then second': (M₂ M₁, M₂ B₁ + B₂)."""
    (M2, B2), (M1, B1) = second, first
    return M2 @ M1, M2 @ B1 + B2


def augmented(M, B):
    """The blocked matrix [[M, B], [0, I]] of shape [.., K+V, K+V]: it maps [S; I] to [M S + B; I]."""
    K, V = B.shape[-2], B.shape[-1]
    top = torch.cat([M, B], -1)
    bottom = torch.cat([torch.zeros(B.shape[:-2] + (V, K), dtype=B.dtype, device=B.device),
                        torch.eye(V, dtype=B.dtype, device=B.device).expand(B.shape[:-2] + (V, V))], -1)
    return torch.cat([top, bottom], -2)


def fold(M, B, S0):
    """Sequential: the state entering each chunk [B, H, N, K, V] and the final state."""
    entering = []
    S = S0
    for n in range(M.shape[2]):
        entering.append(S)
        S = apply(M[:, :, n], B[:, :, n], S)
    return torch.stack(entering, 2), S


def prefix_scan(M, B):
    """Inclusive prefix maps (maps 0..n composed, for every n) in ⌈log₂ N⌉ rounds (Hillis–Steele).

    Round r composes every map with the one 2^r places before it; after it, position n holds the
    composition of maps max(0, n − 2^{r+1} + 1) … n. All positions of a round are one batched matmul.
    Returns (M_pre, B_pre, rounds).
    """
    N = M.shape[2]
    rounds, step = 0, 1
    while step < N:
        M_new, B_new = compose((M[:, :, step:], B[:, :, step:]), (M[:, :, :-step], B[:, :, :-step]))
        M = torch.cat([M[:, :, :step], M_new], 2)
        B = torch.cat([B[:, :, :step], B_new], 2)
        rounds, step = rounds + 1, 2 * step
    return M, B, rounds


def entering_states(M_pre, B_pre, S0):
    """States entering each chunk from the prefix maps: S₀, then prefix_{n−1}(S₀)."""
    after = apply(M_pre, B_pre, S0[:, :, None])                       # state after chunk n
    return torch.cat([S0[:, :, None], after[:, :, :-1]], 2), after[:, :, -1]


def chunk_outputs(maps: ChunkMaps, entering):
    """O = P S + O₀ per chunk, back to [B, T, H, V] (unpadded)."""
    return from_chunks(maps.P @ entering + maps.O0, maps.T)


def run(op, *args, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
        method="scan"):
    """`op` through its chunk maps: states by 'scan' (parallel prefix) or 'fold' (sequential)."""
    if method not in ("scan", "fold"):
        raise InputError(f"method must be 'scan' or 'fold', got {method!r}")
    validate(op, *split_args(op, args), scale, initial_state)         # initial_state too, first
    maps, d = chunk_maps(op, *args, scale=scale, chunk_size=chunk_size)
    q, v = args[0], args[2]
    S0 = initial(initial_state, d, q.device)
    if method == "fold":
        entering, final = fold(maps.M, maps.B, S0)
    else:
        M_pre, B_pre, _ = prefix_scan(maps.M, maps.B)
        entering, final = entering_states(M_pre, B_pre, S0)
    o = chunk_outputs(maps, entering)
    return o.to(v.dtype), (final if output_final_state else None)
