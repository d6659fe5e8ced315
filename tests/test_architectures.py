"""Every Triton kernel compiles for, and fits, every GPU architecture a reader may have.

No GPU is needed: tools/arch_check.py captures the launch configurations the wrappers choose
(running them on CPU tensors with a launch that records) and compiles each with `triton.compile`
for a `GPUTarget` of sm_75 (T4), sm_80 (A100), sm_86 (RTX 30), sm_89 (L4, RTX 40) and sm_90
(H100, H200). Here it compiles CI's subset (per kernel and tile dtype, the largest tiles the
wrappers choose) as far as Triton's shared-memory allocation, and a few small kernels through ptxas;
`python tools/arch_check.py` runs the whole matrix into book/data/architectures.json.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import linattn  # noqa: F401  (decides Triton's interpreter mode before triton is first imported)

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "arch_check.py"
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def ci_table():
    """The CI subset compiled for all five architectures, in a process of its own (Triton must be
    in compiled mode there, and this process may have it in interpreter mode)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "arch.json"
        env = dict(os.environ, TRITON_INTERPRET="0")
        proc = subprocess.run([sys.executable, str(TOOL), "--subset", "ci", "--json", str(out),
                               "--depth", "cubin", "--deep-kernels", "_step_kernel,_local_cumsum_kernel"],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if not out.exists():
            pytest.fail(f"tools/arch_check.py wrote no table:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text()), proc


def test_every_kernel_compiles_and_fits_every_architecture(ci_table):
    """Every configuration compiles for every architecture and fits it (after common.launch's rule of
    fewer pipeline stages), or the wrapper handles it: the fused GLA program falls back to the states
    mode, and float32 tiles on GPUs with less than an A100's shared memory may be refused with an
    InputError naming the GPU (tools/arch_check.py, `may_refuse`), as may bf16/fp16 chunks above 64 on the T4."""
    doc, proc = ci_table
    assert doc["problems"] == [], "\n".join(doc["problems"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for row in doc["configs"]:
        assert set(row["archs"]) == set(ARCHS), row["kernel"]
        for arch, res in row["archs"].items():
            assert "error" not in res, f"{row['kernel']} [{row['config']}] on {arch}: {res['error']}"
        for arch in ("sm_80", "sm_90"):
            res = row["archs"][arch]
            assert res["fits"] or "fallback" in res, f"{row['kernel']} [{row['config']}] on {arch}: {res}"


def test_small_kernels_compile_through_ptxas(ci_table):
    """The whole compilation, ptxas included, works for every architecture (registers reported)."""
    doc, _ = ci_table
    deep = [row for row in doc["configs"] if row["kernel"] in ("_step_kernel", "_local_cumsum_kernel")]
    assert deep
    for row in deep:
        for arch, res in row["archs"].items():
            assert 0 < res["regs"] <= 255 and res["fits"], (row["kernel"], arch, res)


def test_every_kernel_is_covered(ci_table):
    """The subset has every kernel the wrappers launch (forward, backward, decode step)."""
    doc, _ = ci_table
    kernels = {row["kernel"] for row in doc["configs"]}
    expected = {"_local_cumsum_kernel", "_intra_kernel", "_states_kernel", "_output_kernel", "_fused_kernel",
                "_dstates_kernel", "_dA_kernel", "_intra_grad_kernel", "_dv_kernel", "_dqk_kernel", "_dg_kernel",
                "_factor_kernel", "_kda_split_kernel", "_kda_exact_kernel", "_wu_kernel", "_state_kernel",
                "_dstate_kernel", "_dchunk_kernel", "_gate_kernel", "_step_kernel", "_combine_kernel"}
    assert expected <= kernels, sorted(expected - kernels)


def test_recorded_table_covers_every_architecture():
    """book/data/architectures.json (the full matrix, quoted by the README and chapter 00) has every
    architecture and no configuration that neither fits nor falls back."""
    doc = json.loads((ROOT / "book" / "data" / "architectures.json").read_text())
    assert set(doc["limits"]) == set(ARCHS)
    assert doc["problems"] == [], "\n".join(doc["problems"][:20])
    for name, t in doc["table"].items():
        assert set(t["archs"]) == set(ARCHS), name


def test_architectures_are_the_supported_ones():
    """The tool checks exactly the architectures linattn.support names."""
    from linattn import support

    text = TOOL.read_text()
    for major, minor in support.ARCHITECTURES:
        assert f"    {major}{minor}: (" in text, f"sm_{major}{minor} missing from tools/arch_check.py ARCHS"
    assert len(support.ARCHITECTURES) == len(ARCHS)


def test_launch_that_does_not_fit_names_the_gpu():
    """common.launch tries fewer pipeline stages, then raises InputError (not OutOfResources)."""
    from triton.runtime.errors import OutOfResources

    from linattn.triton import common
    from linattn.validate import InputError

    tried = []

    class Kernel:
        __name__ = "_big_kernel"

        def __getitem__(self, grid):
            def run(*args, num_stages, **kw):
                tried.append(num_stages)
                if num_stages > 1:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return "compiled"
            return run

    assert common.launch(Kernel(), (1,), max_stages=3, BV=64) == "compiled"
    assert tried == [3, 2, 1]

    class Huge(Kernel):
        def __getitem__(self, grid):
            def run(*args, num_stages, **kw):
                raise OutOfResources(300_000, 232_448, "shared memory")
            return run

    with pytest.raises(InputError, match="_big_kernel does not fit this GPU"):
        common.launch(Huge(), (1,), max_stages=2, BV=128)


def test_launch_retries_when_a_remembered_stage_count_no_longer_fits():
    """Triton compiles a kernel again for an integer argument equal to 1 (one chunk): that variant
    fitted 3 stages natively where the next length's did not (float32 DeltaNet, K = 128). The
    remembered count must not turn the longer call into a refusal."""
    from triton.runtime.errors import OutOfResources

    from linattn.triton import common

    tried = []

    class Kernel:
        __name__ = "_variant_kernel"

        def __getitem__(self, grid):
            def run(*args, num_stages, **kw):
                tried.append((args[0], num_stages))
                if args[0] > 1 and num_stages > 2:           # the longer variant needs more memory
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return "compiled"
            return run

    k = Kernel()
    assert common.launch(k, (1,), 1, max_stages=3, BV=96) == "compiled"      # NT = 1: 3 stages fit
    assert common.launch(k, (1,), 2, max_stages=3, BV=96) == "compiled"      # NT = 2: 3 do not
    assert tried == [(1, 3), (2, 3), (2, 2)]
    assert common.launch(k, (1,), 2, max_stages=3, BV=96) == "compiled"      # now remembered: 2
    assert tried[-1] == (2, 2)


def test_register_pass_goes_on_where_it_stopped(tmp_path):
    """With --deep-log, each ptxas result is kept as it comes and not compiled again: a register pass
    cut short (hours on a few cores) loses only the compilations in flight."""
    log = tmp_path / "deep.jsonl"
    script = f"""
import json, sys
sys.path[:0] = [{str(ROOT / "tools")!r}, {str(ROOT)!r}]
import arch_check as ac
configs = {{k: v for k, v in ac.capture(False).items() if v[0].fn.__name__ == "_step_kernel"}}
deep = ac.representative(ac.group(configs))
log = {str(log)!r}
first = ac.check(deep, (75, 90), workers=1, log=log)
lines = open(log).read().splitlines()
open(log, "w").write("\\n".join(lines[:-1]) + "\\n")           # a cut run: its last result lost
second = ac.check(deep, (75, 90), workers=1, log=log)
after = open(log).read().splitlines()
def compiled_again(i):
    raise AssertionError("compiled again")
ac._job = compiled_again                                       # the forked pool inherits it
third = ac.check(deep, (75, 90), workers=1, log=log)
def plain(rows):                                               # a result without its compile time
    return [{{a: {{k: v for k, v in res.items() if k != "seconds"}} for a, res in row["archs"].items()}} for row in rows]
print(json.dumps(dict(n=len(lines), after=len(after), same=plain(first) == plain(second) == plain(third),
                      regs=[res.get("regs") for row in third for res in row["archs"].values()])))
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["n"] >= 2 and out["after"] == out["n"]               # only the lost one compiled again
    assert out["same"] and all(0 < r <= 255 for r in out["regs"]), out
