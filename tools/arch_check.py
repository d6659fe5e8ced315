"""Compile every Triton kernel configuration offline for every GPU architecture a reader may have.

    .venv/bin/python tools/arch_check.py                # the full matrix: book/data/architectures.json
    .venv/bin/python tools/arch_check.py --subset ci    # the representative subset CI compiles
    .venv/bin/python tools/arch_check.py --deep-log F   # keep the register pass's results in F as they
                                                        # come: a cut run, started again, goes on

No GPU is needed. The launch configurations are not listed by hand: the real wrappers
(linattn.triton.linear_attn, gla, delta_rule, kda, forward and backward, and the decode steps) run
on CPU tensors with Triton in compiled mode and a launch that records instead of running
(`capture`). Each recorded configuration (kernel, argument types and alignment, constexprs, warps,
pipeline stages) is then compiled with `triton.compile` for a `GPUTarget` of each architecture in
`ARCHS`; the shared memory comes from the compiled metadata, registers and spills from the cubin
(`cuobjdump --dump-resource-usage`, from Triton's wheel).

A launch through `common.launch` retries fewer pipeline stages when the kernel does not fit
(OutOfResources at load time); `fit_stages` applies the same rule per architecture: the most
stages from the wrapper's maximum down that fit. The fused GLA program falls back to the states
mode when it does not fit (`FALLBACKS`), so its not fitting is allowed, not an error.

Must run in a process of its own: TRITON_INTERPRET is decided when linattn is imported, and here it
must be 0 (compiled mode) on a machine without CUDA. `main` re-executes itself when needed.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "book" / "data" / "architectures.json"

# compute capability: (GPUs, shared memory per block with opt-in in bytes). NVIDIA CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability": maximum shared memory per
# thread block 64 KB (7.5), 163 KB (8.0), 99 KB (8.6, 8.9), 227 KB (9.0). Triton compares its
# kernels' shared memory with the same opt-in maximum before a launch.
ARCHS = {
    75: ("T4", 64 * 1024),
    80: ("A100", 163 * 1024),
    86: ("RTX 30", 99 * 1024),
    89: ("L4, RTX 40", 99 * 1024),
    90: ("H100, H200", 227 * 1024),
}
REGS_PER_THREAD = 255          # every architecture here
REGS_PER_SM = 64 * 1024        # registers a block of num_warps · 32 threads may take at most
# Launches whose not fitting the wrapper handles itself (it catches OutOfResources).
FALLBACKS = {"_fused_kernel": "runs in states mode",
             "_dchunk_kernel": "32-wide V-blocks (delta_backward.dchunk_stage)",
             "_dstate_kernel": "one product per carried gradient (delta_backward.dstate_stage)"}

HEAD_DIMS = (16, 32, 64, 128, 256)


# ------------------------------------------------------------------------------------- capture

def _native_import():
    """Import linattn with Triton in compiled mode though there is no CUDA (see module doc)."""
    if os.environ.get("TRITON_INTERPRET") != "0":
        raise RuntimeError("tools/arch_check.py must run with TRITON_INTERPRET=0 (run it as a script)")
    import linattn.triton  # noqa: F401
    from linattn.triton import common
    return common


Record = collections.namedtuple("Record", "fn signature constexprs attrs warps stages max_stages")


SMS = [132]   # the multiprocessor count the wrappers see while recording


@contextlib.contextmanager
def recording(sms: int = 132):
    """Within: every Triton launch of linattn.triton is recorded in the yielded list, not run.
    sms: the multiprocessor count the wrappers see (they choose blocks and modes by it); SMS[0]
    may be changed inside."""
    SMS[0] = sms
    import importlib
    import types
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    common = _native_import()
    backend = make_backend(GPUTarget("cuda", 90, 32))  # argument specialisation is the same for every sm
    binders, records = {}, []
    launch_code = common.launch.__code__

    def fake_run(self, *args, grid, warmup, **kwargs):
        if self not in binders:
            binders[self] = create_function_from_signature(self.signature, self.params, backend)
        bound, spec, opts = binders[self](*args, **kwargs)
        _, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, spec, opts)
        max_stages = None
        f = sys._getframe(1)
        while f is not None:                 # launched by common.launch: it would retry fewer stages
            if f.f_code is launch_code:
                max_stages = f.f_locals["max_stages"]
                break
            f = f.f_back
        records.append(Record(self, signature, constexprs, attrs, kwargs.get("num_warps", 4),
                              kwargs.get("num_stages", 3), max_stages))
        return types.SimpleNamespace(n_regs=0, n_spills=0, metadata=types.SimpleNamespace(shared=0))

    def no_device_check(q):
        if q.dtype not in common.TRITON_DTYPES:
            raise common.InputError(f"q has dtype {q.dtype}")

    patched = [(JITFunction, "run", fake_run)]
    for name in ("common", "gated", "gated_backward", "delta", "delta_backward", "wy", "wy_backward",
                 "step", "linear"):
        mod = importlib.import_module(f"linattn.triton.{name}")
        if hasattr(mod, "check_kernel_inputs"):
            patched.append((mod, "check_kernel_inputs", no_device_check))
        if hasattr(mod, "num_sms"):
            patched.append((mod, "num_sms", lambda: SMS[0]))
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patched]
    for obj, attr, new in patched:
        setattr(obj, attr, new)
    try:
        yield records
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)
        triton  # noqa: B018  (imported for its side effects on the JIT registry)


def calls(full: bool):
    """(label, thunk) for every wrapper call of the enumeration. full=False: the CI subset."""
    import torch
    import linattn.triton as lt
    from linattn.triton import segments, step
    from linattn import support, testing

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    # (B, H, T, SMs): the wrappers choose blocks and modes by B·H against the SM count: a problem of
    # 2 heads on an H100's 132 SMs (few programs) and one of 16 heads on 8 SMs (programs to spare),
    # which takes the other branch of every such choice with small tensors. T > 256: no chunk
    # count is 1 (Triton would make it a constant and fold the chunk loop).
    shapes = [(1, 2, 300, 132), (2, 8, 300, 8)]
    if full:
        dims = [(d, d) for d in HEAD_DIMS] + [(64, 128), (128, 64), (16, 256), (256, 16)]
        gla_chunks = [(C, c) for C in (16, 32, 64, 128, 256) for c in (16, 32, 64) if c <= C]   # linattn.support
        delta_chunks = (16, 32, 64)
    else:   # the largest tiles of every kernel, every dtype: what CI compiles (`representative`)
        dims = [(128, 128), (256, 256)]
        gla_chunks = [(64, 16), (256, 16)]
        delta_chunks = (64,)

    def run(op, kw, B, H, T, K, V, dtype, backward, sms, **extra):
        def thunk():
            SMS[0] = sms
            args = testing.make_inputs(op, B=B, T=T, H=H, K=K, V=V, dtype=dtype, initial_state=kw["h0"],
                                       gate=kw.get("gate", "per_dim"), gate_dtype=kw.get("gdt", torch.float32))
            if backward:
                for x in args.values():
                    x.requires_grad_(True)
            fn = {"linear_attn": lt.linear_attn, "gla": lt.gla, "delta_rule": lt.delta_rule, "kda": lt.kda}[op]
            # kw["segments"]: the state passes cut into segments of that many chunks (segments.py: the
            # rule cuts only walks of hundreds of chunks, which these small tensors never reach)
            with segments.fixed(kw["segments"]) if "segments" in kw else contextlib.nullcontext():
                o, sT = fn(**args, output_final_state=kw["hT"], **extra)
                if backward:
                    loss = o.float().sum() + (sT.sum() if sT is not None else 0)
                    loss.backward()
        return thunk

    out = []
    for (K, V), (B, H, T, sms), dtype in itertools.product(dims, shapes, dtypes):
        gdts = (torch.float32, dtype) if dtype != torch.float32 else (torch.float32,)
        # initial and final state on: the launches without them run a subset of the code (`group`)
        for h0, hT in ((True, True),):
            base = dict(h0=h0, hT=hT)
            for backward, recompute in ((False, True), (True, True), (True, False)):
                tag = f"K={K} V={V} B={B} H={H} T={T} SMs={sms} {str(dtype)[6:]} h0={h0} " + (
                    f"backward recompute={recompute}" if backward else "forward")
                for C, c in gla_chunks:
                    if C > support.max_triton_chunk("gla", dtype):
                        continue             # refused before any launch (float32 stops earlier)
                    kw = dict(chunk_size=C, recompute=recompute)
                    # the state passes in segments (two chunks each) where few programs would cut them
                    cuts = ((), (2,)) if B == 1 and c == 16 else ((),)
                    for cut in cuts:
                        at = dict(base, segments=cut[0]) if cut else base
                        label = " segments=2" if cut else ""
                        if c == 16:
                            out.append((f"linear_attn C={C} {tag}{label}",
                                        run("linear_attn", at, B, H, T, K, V, dtype, backward, sms, **kw)))
                        for gate, gdt in itertools.product(("per_dim", "per_head"), gdts):
                            if c != 16 and (gate == "per_head" or gdt != torch.float32):
                                continue     # sub-chunks: per-dimension gates only; gate dtypes at one
                            out.append((f"gla {gate} C={C} c={c} {tag}{label}",
                                        run("gla", dict(at, gate=gate, gdt=gdt), B, H, T, K, V, dtype, backward,
                                            sms, sub_chunk_size=c, **kw)))
                for C in delta_chunks:
                    kw = dict(chunk_size=C, recompute=recompute)
                    for gdt in gdts:
                        out.append((f"delta_rule C={C} {tag}",
                                    run("delta_rule", dict(base, gdt=gdt), B, H, T, K, V, dtype, backward, sms, **kw)))
                        for gate in ("per_dim", "per_head"):
                            out.append((f"kda {gate} C={C} {tag}",
                                        run("kda", dict(base, gate=gate, gdt=gdt), B, H, T, K, V, dtype,
                                            backward, sms, **kw)))
        # the decode step: one token
        for op, gate in (("linear_attn", None), ("gla", "per_dim"), ("gla", "per_head"), ("delta_rule", None),
                         ("kda", "per_dim"), ("kda", "per_head")):
            def thunk(op=op, gate=gate, K=K, V=V, B=B, H=H, dtype=dtype):
                SMS[0] = 132
                a = testing.make_inputs(op, B=B, T=1, H=H, K=K, V=V, dtype=dtype, gate=gate or "per_dim",
                                        initial_state=True)
                one = {n: (x[:, 0] if n != "initial_state" else x) for n, x in a.items()}
                state = one.pop("initial_state")
                getattr(step, f"{op}_step")(**one, state=state)
            out.append((f"{op}_step {gate} K={K} V={V} {str(dtype)[6:]}", thunk))
    return out


def capture(full: bool, sms: int = 132):
    """Unique configurations {key: (Record, [labels])}, in first-seen order."""
    configs = {}
    with recording(sms) as records:
        todo = calls(full)
        for i, (label, thunk) in enumerate(todo):
            if i % 500 == 0:
                print(f"  capturing {i}/{len(todo)}", file=sys.stderr, flush=True)
            del records[:]
            thunk()
            for r in records:
                key = config_key(r)
                if key not in configs:
                    configs[key] = (r, [])
                if len(configs[key][1]) < 3:
                    configs[key][1].append(label)
    return configs


def _flags(r: Record) -> dict:
    """The optional-tensor switches (HAS_*, STORE_*): a launch with a switch on runs the code of the
    launch with it off plus a load or store."""
    names = list(r.fn.signature.parameters)
    return {names[p[0]]: v for p, v in r.constexprs.items() if len(p) == 1 and isinstance(v, bool)
            and names[p[0]].startswith(("HAS_", "STORE_"))}


def _constexprs(r: Record) -> dict:
    names = list(r.fn.signature.parameters)
    return {names[p[0]]: _plain(v) for p, v in r.constexprs.items()
            if len(p) == 1 and r.fn.params[p[0]].is_constexpr}


def _rank(r: Record):
    """Which launch of a group to compile: the most switches on, then the fewest runtime sizes that
    Triton made constants (a chunk count of 1 folds the chunk loop and its pipelining away)."""
    folded = sum(1 for p in r.constexprs if len(p) == 1 and not r.fn.params[p[0]].is_constexpr)
    return sum(_flags(r).values()), -folded


def group(configs: dict) -> dict:
    """Configurations that differ only in argument alignment, in runtime sizes that happen to be 1
    (Triton makes those constants) or in optional-tensor switches share their tiles: one compile
    stands for them all, the one with the most switches on. {key: [Record, labels, variants]}."""
    out = {}
    for r, labels in configs.values():
        cs = _constexprs(r)
        tiles = tuple(sorted((n, v) for n, v in cs.items() if n not in _flags(r)))
        ptrs = tuple(t for t in r.signature.values() if isinstance(t, str) and t.startswith("*"))
        key = (r.fn.__name__, r.fn.module, tiles, ptrs, r.warps, r.stages, r.max_stages)
        if key not in out:
            out[key] = [r, list(labels), 1]
            continue
        entry = out[key]
        if _rank(r) > _rank(entry[0]):
            entry[0], entry[1] = r, list(labels)
        entry[2] += 1
    return out


SIZES = ("C", "c", "BR", "BW", "BK", "BV", "K", "V")   # constexprs that set tile shapes


def extremes(groups: dict) -> dict:
    """The groups the full run compiles. A family is the groups of one kernel that differ only in tile
    sizes (SIZES); in each, those whose tiles no other group's contain (shared memory and registers
    grow with every tile side, so these bound the family) and those that contain no other's (the
    narrowest tiles, where layouts and tl.dot meet their minimum sizes). Each entry also says how
    many groups its family has."""
    fams = collections.defaultdict(list)
    for key in groups:
        name, module, tiles, ptrs, warps, stages, max_stages = key
        rest = tuple((n, v) for n, v in tiles if n not in SIZES)
        fams[(name, module, rest, ptrs, warps, stages, max_stages)].append(key)
    out = {}
    for keys in fams.values():
        sizes = {k: {n: v for n, v in k[2] if n in SIZES} for k in keys}

        def le(a, b):
            return all(a.get(n, 0) <= b.get(n, 0) for n in set(a) | set(b))
        for k in keys:
            s = sizes[k]
            top = not any(o != s and le(s, o) for o in sizes.values())
            bottom = not any(o != s and le(o, s) for o in sizes.values())
            if top or bottom:
                out[k] = list(groups[k]) + [len(keys)]
    return out


def representative(groups: dict) -> dict:
    """CI's subset: per kernel and tile dtype (float32 or half precision), the group with the largest
    tiles (shared memory grows with their product and the element size)."""
    best = {}
    for key, (r, labels, n) in groups.items():
        half = any(t in ("*bf16", "*fp16") for t in key[3])
        dt = "fp16" if "*fp16" in key[3] else ("bf16" if half else "fp32")
        kind = (key[0], key[1], dt)
        w = _weight(r) * (2 if dt == "fp32" else 1) * (r.max_stages or r.stages)
        if kind not in best or w > best[kind][0]:
            best[kind] = (w, key)
    return {key: list(groups[key]) for _, key in best.values()}


def _plain(v):
    return str(v) if not isinstance(v, (int, float, bool, str, type(None))) else v


def config_key(r: Record):
    return (r.fn.__name__, r.fn.module, tuple(sorted(r.signature.items())),
            tuple(sorted((k, _plain(v)) for k, v in r.constexprs.items())),
            tuple(sorted((k, str(v)) for k, v in r.attrs.items())), r.warps, r.stages, r.max_stages)


def describe(r: Record) -> str:
    """The constexprs that set tile sizes and modes, in a short form for tables."""
    names = list(r.fn.signature.parameters)
    cs = {names[path[0]]: _plain(v) for path, v in r.constexprs.items() if len(path) == 1}
    keep = {k: v for k, v in cs.items() if k.isupper() and k not in ("T", "H", "NT")}
    dt = sorted({t[1:] for t in r.signature.values() if isinstance(t, str) and t.startswith("*")})
    return " ".join(f"{k}={str(v).replace('triton.language.', '')}" for k, v in keep.items()) + \
        f" ptr={'/'.join(dt)} warps={r.warps}"


# ------------------------------------------------------------------------------------- compile

def _ptxas_report(log: str) -> tuple[int, int]:
    """(registers per thread of the kernel, spill-store bytes summed over its functions) from
    `ptxas -v`. A kernel that calls non-inlined functions reports their stack as "cumulative stack
    size": that is call frames, not spills, so the spill counts are read line by line."""
    used = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return (int(used[0]) if used else 0), sum(int(x) for x in spills)


