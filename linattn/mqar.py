"""Multi-query associative recall (MQAR): the data, a small model, a training loop (chapter 14).

A sequence lists n key–value pairs, then asks for the keys again in a random order:

    k₁ v₁ k₂ v₂ … kₙ vₙ | k_{π(1)} k_{π(2)} … k_{π(n)}
                          targets: v_{π(1)} v_{π(2)} … v_{π(n)}

Keys come from the first half of the vocabulary, values from the second, all drawn at random per
sequence, so nothing can be memorised in the weights: the model must store n associations in its
memory while reading the first part and retrieve them in the second. For a recurrent layer that
memory is the state S (H·K·V numbers); softmax attention keeps every token. MQAR is the synthetic
task on which the Zoology study (Arora et al., 2023) separated attention from the subquadratic
models and on which DeltaNet and its gated forms recall better than linear attention and GLA.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import nn as lnn
from .validate import InputError

IGNORE = -100  # positions without a target (the key–value part) are skipped by cross_entropy


def batch(n_pairs: int, size: int, vocab: int, *, generator=None, device="cpu"):
    """(tokens [size, 3n], targets [size, 3n]): n pairs then the n keys asked again, shuffled."""
    half = vocab // 2
    if not 1 <= n_pairs <= half:
        raise InputError(f"n_pairs must be between 1 and vocab // 2 = {half}, got {n_pairs}")
    # n distinct keys per sequence (a repeated key would have two values), values with repeats.
    keys = torch.rand(size, half, generator=generator).argsort(-1)[:, :n_pairs]       # [size, n]
    values = torch.randint(half, vocab, (size, n_pairs), generator=generator)          # [size, n]
    order = torch.rand(size, n_pairs, generator=generator).argsort(-1)                 # [size, n]
    context = torch.stack([keys, values], dim=-1).flatten(1)                           # [size, 2n]
    queries = keys.gather(1, order)
    tokens = torch.cat([context, queries], dim=1)
    targets = torch.cat([torch.full_like(context, IGNORE), values.gather(1, order)], dim=1)
    return tokens.to(device), targets.to(device)


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, mixer: nn.Module, d_model: int):
        super().__init__()
        self.mixer, self.norm1, self.norm2 = mixer, nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x, state=None):
        y, state = self.mixer(self.norm1(x), state)
        x = x + y
        return x + self.mlp(self.norm2(x)), state


class RecallModel(nn.Module):
    """Embedding, `layers` blocks with the chosen mixer (a key of linattn.nn.LAYERS), a read-out."""

    def __init__(self, mixer: str, vocab: int, d_model: int = 64, n_heads: int = 2, layers: int = 2,
                 **mixer_kw):
        super().__init__()
        if mixer not in lnn.LAYERS:
            raise InputError(f"mixer must be one of {sorted(lnn.LAYERS)}, got {mixer!r}")
        self.mixer_name = mixer
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(lnn.LAYERS[mixer](d_model, n_heads, **mixer_kw), d_model)
                                    for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens, states=None):
        """tokens [B, T] → (logits [B, T, vocab], one state per block)."""
        x = self.embed(tokens)
        states = states or [None] * len(self.blocks)
        new = []
        for block, state in zip(self.blocks, states):
            x, state = block(x, state)
            new.append(state)
        return self.head(self.norm(x)), new

    def state_size(self, seq_len: int) -> int:
        """Numbers the model's memory holds per sequence after seq_len tokens (all layers)."""
        mixer = self.blocks[0].mixer
        per_layer = mixer.state_size(seq_len) if isinstance(mixer, lnn.SoftmaxAttention) else mixer.state_size()
        return per_layer * len(self.blocks)


@dataclass
class Run:
    """What `train` returns: the loss per step, the final recall accuracy, the time it took
    (wall-clock seconds, and CPU seconds of this process: on a shared machine the second is the
    better measure of the work)."""
    name: str
    losses: list
    accuracy: float
    seconds: float
    cpu_seconds: float
    state_size: int


