"""JupyterLab for the book: chapters and workbooks (py:percent files) open as notebooks.

    python tools/lab.py --setup    # what `make lab` runs before starting JupyterLab

jupytext (pinned in requirements.txt) brings a server extension that reads and writes .py files as
notebooks, and a JupyterLab extension with the "Jupytext Notebook" viewer. JupyterLab's default
viewer for Python files is the text editor; this sets it to "Jupytext Notebook" in the
environment's own settings overrides (<sys.prefix>/share/jupyter/lab/settings/overrides.json), so
a double click opens a chapter as a notebook, and saving writes it back as the same .py file (no
.ipynb beside it, no outputs in git). Nothing in the user's home directory is touched.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OVERRIDES = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
DOCMANAGER = "@jupyterlab/docmanager-extension:plugin"
NOTIFICATIONS = "@jupyterlab/apputils-extension:notification"


def setup(path: Path = OVERRIDES) -> dict:
    settings = json.loads(path.read_text()) if path.exists() else {}
    settings.setdefault(DOCMANAGER, {}).setdefault("defaultViewers", {})["python"] = "Jupytext Notebook"
    # no "get Jupyter news?" prompt (and no request for it) over the first chapter
    settings.setdefault(NOTIFICATIONS, {}).setdefault("fetchNews", "false")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2) + "\n")
    return settings


if __name__ == "__main__":
    if sys.argv[1:] != ["--setup"]:
        sys.exit(__doc__)
    setup()
    print(f"JupyterLab opens .py files as notebooks (Jupytext Notebook): {OVERRIDES}")