def _ptxas_verbose(ptx: str, cc: int) -> str:
    """ptxas -v on a compiled kernel's PTX, for a kernel that came from Triton's cache (no log)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        arch = sm_arch_from_capability(cc)
        proc = subprocess.run([get_ptxas(cc).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src),
                               "-o", str(Path(tmp) / "k.o")], capture_output=True, text=True)
        return proc.stderr + proc.stdout


class _Allocated(Exception):
    """Raised by the shared-memory-only pipeline with the bytes Triton allocated."""


def _shared_only_hook(*args):
    """A Triton stages hook that ends compilation right after shared memory is allocated: the same
    passes `make_llir` runs first (the number is the one Triton later reports as metadata.shared,
    checked in tests/test_architectures.py), without the lowering to LLVM and ptxas."""
    if not args:
        return "linattn-shared-only", "1"
    backend, stages, options, language, capability = args
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    def shared(mod, metadata):
        pm = ir.pass_manager(mod.context)
        passes.ttgpuir.add_combine_tensor_select_and_if(pm)
        passes.ttgpuir.add_allocate_warp_groups(pm)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(
            pm, capability, get_ptx_version_from_options(options, backend.target.arch))
        pm.run(mod, "linattn_shared_only")
        raise _Allocated(mod.get_int_attr("ttg.shared"))

    for name in ("llir", "ptx", "cubin"):
        stages.pop(name, None)
    stages["llir"] = shared


def compile_one(r: Record, cc: int, stages: int, depth: str = "cubin") -> dict:
    """Compile r for sm_cc with `stages` pipeline stages: shared bytes, registers, spills or error.
    depth "cubin": the whole compilation, ptxas included (registers and spills); "shared": up to
    Triton's shared-memory allocation only (no registers), several times faster."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import io

    t = time.perf_counter()
    knobs.runtime.add_stages_inspection_hook = _shared_only_hook if depth == "shared" else None
    knobs.nvidia.dump_ptxas_log = depth != "shared"
    log = io.StringIO()
    try:
        src = ASTSource(r.fn, r.signature, constexprs=r.constexprs, attrs=r.attrs)
        with contextlib.redirect_stdout(log):
            k = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                               options={"num_warps": r.warps, "num_stages": stages})
    except _Allocated as e:
        return dict(stages=stages, shared=e.args[0], seconds=round(time.perf_counter() - t, 2))
    except Exception as e:  # noqa: BLE001  (a compile error is a result here)
        msg = str(e).strip().splitlines()
        return dict(stages=stages, error=(msg[0] if msg else type(e).__name__)[:300],
                    seconds=round(time.perf_counter() - t, 2))
    finally:
        knobs.runtime.add_stages_inspection_hook = None
        knobs.nvidia.dump_ptxas_log = False
    text = log.getvalue()
    if "registers" not in text:                   # compiled earlier: Triton's cache ran no ptxas
        text = _ptxas_verbose(k.asm["ptx"], cc)
    regs, spill = _ptxas_report(text)
    return dict(stages=stages, shared=k.metadata.shared, regs=regs, spill=spill,
                seconds=round(time.perf_counter() - t, 2))