def loss_fn(model, tokens, targets):
    logits, _ = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def accuracy(model, n_pairs: int, vocab: int, *, size=256, seed=1234, device="cpu") -> float:
    """Fraction of the queries answered with the right value, on fresh sequences."""
    gen = torch.Generator().manual_seed(seed)
    tokens, targets = batch(n_pairs, size, vocab, generator=gen, device=device)
    logits, _ = model(tokens)
    asked = targets != IGNORE
    return (logits.argmax(-1)[asked] == targets[asked]).float().mean().item()


def train(model, *, n_pairs: int, vocab: int, steps: int, batch_size: int = 64, lr: float = 3e-3,
          seed: int = 0, device="cpu", progress=True, name=None) -> Run:
    """AdamW with a linear warm-up and cosine decay on fresh MQAR batches; a tqdm bar shows the loss.

    Each batch draws its number of pairs from n_pairs // 4 … n_pairs, so the model meets short and
    long lists (a curriculum at no cost) and `accuracy` can be read off at any n up to n_pairs."""
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.98))
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    losses, start, cpu = [], time.perf_counter(), time.process_time()
    bar = tqdm(range(steps), desc=name or model.mixer_name, disable=not progress, mininterval=1.0)
    for _ in bar:
        n = int(torch.randint(max(1, n_pairs // 4), n_pairs + 1, (1,), generator=gen))
        tokens, targets = batch(n, batch_size, vocab, generator=gen, device=device)
        loss = loss_fn(model, tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    model.eval()
    acc = accuracy(model, n_pairs, vocab, device=device)
    return Run(name or model.mixer_name, losses, acc, seconds, cpu, model.state_size(3 * n_pairs))


def warm_up(jobs: dict, *, device="cuda", workers: int | None = None) -> dict:
    """Compile the Triton kernels that `train` and `accuracy` will launch for each job's model, each
    job in a process of its own, all at once, so that the runs that follow find them in Triton's
    on-disk cache instead of compiling one model after another at its first step.

    jobs: {label: dict(mixer=, vocab=, d_model=, n_heads=, layers=, n_pairs=, batch_size=)}, the
    arguments of `RecallModel` and `train`. Returns {label: seconds} that one training step and one
    evaluation took in that job's fresh process, where every kernel is compiled before it runs (the
    job's cold compile, with its start-up); a job that failed gives the error's text instead, and
    its kernels compile later where they run. {} on a CPU, where nothing is compiled (the layers
    run the chunk level there, or Triton's interpreter where a caller asks for the Triton level).

    Kernels are specialised on head dims, dtypes and flags, not on B, T or H (`common.kernel`), but
    a launch chooses its blocks by its number of programs (B·H): one step at the run's batch size
    compiles what every length of the same model launches. Processes are spawned (a forked child
    cannot use CUDA), at most `workers` at a time (default: the CPU count; compiling is CPU-bound)."""
    if torch.device(device).type == "cpu":
        return {}
    try:
        return _in_processes(jobs, device, workers)
    except Exception as e:  # noqa: BLE001  (no process could start: the run compiles as it goes)
        return {label: f"{type(e).__name__}: {e}" for label in jobs}


def _in_processes(jobs: dict, device, workers) -> dict:
    import concurrent.futures
    import multiprocessing
    import os

    n = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {label: pool.submit(first_step, job, str(device)) for label, job in jobs.items()}
        out = {}
        for label, f in futures.items():
            try:
                out[label] = f.result()
            except Exception as e:  # noqa: BLE001  (reported, not raised: the run compiles it later)
                out[label] = f"{type(e).__name__}: {e}"
        return out


def first_step(job: dict, device: str) -> float:
    """One training step and one evaluation of job's model on `device`: seconds (in a fresh process:
    the kernels' compilation). What `warm_up` runs for each job, and what tools/compile_time.py
    --mqar-offline records the launches of."""
    start = time.perf_counter()
    torch.manual_seed(0)
    model = RecallModel(job["mixer"], job["vocab"], d_model=job["d_model"], n_heads=job["n_heads"],
                        layers=job["layers"]).to(device)
    # the batch sizes the run uses: blocks are chosen by the number of programs (B·H), so a smaller
    # batch could compile other variants
    tokens, targets = batch(job["n_pairs"], job["batch_size"], job["vocab"], device=device)
    loss_fn(model, tokens, targets).backward()
    model.eval()
    accuracy(model, job["n_pairs"], job["vocab"], device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start
