"""Context parallelism (across processes) and SM parallelism (within one device) by affine maps.

A slice of the sequence acts on the state entering it as one affine map S' = M S + B (affine.py).
Context parallel, on every rank r holding a contiguous slice:
  1. local: chunk maps and their prefix scan from a zero entering state; the slice's own map
     (M_r, B_r) is the last prefix; the outputs from a zero state O_local follow at once;
  2. exchange: all_gather of (M_r, B_r) — two small [B, H, K, K] and [B, H, K, V] tensors per rank,
     whatever the slice length;
  3. fold: S_r = (map_{r−1} ∘ … ∘ map_0)(S_0), the true state entering the slice;
  4. correct: outputs are affine in the entering state, O = O_local + P_n (M_pre_{n−1} S_r) chunk by chunk.
SM parallel is the same algebra on one device: the sequence is cut into sub-sequences that run as
extra batch entries, and their maps are merged by a scan over the sub-sequence axis.
Works for all four operations: pass the library function's positional tensors after `op`.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
from dataclasses import dataclass

import torch

from . import affine, testing
from .chunk.delta import from_chunks
from .naive.linear import initial
from .validate import InputError, check_chunk

OPS = affine.OPS


@dataclass
class Local:
    maps: affine.ChunkMaps
    M_pre: torch.Tensor   # [B, H, N, K, K]  chunks 0..n composed
    B_pre: torch.Tensor   # [B, H, N, K, V]
    o_local: torch.Tensor  # [B, T, H, V] outputs from a zero entering state (accumulation dtype)

    @property
    def total(self):
        """The whole slice as one map (M, B): [B, H, K, K], [B, H, K, V]."""
        return self.M_pre[:, :, -1], self.B_pre[:, :, -1]


def local_pass(op, args, *, scale, chunk_size):
    """Steps 1 of both schemes: everything a slice can do before it knows its entering state."""
    maps, d = affine.chunk_maps(op, *args, scale=scale, chunk_size=chunk_size)
    M_pre, B_pre, _ = affine.prefix_scan(maps.M, maps.B)
    zero = torch.zeros(d.B, d.H, d.K, d.V, dtype=d.acc, device=args[0].device)
    entering, _ = affine.entering_states(M_pre, B_pre, zero)
    return Local(maps, M_pre, B_pre, affine.chunk_outputs(maps, entering)), d


def corrected(local: Local, S):
    """O_local plus what the entering state S [B, H, K, V] adds: P_n (M_pre_{n−1} S) per chunk."""
    reach = torch.cat([S[:, :, None], local.M_pre[:, :, :-1] @ S[:, :, None]], 2)  # [B, H, N, K, V]
    return local.o_local + from_chunks(local.maps.P @ reach, local.maps.T)


def fold_maps(Ms, Bs, S0):
    """States entering each of the R pieces and the state after all of them (R small: sequential)."""
    entering, S = [], S0
    for M, B in zip(Ms, Bs):
        entering.append(S)
        S = affine.apply(M, B, S)
    return entering, S


def context_parallel(op, *args, scale=None, initial_state=None, output_final_state=False,
                     chunk_size=64, group=None):
    """Call on every rank of `group` with that rank's contiguous slice of the sequence (axis 1).

    `initial_state` is the state before the whole sequence (the same on every rank). Returns this
    rank's outputs and, if asked, the final state of the whole sequence (on every rank).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InputError("group: context_parallel needs torch.distributed initialised "
                         "(dist.init_process_group) on every rank")
    q, v = args[0], args[2]
    affine.validate(op, *affine.split_args(op, args), scale, initial_state)  # before any work
    local, d = local_pass(op, args, scale=scale, chunk_size=chunk_size)
    M_r, B_r = (x.contiguous() for x in local.total)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    Ms = [torch.empty_like(M_r) for _ in range(world)]
    Bs = [torch.empty_like(B_r) for _ in range(world)]
    dist.all_gather(Ms, M_r, group=group)
    dist.all_gather(Bs, B_r, group=group)
    entering, final = fold_maps(Ms, Bs, initial(initial_state, d, q.device))
    o = corrected(local, entering[rank])
    return o.to(v.dtype), (final if output_final_state else None)


