"""Greedy generation with a carried state: prefill the prompt once, then one token per call.

`model(tokens [B, T], states) -> (logits [B, T, vocab], states)` is the interface of the models in
linattn.mqar. The prompt goes through the whole-sequence path (the chunkwise kernel); each new
token through the one-token step, starting from the states the previous call returned. For the
recurrent layers those states have the same size at every step; softmax attention's KV cache
grows by one key and one value per layer and token.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def generate(model, prompt, new_tokens: int):
    """(prompt followed by `new_tokens` greedy tokens [B, T + new], the final states)."""
    logits, states = model(prompt)                                  # prefill: one chunked pass
    out = [prompt]
    for _ in range(new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)                 # [B, 1]
        out.append(nxt)
        logits, states = model(nxt, states)                          # decode: one step
    return torch.cat(out, dim=1), states


@torch.no_grad()
def prefill_then_decode(layer, x, prefill: int):
    """A layer's outputs [B, T, d] for x [B, T, d] computed as generation does: the first `prefill`
    tokens in one call, then one call per token with the state carried. Equals layer(x)[0]."""
    y, state = layer(x[:, :prefill])
    ys = [y]
    for t in range(prefill, x.shape[1]):
        y, state = layer(x[:, t:t + 1], state)
        ys.append(y)
    return torch.cat(ys, dim=1)
