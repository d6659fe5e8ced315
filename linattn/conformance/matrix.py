"""The generated case matrix of the native conformance suite: a covering design, not a full product.

A case is a plain dict (JSON-serialisable, so it travels to worker processes and into the results):

    id, part, variant, B, T, H, K, V, dtype, strength, h0, final, dht, chunk_size, sub_chunk_size,
    seed, fla, decode, check (property cases only)

`variant` is one of VARIANTS (the six operations as models use them); `h0` an initial state;
`final` output_final_state; `dht` an incoming gradient on the final state; `fla` whether FLA runs
beside ours on the same inputs; `check` names a property (see properties.py).

What the native matrix promises, per variant (`coverage` checks it, tests/test_conformance.py too):
every K × V in KS × KS (square and K ≠ V), every boundary length in LENGTHS with every dtype,
every gate strength with every dtype (gated variants), every chunk size (and GLA sub-chunk size) the
Triton level accepts, initial state and final-state gradient on and off, odd B and H.

Compilation dominates a cold native run (one Triton specialisation per K, V, dtype, chunk size:
seconds to a minute each, docs/performance.md), so the promises are laid onto few specialisations:
the K × V grid carries the chunk sizes and rotates the dtype; the lengths, the strengths, FLA and
the extra random cases reuse one core shape per dtype (K = V = 128, the default chunk).
"""
from __future__ import annotations

import random

from .. import testing

VARIANTS = testing.VARIANTS        # variant → (linattn op, gate kind); the names are FLA's
KS = (16, 32, 64, 128, 256)                                     # head dims, for K and for V
LENGTHS = (1, 2, 15, 16, 17, 63, 64, 65, 257, 300, 1000, 2048)  # around every boundary, and long
DTYPES = ("float32", "bfloat16", "float16")
STRENGTHS = testing.GATE_STRENGTHS
CORE = (128, 128)                                               # K, V of the core shape
# (h0, final, dht) in rotation: initial state and final-state gradient on and off
FLAGS = ((True, True, True), (False, True, False), (True, False, False), (False, True, True),
         (True, True, False), (False, False, False))
BH = ((1, 3), (3, 1), (3, 3), (1, 1), (2, 3))                   # batch, heads in rotation: odd ones
# float64 reference memory: the naive level keeps every state, B·H·T·K·V float64 numbers per copy
MAX_STATE_ELEMENTS = 1 << 26
# The delta rules in float32 at head dim 256: IEEE products over 256 compile to minutes of FMA code
# natively (tests/test_triton_backward_delta.py tests that size in bf16 only); half precision there.
SLOW_COMPILE = {"family": "delta", "dtype": "float32", "head_dim": 256}

PROPERTIES = ("causality", "prefix_suffix", "batch_rows", "chunk_size")

SIZES = ("native", "cpu")
NATIVE_PER_VARIANT = 170            # regular cases per variant (the rest random extras on core shapes)


def gated(variant: str) -> bool:
    return VARIANTS[variant][1] is not None


def delta_family(variant: str) -> bool:
    return VARIANTS[variant][0] in ("delta_rule", "kda")


def chunk_options(variant: str, dtype: str | None = None) -> list[tuple[int, int | None]]:
    """Every (chunk_size, sub_chunk_size) the Triton level accepts for `variant`, read from its
    supported range (linattn.support); GLA with per-dimension gates also
    every sub-chunk size (a power of two from 16 to 64 dividing the chunk). sub_chunk_size None: the
    function takes none (linear attention, the delta rules) or ignores it (per-head gates). With a
    dtype: those it accepts in that dtype (float32 stops at a smaller chunk)."""
    import torch
    from .. import support
    sizes = list(support.triton_chunk_sizes(VARIANTS[variant][0], dtype and getattr(torch, dtype)))
    if variant == "gla":
        return [(C, c) for C in sizes for c in sizes if c <= min(C, support.MAX_TRITON_SUB_CHUNK)]
    return [(C, None) for C in sizes]


def _max_chunk(variant: str, dtype: str) -> int:
    """The largest chunk_size the Triton level takes for the variant in `dtype` (linattn.support)."""
    import torch
    from .. import support
    return support.max_triton_chunk(VARIANTS[variant][0], getattr(torch, dtype))


def default_chunk(variant: str) -> tuple[int, int | None]:
    return (64, 16) if variant == "gla" else (64, None)


def _fit(B, H, T, K, V):
    """Shrink B, then H, so the float64 reference's states fit MAX_STATE_ELEMENTS."""
    while B * H * T * K * V > MAX_STATE_ELEMENTS and B > 1:
        B -= 1
    while B * H * T * K * V > MAX_STATE_ELEMENTS and H > 1:
        H -= 1
    return B, H