def slice_bounds(T, world, rank):
    """The contiguous tokens [start, end) of rank `rank` when T tokens are split as evenly as possible."""
    base, extra = divmod(T, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def sm_parallel(op, *args, splits, scale=None, initial_state=None, output_final_state=False,
                chunk_size=64):
    """One long sequence cut into `splits` sub-sequences that run side by side as batch entries.

    Sub-sequences are whole numbers of chunks long; the last one is padded with identity tokens
    (q = k = v = 0, β = 0, g = 0). Their maps are merged by a prefix scan over the sub-sequences.
    """
    if not (isinstance(splits, int) and not isinstance(splits, bool) and splits >= 1):
        raise InputError(f"splits must be an int ≥ 1, got {splits!r}")
    q, k, v, g, beta = affine.split_args(op, args)
    d = affine.validate(op, q, k, v, g, beta, scale, initial_state)
    check_chunk(chunk_size)
    L = -(-d.T // (splits * chunk_size)) * chunk_size                 # whole chunks per piece

    def cut(x):  # [B, T, H, *] → [B·splits, L, H, *], zero-padded at the end
        if x is None:
            return None
        pad = torch.zeros((d.B, splits * L - d.T) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
        x = torch.cat([x, pad], 1)
        return x.reshape((d.B * splits, L) + tuple(x.shape[2:]))

    pieces = tuple(cut(x) for x in (q, k, v, g, beta) if x is not None)
    local, _ = local_pass(op, pieces, scale=d.scale, chunk_size=chunk_size)
    M, B = (x.reshape((d.B, splits) + tuple(x.shape[1:])).transpose(1, 2) for x in local.total)
    M_pre, B_pre, _ = affine.prefix_scan(M, B)                         # over sub-sequences
    S0 = initial(initial_state, d, q.device)
    entering, final = affine.entering_states(M_pre, B_pre, S0)        # [B, H, splits, K, V]
    S = entering.transpose(1, 2).reshape(d.B * splits, d.H, d.K, d.V)
    o = corrected(local, S).reshape(d.B, splits * L, d.H, d.V)[:, :d.T]
    return o.to(v.dtype), (final if output_final_state else None)


# ---------------------------------------------------------------- a self-check across processes

def free_port():
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ARG_NAMES = {"linear_attn": ("q", "k", "v"), "gla": ("q", "k", "v", "g"),
             "delta_rule": ("q", "k", "v", "beta"), "kda": ("q", "k", "v", "g", "beta")}
SIZES = dict(B=1, T=203, H=2, K=16, V=24)


def problem(op, seed, sizes=SIZES, dtype=torch.float32):
    """The positional tensors and the initial state of one self-check problem (CPU)."""
    a = testing.make_inputs(op, **sizes, dtype=dtype, gate="per_dim", strength="normal",
                            initial_state=True, seed=seed)
    return tuple(a[n] for n in ARG_NAMES[op]), a["initial_state"]


def _worker(rank, world, backend, port, ops, sizes, chunk_size, seed, outdir):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for op in ops:
            args, S0 = problem(op, seed, sizes)
            s, e = slice_bounds(sizes["T"], world, rank)
            mine = tuple(x[:, s:e].to(device) for x in args)
            o, S = context_parallel(op, *mine, initial_state=S0.to(device), output_final_state=True,
                                    chunk_size=chunk_size)
            torch.save({"o": o.cpu(), "S": S.cpu()}, os.path.join(outdir, f"{op}.{rank}.pt"))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _children_skip_main_script():
    """Spawned children re-run the parent's main *script* (by its __file__) before unpickling the
    worker. The worker lives in this module, so they need none of it — and a chapter run as a
    plain script would otherwise execute itself again in every child. Hide the path meanwhile."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is not None:
        del main.__file__
    try:
        yield
    finally:
        if path is not None:
            main.__file__ = path


def reference(op, args, S0, chunk_size):
    """float64 single-process result: the naive level when it has `op`, else the sequential fold."""
    from . import naive

    args64 = tuple(x.double() for x in args)
    fn = getattr(naive, op, None)
    if fn is not None:
        return fn(*args64, initial_state=S0.double(), output_final_state=True), f"naive.{op}"
    return (affine.run(op, *args64, initial_state=S0.double(), output_final_state=True,
                       chunk_size=chunk_size, method="fold"), "affine.run(fold)")


def selfcheck(world=2, backend="gloo", ops=OPS, *, sizes=SIZES, chunk_size=16, seed=0):
    """Run `context_parallel` on `world` processes (one per GPU for nccl) and compare each op with
    the float64 single-process result. Returns {op: {"o": rel err, "final_state": rel err, "ref": ...}}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir, _children_skip_main_script():
        mp.spawn(_worker, args=(world, backend, free_port(), tuple(ops), dict(sizes), chunk_size,
                                seed, outdir), nprocs=world, join=True)
        parts = {op: [torch.load(os.path.join(outdir, f"{op}.{r}.pt")) for r in range(world)]
                 for op in ops}
    errors = {}
    for op in ops:
        args, S0 = problem(op, seed, sizes)
        (o_ref, S_ref), used = reference(op, args, S0, chunk_size)
        o = torch.cat([p["o"] for p in parts[op]], 1)
        finals = [testing.rel_err(p["S"], S_ref) for p in parts[op]]
        errors[op] = {"o": testing.rel_err(o, o_ref), "final_state": max(finals), "ref": used}
    return errors
