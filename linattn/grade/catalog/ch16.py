"""Chapter 16 — packed sequences: the packed token loop, the packed chunk level, and a Triton state
pass that reads its boundaries from cu_seqlens.

All three take GLA with one log-gate per head (g [1, T, H]) over a packed row (B = 1) cut by
`cu_seqlens` (int64 [N+1]); initial and final states are one per sequence, [N, H, K, V]. The truth
is always each sequence run alone (linattn.naive.gla with cu_seqlens, in float64).

`ch16.packed_loop` and `ch16.packed_chunk` have the library's signature (references: the naive and
chunk levels with cu_seqlens). `ch16.packed_states` is a kernel: the final state of every sequence,
one program per (sequence, head); its reference is the kernel below (the library's Triton level
does not take cu_seqlens yet).

The planted mistakes each grader names are written out below as small functions
(tests/test_grade_ch16.py plants each one in an otherwise correct solution and checks the verdict).
"""
from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from ... import chunk, naive, outputs, testing
from ..exercise import Case, Exercise

F32 = torch.float32


def lengths_of(cu_seqlens) -> list[int]:
    b = cu_seqlens.tolist()
    return [e - s for s, e in zip(b, b[1:])]


def _alone(q, k, v, g, s, e, S0, scale):
    """(o, final state) of the tokens s … e − 1 run as one sequence from S0 (None: zeros)."""
    return naive.gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], scale=scale, initial_state=S0,
                     output_final_state=True)


def _zeros(q, v):
    return torch.zeros(1, q.shape[2], q.shape[3], v.shape[3], dtype=torch.float64)


def _h0(initial_state, n, q, v):
    return _zeros(q, v) if initial_state is None else initial_state[n:n + 1].double()


# ------------------------------------------------------------------------ cases
# (lengths, H, K, V, initial states): lengths unsorted and rarely chunk multiples, an empty
# sequence inside the row, single tokens, sequences shorter than one chunk and longer than two.
_ROWS = [
    ([23, 5, 40, 0, 17], 2, 8, 8, True),
    ([12, 50, 31], 1, 16, 8, True),
    ([3, 1, 19, 33, 6], 2, 8, 16, False),
]


def _jitter(lengths, rng):
    return [0 if L == 0 else max(1, L + rng.randint(-2, 2)) for L in lengths]


def packed_inputs(lengths, H, K, V, init, seed, dtype=F32):
    """Packed GLA inputs [1, T, H, …] with per-head gates, cu_seqlens and (optionally) one initial
    state per sequence [N, H, K, V]."""
    a = testing.make_inputs("gla", B=1, T=sum(lengths), H=H, K=K, V=V, dtype=dtype, gate="per_head",
                            seed=seed)
    cu = torch.tensor([0] + lengths).cumsum(0)
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = torch.randn(len(lengths), H, K, V, generator=gen) if init else None
    return a, cu, h0


def packed_cases(seed, chunk_size=None):
    rng = random.Random(seed)
    cases = []
    for i, (lengths, H, K, V, init) in enumerate(_ROWS):
        lengths = _jitter(lengths, rng)
        a, cu, h0 = packed_inputs(lengths, H, K, V, init, seed * 17 + i)
        kw = dict(cu_seqlens=cu, initial_state=h0, output_final_state=True)
        if chunk_size:
            kw["chunk_size"] = chunk_size
        note = f"lengths {lengths}, H={H} K={K} V={V}" + (", initial states" if init else "")
        cases.append(Case(args=(a["q"], a["k"], a["v"], a["g"]), kwargs=kw, note=note, dtype=F32))
    return cases


# ------------------------------------------------------------------------ ch16.packed_loop
def _carried(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
             **_):
    """The row run as one sequence: each sequence starts from the state the previous one left."""
    b = cu_seqlens.tolist()
    S = _h0(initial_state, 0, q, v)
    outs, finals = [], []
    for s, e in zip(b, b[1:]):
        if e > s:
            o, S = _alone(q.double(), k.double(), v.double(), g.double(), s, e, S, scale)
            outs.append(o)
        finals.append(S)
    return torch.cat(outs, 1), (torch.cat(finals) if output_final_state else None)