def fits(res: dict, cc: int, warps: int) -> bool:
    """Shared memory within the opt-in maximum; registers (where compiled that far) within the
    thread's and the SM's."""
    if "error" in res or res["shared"] > ARCHS[cc][1]:
        return False
    regs = res.get("regs", 0)
    return regs <= REGS_PER_THREAD and regs * warps * 32 <= REGS_PER_SM


def fallback(r: Record) -> str | None:
    """What the wrapper does where this launch does not fit, if it handles that itself (FALLBACKS):
    the fused GLA program runs in states mode; the delta rules' per-chunk kernel with its wide
    V-blocks (bf16/fp16, `delta_backward.chunk_block`) retries with the narrow ones; KDA's bf16
    reverse pass with two-part products (`delta_backward.two_part_state_grads`) with one."""
    name = r.fn.__name__
    if name == "_dchunk_kernel":
        from linattn.triton.delta_backward import TUNING
        c = _constexprs(r)
        wide = c.get("BV") == TUNING["bv_chunk_wide"] and not c.get("IEEE")
        return FALLBACKS[name] if wide else None
    if name == "_dstate_kernel":
        return FALLBACKS[name] if _constexprs(r).get("TWO") else None
    return FALLBACKS.get(name)


def fit_stages(r: Record, cc: int, depth: str = "cubin") -> dict:
    """What the wrapper's launch ends with on sm_cc: the recorded stages, or through common.launch the
    most stages from max_stages down that fit; where none does, launch raises an InputError naming
    the GPU ("refused"; the one-stage compile is reported)."""
    tries = [r.stages] if r.max_stages is None else list(range(r.max_stages, 0, -1))
    for s in tries:
        res = compile_one(r, cc, s, depth)
        if fits(res, cc, r.warps) or "error" in res:
            break
    res["fits"] = fits(res, cc, r.warps)
    if not res["fits"] and "error" not in res:
        handled = fallback(r)
        if handled:
            res["fallback"] = handled
        elif r.max_stages is not None:
            res["refused"] = "InputError from common.launch"
    return res


