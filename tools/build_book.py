"""Execute every chapter of the book top to bottom (the main job).

    python tools/build_book.py [book/03_decay.py ...]

Each py:percent chapter is converted to a notebook, executed in a fresh kernel from book/ (as a
reader's Jupyter would), and saved with its outputs and figures to _build/book/<name>.ipynb.
Stops with a non-zero exit if any chapter fails.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbclient
from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "_build" / "book"


def execute(path: Path) -> float:
    nb = jupytext.read(str(path))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    t0 = time.perf_counter()
    # The kernel talks to us over local IPC sockets (files in a temporary directory), not TCP:
    # nothing leaves the machine, and ipykernel has no unencrypted TCP port to warn about.
    # `ip` is the sockets' path prefix; absolute, since the kernel runs in book/ and we do not.
    with tempfile.TemporaryDirectory(prefix="linattn-kernel-") as sockets:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(sockets) / "kernel"))
        nbclient.NotebookClient(nb, km=km, timeout=1800,
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    OUT.mkdir(parents=True, exist_ok=True)
    jupytext.write(nb, str(OUT / (path.stem + ".ipynb")), fmt="ipynb")
    return time.perf_counter() - t0


def main(args) -> int:
    chapters = [Path(a).resolve() for a in args] or sorted((ROOT / "book").glob("[0-9][0-9]_*.py"))
    failed = []
    for path in chapters:
        try:
            dt = execute(path)
            print(f"  ok    {path.name:<40} {dt:6.1f} s")
        except Exception as e:  # noqa: BLE001  (report every chapter, then fail)
            failed.append(path.name)
            print(f"  FAIL  {path.name:<40} {type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}")
    print(f"executed notebooks in {OUT}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
