"""The operations as `torch.library` custom ops, so that torch.compile sees each as one node.

Whole sequences (the dispatcher's `linattn.<op>` under torch.compile):

    linattn::linear_attn(q, k, v,          initial_state, cu_seqlens, <options>) -> (o, final_state)
    linattn::gla        (q, k, v, g,       initial_state, cu_seqlens, <options>) -> (o, final_state)
    linattn::delta_rule (q, k, v, beta,    initial_state, cu_seqlens, <options>) -> (o, final_state)
    linattn::kda        (q, k, v, g, beta, initial_state, cu_seqlens, <options>) -> (o, final_state)

<options>: scale, level, and the tuning knobs chunk_size, sub_chunk_size, recompute, mode,
inter_dtype, each None for the level's default. One token (the layers' decoding step):

    linattn::<op>_step(q, k, v[, g][, beta], state, scale, level) -> (o, new_state)

Why custom ops: dynamo cannot trace the levels (Python loops over chunks and sequences, value
checks that read tensors, Triton launches, hand-written autograd.Functions). A custom op is opaque
to it: it records the call, takes output shapes from the fake implementation and the gradient
from the registered autograd formula, and runs the level itself when the graph runs.

Choices the schema forces:
- The final state is always returned: a schema cannot return "a tensor or None". Every level
  computes it anyway; `linattn.<op>` drops it when output_final_state=False.
- `level` is "auto" (the op picks by device: Triton for CUDA tensors, chunk otherwise), "chunk",
  "triton" or "naive"; for a step "naive" (plain torch, differentiable) or "triton" (the fused
  step, inference only), "auto" meaning naive. One op serves CPU and CUDA: the level decides.
- The backward is a second custom op, linattn::<op>_backward (<op>_step_backward), so that a
  compiled graph records it as one node too. It runs the level's own backward (its
  autograd.Function; plain autograd for the naive level) on a recomputed forward: one forward more
  per backward than an eager call, whose autograd keeps the forward's context. Its gradient of an
  absent initial state is an empty tensor (the autograd formula then returns None).
- The autograd formula is first-order, like the levels' backwards: differentiating it again fails.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

import torch

from . import dispatch
from .validate import InputError, check_qkv, value_checks

# Input tensors of each operation, in order (the dispatcher's positional arguments).
TENSORS = {
    "linear_attn": ("q", "k", "v"),
    "gla": ("q", "k", "v", "g"),
    "delta_rule": ("q", "k", "v", "beta"),
    "kda": ("q", "k", "v", "g", "beta"),
}


@dataclass(frozen=True)
class Spec:
    """One custom op: its input tensors, then its options (name, schema type, default)."""
    op: str                       # the operation: linear_attn, gla, delta_rule or kda
    step: bool                    # one token (linattn.naive.<op>_step) or a whole sequence
    options: tuple

    @property
    def name(self) -> str:
        return self.op + ("_step" if self.step else "")

    @property
    def tensors(self) -> tuple:
        return TENSORS[self.op]

    @property
    def state(self) -> str:
        """The option holding the state the op starts from."""
        return "state" if self.step else "initial_state"

    def schema(self, backward: bool = False) -> str:
        args = [f"Tensor {n}" for n in self.tensors]
        args += [f"{t} {n}={default}" for n, t, default in self.options]
        if backward:
            # grads of every input tensor, then of the state (empty when there is none)
            outs = ", ".join(["Tensor"] * (len(self.tensors) + 1))
            return f"(Tensor do, Tensor dS, {', '.join(args)}) -> ({outs})"
        return f"({', '.join(args)}) -> (Tensor, Tensor)"

    def split(self, args):
        """(input tensors, options dict) from positional arguments in schema order. Trailing
        arguments equal to their defaults may be left off by PyTorch (a fake call under dynamo)."""
        n = len(self.tensors)
        opts = {name: (None if default == "None" else default.strip('"'))
                for name, _, default in self.options}
        opts.update(zip((name for name, _, _ in self.options), args[n:]))
        return tuple(args[:n]), opts

    def args(self, tensors, opts) -> list:
        return [*tensors, *(opts[name] for name, _, _ in self.options)]


SEQUENCE_OPTIONS = (
    ("initial_state", "Tensor?", "None"), ("cu_seqlens", "Tensor?", "None"),
    ("scale", "float?", "None"), ("level", "str", '"auto"'), ("chunk_size", "int?", "None"),
    ("sub_chunk_size", "int?", "None"), ("recompute", "bool?", "None"), ("mode", "str?", "None"),
    ("inter_dtype", "ScalarType?", "None"),
)
STEP_OPTIONS = (("state", "Tensor?", "None"), ("scale", "float?", "None"), ("level", "str", '"auto"'))
LEVELS = ("auto",) + dispatch.LEVELS
STEP_LEVELS = ("auto", "naive", "triton")

SPECS = {s.name: s for s in [Spec(op, False, SEQUENCE_OPTIONS) for op in TENSORS]
         + [Spec(op, True, STEP_OPTIONS) for op in TENSORS]}
OPS: dict = {}            # name (e.g. "gla", "gla_step") → its custom op (a torch.library CustomOpDef)
BACKWARDS: dict = {}      # name → the custom op of its backward


def _level(spec: Spec, opts, q) -> str:
    level = opts["level"]
    allowed = STEP_LEVELS if spec.step else LEVELS
    if level not in allowed:
        raise InputError(f"linattn::{spec.name}: level must be one of {allowed}, got {level!r}")
    if level == "auto":
        return "naive" if spec.step else dispatch.device_level(q.is_cuda)
    return level


def _run(spec: Spec, tensors, opts):
    """(o, state after the last token) from the level the options choose."""
    level = _level(spec, opts, tensors[0])
    if spec.step:
        module = importlib.import_module(f"linattn.{level}" + (".step" if level == "triton" else ""))
        return getattr(module, spec.name)(*tensors, opts["state"], scale=opts["scale"])
    fn = dispatch.level_fn(spec.op, level)
    given = {n: x for n, x in opts.items() if n != "level" and x is not None}
    # checked as the dispatcher checks them: a knob the level lacks is dropped, any other refused
    kwargs = dispatch.keywords(spec.op, fn, f"linattn.{level}.{spec.op} (reference)", given)
    return fn(*tensors, output_final_state=True, **kwargs)


def _forward(spec: Spec):
    def impl(*args):
        o, S = _run(spec, *spec.split(args))
        # a custom op's outputs may not alias its inputs (a state passed through unchanged), and
        # are contiguous, as the fake implementation says (inductor checks the strides)
        return tuple(x.clone() if _aliases(x, args) else x.contiguous() for x in (o, S))
    return impl


def _aliases(x, args) -> bool:
    ptr = x.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.numel() and a.untyped_storage().data_ptr() == ptr
               for a in args)


def _fake(spec: Spec):
    """Output shapes and dtypes from the inputs' metadata: o in v's dtype; the state in float32 at
    every level (float64 for float64 inputs, except at the Triton level)."""
    def fake(*args):
        (q, k, v, *_), opts = spec.split(args)
        acc = torch.float64 if q.dtype == torch.float64 and _level(spec, opts, q) != "triton" else torch.float32
        if spec.step:                                                  # one token: [B, H, K] → [B, H, V]
            B, H, K = q.shape
            return v.new_empty(v.shape), q.new_empty((B, H, K, v.shape[-1]), dtype=acc)
        d = check_qkv(q, k, v, opts["scale"])                          # shapes only: no values read
        cu = opts["cu_seqlens"]
        N = d.B if cu is None else cu.shape[0] - 1                     # packed: one state per sequence
        return v.new_empty((d.B, d.T, d.H, d.V)), q.new_empty((N, d.H, d.K, d.V), dtype=acc)
    return fake


def _backward_impl(spec: Spec):
    def impl(do, dS, *args):
        tensors, opts = spec.split(args)
        h0 = opts[spec.state]
        leaves = [x.detach().requires_grad_() for x in tensors]
        if h0 is not None:
            opts = dict(opts, **{spec.state: h0.detach().requires_grad_()})
        wrt = leaves + ([opts[spec.state]] if h0 is not None else [])
        # The forward checked these values already. The level's own backward runs (its
        # autograd.Function) on the recomputed forward.
        with torch.enable_grad(), _autograd_on(), value_checks(False):
            o, S = _run(spec, leaves, opts)
            grads = torch.autograd.grad((o, S), wrt, (do, dS), allow_unused=True)
        # contiguous, as the fake implementation says (an input may be a strided view)
        grads = [x.new_zeros(x.shape) if gx is None else gx.contiguous() for gx, x in zip(grads, wrt)]
        if h0 is None:
            grads.append(tensors[0].new_empty(0))
        return tuple(grads)
    return impl


@contextlib.contextmanager
def _autograd_on():
    """Record autograd graphs inside a custom op's implementation. PyTorch calls an op without an
    autograd formula (the backward ops) below the autograd layer, and there plain torch operations
    (the naive level, the slices and joins of packed sequences) would record nothing to
    differentiate. Private API: torch.library offers no public switch for this."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def _backward_fake(spec: Spec):
    def fake(do, dS, *args):
        tensors, opts = spec.split(args)
        h0 = opts[spec.state]
        return (*(x.new_empty(x.shape) for x in tensors),
                tensors[0].new_empty(0) if h0 is None else h0.new_empty(h0.shape))
    return fake