def _case(n, part, variant, *, K, V, T, dtype, chunk, strength=None, flags=FLAGS[0], bh=(1, 1),
          fla=False, decode=True, check=None, seed=None):
    h0, final, dht = flags
    B, H = _fit(*bh, T, K, V)
    return dict(id=f"{variant}-{part}-{n:03d}", part=part, variant=variant, B=B, T=T, H=H, K=K, V=V,
                dtype=dtype, strength=strength if gated(variant) else None, h0=h0, final=final,
                dht=dht and final, chunk_size=chunk[0], sub_chunk_size=chunk[1],
                seed=n if seed is None else seed, fla=fla, decode=decode, check=check)


def _slow(variant, K, V, dtype):
    return delta_family(variant) and dtype == SLOW_COMPILE["dtype"] and max(K, V) >= SLOW_COMPILE["head_dim"]


def native_cases(variant: str, per_variant: int = NATIVE_PER_VARIANT) -> list[dict]:
    cases, n = [], 0
    strengths = STRENGTHS if gated(variant) else (None,)
    opts = chunk_options(variant)
    dc = default_chunk(variant)

    # the grid: every K × V; chunk sizes and dtypes rotate over it, lengths around the chunk
    for i, K in enumerate(KS):
        for j, V in enumerate(KS):
            k = i * len(KS) + j
            chunk = opts[(3 * i + j) % len(opts)] if len(opts) <= len(KS) else opts[k % len(opts)]
            dtype = DTYPES[(i + j) % len(DTYPES)]
            if _slow(variant, K, V, dtype) or chunk[0] > _max_chunk(variant, dtype):
                dtype = DTYPES[1 + k % 2]          # float32 stops earlier (linattn.support)
            C = chunk[0]
            T = (C - 1, C + 1, 2 * C + 3, 3 * C, 100)[k % 5]
            cases.append(_case(n, "grid", variant, K=K, V=V, T=T, dtype=dtype, chunk=chunk,
                               strength=strengths[k % len(strengths)], flags=FLAGS[k % len(FLAGS)],
                               bh=BH[k % len(BH)]))
            n += 1
    # chunk options the 25 grid slots did not reach (GLA has 15 (C, c) pairs; all fit, kept general)
    seen = {(c["chunk_size"], c["sub_chunk_size"]) for c in cases}
    for chunk in opts:
        if chunk not in seen:
            cases.append(_case(n, "grid", variant, K=64, V=32, T=2 * chunk[0] + 1, dtype="bfloat16",
                               chunk=chunk, flags=FLAGS[n % len(FLAGS)], bh=BH[n % len(BH)]))
            n += 1
    # every boundary length with every dtype, on the core shape (FLA beside)
    for d, dtype in enumerate(DTYPES):
        for t, T in enumerate(LENGTHS):
            k = d * len(LENGTHS) + t
            cases.append(_case(n, "length", variant, K=CORE[0], V=CORE[1], T=T, dtype=dtype, chunk=dc,
                               strength=strengths[k % len(strengths)], flags=FLAGS[k % len(FLAGS)],
                               bh=BH[k % len(BH)], fla=True))
            n += 1
    # every strength with every dtype (the gated variants), long enough for the gates to compound
    if gated(variant):
        for d, dtype in enumerate(DTYPES):
            for s, strength in enumerate(STRENGTHS):
                k = d * len(STRENGTHS) + s
                cases.append(_case(n, "strength", variant, K=CORE[0], V=CORE[1], T=(300, 1000, 257)[k % 3],
                                   dtype=dtype, chunk=dc, strength=strength, flags=FLAGS[k % len(FLAGS)],
                                   bh=BH[k % len(BH)], fla=True))
                n += 1
    # random extras on the specialisations already compiled: lengths, batch/heads, strengths, flags
    rng = random.Random(f"conformance-{variant}")
    shapes = sorted({(c["K"], c["V"], c["dtype"], c["chunk_size"], c["sub_chunk_size"]) for c in cases})
    core = [s for s in shapes if (s[0], s[1]) == CORE and (s[3], s[4]) == dc]
    while len(cases) < per_variant:
        K, V, dtype, C, c = rng.choice(core) if rng.random() < 0.6 else rng.choice(shapes)
        T = rng.choice(LENGTHS) if rng.random() < 0.4 else rng.randint(1, 1200)
        if T * K * V > MAX_STATE_ELEMENTS:
            continue
        cases.append(_case(n, "extra", variant, K=K, V=V, T=T, dtype=dtype, chunk=(C, c),
                           strength=rng.choice(strengths), flags=rng.choice(FLAGS), bh=rng.choice(BH),
                           fla=(K, V) == CORE and (C, c) == dc))
        n += 1
    return cases


