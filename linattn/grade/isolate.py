"""Running the reader's function in a child process: a hard time limit, a clean state, and a
verdict only the notebook's own process can give.

`check()` forks once per check (Linux, macOS). The child inherits the reader's function as it is
— a closure, a function defined in a notebook cell, a Triton kernel under the interpreter; nothing
needs to be picklable — calls it on each case in turn and sends back through a pipe only data:
the outputs and the inputs after the call, as raw tensor bytes behind a JSON header. Nothing is
unpickled, so nothing the child sends can run code in the notebook's process; the parent computes
the reference, compares and alone writes progress (`progress` refuses to write in the child).

On a time-out the parent asks the child where it is (SIGUSR1: the verdict names the line), then
kills the child's whole process group: a loop that catches BaseException, processes the function
forked and a child that ignores signals all end there. What the function prints is captured in
the child and printed by the parent above the verdict.

The child runs PyTorch on one thread: an OpenMP thread pool the parent started does not exist in a
forked child, and a parallel region there would wait for its threads forever.

Where forking cannot work, the function runs in the notebook's own process (`InProcess`): on a
platform without fork (Windows), and on any machine where PyTorch sees a GPU. CUDA cannot be used
in a child forked after the parent initialised it, and neither can autograd: its engine keeps a
worker thread per GPU, started by the parent's first backward, so a forked child's backward raises
("Unable to handle autograd's threading in combination with fork-based multiprocessing") or dies
setting up CUDA — every backward exercise would fail for a reason that is not the reader's. Which
functions use autograd cannot be known before they run, so on a GPU machine every check runs
in-process (`fork_is_safe`). There the time limit is an alarm between bytecodes
(limits.py); a function that catches BaseException outlasts it, and then fails for running past
the limit (only the stop button or a kernel restart ends an endless one), and the global torch
state (default dtype and device, grad mode, random state, threads, ...) is restored after each call.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import select
import signal
import struct
import sys
import time
import warnings

import torch

_HEAD = struct.Struct("<QQ")          # bytes of the JSON header, bytes of the tensor data after it
MAX_HEADER = 1 << 24
MAX_TENSOR_BYTES = 1 << 28            # an output this large is described, not sent (cases are small)
MAX_PRINTED = 20_000                  # characters of the function's own output shown per check
GRACE_S = 0.5                         # after a time-out: how long the child gets to say where it is

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class Other:
    """Something the function returned (or left in an argument) that is not a plain tensor, by
    its description, e.g. 'a sparse_coo tensor of shape (2, 3)'."""

    def __init__(self, what: str):
        self.what = what

    def __repr__(self):
        return self.what


class BadRecord(ValueError):
    """The child's bytes do not decode (a function that wrote into the grader's pipe)."""


def can_fork() -> bool:
    return hasattr(os, "fork") and hasattr(os, "killpg") and hasattr(signal, "SIGUSR1")


def accelerators() -> int:
    """How many GPUs (or other accelerators) this PyTorch sees; 0 on a CPU-only machine."""
    counts = [torch.cuda.device_count()]
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "device_count"):
        counts.append(acc.device_count())
    return max(counts)


def fork_is_safe() -> bool:
    """Whether the reader's function may run in a forked child: fork exists and no accelerator is
    visible (see the module docstring: with one, a child's CUDA and autograd both fail)."""
    return can_fork() and accelerators() == 0


# ---- what crosses the pipe: plain data only ---------------------------------------------------

def portable(x, *, cuda_ok=False):
    """x as plain data: a dense CPU tensor (a copy), None, a number, a short string, or Other."""
    if x is None or type(x) in (bool, int, float):
        return x
    if type(x) is str:
        return x[:200]
    if isinstance(x, torch.Tensor):
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            return Other(f"{_a(type(x).__name__)} (a torch.Tensor subclass; return a plain tensor)")
        shape = tuple(x.shape)
        if x.layout != torch.strided:
            return Other(f"a {str(x.layout).removeprefix('torch.')} tensor of shape {shape} "
                         "(return a dense tensor)")
        if x.device.type == "meta":
            return Other(f"a tensor of shape {shape} on the meta device (it has a shape but no values)")
        if x.dtype not in _DTYPES.values():
            return Other(f"a tensor of shape {shape} and dtype {x.dtype}")
        if x.device.type != "cpu":
            if not cuda_ok:
                return Other(f"a tensor of shape {shape} on {x.device}")
            x = x.detach().cpu()
        if x.numel() * x.element_size() > MAX_TENSOR_BYTES:
            return Other(f"a tensor of shape {shape} (too large to compare)")
        return x.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    return Other(_a(type(x).__name__))


def _a(noun: str) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def encode(obj) -> bytes:
    """One record: plain data (dicts with str keys, lists, tensors, Other, numbers, str, None)."""
    blobs = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            data = x.reshape(-1).view(torch.uint8).numpy().tobytes() if x.numel() else b""
            blobs.append(data)
            return {"__tensor__": [str(x.dtype).removeprefix("torch."), list(x.shape), len(data)]}
        if isinstance(x, Other):
            return {"__other__": x.what}
        if isinstance(x, dict):
            return {str(k): walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        return x

    header = json.dumps(walk(obj)).encode()
    data = b"".join(blobs)
    return _HEAD.pack(len(header), len(data)) + header + data


def decode(header: bytes, data: bytes):
    """The record's data; BadRecord if it is not what encode() writes."""
    try:
        tree = json.loads(header.decode())
    except (ValueError, RecursionError) as e:
        raise BadRecord(f"header: {e}") from None
    view = memoryview(data)
    pos = 0

    def build(x):
        nonlocal pos
        if isinstance(x, list):
            return [build(v) for v in x]
        if not isinstance(x, dict):
            return x
        if "__tensor__" in x:
            try:
                name, shape, n = x["__tensor__"]
                dtype = _DTYPES[name]
                shape = [int(s) for s in shape]
            except (KeyError, TypeError, ValueError):
                raise BadRecord("tensor description") from None
            numel = 1
            for s in shape:
                if s < 0:
                    raise BadRecord("negative size")
                numel *= s
            size = torch.empty((), dtype=dtype).element_size()
            if type(n) is not int or n != numel * size or pos + n > len(view):
                raise BadRecord("tensor size")
            t = (torch.frombuffer(bytearray(view[pos:pos + n]), dtype=torch.uint8).view(dtype)
                 if n else torch.zeros(0, dtype=dtype))
            pos += n
            return t.reshape(shape)
        if "__other__" in x:
            return Other(str(x["__other__"])[:300])
        return {k: build(v) for k, v in x.items()}

    return build(tree)


# ---- the child ---------------------------------------------------------------------------------

class _Capture(io.TextIOBase):
    """sys.stdout / sys.stderr in the child: what the function prints, sent back with each record."""

    def __init__(self):
        self.parts, self.size = [], 0

    def writable(self):
        return True

    def write(self, s):
        s = str(s)
        if self.size < MAX_PRINTED:
            self.parts.append(s[:MAX_PRINTED - self.size])
            if self.size + len(s) > MAX_PRINTED:
                self.parts.append("\n[... more output cut]\n")
        self.size += len(s)
        return len(s)

    def take(self) -> str:
        text = "".join(self.parts)
        self.parts = []
        return text


def _write_all(fd, data: bytes):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _child(fn, inputs, call, where, fd, go, me):
    """Body of the forked child: call fn on each case the parent asks for (one byte on `go` per
    case), send one record per case, then stop."""
    from . import progress

    progress.read_only = True  # the parent alone writes progress
    torch.set_num_threads(1)   # see the module docstring: no OpenMP parallel regions after fork
    sending = [False]
    capture = _Capture()

    def on_timeout(signum, frame):
        if sending[0] or os.getpid() != me:
            return
        sending[0] = True
        with contextlib.suppress(BaseException):
            _write_all(fd, encode({"kind": "where", "where": where(frame), "printed": capture.take()}))
        os._exit(0)

    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGUSR1, on_timeout)
    for sig in ("SIGINT", "SIGTERM"):  # the parent decides; the notebook's handlers do not apply here
        with contextlib.suppress(ValueError, OSError, AttributeError):
            signal.signal(getattr(signal, sig), signal.SIG_DFL)
    sys.stdout = sys.stderr = capture
    for args, kwargs in inputs:
        if os.read(go, 1) != b"g":
            return  # the parent has judged enough (or is gone)
        record = call(fn, args, kwargs)
        if os.getpid() != me:
            os._exit(0)  # a process the function forked: it never reports
        sending[0] = True
        record["printed"] = capture.take()
        try:
            data = encode(record)
        except BaseException as e:  # noqa: BLE001
            data = encode({"kind": "raised", "printed": record["printed"],
                           "message": f"its result could not be sent back ({type(e).__name__})"})
        _write_all(fd, data)
        sending[0] = False
        if record.get("kind") != "returned":
            return


class Child:
    """The function running on the cases in a forked child; `next(limit)` waits for one case."""

    def __init__(self, fn, inputs, call, where):
        r, w = os.pipe()
        go_r, go_w = os.pipe()
        with warnings.catch_warnings():  # Python 3.12 warns about forking a threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: whatever happens, it ends here and never returns into check()
            try:
                os.setpgid(0, 0)
                os.close(r)
                os.close(go_w)
                _child(fn, inputs, call, where, w, go_r, os.getpid())
            except BaseException:  # noqa: BLE001
                pass
            finally:
                os._exit(0)
        os.close(w)
        os.close(go_r)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # also here: the group must exist before the parent may kill it
        self.pid, self.fd, self.go, self.buf, self.status = pid, r, go_w, bytearray(), None
        self.asked = self.taken = 0
        self.ahead()

    def ahead(self):
        """Let the child start on the next case while this process computes its reference. Only
        after the previous case passed: a failed check wastes no work on cases never judged."""
        if self.asked == self.taken:
            self.asked += 1
            with contextlib.suppress(OSError):
                os.write(self.go, b"g")

    def next(self, limit: float | None) -> dict:
        """The next record; {"kind": "timeout"} after `limit` s, {"kind": "lost"} if the child ended."""
        self.ahead()
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            record = self._take()
            if record is not None:
                self.taken += 1
                return record
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return self._timed_out()
            if not self._read(wait):
                return {"kind": "lost", "status": self._ended()}

    def _read(self, wait) -> bool:
        ready, _, _ = select.select([self.fd], [], [], wait)
        if ready:
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                return False
            self.buf += chunk
        return True

    def _take(self):
        if len(self.buf) < _HEAD.size:
            return None
        nh, nd = _HEAD.unpack_from(self.buf)
        if nh > MAX_HEADER or nd > 64 * MAX_TENSOR_BYTES:
            return {"kind": "garbled"}
        end = _HEAD.size + nh + nd
        if len(self.buf) < end:
            return None
        head, data = bytes(self.buf[_HEAD.size:_HEAD.size + nh]), bytes(self.buf[_HEAD.size + nh:end])
        del self.buf[:end]
        try:
            record = decode(head, data)
        except BadRecord:
            return {"kind": "garbled"}
        return record if isinstance(record, dict) else {"kind": "garbled"}

    def _timed_out(self) -> dict:
        where, printed = "", ""
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGUSR1)
            end = time.monotonic() + GRACE_S
            while time.monotonic() < end:
                record = self._take()
                if record is not None:
                    if record.get("kind") == "where":
                        where = record.get("where") if isinstance(record.get("where"), str) else ""
                        printed = record.get("printed") if isinstance(record.get("printed"), str) else ""
                    if record.get("kind") in ("where", "garbled"):
                        break
                    continue  # a case that finished just too late: not what was asked for
                if not self._read(max(end - time.monotonic(), 0)):
                    break
        return {"kind": "timeout", "where": where, "printed": printed}

    def _ended(self) -> str:
        """How the child ended, once it has (it closed the pipe): 'exit status 3', 'signal 9'."""
        end = time.monotonic() + GRACE_S
        while time.monotonic() < end:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # SIGCHLD ignored in this process: children reap themselves
                self.status = 0
                return "it ended"
            if pid:
                self.status = status
                if os.WIFSIGNALED(status):
                    return f"killed by signal {os.WTERMSIG(status)}"
                return f"exit status {os.WEXITSTATUS(status)}"
            time.sleep(0.01)
        return "it closed the grader's pipe"

    def close(self):
        """Kill the child's process group (the child and anything it started) and reap the child."""
        with contextlib.suppress(OSError):
            os.killpg(self.pid, signal.SIGKILL)
        for fd in (self.fd, self.go):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.status is None:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)


