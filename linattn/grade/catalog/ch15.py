"""Chapter 15 — serving: a padded batch of prompts prefilled into the right states, and the
distribution a sampler draws the next token from.

`ch15.padded_prefill`: KDA over a batch of prompts padded on the right to one length, returning
each prompt's final state. Its truth is each prompt run alone (linattn.naive.kda in float64 on the
row's first L_b tokens), never the padded batch. `ch15.next_token_probs`: the probabilities of
temperature and top-k sampling (one-hot at temperature 0), checked against the same formula in
float64.

The planted mistakes each grader names are written out below as small functions (tests/
test_grade_ch15.py plants each one in an otherwise correct solution and checks the verdict).
"""
from __future__ import annotations

import random

import torch

from ... import chunk, naive, testing
from ..exercise import Case, Exercise

F32 = torch.float32


# ------------------------------------------------------------------------ ch15.padded_prefill
def real_tokens(lengths, T, device=None):
    """[B, T] mask: 1 on row b's first lengths[b] tokens, 0 on its padding."""
    L = torch.as_tensor(lengths, device=device)
    return (torch.arange(T, device=device)[None, :] < L[:, None])


def padded_prefill(q, k, v, g, beta, lengths):
    """Padded tokens made no-ops of the recurrence: no decay (g = 0) and no write (β = 0)."""
    m = real_tokens(lengths, q.shape[1], q.device).to(g.dtype)
    _, S = chunk.kda(q, k, v, g * m[..., None, None], beta * m.to(beta.dtype)[..., None],
                     output_final_state=True)
    return S


def each_alone(q, k, v, g, beta, lengths):
    """The truth: every prompt run on its own, its padding never seen."""
    return torch.cat([naive.kda(q[b:b + 1, :L], k[b:b + 1, :L], v[b:b + 1, :L], g[b:b + 1, :L],
                                beta[b:b + 1, :L], output_final_state=True)[1]
                      for b, L in enumerate(lengths)])


def prefill_cases(seed):
    """Batches of 2–4 prompts, one of full length, others down to a single token; lengths that are
    not multiples of the chunk size; strong and normal gates."""
    rng = random.Random(seed)
    cases = []
    for i, (B, T, H, K, V, strength) in enumerate([(3, 40, 2, 8, 8, "normal"), (2, 70, 1, 16, 8, "strong"),
                                                   (4, 23, 2, 8, 16, "normal")]):
        T = T + rng.randint(-3, 3)
        lengths = [T] + [rng.randint(1, T - 1) for _ in range(B - 2)] + [1 + (i % 2)]
        rng.shuffle(lengths)
        args = testing.make_inputs("kda", B=B, T=T, H=H, K=K, V=V, strength=strength, seed=seed * 7 + i)
        cases.append(Case(args=tuple(args[n] for n in ("q", "k", "v", "g", "beta")) + (lengths,),
                          dtype=F32, note=f"B={B}, padded to T={T}, lengths {lengths}, {strength} gates"))
    return cases


def _prefill_mistake(kind):
    def mistake(q, k, v, g, beta, lengths):
        T = q.shape[1]
        shift = {"one padded token read": 1, "last real token dropped": -1}.get(kind, 0)
        m = real_tokens([min(max(L + shift, 0), T) for L in lengths], T).to(g.dtype)
        mg, mb = m[..., None, None], m[..., None]
        if kind == "no mask":
            mg, mb = 1.0, 1.0
        if kind == "write only":
            mg = 1.0
        if kind == "decay only":
            mb = 1.0
        if kind == "v masked":
            return chunk.kda(q, k, v * mg, g * mg, beta, output_final_state=True)[1]
        return chunk.kda(q, k, v, g * mg, beta * mb, output_final_state=True)[1]
    return mistake


PREFILL_MISTAKES = (
    ("run the padded batch as it is: the recurrence goes on over the padding, decaying the state "
     "and writing the padded tokens into it", _prefill_mistake("no mask")),
    ("block the write (β = 0 or k = 0) but not the decay: a padded token still multiplies S by "
     "diag(e^g); set g = 0 there too", _prefill_mistake("write only")),
    ("stop the decay (g = 0) but not the write: a padded token still adds β kᵀ(v − kS)",
     _prefill_mistake("decay only")),
    ("zero v (and g) on the padding: the delta rule's write β kᵀ(0 − kS) is not zero, it erases "
     "what k points at; β = 0 (or k = 0) stops the write", _prefill_mistake("v masked")),
    ("count one token too many: row b's real tokens are t = 0 … L_b − 1 (t < L_b)",
     _prefill_mistake("one padded token read")),
    ("count one token too few: row b's real tokens are t = 0 … L_b − 1, its last one included",
     _prefill_mistake("last real token dropped")),
)