def property_cases(variant: str, dtypes=DTYPES, *, K=32, V=64, T=100, grid=None) -> list[dict]:
    """Causality, prefix + suffix, batch rows (every dtype) and chunk-size independence (bf16) on a
    small K ≠ V shape; decode = whole sequence runs inside every regular case. With `grid` (the
    variant's regular cases) each dtype takes the shape and chunk of a small K ≠ V grid case of that
    dtype, so the properties compile nothing new natively."""
    strength = "strong" if gated(variant) else None
    cases, n = [], 900
    for dtype in dtypes:
        shape = (K, V, (32, 16) if variant == "gla" else (32, None))
        for c in grid or ():
            if (c["part"] == "grid" and c["dtype"] == dtype and c["K"] != c["V"] and max(c["K"], c["V"]) <= 64
                    and c["chunk_size"] <= 64):
                shape = (c["K"], c["V"], (c["chunk_size"], c["sub_chunk_size"]))
                break
        for check in ("causality", "prefix_suffix", "batch_rows"):
            cases.append(_case(n, "property", variant, K=shape[0], V=shape[1], T=T, dtype=dtype, chunk=shape[2],
                               strength=strength, flags=(True, True, True), bh=(3, 3) if check == "batch_rows" else (1, 3),
                               decode=False, check=check))
            n += 1
    cases.append(_case(n, "property", variant, K=16, V=32, T=T, dtype="bfloat16" if "bfloat16" in dtypes else dtypes[0],
                       chunk=default_chunk(variant), strength=strength, flags=(True, True, True), bh=(1, 3),
                       decode=False, check="chunk_size"))
    return cases


def cpu_cases(variants=None) -> list[dict]:
    """A handful of tiny cases for CI under the interpreter: one regular case per variant (K ≠ V,
    T past a chunk, half with an initial state, each with a final-state gradient, one in bf16), and
    the four properties on simple GLA (the cheapest gated variant to interpret)."""
    out = []
    for v, variant in enumerate(variants or VARIANTS):
        chunk = (16, 16) if variant == "gla" else (16, None)
        out.append(_case(v, "cpu", variant, K=16, V=32, T=19, dtype="bfloat16" if v == 0 else "float32",
                         chunk=chunk, strength="reset" if gated(variant) else None, flags=FLAGS[v % 2 * 3],
                         bh=(1, 3) if v % 2 else (3, 1), fla=True))
    if variants is None or "simple_gla" in variants:
        for c in property_cases("simple_gla", ("float32",), K=16, V=16, T=20):
            out.append(dict(c, H=1, B=min(c["B"], 2)))
    return out


def cases(size: str = "native", *, only=None, per_variant: int = NATIVE_PER_VARIANT) -> list[dict]:
    """Every case of the matrix of `size` ('native' or 'cpu'), optionally for some variants only.
    per_variant: regular native cases per variant; below the covering part's size (61 ungated, 79 gated) no
    random extras are added, nothing of the covering part is dropped."""
    variants = [v for v in VARIANTS if not only or v in only]
    if size == "cpu":
        return cpu_cases(variants)
    if size != "native":
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    out = []
    for variant in variants:
        regular = native_cases(variant, per_variant)
        out += regular + property_cases(variant, grid=regular)
    return out


def specialisations(cases_: list[dict]) -> set:
    """The Triton specialisations the cases compile, roughly: (variant, K, V, dtype, chunk, sub-chunk)
    — the chunk-size property compiles every chunk option. (Flags such as an initial state add a few
    small variants of some kernels.)"""
    out = set()
    for c in cases_:
        opts = chunk_options(c["variant"], c["dtype"]) if c.get("check") == "chunk_size" else [(c["chunk_size"], c["sub_chunk_size"])]
        out |= {(c["variant"], c["K"], c["V"], c["dtype"], C, sub) for C, sub in opts}
    return out


def coverage(cases_: list[dict]) -> dict:
    """What the regular cases of a matrix cover, per variant: {variant: {promise: missing items}}.
    An empty list everywhere means every promise of the module doc is kept."""
    report = {}
    for variant in VARIANTS:
        mine = [c for c in cases_ if c["variant"] == variant and c["part"] != "property"]
        if not mine:
            continue
        kv = {(c["K"], c["V"]) for c in mine}
        td = {(c["T"], c["dtype"]) for c in mine}
        sd = {(c["strength"], c["dtype"]) for c in mine}
        ch = {(c["chunk_size"], c["sub_chunk_size"]) for c in mine}
        flags = {(c["h0"], c["dht"]) for c in mine}
        props = {c["check"] for c in cases_ if c["variant"] == variant and c["part"] == "property"}
        report[variant] = {
            "K×V": [p for p in ((K, V) for K in KS for V in KS) if p not in kv],
            "T×dtype": [p for p in ((T, d) for T in LENGTHS for d in DTYPES) if p not in td],
            "strength×dtype": [p for p in ((s, d) for s in STRENGTHS for d in DTYPES) if p not in sd]
            if gated(variant) else [],
            "chunk": [o for o in chunk_options(variant) if o not in ch],
            "h0×dht": [f for f in ((a, b) for a in (False, True) for b in (False, True)) if f not in flags],
            "odd B, H": [] if any(c["B"] % 2 and c["B"] > 1 for c in mine) and any(
                c["H"] % 2 and c["H"] > 1 for c in mine) else ["B = 3 / H = 3"],
            "properties": [p for p in PROPERTIES if p not in props],
        }
    return report