_JOBS: list = []


def _job(i):
    r, cc, depth = _JOBS[i]
    return i, fit_stages(r, cc, depth)


def check(configs: dict, archs=tuple(ARCHS), workers=None, progress=False, depth="cubin",
          log: Path | None = None) -> list[dict]:
    """Compile every configuration for every architecture, in a pool of forked workers. With `log`
    (a JSON-lines file), each result is appended as it comes and the results already there are not
    compiled again: a pass cut short (the register pass takes hours on a few cores) goes on where it
    stopped."""
    import multiprocessing as mp

    items = list(configs.values())
    _JOBS[:] = [(item[0], cc, depth) for item in items for cc in archs]
    keys = [(r.fn.__name__, describe(r), cc, d) for r, cc, d in _JOBS]
    done = _logged(log)
    results = [done.get(k) for k in keys]
    # the heavy kernels first, so the pool does not end waiting on one of them
    order = sorted((i for i, res in enumerate(results) if res is None), key=lambda i: -_weight(_JOBS[i][0]))
    workers = workers or os.cpu_count() or 1
    with mp.get_context("fork").Pool(workers) as pool:
        for n, (i, res) in enumerate(pool.imap_unordered(_job, order), 1):
            results[i] = res
            if log:
                with open(log, "a") as f:
                    f.write(json.dumps(dict(zip(("kernel", "config", "cc", "depth"), keys[i]), result=res)) + "\n")
            if progress and n % 20 == 0:
                taken = len(_JOBS) - len(order)
                print(f"  {n}/{len(order)} compiled" + (f" ({taken} more from {log})" if taken else ""),
                      file=sys.stderr, flush=True)
    rows = []
    for j, (r, labels, variants, *family) in enumerate(items):
        per = {f"sm_{cc}": results[j * len(archs) + a] for a, cc in enumerate(archs)}
        rows.append(dict(kernel=r.fn.__name__, module=r.fn.module.rsplit(".", 1)[-1], config=describe(r),
                         max_stages=r.max_stages, example=labels[0], launches=variants,
                         family=family[0] if family else 1, archs=per))
    return rows


