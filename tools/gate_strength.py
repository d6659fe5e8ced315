"""Measure how strongly forget gates decay over a 64-token chunk; write book/data/gate_strength.json.

The kernels' fast path (the split, `linattn.decay.split`) needs every key dimension of a chunk to
decay by less than e^60. This tool measures, per gate distribution, the chunk decay −b_C (per
chunk, head and key dimension; `linattn.gate_stats`), and the fraction of 16-token blocks that
decay past the same bound (what a split with its reference point at each block's start would still
refuse):

    mild          logσ(x)/16, x ~ N(0, 1): the tests' and benchmarks' "normal" gates
    strong        −20·U(0, 1) per token: the tests' "strong" gates
    gla_raw       logσ(x), x ~ N(0, 1): GLA's sigmoid without the temperature τ = 16
    gla_init      the GLA layer's gate as linattn initialises it (low rank, b = 4, τ = 16), x ~ N(0, 1)
    gla_init_b0   the same with the output bias at PyTorch's default (near 0) instead of 4
    mamba2_init   Mamba-2 / Gated DeltaNet: −exp(A_log)·softplus(xW + dt_bias) per head, A ~ U(1, 16),
                  dt log-uniform in [1e-3, 0.1], dt_bias = softplus⁻¹(dt), x ~ N(0, 1)
    kda_init      KDA: the same per key dimension (low-rank W, dt_bias from the same dt)
    kda_init_dt0  KDA with dt_bias = 0
    ch14_gla, ch14_kda  the GLA and KDA models chapter 14 trains on a CPU (same sizes, steps, seeds),
                  their gates on MQAR sequences laid end to end, before and after training

    python tools/gate_strength.py              # about 2 minutes on one CPU thread
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linattn import bench, gate_stats, mqar, testing  # noqa: E402
from linattn.nn.gates import LogGate  # noqa: E402

C = 64
BLOCK = 16                         # the sub-chunk: a candidate split's reference point (gate_stats.frac_past_bound)
# Chapter 14's CPU configuration (book/14_training.py: `pick(cpu=...)`).
CH14 = dict(vocab=64, pairs=12, d_model=32, n_heads=4, layers=1, steps=600, batch=32, lr=1e-2, seed=0)


def random_x(B, T, d, seed):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def layer_gates(make, *, seeds, B, T, d):
    """Log-gates of a freshly initialised gate, one layer per seed, on x ~ N(0, 1) [B, T, d]."""
    out = []
    for s in seeds:
        torch.manual_seed(s)
        gate = make(torch.Generator().manual_seed(s))
        out.append(gate(random_x(B, T, d, 1000 + s)))
    return torch.cat(out)


def model_gates(model, n_pairs, vocab, *, size=256, seed=1234):
    """The forget gates every block's mixer produces on `size` MQAR sequences of n_pairs pairs,
    laid end to end as one stream (a packed batch) and cut into chunks of C tokens."""
    seen = []
    hooks = [b.mixer.gate.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
             for b in model.blocks]
    tokens, _ = mqar.batch(n_pairs, size, vocab, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.eval()
        model(tokens)
    for h in hooks:
        h.remove()
    return torch.cat([g.flatten(0, 1)[None] for g in seen])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "book" / "data" / "gate_strength.json"))
    p.add_argument("--no-train", action="store_true", help="skip chapter 14's models")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()

    B, T = 2, 2048                     # 64 chunks per layer and sequence batch
    d, H, K = 2048, 16, 128            # FLA's KDA defaults (hidden 2048, 16 heads of 128)
    seeds = range(4)
    gen = torch.Generator().manual_seed(0)
    dists = {}

    def add(name, what, g, **setting):
        """g: log-gates [B, T, H, K] or [B, T, H] of one distribution."""
        dists[name] = {"what": what, **setting, **gate_stats.summary(gate_stats.chunk_decays(g, C)),
                       "block_size": BLOCK, "frac_blocks_past_bound": gate_stats.frac_past_bound(g, BLOCK)}
        s = dists[name]
        print(f"{name:13s} p50 {s['percentiles']['50']:8.2f}  p99 {s['percentiles']['99']:8.2f}  "
              f"max {s['max']:8.1f}  strongest dim p50 {s['strongest_dim_percentiles']['50']:8.2f}  "
              f"past e^60: chunks {s['frac_chunks_past_bound']:.1%}, {BLOCK}-token blocks "
              f"{s['frac_blocks_past_bound']:.2%}", flush=True)

    shape = (len(seeds) * B, T, H, K)
    add("mild", "logσ(x)/16, x ~ N(0, 1) (testing.log_gates 'normal')",
        testing.log_gates(shape, "normal", generator=gen), shape=list(shape))
    add("strong", "−20·U(0, 1) per token (testing.log_gates 'strong')",
        testing.log_gates(shape, "strong", generator=gen), shape=list(shape))
    add("gla_raw", "logσ(x), x ~ N(0, 1): no temperature",
        torch.nn.functional.logsigmoid(torch.randn(shape, generator=gen)), shape=list(shape))
    layer = dict(d_model=d, heads=H, head_k=K, layers=len(seeds), batch=B, T=T, x="N(0, 1)")
    add("gla_init", "GLA gate as initialised: logσ(x W₁W₂ + b)/16, rank 16, b = 4",
        layer_gates(lambda g: LogGate(d, H, K), seeds=seeds, B=B, T=T, d=d), **layer)

    def gla_b0(g):
        gate = LogGate(d, H, K)
        lin = gate.out_layer
        torch.nn.init.uniform_(lin.bias, -lin.in_features ** -0.5, lin.in_features ** -0.5)   # PyTorch's default
        return gate
    add("gla_init_b0", "GLA gate with PyTorch's default bias (|b| ≤ 1/4) instead of 4",
        layer_gates(gla_b0, seeds=seeds, B=B, T=T, d=d), **layer)
    H2 = 64                            # Mamba-2 at d = 2048: 4096 inner channels in heads of 64
    add("mamba2_init", "Mamba-2 / Gated DeltaNet: −exp(A_log)·softplus(xW + dt_bias), one per head, "
        "A ~ U(1, 16), dt log-uniform [1e-3, 0.1], dt_bias = softplus⁻¹(dt)",
        layer_gates(lambda g: gate_stats.SoftplusGate(d, H2, generator=g), seeds=seeds, B=B, T=T, d=d),
        **{**layer, "heads": H2, "head_k": 1})
    add("kda_init", "KDA: the same per key dimension, W low rank (d → 128 → H·K), dt_bias = softplus⁻¹(dt)",
        layer_gates(lambda g: gate_stats.SoftplusGate(d, H, K, generator=g), seeds=seeds, B=B, T=T, d=d),
        **layer)
    add("kda_init_dt0", "KDA with dt_bias = 0",
        layer_gates(lambda g: gate_stats.SoftplusGate(d, H, K, dt_init="zero", generator=g),
                    seeds=seeds, B=B, T=T, d=d), **layer)

    trained = {}
    if not args.no_train:
        cfg = CH14
        for name in ("gla", "kda"):
            torch.manual_seed(cfg["seed"])
            model = mqar.RecallModel(name, cfg["vocab"], d_model=cfg["d_model"], n_heads=cfg["n_heads"],
                                     layers=cfg["layers"])
            add(f"ch14_{name}_init", f"chapter 14's {name.upper()} model before training, on MQAR "
                f"sequences ({cfg['pairs']} pairs) laid end to end",
                model_gates(model, cfg["pairs"], cfg["vocab"]), **cfg)
            run = mqar.train(model, n_pairs=cfg["pairs"], vocab=cfg["vocab"], steps=cfg["steps"],
                             batch_size=cfg["batch"], lr=cfg["lr"], seed=cfg["seed"], progress=False)
            trained[name] = {"accuracy": run.accuracy, "cpu_seconds": round(run.cpu_seconds, 1)}
            add(f"ch14_{name}", f"chapter 14's {name.upper()} model after {cfg['steps']} steps "
                f"(recall {run.accuracy:.2f}), on MQAR sequences ({cfg['pairs']} pairs) laid end to end",
                model_gates(model, cfg["pairs"], cfg["vocab"]), **cfg)

    env = bench.environment()
    env.pop("fla", None)
    seeds_used = {"synthetic gates": "torch.Generator().manual_seed(0), drawn in the order listed",
                  "layers": f"torch.manual_seed(s) and Generator(s) for A, dt, s in {list(seeds)}",
                  "layer inputs x": "Generator(1000 + s)", "chapter 14 models": "torch.manual_seed(0), train(seed=0)",
                  "MQAR evaluation batch": "Generator(1234), 256 sequences"}
    record = {"env": env, "device": "cpu", "chunk_size": C, "threads": 1, "seeds": seeds_used,
              "seconds": round(time.perf_counter() - start, 1), "trained": trained, "distributions": dists}
    Path(args.out).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out} ({record['seconds']} s)")


if __name__ == "__main__":
    main()