def _autograd(spec: Spec):
    n = len(spec.tensors)

    def setup_context(ctx, inputs, output):
        tensors, opts = spec.split(inputs)
        ctx.save_for_backward(*tensors, opts[spec.state])
        ctx.opts = opts

    def backward(ctx, do, dS):
        *tensors, h0 = ctx.saved_tensors
        opts = dict(ctx.opts, **{spec.state: h0})
        grads = BACKWARDS[spec.name](do, dS, *spec.args(tensors, opts))
        # one gradient per input: the tensors, then the options (only the state has one)
        return (*grads[:n], *(grads[n] if name == spec.state and h0 is not None else None
                              for name, _, _ in spec.options))

    return backward, setup_context


def _register(spec: Spec):
    fwd = torch.library.custom_op(f"linattn::{spec.name}", _forward(spec), mutates_args=(),
                                  schema=spec.schema())
    fwd.register_fake(_fake(spec))
    bwd = torch.library.custom_op(f"linattn::{spec.name}_backward", _backward_impl(spec),
                                  mutates_args=(), schema=spec.schema(backward=True))
    bwd.register_fake(_backward_fake(spec))
    backward, setup_context = _autograd(spec)
    fwd.register_autograd(backward, setup_context=setup_context)
    OPS[spec.name], BACKWARDS[spec.name] = fwd, bwd


for _spec in SPECS.values():
    _register(_spec)


def call(name: str, tensors, **options):
    """linattn::<name>(*tensors, **options) -> (o, state): options by name (`Spec.options`); a
    name outside them raises dispatch.KeywordError, as linattn.<op> does."""
    spec = SPECS[name]
    names = {n for n, _, _ in spec.options}
    for key in options:
        if key not in names:
            # plain string operations: under torch.compile this message is built while tracing
            takes = ", ".join(n for n, _, _ in spec.options if n != "level")
            raise dispatch.KeywordError(f"linattn.{spec.op} got an unexpected keyword argument "
                                        f"{key!r}; under torch.compile it takes {takes}")
    _, opts = spec.split(tensors)
    opts.update(options)
    return OPS[name](*spec.args(tensors, opts))
