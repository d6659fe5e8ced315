"""What every Triton kernel wrapper shares: the compute dtype, input checks, block sizes, one dot.

Kept small and stable: linattn/triton/linear.py, gated.py and delta.py import from here.

Two facts decide how a kernel computes (see chapter 09):
- Natively on a GPU, bf16/fp16 tiles go to the tensor cores as they are (float32 accumulation);
  float32 tiles use `input_precision="ieee"`, since tf32 (10-bit mantissa) would miss the float32
  tolerance by two orders of magnitude.
- Under the Triton interpreter (CPU) bf16 arithmetic is broken, so every tile is upcast to float32
  right after its load. `compute_dtype` gives the one constexpr that says which case applies.

So "interpreting" means two things, kept apart here: `interpreting()`, the kernels run in Triton's
interpreter on the CPU (any tensor's device, one program at a time), and `float32_tiles()`, every
tile is float32 with exact products. The plain interpreter has both; the emulated mode
(LINATTN_EMULATE=fp16 or bf16, `linattn.device`, `emulate`) runs in the interpreter with the native
dtype decisions, which is how the native half-precision roundings are reproduced on a CPU.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import time

import torch
import triton
import triton.language as tl

from triton.runtime.errors import OutOfResources

from .. import decay, device  # noqa: F401  (device sets TRITON_INTERPRET=1 without CUDA, before any @triton.jit)
from ..support import TRITON_DTYPES
from ..validate import InputError



def _check_import_order() -> None:
    # Triton decides interpreter vs compiler per @triton.jit function when it is defined, and
    # triton.language defines some of its own (tl.zeros, tl.cdiv, …) on import. Imported before
    # TRITON_INTERPRET=1 was set, those stay compiled-only and every kernel fails on the CPU with
    # "Cannot call @triton.jit'd outside of the scope of a kernel". Say what to do instead.
    if device.triton_mode() != "native" and type(tl.zeros).__name__ != "InterpretedFunction":
        raise ImportError("triton was imported before linattn on a machine without a GPU, so Triton's "
                          "interpreter mode is only half on. Import linattn first (it sets "
                          "TRITON_INTERPRET=1), or set TRITON_INTERPRET=1 before starting Python.")


_check_import_order()
if device.triton_mode() == "emulated":
    from . import emulate
    emulate.install()       # the interpreter rounds and multiplies bf16 and tf32 as a GPU does

# Sizes that change from call to call — the length T, the chunk count NT, the heads H, BTH = B·T·H —
# are not specialised on. By default Triton compiles a kernel again when an integer argument is 1 or a
# multiple of 16, so T = 1, T = 64 and T = 65 (and H = 1, 3, 16) were separate compilations of every
# kernel with the same tiles, each a compiled path of its own to trust: the one-chunk (NT = 1) variant
# of the delta family's sequential passes faulted natively where the general loop was right
# (docs/native_correctness.md). Head dims and strides (K, V, W = H·K) stay specialised: their
# divisibility by 16 tells Triton that tile rows are aligned for vector loads.
SIZE_ARGS = ("T", "NT", "H", "BTH")


def kernel(fn=None, *, keep=()):
    """The decorator of every launched kernel: `triton.jit`, not specialised on the SIZE_ARGS it takes
    except those in `keep` (`@kernel(keep=("T",))`, where a kernel measurably needs the divisibility)."""
    if fn is None:
        return lambda f: kernel(f, keep=keep)
    names = inspect.signature(fn).parameters
    return triton.jit(fn, do_not_specialize=[a for a in SIZE_ARGS if a in names and a not in keep])


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def decayed_dtype(dtype: torch.dtype):
    """The dtype of a dot operand that carries a decay from the chunk start, q ⊙ e^{b} in the reverse
    state pass of the gated backward: float32 for fp16 inputs (a tf32 product, in which fp16 inputs
    are exact), the compute dtype otherwise. fp16 ends at 6e-8 and its subnormals below 6e-5 keep few
    bits, while under strong gates the first token's decay (e^{-15} = 3e-7) alone makes the initial
    state's gradient: natively (H200) per-head GLA in fp16 had that gradient 6.8e-3 wrong with an
    fp16 operand and 2.0e-4 with this one (conformance case simple_gla-extra-108). bf16 has float32's
    range."""
    return tl.float32 if dtype == torch.float16 or float32_tiles() else compute_dtype(dtype)


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels on the CPU (plainly or emulating, module doc)."""
    return device.triton_mode() != "native"


def float32_tiles() -> bool:
    """Whether every tile is float32 with exact products: under the plain interpreter, whose bf16
    arithmetic is broken. Natively and in the emulated mode the dtype decisions are the native ones."""
    return device.triton_mode() == "interpreter"