def _previous_initial(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None,
                      output_final_state=False, **_):
    """Sequence n started from initial_state[n − 1] (the first from the last one)."""
    h0 = None if initial_state is None else initial_state.roll(1, 0)
    return naive.gla(q, k, v, g, cu_seqlens=cu_seqlens, scale=scale, initial_state=h0,
                     output_final_state=output_final_state)


def _longest_first(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None,
                   output_final_state=False, **_):
    """Right states, stacked in the order of a longest-first schedule instead of sequence order."""
    o, S = naive.gla(q, k, v, g, cu_seqlens=cu_seqlens, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state)
    L = lengths_of(cu_seqlens)
    order = sorted(range(len(L)), key=lambda n: -L[n])
    return o, (S[order] if S is not None else None)


LOOP_MISTAKES = (
    ("carry the state across a boundary: at c_n the state must restart from sequence n's own "
     "initial state (zeros without one), not go on from the previous sequence's last token",
     _carried),
    ("start sequence n from initial_state[n − 1]: the initial states are indexed by sequence, "
     "initial_state[n] for the tokens c_n … c_{n+1} − 1", _previous_initial),
    ("stack the final states in the order you processed the sequences (longest first): "
     "final_state[n] belongs to sequence n, in the order of cu_seqlens", _longest_first),
)


# ------------------------------------------------------------------------ ch16.packed_chunk
def _straddling(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None,
                output_final_state=False, chunk_size=16):
    """Chunks cut at multiples of C from the row's start. The state is reset to sequence n's
    initial state only where c_n falls on a chunk start; a chunk holding a boundary runs both
    sequences' tokens as one, and every sequence ending in it takes the state at the chunk's end."""
    b, T = cu_seqlens.tolist(), q.shape[1]
    q, k, v, g = (x.double() for x in (q, k, v, g))
    N = len(b) - 1
    o = torch.full(v.shape, float("nan"), dtype=torch.float64)
    finals = [_h0(initial_state, n, q, v) for n in range(N)]   # empty sequences keep theirs
    S = None
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        starts = [n for n in range(N) if b[n] == s and b[n + 1] > s]
        if starts:
            S = _h0(initial_state, starts[0], q, v)
        o[:, s:e], S = _alone(q, k, v, g, s, e, S, scale)
        for n in range(N):
            if b[n + 1] > b[n] and s < b[n + 1] <= e:
                finals[n] = S
    return o, (torch.cat(finals) if output_final_state else None)


def _one_past_the_end(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None,
                      output_final_state=False, chunk_size=16):
    """Sequence n taken as tokens c_n … c_{n+1} (the end included), in order: its extra output is
    overwritten by the next sequence, its final state keeps the next sequence's first token."""
    b, T = cu_seqlens.tolist(), q.shape[1]
    q, k, v, g = (x.double() for x in (q, k, v, g))
    o = torch.full(v.shape, float("nan"), dtype=torch.float64)
    finals = []
    for n, s in enumerate(b[:-1]):
        e = min(b[n + 1] + 1, T)
        S = _h0(initial_state, n, q, v)
        if e > s:
            o[:, s:e], S = _alone(q, k, v, g, s, e, S, scale)
        finals.append(S)
    return o, (torch.cat(finals) if output_final_state else None)


CHUNK_MISTAKES = (
    ("cut the packed row into chunks of C from its start: a chunk that straddles a boundary "
     "mixes two sequences (the later one sees the earlier one's tokens and inherits its state); "
     "cut each sequence into chunks from its own start c_n", _straddling),
    ("take sequence n as tokens c_n … c_{n+1} with the end included (one token too many): "
     "its final state has the next sequence's first token in it; sequence n is "
     "cu_seqlens[n] ≤ t < cu_seqlens[n + 1]", _one_past_the_end),
)