def _logged(log: Path | None) -> dict:
    """The results a log of `check` holds, by (kernel, config, cc, depth); a torn last line is left."""
    done = {}
    if log and Path(log).exists():
        for line in Path(log).read_text().splitlines():
            try:
                x = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[(x["kernel"], x["config"], x["cc"], x["depth"])] = x["result"]
    return done


def _weight(r: Record) -> int:
    names = list(r.fn.signature.parameters)
    cs = {names[p[0]]: v for p, v in r.constexprs.items() if len(p) == 1 and isinstance(v, int)}
    w = 1
    for n in ("C", "BK", "BV", "K", "V", "BR"):
        w *= cs.get(n, 1) or 1
    return w


# ------------------------------------------------------------------------------------- report

def half_precision(row) -> bool:
    return "ptr=" in row["config"] and any(t in row["config"].split("ptr=")[1].split()[0].split("/")
                                           for t in ("bf16", "fp16"))


def may_refuse(row, cc: int) -> bool:
    """Where a launch may be refused (common.launch's InputError naming the GPU) rather than fit:
    - float32 tiles (twice the bytes of bf16/fp16) on GPUs with less shared memory per block than an
      A100 (T4, RTX 30/40, L4);
    - on those GPUs, bf16/fp16 tiles of chunks larger than the default 64.
    Everything else must fit every architecture (GLA's sub-chunks above 64, which fit no GPU at
    K = 256, are outside linattn.support's range and refused before any launch)."""
    if cc not in (75, 86, 89):
        return False
    if not half_precision(row):
        return True
    chunk = re.search(r"\bC=(\d+)", row["config"])
    return chunk is not None and int(chunk.group(1)) > 64


