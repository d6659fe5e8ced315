"""Decoding measured: one generated token, fused step vs unfused step vs softmax with a KV cache.

    from linattn import bench_decode; print(bench_decode.report(bench_decode.measure()))
    python tools/bench_decode.py [--size small|full] [--op kda|gla] [--out FILE]   (the same, as a script)

For each context length L (tokens already read), one decode step of one layer's memory for a batch
of B sequences and H heads, and the bytes that step must move:

  fused     linattn.triton.step: one kernel reads each block of S once and writes it once
            (compiled on a GPU; under the Triton interpreter on a CPU a time would measure Python,
            so none is taken there: the fused step is only checked against the unfused one)
  unfused   linattn.naive.step: the same step as PyTorch operations (decay, residual, write,
            read-out), each a pass over S
  softmax   one query against a KV cache of L keys and values (SDPA), the new key and value
            written into a preallocated cache first

Bytes per step: a recurrent step reads S and writes it back (float32 B·H·K·V numbers, twice) plus
one token's q, k, v, g, β and o, at every L; softmax reads its whole cache (2·B·H·L·D numbers in
the model's dtype) plus the new row and o. The floor is bytes / bandwidth, the bandwidth measured
as a device-to-device copy (read + write). Sizes come from linattn.device (--size overrides, as
LINATTN_SIZE does): small on a CPU, the anchor heads (H = 16, K = V = 128, bf16) on a GPU.

Times: on a GPU the median of triton.testing.do_bench (L2 cache flushed between runs, so S is read
from memory as it is when a model's layers take turns); on a CPU the fastest of several runs on one
thread (linattn.bench.fastest_ms). A benchmark, not a test: nothing about speed is asserted.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import bench, device, naive, testing

SIZES = {
    "small": dict(B=1, H=2, K=32, V=32, dtype=torch.float32, Ls=[64, 256, 1024, 4096, 16384]),
    "full": dict(B=8, H=16, K=128, V=128, dtype=torch.bfloat16, Ls=[256, 1024, 4096, 16384, 65536]),
}


def step_inputs(op: str, B, H, K, V, dtype, dev) -> dict:
    """One token's q, k, v (g, β) [B, H, ·] and a float32 state [B, H, K, V]."""
    args = testing.make_inputs(op, B=B, T=1, H=H, K=K, V=V, dtype=dtype, device=dev, seed=0)
    tok = {n: a[:, 0] for n, a in args.items()}
    tok["state"] = torch.randn(B, H, K, V, device=dev) / K ** 0.5
    return tok


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def recurrent_bytes(tok: dict) -> int:
    """S read and written once, the token's inputs read, o written (in v's dtype)."""
    return nbytes(*tok.values()) + nbytes(tok["state"]) + nbytes(tok["v"])


def check_fused(op: str, tok: dict) -> float:
    """Relative error of the fused step's (o, S) against the unfused step's: the same computation."""
    from linattn.triton import step as fused

    o, S = getattr(fused, op + "_step")(**tok)
    o_ref, S_ref = getattr(naive, op + "_step")(**testing.to_float64(tok))
    err = max(testing.rel_err(o, o_ref), testing.rel_err(S, S_ref))
    assert err < testing.tolerance(tok["v"].dtype), f"fused {op} step differs from the naive step: {err:.2e}"
    return err


def softmax_step(B, H, L, D, dtype, dev):
    """A function running one decode step of softmax attention after L tokens, and its bytes."""
    q, k, v = (torch.randn(B, H, 1, D, device=dev, dtype=dtype) for _ in range(3))
    cache_k, cache_v = (torch.randn(B, H, L + 1, D, device=dev, dtype=dtype) for _ in range(2))

    def run():
        cache_k[:, :, L:] = k                                          # append the new key and value
        cache_v[:, :, L:] = v
        return F.scaled_dot_product_attention(q, cache_k, cache_v)     # one query sees every key

    return run, nbytes(cache_k, cache_v, q, k, v) + nbytes(q)          # cache read, row written, o


