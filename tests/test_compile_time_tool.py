"""tools/compile_time.py --mqar-offline on the CPU: chapter 14's kernels recorded without running and
compiled for sm_90 through ptxas. Run as a process of its own: it imports the Triton level compiled,
not interpreted, which this test process has already imported interpreted."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_offline_compile_of_a_chapter_14_model(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_time.py"), "--mqar-offline", "linear:2",
                          "--workers", "1"], capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "TRITON_CACHE_DIR": str(tmp_path)}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    model, total = [json.loads(line) for line in out.stdout.splitlines()[-2:]]
    assert model["model"] == "linear:2" and model["kernels"] > 0 and model["seconds"] > 0
    # the slowest of the model's launches, named by kernel
    names = {name for name, _ in model["slowest"]}
    assert names and all(n.startswith("_") and n.endswith("_kernel") for n in names)
    assert total["models"] == 1 and total["distinct_launches"] == model["kernels"]
    assert any(tmp_path.rglob("*.cubin"))                 # compiled through ptxas into the given cache