# ------------------------------------------------------------------------ ch16.packed_states
@triton.jit
def _packed_states_kernel(k, v, g, h0, out, cu, H, K, V, C: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr):
    n, h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu + n)                                   # this sequence's tokens: bos … eos − 1
    eos = tl.load(cu + n + 1)
    rk, rv, t = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, C)
    in_state = (rk[:, None] < K) & (rv[None, :] < V)
    state = ((n * H + h) * K + rk[:, None]) * V + rv[None, :]
    S = tl.load(h0 + state, mask=in_state, other=0.0)      # [BK, BV] float32
    for s in range(bos, eos, C):                            # this sequence's chunks, no other's
        rows = s + t
        real = rows < eos                                   # the last chunk may be short
        kc = tl.load(k + (rows[:, None] * H + h) * K + rk[None, :],
                     mask=real[:, None] & (rk[None, :] < K), other=0.0).to(tl.float32)
        vc = tl.load(v + (rows[:, None] * H + h) * V + rv[None, :],
                     mask=real[:, None] & (rv[None, :] < V), other=0.0).to(tl.float32)
        gc = tl.load(g + rows * H + h, mask=real, other=0.0)       # 0 past the end: no decay
        b = tl.cumsum(gc, axis=0)
        total = tl.sum(gc, axis=0)
        kc = kc * tl.exp(total - b)[:, None]                # decay from token t to the chunk end
        S = S * tl.exp(total) + tl.dot(tl.trans(kc), vc, input_precision="ieee")
    tl.store(out + state, S, mask=in_state)


def packed_states(k, v, g, cu_seqlens, initial_state, chunk_size=16):
    """Final state of every packed sequence: S ← e^{g_t} S + k_tᵀ v_t over its own tokens, from
    its own initial state. k [1, T, H, K], v [1, T, H, V], g [1, T, H], initial_state and the
    result [N, H, K, V] float32. Grid (N, H)."""
    _, T, H, K = k.shape
    V, N = v.shape[-1], cu_seqlens.numel() - 1
    out = outputs.empty((N, H, K, V), dtype=F32, device=k.device)
    block = lambda n: max(16, triton.next_power_of_2(n))   # noqa: E731  (tl.dot wants sides ≥ 16)
    _packed_states_kernel[(N, H)](k, v, g, initial_state, out, cu_seqlens, H, K, V, C=chunk_size,
                                  BK=block(K), BV=block(V))
    return out


def _states_over(k, v, g, initial_state, spans):
    """Final state of each span (s, e) of the row, run alone from its sequence's initial state."""
    k, v, g = (x.double() for x in (k, v, g))
    finals = []
    for n, (s, e) in enumerate(spans):
        S = initial_state[n:n + 1].double()
        if e > s:
            S = _alone(k, k, v, g, s, e, S, None)[1]
        finals.append(S)
    return torch.cat(finals)


def packed_states_truth(k, v, g, cu_seqlens, initial_state, chunk_size=16):
    b = cu_seqlens.tolist()
    return _states_over(k, v, g, initial_state, list(zip(b, b[1:])))


def _rounded_spans(cu_seqlens, T, C, longest):
    """Sequence n's chunks run to the next multiple of C past its own length (or past the longest
    length), masked only at the row's end T."""
    b, L = cu_seqlens.tolist(), lengths_of(cu_seqlens)
    reach = [triton.cdiv(max(L) if longest else L[n], C) * C for n in range(len(L))]
    return [(b[n], min(b[n] + reach[n], T)) for n in range(len(L))]


def _states_mistake(kind):
    def mistake(k, v, g, cu_seqlens, initial_state, chunk_size=16):
        T = k.shape[1]
        if kind == "zeros":
            return packed_states_truth(k, v, g, cu_seqlens, torch.zeros_like(initial_state))
        spans = _rounded_spans(cu_seqlens, T, chunk_size, longest=(kind == "longest"))
        return _states_over(k, v, g, initial_state, spans)
    return mistake