def problems(rows) -> list[str]:
    """Every configuration that fails to compile, or does not fit and neither falls back nor may be
    refused (`may_refuse`)."""
    out = []
    for row in rows:
        for arch, res in row["archs"].items():
            allowed = "fallback" in res or ("refused" in res and may_refuse(row, int(arch[3:])))
            if not res["fits"] and not allowed:
                why = res.get("error") or f"shared memory {res['shared']} B" + (
                    f", {res['regs']} registers" if "regs" in res else "")
                out.append(f"{row['kernel']} [{row['config']}] on {arch}: {why} (e.g. {row['example']})")
    return out


def summary(rows) -> dict:
    """Per kernel and architecture: the largest shared memory, registers and spills over its configs."""
    table = {}
    for row in rows:
        t = table.setdefault(row["kernel"], {"module": row["module"], "configs": 0, "archs": {}})
        t["configs"] += 1
        for arch, res in row["archs"].items():
            a = t["archs"].setdefault(arch, dict(shared_kb=0.0, regs=None, spill=None, stages=[], fits=0,
                                                 fallback=0, refused=0, errors=0))
            if "error" in res:
                a["errors"] += 1
            else:
                a["shared_kb"] = max(a["shared_kb"], round(res["shared"] / 1024, 1))
                if "regs" in res:      # compiled through ptxas (the largest tiles of each kernel)
                    a["regs"] = max(a["regs"] or 0, res["regs"])
                    a["spill"] = max(a["spill"] or 0, res["spill"])
            if res["stages"] not in a["stages"]:
                a["stages"] = sorted(a["stages"] + [res["stages"]])
            a["fits"] += res["fits"]
            a["fallback"] += "fallback" in res
            a["refused"] += "refused" in res
    return table