def compute_dtype(dtype: torch.dtype):
    """The dtype tiles have inside a kernel: the input's natively (and emulated), float32 under the
    plain interpreter."""
    return tl.float32 if float32_tiles() else _TL[dtype]


# The split (e^{b_t − b_s} = e^{b_t} · e^{−b_s}, chapter 11): its factor e^{−b} goes up to e^SPLIT_RANGE,
# the same bound as the chunk level's (linattn.decay.split).
SPLIT_RANGE = tl.constexpr(decay.SPLIT_RANGE)


def split_dtype():
    """Operand dtype of the split products, whose factors reach e^{60}: float32, for every input
    dtype. For bf16/fp16 inputs their products run on the tensor cores as tf32 (10 mantissa bits):
    the operands are computed (q ⊙ e^b, k ⊙ e^{−b}), not inputs, and rounding them to bf16 (7 bits)
    made the intra-chunk matrix, and so the output and every gradient, up to 1.4× less precise than
    FLA's, which takes these products in tf32 too. fp16 could not hold e^60 at all."""
    return tl.float32


@triton.jit
def dot_x3(a, b, IEEE: tl.constexpr):
    """a @ b of float32 tiles to about float32 precision: three tf32 products natively (relative
    error ~2⁻²¹), exact under the interpreter or for float32 inputs (IEEE). For a product whose
    operands are both computed in float32 where one tf32 rounding would show in the result."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def dot_split(a, b, IEEE: tl.constexpr):
    """a @ b for a computed float32 tile a and a tile b exact in its own dtype (an input: dO, v, k)
    to about float32 precision: a = hi + lo, each part one product with b. For bf16 b, hi = bf16(a)
    and lo = bf16(a − hi), two bf16 products (a's error ~2⁻¹⁷ relative, b exact) where three tf32
    products (`dot_x3`) cost the tensor cores three times as much. For fp16 b (exact in tf32),
    hi = tf32(a) and lo = a − hi, two tf32 products (a's error ~2⁻²¹): fp16 parts would leave lo
    below fp16's normal range for small a. Float32 b: `dot_x3`."""
    if b.dtype == tl.bfloat16:
        hi, lo = bf16_parts(a)
        return tl.dot(lo, b, tl.dot(hi, b))
    if b.dtype == tl.float16:
        bf = b.to(tl.float32)
        hi = tf32(a)
        return tl.dot(a - hi, bf, tl.dot(hi, bf))
    return dot_x3(a, b.to(tl.float32), IEEE)


@triton.jit
def bf16_parts(x):
    """A float32 tile as two bf16 tiles hi = bf16(x) and lo = bf16(x − hi): hi + lo keeps about 16 of
    x's bits where hi alone keeps bf16's 8 (`dot_split`, `dot_split_bf16`)."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def dot_split_bf16(a, b):
    """a @ b for a tile a taken in bf16 and a computed float32 tile b in two bf16 parts
    (`bf16_parts`), two bf16 products. For a gradient carried from chunk to chunk
    (`delta_backward._dstate_kernel`)."""
    hi, lo = bf16_parts(b)
    a = a.to(tl.bfloat16)
    return tl.dot(a, lo, tl.dot(a, hi))


@triton.jit
def dot_input(a, b, DT: tl.constexpr, IEEE: tl.constexpr):
    """a @ b for a computed float32 tile a and b an input tile exact in the compute dtype DT
    (keys, values, queries): `dot_split` for half inputs, exact products for float32 ones (IEEE)."""
    if IEEE:
        return dot(a, b.to(tl.float32), IEEE)
    return dot_split(a, b.to(DT), IEEE)


def check_kernel_inputs(q) -> None:
    """What the kernels add to linattn.validate: a dtype they compute in (in the emulated mode, the one
    it emulates), a device they run on."""
    if q.dtype not in TRITON_DTYPES:
        raise InputError(f"q has dtype {q.dtype}; linattn.triton computes in float16, bfloat16 or "
                         "float32 (use linattn.chunk or linattn.naive for float64)")
    problem = interpreting() and device.interpreter_problem()
    if problem:
        raise RuntimeError(problem)
    if not interpreting() and not q.is_cuda:
        raise InputError(f"q is on {q.device}; linattn.triton runs on CUDA tensors here (the "
                         "Triton interpreter is used only on machines without a GPU)")
    if device.triton_mode() == "emulated" and q.dtype != device.emulated_dtype():
        # refused rather than run with other tiles: an emulated result is read as the native one
        raise InputError(f"q has dtype {q.dtype}; the emulated mode (LINATTN_EMULATE="
                         f"{os.environ.get('LINATTN_EMULATE', '').strip()}) reproduces the native roundings "
                         f"of {device.emulated_dtype()} inputs only (LINATTN_EMULATE=fp16 or bf16 for "
                         "half inputs; float32 ones are not emulated: unset it to run them with the "
                         "interpreter's float32 tiles)")


def contiguous(*xs):
    """Kernels index [B, T, H, *] tensors with plain row-major strides."""
    return tuple(None if x is None else x.contiguous() for x in xs)


# Head-dimension tiles (the K- and V-blocks) are at least MIN_TILE wide, and a kernel takes 8 warps only
# where every such tile of its products is at least WIDE_TILE wide. Compiled for sm_90 by Triton 3.6,
# a product whose tile has 16 columns (or 32 columns split over the two warp groups of 8 warps) came
# out wrong or faulted with an illegal memory access on an H200, while the interpreter computed it
# right: DeltaNet / Gated DeltaNet / KDA backward at K = V = 16, linear attention's dv at K = 256
# (32-column V-blocks). Padding to 32 (masked) and 4 warps for narrow tiles remove the whole class;
# they cost nothing at the head dimensions models use (K, V ≥ 64). A lone tl.dot of each such shape was
# right natively: it is how these kernels compile as a whole. tests/test_native_regressions.py keeps
# the shapes that failed, docs/native_correctness.md what each showed.
MIN_TILE = 32
WIDE_TILE = 64


def block(n: int, minimum: int = MIN_TILE) -> int:
    """Smallest power of two ≥ n and ≥ minimum (tl.dot needs every side ≥ 16; head-dim tiles use
    MIN_TILE, see above); masks cover the rest."""
    return max(triton.next_power_of_2(n), minimum)


def tile(n: int, cap: int) -> int:
    """A head-dimension tile for n columns at most `cap` wide, never narrower than MIN_TILE (also
    where tuning or a test asks for less)."""
    return min(block(n), max(cap, MIN_TILE))


def warps(want: int, *widths: int) -> int:
    """`want` warps, but at most 4 unless every head-dimension tile width of the kernel's products
    is ≥ WIDE_TILE: with 8 warps the two warp groups split a tile's columns (see MIN_TILE)."""
    return want if want <= 4 or min(widths) >= WIDE_TILE else 4


def num_sms() -> int:
    """Streaming multiprocessors of the current GPU (1 under the interpreter: nothing runs in parallel)."""
    if interpreting():
        return 1
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


_STAGES_THAT_FIT: dict = {}


def launch(kernel, grid, *args, max_stages: int = 3, **kw):
    """kernel[grid](*args, **kw) with the most software-pipeline stages (max_stages, then fewer down
    to 1) that fit in shared memory. Each extra stage holds another copy of the loop's tiles; at
    C = 256 the state pass's tiles (k, v and float32 gates, 128 KB in bf16) need 257 KB with
    Triton's default of 3 stages, over an H200's 227 KB (seen in chapter 10's chunk sweep). Fewer stages compute the
    same result, a little less overlapped. What fits is remembered per kernel, constexprs and dtypes,
    but Triton also compiles a kernel again for integer arguments equal to 1 or divisible by 16 (one
    chunk, say), and that variant can need less shared memory than the next: a remembered stage
    count that does not fit is forgotten and the whole range tried again, never refused on the
    strength of another variant (natively, float32 DeltaNet at K = 128 fitted 3 stages for T ≤ 64
    and then refused T = 65).

    The same rule makes a launch fit GPUs with less shared memory per block than the H200 the blocks
    were tuned on (A100 163 KB, RTX 30/40 and L4 99 KB, T4 64 KB): tools/arch_check.py compiles
    every launch offline for each and records the stages that fit (book/data/architectures.json).
    Where even one stage does not fit, an InputError names the GPU instead of Triton's
    OutOfResources (narrower blocks are not tried: tiles narrower than the tuned ones faulted
    natively, see MIN_TILE)."""
    # tensors passed by keyword (a packed launch's tables) count by their dtype, as positional ones
    key = (kernel, max_stages, tuple(sorted((n, getattr(x, "dtype", x)) for n, x in kw.items())),
           tuple(getattr(a, "dtype", None) for a in args))
    every = tuple(range(max_stages, 0, -1))
    remembered = _STAGES_THAT_FIT.get(key)
    tried = every if remembered is None else remembered + tuple(s for s in every if s < remembered[0])
    for i, stages in enumerate(tried):
        try:
            compiled = kernel[grid](*args, num_stages=stages, **kw)
        except OutOfResources as e:
            if i == len(tried) - 1:
                raise InputError(does_not_fit(kernel, e)) from e
            continue
        _STAGES_THAT_FIT[key] = (stages,)
        return compiled


def does_not_fit(kernel, error) -> str:
    """The message for a launch that does not fit this GPU even with one pipeline stage."""
    name = getattr(kernel, "__name__", str(kernel))
    gpu = "this GPU"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu = f"this GPU ({torch.cuda.get_device_name()}, sm_{major}{minor})"
    return (f"{name} does not fit {gpu}: {error}. Its tiles grow with the head dims, the chunk size and "
            "the dtype (float32 tiles are twice as large): use bfloat16/float16 inputs, a smaller "
            "chunk_size, or linattn.chunk (impl='chunk'). tools/arch_check.py lists what fits each GPU.")


# Log-gates below GATE_FLOOR are read as GATE_FLOOR by every kernel that sums them. The kernels take
# differences of float32 prefix sums of gates inside a chunk; one gate of −1e4 puts every later prefix
# sum near −1e4, where float32 resolves 1e-3, and −1e8 leaves nothing of the gates after it (relative
# errors 7.6e-4 to 0.76 were measured). e^{−110} is 0 in float32 (its smallest number is e^{−103.3}),
# so a gate at the floor already decays to exactly 0 whatever it multiplies: the floor changes no
# float32 product, only the size of the prefix sums after it. A higher floor would not be exact: a
# quantity made only of decayed terms (the initial state's gradient behind a gate of −100) would
# come out e^{100 + floor} times too large (seen natively at a floor of −40).
GATE_FLOOR = tl.constexpr(-110.0)


@triton.jit
def gate_floor(g):
    """Raw log-gates as the kernels compute with them: float32, at least GATE_FLOOR (see there)."""
    return tl.maximum(g.to(tl.float32), GATE_FLOOR)


@triton.jit
def tf32(x):
    """float32 x rounded to the nearest tf32 (10 mantissa bits; ties away from zero, as PTX's
    cvt.rna.tf32.f32). The tensor cores read a float32 operand's top 19 bits, that is, truncated
    (checked natively on an H100 and an H200: 1 + 2⁻¹¹ + 2⁻¹² times 1 gave 1): for a computed operand
    (q ⊙ e^b, a gradient tile) an error of up to 2⁻¹⁰, always towards zero, where rounding gives at
    most 2⁻¹¹ of either sign — the precision of an fp16 input. Values that already are tf32 (every
    bf16 or fp16 input widened) are unchanged. Two integer operations per element; Inf stays Inf."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def operand(x, SDT: tl.constexpr, IEEE: tl.constexpr, RND: tl.constexpr = True):
    """A computed tile as a dot operand of dtype SDT, made once where it is computed. Where it stays
    float32 for a tf32 product (half inputs) it is rounded to tf32 (`tf32`) when RND
    (`rounds_tf32`), else the tensor cores truncate it; exact for float32 inputs (IEEE products);
    otherwise cast to SDT."""
    if SDT == tl.float32:
        if IEEE:
            return x.to(tl.float32)
        if RND:
            return tf32(x.to(tl.float32))
        return x.to(tl.float32)
    return x.to(SDT)


def rounds_tf32(dtype) -> bool:
    """Whether a kernel that pays for it rounds its computed float32 operands to tf32 (`tf32`) for
    inputs of `dtype`. GLA's kernels always round (no measurable cost). KDA's split kernel, whose
    tiles already spill, took 48 % longer in the forward with rounding (H200, bf16, H = 16,
    K = V = 128, T = 4k: 1.70 → 2.52 ms): there it rounds for fp16 only, whose inputs carry 2⁻¹¹ and
    so lose to a truncation's 2⁻¹⁰ (KDA's fp16 errors: up to 1.3× FLA's truncated, below FLA's
    rounded), while bf16 inputs carry 2⁻⁹ and rounding changes their errors by 1 %."""
    return dtype == torch.float16


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b with float32 accumulation: exact float32 products when IEEE (float32 inputs); else
    bf16/fp16 tiles as they are, float32 tiles as tf32 — computed float32 tiles come through
    `operand`, rounded to tf32 once where they are made."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@contextlib.contextmanager
def stage(timer, name):
    """Time the kernels launched inside into timer[name] (ms) when a timer dict is given: CUDA events
    natively, wall clock under the interpreter. Without a timer it does nothing (no syncs)."""
    if timer is None:
        yield
        return
    if torch.cuda.is_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        end.synchronize()
        timer[name] = timer.get(name, 0.0) + start.elapsed_time(end)
    else:
        t = time.perf_counter()
        yield
        timer[name] = timer.get(name, 0.0) + 1e3 * (time.perf_counter() - t)