STATES_MISTAKES = (
    ("mask the last chunk at the row's end T instead of the sequence's end: its tail reads the "
     "next sequence's tokens into the state; mask rows < eos = cu_seqlens[n + 1]",
     _states_mistake("next")),
    ("loop over as many chunks as the longest sequence has, with no mask at the sequence's end: a "
     "shorter sequence runs on into the next ones; bound the loop by its own eos (or mask rows < eos)",
     _states_mistake("longest")),
    ("start S at zeros: each sequence starts from its own initial_state[n]", _states_mistake("zeros")),
)


# (lengths, H, K, V, dtype): one sequence much longer than the others, lengths across chunk
# sizes, K and V not powers of two in one case, an empty sequence, bf16 keys and values.
_STATE_ROWS = [
    ([37, 5, 70, 0, 20], 2, 16, 16, F32),
    ([16, 45, 9], 1, 24, 16, F32),
    ([50, 1, 3, 28], 2, 16, 32, torch.bfloat16),
]


def states_cases(seed):
    rng = random.Random(seed)
    cases = []
    for i, (lengths, H, K, V, dtype) in enumerate(_STATE_ROWS):
        lengths = _jitter(lengths, rng)
        a, cu, h0 = packed_inputs(lengths, H, K, V, True, seed * 19 + i, dtype)
        note = f"lengths {lengths}, H={H} K={K} V={V} {str(dtype).replace('torch.', '')}, C=16"
        # float32 states: the tolerance is float32's for bf16 keys and values too
        cases.append(Case(args=(a["k"], a["v"], a["g"], cu, h0), kwargs={"chunk_size": 16},
                          note=note, dtype=F32))
    return cases


EXERCISES = [
    Exercise(
        name="ch16.packed_loop",
        chapter=16,
        title="The packed token loop: the state restarts at every boundary",
        signature="packed_loop(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None, "
                  "output_final_state=False) -> (o, final_state)   # [1, T, H, …]; g [1, T, H]; "
                  "cu_seqlens int64 [N+1]; states [N, H, K, V]",
        reference=naive.gla,
        cases=packed_cases,
        outputs=("o", "final_state"),
        hint="for each n: S = initial_state[n] (zeros without one); for t in cu_seqlens[n] … "
             "cu_seqlens[n+1] − 1: S = e^{g_t} S + k_tᵀ v_t, o_t = scale · q_t S; final_state[n] = S.",
        diagnoses=LOOP_MISTAKES,
    ),
    Exercise(
        name="ch16.packed_chunk",
        chapter=16,
        title="The packed chunk level: every sequence chunked from its own start",
        signature="packed_chunk(q, k, v, g, *, cu_seqlens, scale=None, initial_state=None, "
                  "output_final_state=False, chunk_size=16) -> (o, final_state)",
        reference=chunk.gla,
        truth=naive.gla,
        cases=lambda seed: packed_cases(seed, chunk_size=16),
        outputs=("o", "final_state"),
        hint="list the chunks per sequence: (n, s, min(s + C, c_{n+1})) for s in range(c_n, "
             "c_{n+1}, C); reset S to initial_state[n] at each sequence's first chunk.",
        diagnoses=CHUNK_MISTAKES,
    ),
    Exercise(
        name="ch16.packed_states",
        chapter=16,
        on_gpu=True,
        title="A Triton state pass that reads its boundaries from cu_seqlens",
        signature="packed_states(k, v, g, cu_seqlens, initial_state, chunk_size=16) -> final_state"
                  "   # k [1,T,H,K], v [1,T,H,V], g [1,T,H]; states [N,H,K,V] float32; grid (N, H)",
        reference=packed_states,
        truth=packed_states_truth,
        cases=states_cases,
        outputs=("final_state",),
        spec=packed_states_truth,
        hint="bos = tl.load(cu + n), eos = tl.load(cu + n + 1); for s in range(bos, eos, C) with "
             "rows = s + tl.arange(0, C) masked by rows < eos (g masked to 0: no decay); per chunk "
             "S = e^{Σg} S + (K ⊙ e^{Σg − b})ᵀ V, b the cumulative gate inside the chunk.",
        diagnoses=STATES_MISTAKES,
    ),
]