class InProcess:
    """The same interface, running each case in this process (no fork, or CUDA needed)."""

    def __init__(self, fn, inputs, call):
        self.fn, self.inputs, self.call, self.i = fn, list(inputs), call, 0

    def ahead(self):
        pass

    def next(self, limit):
        args, kwargs = self.inputs[self.i]
        self.i += 1
        with global_state():
            return self.call(self.fn, args, kwargs, limit)

    def close(self):
        pass


# ---- global state a function may change in this process ---------------------------------------

@contextlib.contextmanager
def global_state():
    """Restore, after the block, the process-wide settings a graded function might change."""
    saved = [(get, put, _try(get)) for get, put in _SETTINGS]
    modes = _try(torch._C._len_torch_function_stack)
    device_ctx = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    device = device_ctx.device if device_ctx is not None else None
    try:
        yield
    finally:
        if getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None) is not device_ctx:
            with contextlib.suppress(Exception):
                torch.set_default_device(None)
            with contextlib.suppress(Exception):
                torch.set_default_device(device)
        with contextlib.suppress(Exception):  # torch-function modes entered and never left
            while modes is not None and torch._C._len_torch_function_stack() > modes:
                torch._C._pop_torch_function_stack()
        for get, put, value in saved:
            if value is not _FAILED:
                with contextlib.suppress(Exception):
                    if _try(get) != value:
                        put(value)