def markdown(table) -> str:
    archs = [f"sm_{cc}" for cc in ARCHS if any(f"sm_{cc}" in t["archs"] for t in table.values())]
    head = "| kernel | configs | " + " | ".join(f"{a} ({ARCHS[int(a[3:])][0]}, {ARCHS[int(a[3:])][1] // 1024} KB)"
                                                for a in archs) + " |"
    lines = [head, "|" + "---|" * (2 + len(archs))]
    for name, t in table.items():
        cells = []
        for a in archs:
            x = t["archs"][a]
            ok = "fits" if x["fits"] == t["configs"] else (
                f"{x['fits']}/{t['configs']} fit" + (f", {x['fallback']} fall back" if x["fallback"] else "")
                + (f", {x['refused']} refused" if x["refused"] else "")
                + (f", {x['errors']} errors" if x["errors"] else ""))
            regs = "" if x["regs"] is None else f"{x['regs']} regs · {x['spill']} B spilled · "
            cells.append(f"{x['shared_kb']:g} KB · {regs}stages {','.join(map(str, x['stages']))} · {ok}")
        lines.append(f"| {t['module']}.{name} | {t['configs']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def versions() -> dict:
    import torch
    import triton
    return dict(triton=triton.__version__, torch=torch.__version__)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subset", choices=("full", "ci"), default="full")
    ap.add_argument("--json", type=Path, default=None, help=f"where to write the table (full: {OUT})")
    ap.add_argument("--archs", default=",".join(map(str, ARCHS)))
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--list", action="store_true", help="only capture and list the configurations")
    ap.add_argument("--depth", choices=("shared", "cubin"), default="cubin",
                    help="shared: shared memory only; cubin: also registers and spills of the largest tiles")
    ap.add_argument("--deep-kernels", default="", help="with --depth cubin: only these kernels (comma-separated)")
    ap.add_argument("--deep-log", type=Path, default=None,
                    help="with --depth cubin: keep each ptxas result in this JSON-lines file as it comes, and "
                         "take the ones already there (a cut register pass goes on where it stopped)")
    ap.add_argument("--rescore", type=Path, default=None,
                    help="recompute the table and problems of a written JSON file with the current rules")
    a = ap.parse_args(argv)
    if a.rescore:
        doc = json.loads(a.rescore.read_text())
        doc.update(table=summary(doc["configs"]), problems=problems(doc["configs"]))
        a.rescore.write_text(json.dumps(doc, indent=1) + "\n")
        print(markdown(doc["table"]))
        for p in doc["problems"]:
            print("DOES NOT FIT:", p)
        return 1 if doc["problems"] else 0
    if os.environ.get("TRITON_INTERPRET") != "0":
        env = dict(os.environ, TRITON_INTERPRET="0")
        sys.exit(subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:])], env=env).returncode)
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    configs = capture(full=a.subset == "full")
    groups = group(configs)
    # Shared memory (what decides whether a launch fits) for every tile configuration of the
    # enumeration, or CI's subset; registers and spills (the whole compilation, ptxas included,
    # several times slower) for the largest tiles of every kernel.
    todo = extremes(groups) if a.subset == "full" else representative(groups)
    deep = representative(groups) if a.depth == "cubin" else {}
    if a.deep_kernels:
        deep = {k: v for k, v in deep.items() if k[0] in a.deep_kernels.split(",")}
    print(f"{len(configs)} launch configurations captured in {time.perf_counter() - t0:.0f} s: "
          f"{len(groups)} tile configurations; {len(todo)} compiled to shared memory, {len(deep)} "
          f"through ptxas", file=sys.stderr)
    if a.list:
        for r, labels, *_ in todo.values():
            print(f"{r.fn.__name__:22s} {describe(r)} max_stages={r.max_stages}  ({labels[0]})")
        return 0
    archs = tuple(int(x) for x in a.archs.split(","))
    path = a.json or (OUT if a.subset == "full" else None)

    def write(rows, stage):
        """The table as JSON at `path`: after the shared-memory pass, then with registers."""
        doc = dict(versions=versions(), subset=a.subset, stage=stage,
                   limits={f"sm_{cc}": dict(gpus=g, shared_bytes=s, regs_per_thread=REGS_PER_THREAD,
                                            regs_per_sm=REGS_PER_SM) for cc, (g, s) in ARCHS.items() if cc in archs},
                   captured=dict(launches=len(configs), tile_configurations=len(groups), compiled=len(todo),
                                 through_ptxas=len(deep)),
                   seconds=round(time.perf_counter() - t0), table=summary(rows), problems=problems(rows),
                   configs=rows)
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=1) + "\n")
        return doc

    rows = check(todo, archs, a.workers, progress=True, depth="shared")
    write(rows, "shared memory")
    if deep:
        full = {(row["kernel"], row["config"]): row
                for row in check(deep, archs, a.workers, progress=True, log=a.deep_log)}
        for row in rows:
            if (row["kernel"], row["config"]) in full:
                row["archs"] = full.pop((row["kernel"], row["config"]))["archs"]
        rows += list(full.values())
    doc = write(rows, "complete" if deep else "shared memory")     # --depth shared: no register pass
    print(markdown(doc["table"]))
    for p in doc["problems"]:
        print("DOES NOT FIT:", p)
    print(f"{len(rows)} configurations × {len(archs)} architectures in {time.perf_counter() - t0:.0f} s; "
          f"{len(doc['problems'])} problems", file=sys.stderr)
    return 1 if doc["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
