"""Chapter 02 — chunkwise linear attention with state passing."""
import torch

from ... import chunk, naive
from ..exercise import Exercise
from .ch01 import LINEAR_MISTAKES, MASKS, linear_cases


def chunk_mistake(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                  chunk_size=64, mask="causal", read_after=False, state_before_last=False):
    """The chunkwise form with one of the usual mistakes switched on."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qa, ka, va = (x.to(acc).transpose(1, 2) for x in (q, k, v))         # [B, H, T, *]
    S = (torch.zeros(ka.shape[:2] + (ka.shape[-1], va.shape[-1]), dtype=acc) if initial_state is None
         else initial_state.to(acc))                                     # [B, H, K, V]
    M = MASKS[mask](chunk_size).to(acc)                                  # [C, C]
    o, T = [], q.shape[1]
    for s in range(0, T, chunk_size):
        qc, kc, vc = qa[:, :, s:s + chunk_size], ka[:, :, s:s + chunk_size], va[:, :, s:s + chunk_size]
        c = qc.shape[2]
        S_next = S + kc.transpose(-1, -2) @ vc                           # [B, H, K, V]
        intra = (qc @ kc.transpose(-1, -2)) * M[:c, :c] @ vc             # [B, H, c, V]
        o.append(scale * (qc @ (S_next if read_after else S) + intra))
        S = S if (state_before_last and s + chunk_size >= T) else S_next
    o = torch.cat(o, 2).transpose(1, 2).to(v.dtype)
    return o, (S if output_final_state else None)


def _with(**changes):
    def mistake(q, k, v, **kwargs):
        return chunk_mistake(q, k, v, **{**kwargs, **changes})
    return mistake


CHUNK_MISTAKES = LINEAR_MISTAKES[:1] + (
    ("read the state after adding the chunk's Kᵀ V (the chunk counts twice)", _with(read_after=True)),
    ("mask the chunk with the upper triangle (tokens see later ones)", _with(mask="future")),
    ("return the state from before the last chunk", _with(state_before_last=True)),
) + LINEAR_MISTAKES[3:6]

EXERCISES = [
    Exercise(
        name="ch02.chunkwise",
        chapter=2,
        title="Chunkwise linear attention (inter-chunk state + intra-chunk mask)",
        signature="chunk_linear_attn(q, k, v, *, scale=None, initial_state=None, "
                  "output_final_state=False, chunk_size=64) -> (o, final_state)",
        reference=chunk.linear_attn,
        truth=naive.linear_attn,
        # chunk_size=16: most cases then span several chunks and, by their random lengths, end
        # in a partial chunk; the T≈7 case is shorter than a single chunk.
        cases=lambda seed: linear_cases(seed, chunk_size=16),
        unlocks=("linear_attn", "chunk"),
        outputs=("o", "final_state"),
        hint="read the state S_[n-1] *before* adding the chunk's Kᵀ V; mask the chunk's Q Kᵀ with "
             "the lower triangle including the diagonal; the last chunk may be shorter than chunk_size.",
        diagnoses=CHUNK_MISTAKES,
    ),
]