_FAILED = object()


def _try(get):
    try:
        return get()
    except Exception:  # noqa: BLE001  (a setting this build does not have)
        return _FAILED


def _cuda_rng():
    return torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _set_cuda_rng(states):
    if states is not None:
        torch.cuda.set_rng_state_all(states)


def _deterministic():
    return (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())


def _np_random():
    np = sys.modules.get("numpy")
    return np.random.get_state() if np is not None else None


def _set_np_random(state):
    if state is not None:
        sys.modules["numpy"].random.set_state(state)


class _Rng:
    """A random state, boxed so that it always counts as changed: states are tensors and tuples of
    arrays, which `!=` does not compare as wholes, and putting one back is cheap."""

    def __init__(self, get):
        self.get = get

    def __call__(self):
        return _Box(self.get())


class _Box:
    def __init__(self, value):
        self.value = value

    def __ne__(self, other):
        return True


def _put_rng(put):
    return lambda box: put(box.value)


_SETTINGS = [
    (torch.get_default_dtype, torch.set_default_dtype),
    (torch.is_grad_enabled, torch.set_grad_enabled),
    (torch.get_num_threads, torch.set_num_threads),
    (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    (_deterministic, lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    (lambda: torch.backends.cudnn.allow_tf32, lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
    (lambda: torch.backends.cudnn.deterministic,
     lambda v: setattr(torch.backends.cudnn, "deterministic", v)),
    (lambda: torch.backends.cudnn.benchmark, lambda v: setattr(torch.backends.cudnn, "benchmark", v)),
    (lambda: torch.backends.cuda.matmul.allow_tf32,
     lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    # random states, so that a function that seeds does not reseed the notebook
    (_Rng(torch.random.get_rng_state), _put_rng(torch.random.set_rng_state)),
    (_Rng(_cuda_rng), _put_rng(_set_cuda_rng)),
    (_Rng(random.getstate), _put_rng(random.setstate)),
    (_Rng(_np_random), _put_rng(_set_np_random)),
]
