"""Timing: the median of repeated runs, with device events on a GPU and a wall clock on a CPU.

Speed is measured here and in tools/bench.py, never asserted in unit tests.
"""
from __future__ import annotations

import statistics
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def timeit(fn, *, warmup: int = 2, rep: int = 7) -> float:
    """Median milliseconds of fn() over `rep` runs after `warmup` runs (compilation, caches)."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        times = []
        for _ in range(rep):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- Comparisons shared by tools/bench.py and chapters 09–10 -----------------------------------
# The anchor setting (ANCHORS.md): H=16 heads, K=V=128, B·T = 32768 tokens, bf16, forward only,
# gates logsigmoid(randn)/16. Every implementation of one row gets the same input tensors.


def fastest_ms(fn, runs: int = 5) -> float:
    """Fastest of `runs` single runs, in ms, on one CPU thread: the chapters' timing on a reader's machine.

    Interference from other work only ever adds time, so the fastest run is the honest one. One
    thread: on a small shared CPU a multi-threaded op stalls whenever another process takes a core
    and timings turn into noise (GPU kernels are not affected by the setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timeit(fn, warmup=1, rep=1)
        return min(timeit(fn, warmup=0, rep=1) for _ in range(runs))
    finally:
        torch.set_num_threads(threads)


def memory_use(fn, device=None) -> tuple:
    """(peak, held) bytes of fn(): the most memory it holds at once beyond what was allocated when
    it started, and what is still allocated when it returns (its result kept alive: for a forward
    with grad, the outputs plus what autograd keeps for the backward).

    GPU: torch.cuda's allocator counters. CPU (PyTorch keeps no such counter there): every tensor
    storage an operation creates during fn — forward and backward, `.grad` included — counted from
    its creation until it is freed; outputs that alias an existing tensor (views, in-place ops) add
    nothing. What an operation allocates and frees inside itself (scratch space) is not seen.
    `device`: where fn's tensors live ("cuda" or "cpu"); default: the GPU when there is one."""
    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
    with _StorageTracker() as tracker:
        result = fn()
    del result
    return tracker.peak, tracker.held


class _StorageTracker(TorchDispatchMode):
    """Adds up the storages created by the operations run under it, minus those freed since."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.held = {}, 0, 0, 0         # data pointer → bytes

    def __exit__(self, *exc):
        self.held = self.now                                           # before fn's result is dropped
        return super().__exit__(*exc)

    def _freed(self, ptr):
        self.now -= self.live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0]
                  if isinstance(x, torch.Tensor)}
        for x in tree_flatten(out)[0]:
            if not isinstance(x, torch.Tensor):
                continue
            st = x.untyped_storage()
            ptr = st.data_ptr()
            if ptr in inputs or ptr in self.live or st.nbytes() == 0:
                continue                                               # an alias, or counted already
            self.live[ptr] = st.nbytes()
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(st, self._freed, ptr)                     # fires when the storage is freed
        return out

import json  # noqa: E402
import platform  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from .testing import log_gates  # noqa: E402

# op → (linattn function name, extra library kwargs, FLA function in fla.ops)
OPS = {
    "linear_attn": ("linear_attn", {}, "chunk_linear_attn"),
    "gla": ("gla", {}, "chunk_gla"),                              # per-dimension gate [B,T,H,K]
    "simple_gla": ("gla", {}, "chunk_simple_gla"),                # per-head gate [B,T,H]
    "delta_rule": ("delta_rule", {}, "chunk_delta_rule"),
    "kda": ("kda", {}, "chunk_kda"),                              # per-dimension gate
    "gated_delta_rule": ("kda", {}, "chunk_gated_delta_rule"),    # per-head gate
}
GATED = {"gla": "dim", "simple_gla": "head", "kda": "dim", "gated_delta_rule": "head"}
# Gate distributions a benchmark sweeps (`testing.log_gates`): "normal", logsigmoid(x)/16, is mild —
# a 64-token chunk decays by at most about e^-5 — and is the anchor setting every recorded table and
# chapter reads; "logsigmoid" is a model's gate without that damping; "mamba" is the initialisation
# of Mamba-2's and KDA's gate, −e^{A_log}·softplus(x + dt_bias), whose chunks decay by e^-74 to e^-246.
# Speed may depend on them (a kernel's fast path can hold only for chunks that decay little).
GATE_SWEEP = ("normal", "logsigmoid", "mamba")
DELTA = ("delta_rule", "kda", "gated_delta_rule")


def median_ms(fn, *, slow_ms: float = 20.0) -> float:
    """Median milliseconds: triton.testing.do_bench (L2 flushed between runs) on a GPU, else timeit.

    A function slower than `slow_ms` (a Python loop over chunks, say) is timed over 3 runs with CUDA
    events instead: do_bench's own estimate would cost more device time than the measurement.
    """
    if not torch.cuda.is_available():
        return timeit(fn, warmup=1, rep=3)
    fn()  # compile and warm up
    if timeit(fn, warmup=0, rep=1) > slow_ms:
        return timeit(fn, warmup=0, rep=3)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def anchor_inputs(op: str, T: int, *, tokens=32768, H=16, K=128, V=128, dtype=torch.bfloat16,
                  device="cuda", seed=0, gates="normal") -> dict:
    """Keyword arguments for the library op behind `op` at the anchor setting (B = tokens // T);
    gates: the log-gates' distribution (one of GATE_SWEEP, `testing.log_gates`)."""
    B = max(1, tokens // T)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    args = {"q": rnd(B, T, H, K).to(dtype), "k": rnd(B, T, H, K), "v": rnd(B, T, H, V).to(dtype)}
    if op in DELTA:  # delta-rule keys are L2-normalised, β ∈ (0, 1)
        args["k"] = F.normalize(args["k"], dim=-1)
        args["beta"] = torch.rand(B, T, H, generator=gen, device=device).to(dtype)
    args["k"] = args["k"].to(dtype)
    if op in GATED:
        shape = (B, T, H, K) if GATED[op] == "dim" else (B, T, H)
        args["g"] = log_gates(shape, gates, generator=gen, device=device)
    return args


def backward_stages(op: str, T: int, *, runs: int = 5, **size) -> dict:
    """Milliseconds of each stage of op's Triton backward at the anchor inputs (median of `runs`):
    the work of the default call (recompute=True: states recomputed; for GLA with per-dimension
    gates the forward's A and cumulated gates reused). Chapter 13 and tools/bench.py."""
    from .triton import delta, delta_backward, gated, gated_backward
    from .validate import check_inputs

    a = anchor_inputs(op, T, **size)
    q, k, v, g, beta = a["q"], a["k"], a["v"], a.get("g"), a.get("beta")
    do = torch.randn_like(v)
    if beta is None:
        d = check_inputs(q, k, v, g=g, gate=g is not None)
        kw, kept = dict(chunk_size=64, sub_chunk_size=16), {}
        if g is not None and g.dim() == 4:                    # only per-dimension gates keep A and b
            gated.forward(q, k, v, g, d, initial_state=None, output_final_state=False, mode="auto", keep=kept,
                          **kw)

        def run(timer):
            gated_backward.backward(do, None, q, k, v, g, None, d, A=kept.get("A"), b=kept.get("b"),
                                    timer=timer, **kw)
    else:
        d = check_inputs(q, k, v, g=g, beta=beta, gate=g is not None, delta=True)
        p = delta.plan(q, g, d, 64)

        def run(timer):
            delta_backward.backward(q, k, v, g, beta, None, do, None, p, timer=timer)
    run(None)                                                              # compile, warm up
    timers = [{} for _ in range(runs)]
    for t in timers:
        run(t)
    return {name: sorted(t[name] for t in timers)[runs // 2] for name in timers[0]}


def library_call(op: str, level: str, args: dict, **kw):
    """A no-argument callable running linattn.<level>.<op> on `args`: the default call, exactly
    what a user runs (value checks as the library decides them: off for GPU tensors)."""
    from .dispatch import level_fn

    fn = level_fn(OPS[op][0], level)

    def call():
        return fn(**args, **kw)
    return call


def fla_fn(op: str):
    """FLA's chunk kernel for `op` (a function of the library's keyword arguments), or None when fla
    is not importable (absent, or broken against this torch/triton) or has no such kernel."""
    try:
        import fla.ops as ops
    except Exception:  # noqa: BLE001
        return None
    fn = getattr(ops, OPS[op][2], None)
    if fn is None:
        return None
    kw = {"normalize": False} if op == "linear_attn" else {}
    return lambda **a: fn(**a, **kw)


def fla_call(op: str, args: dict, **kw):
    """A callable running FLA's chunk kernel for `op` on `args` (and `kw`, e.g. cu_seqlens), or None."""
    fn = fla_fn(op)
    return None if fn is None else (lambda: fn(**args, **kw))


def train_call(fn, args, **kw):
    """A no-argument callable: forward fn(**args, **kw), then the backward of <o, dO> for every
    floating input (torch.autograd.grad: nothing accumulates into .grad between runs)."""
    inputs = {n: a.detach().requires_grad_(True) for n, a in args.items()
              if isinstance(a, torch.Tensor) and a.is_floating_point()}
    others = {n: a for n, a in args.items() if n not in inputs}
    o = fn(**inputs, **others, **kw)[0]
    gen = torch.Generator(device=o.device).manual_seed(0)      # one dO for every implementation
    do = torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype)

    def call():
        out = fn(**inputs, **others, **kw)[0]
        return torch.autograd.grad(out, list(inputs.values()), do)
    return call


def timed(row: dict, key: str, make) -> None:
    """row[key] = median ms and row[f"mem_{key}"] = peak bytes of make()(), or the failure recorded
    (row[key] = None, row[f"error_{key}"]: FLA refusing a backward, out of memory, a compile failure)."""
    try:
        fn = make()
        fn()                                                   # compile, warm up, and see that it runs
        row[key] = median_ms(fn)
        row[f"mem_{key}"] = memory_use(fn)[0]
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}".split("\n")[0][:300]
        row[key], row[f"error_{key}"] = None, ("refused: " + msg) if key == "fla" else msg
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def sized(sizes: dict, size: str | None = None) -> tuple:
    """(size name, its settings, device) of a benchmark with `sizes` {"small": …, "full": …}: the
    size linattn.device picks (a GPU: "full") unless one is named."""
    from . import device as devices          # (this module's functions take a `device` argument)
    size = size or devices.pick(cpu="small", gpu="full")
    return size, sizes[size], devices.default_device()


def selected_ops(only=None) -> list:
    """The ops of OPS a benchmark runs: all, or those in `only`."""
    return [o for o in OPS if not only or o in only]


def measure_layout(row: dict, layout: str, make, warm_only: bool = False) -> None:
    """One cell of a benchmark's table: `timed` for make (a function returning the no-argument call),
    "FLA not installed" where make is None; warm_only runs the call once to compile it, timing nothing
    (several processes can then compile in parallel before one process times)."""
    if make is None:
        row[layout], row["error_" + layout] = None, "FLA not installed"
    elif warm_only:
        try:
            make()()
        except Exception as exc:  # noqa: BLE001
            row["error_" + layout] = f"{type(exc).__name__}: {exc}".split("\n")[0][:300]
    else:
        timed(row, layout, make)


def table_cli(module, example_out: str, argv=None) -> None:
    """The command line of a benchmark module that has SIZES, MODES, measure and report
    (linattn.bench_packing, linattn.bench_long): prints the table, writes JSON with --out; --warm
    compiles only (each callable run once, nothing timed), for one process per op in parallel before
    the timing run finds every kernel in Triton's cache."""
    import argparse

    p = argparse.ArgumentParser(description=module.__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(module.SIZES), default=None, help="default: linattn.device's choice")
    p.add_argument("--only", nargs="+", choices=sorted(OPS), default=None)
    p.add_argument("--modes", nargs="+", choices=module.MODES, default=module.MODES)
    p.add_argument("--warm", action="store_true", help="compile only, time nothing")
    p.add_argument("--out", default=None, help=f"JSON file to write (e.g. {example_out})")
    a = p.parse_args(argv)
    r = module.measure(a.size, a.only, modes=a.modes, warm_only=a.warm)
    if a.warm:
        return
    print(module.report(r))
    if a.out:
        save_json(a.out, r)
        print("wrote", a.out)


def ratio(row: dict, a: str, b: str):
    """row[a] / row[b], None where either did not run (a benchmark's table of layouts)."""
    return None if row.get(a) is None or row.get(b) is None else row[a] / row[b]


def layout_cells(row: dict, layouts) -> str:
    """'layout 0.123 ms, …' for a progress line, with the failure's start where one did not run."""
    def cell(layout):
        ms = row.get(layout)
        return f"{layout} {ms:.3f} ms" if ms is not None else f"{layout} – ({row.get('error_' + layout, '')[:60]})"
    return ", ".join(cell(x) for x in layouts)


def fla_version():
    try:
        from importlib.metadata import version

        return version("fla-core")
    except Exception:  # not installed
        return None


def sdpa_call(T: int, *, tokens=32768, H=16, D=128, dtype=torch.bfloat16, device="cuda"):
    """Causal softmax attention (FlashAttention through SDPA) at the same size, [B, H, T, D] layout."""
    B = max(1, tokens // T)
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype) for _ in range(3))
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows, else "CPU". Recorded CPU
    runs name it: a chunk forward made of matrix products against a token loop bound by Python's
    per-step cost is a ratio of two different kinds of speed, and it moves from one CPU to another."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


# Longer than NVML's utilization sample period (1/6 s to 1 s, by product): a reading taken after
# this process has been idle that long counts other processes' kernels only.
IDLE_S = 1.1


def gpu_without_us() -> dict | None:
    """How busy this process's GPU is without us, through NVML (`torch.cuda.utilization` and
    `device_memory_used`, which need nvidia-ml-py): after IDLE_S with no kernel of ours, the percent
    of the last sample period in which some kernel ran (`busy_pct`) and the GPU memory in use beyond
    what our allocator reserved (`outside_mib`: our CUDA context and loaded kernels, plus any other
    process's). None without a GPU or where NVML cannot say.

    A timing measures our kernels only on a GPU nothing else is running on, and another process's
    kernels on the same SMs leave no trace in the numbers: the same code once measured the delta
    rules' reverse pass at twice the time another device call measured (docs/performance.md). A run
    records this reading beside its results, and `run_label` names a GPU that was not idle."""
    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.synchronize()
        time.sleep(IDLE_S)
        busy = int(torch.cuda.utilization())
        outside = torch.cuda.device_memory_used() - torch.cuda.memory_reserved()
    except Exception:  # noqa: BLE001  (no nvidia-ml-py, or a driver that does not answer NVML)
        return None
    return {"busy_pct": busy, "outside_mib": round(outside / 2**20)}


def environment() -> dict:
    """Device, date and versions, and on a GPU how busy it was without us (`gpu_without_us`): stored
    with every recorded result."""
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()
    # The day, not the hour: a recorded run is quoted in the book by its setting; which commit ran
    # it belongs in the git log (docs/performance.md names the command that produced it).
    env = {"device": dev, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
           "torch": torch.__version__, "triton": triton.__version__, "fla": fla_version(),
           "python": platform.python_version()}
    quiet = gpu_without_us()
    if quiet is not None:
        env["gpu_without_us"] = quiet
        if quiet["busy_pct"] > 0:
            print(f"warning: the GPU ran kernels {quiet['busy_pct']} % of the time while this process was idle: "
                  "another process is using it, and timings taken now measure both", file=sys.stderr)
    return env


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the HBM speed kernels can reach."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / (median_ms(lambda: y.copy_(x)) * 1e-3)


def floor_ms(args: dict, bandwidth: float) -> float:
    """The least time a forward can take: read every input once and write o once, at `bandwidth`."""
    nbytes = sum(a.numel() * a.element_size() for a in args.values()) + args["v"].numel() * args["v"].element_size()
    return nbytes / bandwidth * 1e3


def save_json(path, results: dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def load_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


# Where recorded GPU runs live: book/data/ of the checkout (the chapters' own data/ when run from book/).
DATA_DIRS = (Path("data"), Path("book/data"), Path(__file__).resolve().parent.parent / "book" / "data")


def recorded_run(*names):
    """The first of `names` found in book/data/ (GPU runs the chapters show on a CPU), parsed; else None."""
    for name in names:
        for here in DATA_DIRS:
            if (here / name).exists():
                return load_json(here / name)
    return None


def run_label(env: dict) -> str:
    """Where, when and with what a recorded run was made: the line printed above its table, and a
    warning where the GPU was running other kernels while the run's process was idle."""
    label = (f"{env['device']}, {env['date'][:10]}, torch {env['torch']}, triton {env['triton']}, "
             f"FLA {env.get('fla')}")
    busy = (env.get("gpu_without_us") or {}).get("busy_pct")
    return label + (f" (GPU {busy} % busy without this run: timings shared it)" if busy else "")


def markdown_table(columns, rows) -> str:
    """rows: list of lists; floats printed with 3 significant digits, None as '—'."""
    def cell(x):
        if x is None:
            return "—"
        return f"{x:.3g}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_times(ax, Ts, series: dict, *, title="", ylabel="ms"):
    """One line per implementation, time vs sequence length (log-log)."""
    for name, ys in series.items():
        pts = [(t, y) for t, y in zip(Ts, ys) if y is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    # plain numbers on the time axis (2, 5, 10, 20 ms), not powers of ten
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
    ax.set_xlabel("sequence length T (B·T fixed)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