# ------------------------------------------------------------------------ ch15.next_token_probs
def next_token_probs(logits, temperature=1.0, top_k=None):
    """p ∝ exp(z / temperature) over the top_k largest logits of each row (all when None);
    temperature 0: all the probability on the largest logit (greedy decoding)."""
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    z = logits / temperature
    if top_k is not None:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    return z.softmax(-1)


def probs_cases(seed):
    """Rows of logits (spread ~1–3, no ties) at temperatures 0 to 2, with and without top-k."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for B, vocab, temperature, top_k in [(3, 50, 0.7, 5), (2, 300, 1.5, None), (4, 64, 0.3, 10),
                                         (2, 40, 0.0, None), (3, 80, 1.0, 1), (2, 33, 2.0, 7)]:
        vocab += rng.randint(0, 5)
        logits = rng.choice([1.0, 3.0]) * torch.randn(B, vocab, generator=gen)
        cases.append(Case(args=(logits,), kwargs={"temperature": temperature, "top_k": top_k}, dtype=F32,
                          note=f"logits [{B}, {vocab}], temperature {temperature:g}, top_k {top_k}"))
    return cases


def _probs_mistake(kind):
    def mistake(logits, temperature=1.0, top_k=None):
        if kind == "temperature 0 as 1" and temperature == 0:
            temperature = 1.0
        if temperature == 0:
            return next_token_probs(logits, 0.0)
        z = logits * temperature if kind == "times temperature" else logits / temperature
        if kind == "no top-k":
            top_k = None
        if kind == "not renormalised" and top_k is not None:
            p = z.softmax(-1)
            return p * (z >= z.topk(top_k, dim=-1).values[..., -1:])
        if top_k is not None:
            k = min(top_k + 1, z.shape[-1]) if kind == "k + 1" else top_k
            z = z.masked_fill(z < z.topk(k, dim=-1).values[..., -1:], float("-inf"))
        return z.softmax(0 if kind == "batch axis" else -1)
    return mistake


PROBS_MISTAKES = (
    ("multiply the logits by the temperature: p ∝ exp(z / θ), so a small θ sharpens",
     _probs_mistake("times temperature")),
    ("take the softmax over all logits, then zero all but the top k: the k kept probabilities must "
     "be normalised to sum to 1", _probs_mistake("not renormalised")),
    ("keep k + 1 logits: the k-th largest itself is kept, the ones below it are not",
     _probs_mistake("k + 1")),
    ("ignore top_k", _probs_mistake("no top-k")),
    ("treat temperature 0 as 1: temperature 0 is greedy decoding, all the probability on the "
     "largest logit", _probs_mistake("temperature 0 as 1")),
    ("normalise over the batch axis: each row is one sequence's distribution over the vocabulary",
     _probs_mistake("batch axis")),
)


EXERCISES = [
    Exercise(
        name="ch15.padded_prefill",
        chapter=15,
        title="A right-padded batch of prompts prefilled into each prompt's own state",
        signature="padded_prefill(q, k, v, g, beta, lengths) -> final_state  # KDA inputs [B, T, …] "
                  "padded on the right; lengths: B ints; final_state [B, H, K, V]",
        reference=padded_prefill,
        truth=each_alone,
        cases=prefill_cases,
        outputs=("final_state",),
        hint="a token leaves S as it was if it neither decays it nor writes into it: which values of "
             "g and β make KDA's step the identity, and on which positions t of row b?",
        diagnoses=PREFILL_MISTAKES,
    ),
    Exercise(
        name="ch15.next_token_probs",
        chapter=15,
        title="Temperature and top-k: the distribution the next token is drawn from",
        signature="next_token_probs(logits, temperature=1.0, top_k=None) -> p  # logits, p [B, vocab]",
        reference=next_token_probs,
        cases=probs_cases,
        outputs=("p",),
        hint="divide the logits by the temperature, give every logit below the k-th largest "
             "probability 0, normalise each row; at temperature 0 the limit of that is one-hot.",
        diagnoses=PROBS_MISTAKES,
    ),
]