def bandwidth(dev) -> float:
    """Bytes per second a copy moves (read + write): the speed a memory-bound step can reach."""
    if dev == "cuda":
        return bench.copy_bandwidth()
    x = torch.empty(1 << 24)                                           # 64 MiB: beyond the caches
    y = torch.empty_like(x)
    return 2 * nbytes(x) / (bench.fastest_ms(lambda: y.copy_(x), runs=5) * 1e-3)


def time_ms(fn) -> float:
    if torch.cuda.is_available():
        return bench.median_ms(fn)
    return bench.fastest_ms(fn, runs=20)


def measure(size: str | None = None, op: str = "kda", progress=print) -> dict:
    """Run the benchmark at `size` ('small' | 'full'; default: what linattn.device chooses)."""
    size = size or device.size_mode()
    cfg = SIZES[size]
    B, H, K, V, dtype, Ls = (cfg[n] for n in ("B", "H", "K", "V", "dtype", "Ls"))
    dev = device.default_device()
    native = device.triton_mode() == "native"
    tok = step_inputs(op, B, H, K, V, dtype, dev)
    err = check_fused(op, tok)
    bw = bandwidth(dev)
    with torch.no_grad():
        unfused = time_ms(lambda: getattr(naive, op + "_step")(**tok))
        fused = None
        if native:
            from linattn.triton import step as fused_mod
            fused = time_ms(lambda: getattr(fused_mod, op + "_step")(**tok))
        soft_ms, soft_bytes = [], []
        for L in Ls:
            run, n = softmax_step(B, H, L, K, dtype, dev)
            soft_ms.append(time_ms(run))
            soft_bytes.append(n)
            progress(f"L = {L}: softmax {soft_ms[-1]:.4f} ms")
            del run
    rec_bytes = recurrent_bytes(tok)
    return {
        "env": dict(bench.environment(), triton_mode=device.triton_mode(), size=size,
                    load_average=os.getloadavg()[0] if dev == "cpu" else None),
        "setting": dict(op=op, B=B, H=H, K=K, V=V, D=K, dtype=str(dtype).replace("torch.", ""),
                        state_dtype="float32"),
        "fused_vs_unfused_rel_err": err,
        "bandwidth_bytes_per_s": bw,
        "L": Ls,
        # The recurrent step does not depend on L: one time, drawn flat across the contexts.
        "ms": {"fused": fused, "unfused": unfused, "softmax": soft_ms},
        "bytes": {"recurrent": rec_bytes, "softmax": soft_bytes},
        "floor_ms": {"recurrent": rec_bytes / bw * 1e3, "softmax": [n / bw * 1e3 for n in soft_bytes]},
    }


def report(r: dict) -> str:
    """The measurement as a table: per L, time and bytes of each step, and the floors."""
    s, ms, fl = r["setting"], r["ms"], r["floor_ms"]
    lines = [f"{r['env']['device']} · {r['env']['date']} · torch {r['env']['torch']} · triton "
             f"{r['env']['triton']} ({r['env']['triton_mode']}) · {s['op']}, B = {s['B']}, H = {s['H']}, "
             f"K = V = {s['K']}, {s['dtype']} (state float32) · copy bandwidth "
             f"{r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
             f"{'L':>7} | {'fused ms':>9} {'unfused ms':>10} {'floor ms':>9} {'MiB':>7} | "
             f"{'softmax ms':>10} {'floor ms':>9} {'MiB':>8}"]
    fused = "—" if ms["fused"] is None else f"{ms['fused']:.4f}"
    for i, L in enumerate(r["L"]):
        lines.append(f"{L:>7} | {fused:>9} {ms['unfused']:>10.4f} {fl['recurrent']:>9.4f} "
                     f"{r['bytes']['recurrent'] / 2**20:>7.2f} | {ms['softmax'][i]:>10.4f} "
                     f"{fl['softmax'][i]:>9.4f} {r['bytes']['softmax'][i] / 2**20:>8.2f}")
    return "\n".join(lines)
