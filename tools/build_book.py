"""Execute every chapter of the book top to bottom (the main job).

    python tools/build_book.py [book/03_decay.py ...]

Each py:percent chapter is converted to a notebook (its Colab cell configured from
[tool.linattn] in pyproject.toml, see tools/colab.py), executed in a fresh kernel from book/ (as a
reader's Jupyter would), and saved with its outputs and figures to _build/book/<name>.ipynb.
Stops with a non-zero exit if any chapter fails; a chapter that fails or is interrupted is saved as
_build/book/<name>.failed.ipynb, with the outputs of the cells that ran.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbclient
from traitlets.config import Config

import colab  # tools/colab.py: the Colab cell's configured source and badge

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "_build" / "book"


def execute(path: Path) -> float:
    nb = jupytext.read(str(path))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    try:
        colab.configure(nb, f"book/{path.stem}")   # [tool.linattn] of pyproject.toml into the first cell
    except ValueError as e:              # still runs; tests/test_colab.py fails on it
        print(f"  note  {e} (python tools/colab.py --rewrite {path.relative_to(ROOT)})")
    t0 = time.perf_counter()
    # The kernel talks to us over local IPC sockets (files in a temporary directory), not TCP:
    # nothing leaves the machine, and ipykernel has no unencrypted TCP port to warn about.
    # `ip` is the sockets' path prefix; absolute, since the kernel runs in book/ and we do not.
    # Configured, not passed in as km=, so that the client owns the kernel and shuts it down.
    with tempfile.TemporaryDirectory(prefix="linattn-kernel-") as sockets:
        ipc = Config({"KernelManager": {"transport": "ipc", "ip": str(Path(sockets) / "kernel")}})
        client = nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3", config=ipc,
                                         resources={"metadata": {"path": str(path.parent)}})
        OUT.mkdir(parents=True, exist_ok=True)
        failed = OUT / (path.stem + ".failed.ipynb")
        try:
            client.execute()
        except BaseException:
            # the cells that ran keep their outputs (a chapter stopped by a time limit still shows
            # what its cells printed up to there); the site and the checks read only <name>.ipynb
            jupytext.write(nb, str(failed), fmt="ipynb")
            raise
    failed.unlink(missing_ok=True)
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
            print(f"  FAIL  {path.name:<40} {type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}"
                  f" (the cells that ran: {OUT / (path.stem + '.failed.ipynb')})")
    print(f"executed notebooks in {OUT}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
