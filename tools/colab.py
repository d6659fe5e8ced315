"""The first cell of every chapter and workbook, and where Colab installs the library from.

One place configures the source: `[tool.linattn]` in pyproject.toml,

    install = "linattn @ git+https://github.com/OWNER/linattn"   # what pip installs on Colab
    colab = "OWNER/linattn/blob/main/notebooks"   # GitHub folder of `make notebooks`' .ipynb

Both empty (the default) until the book has a public home. The chapters' .py files all carry
the same first cell, `CELL`, with `LINATTN_SOURCE = ""`; building notebooks (tools/build_book.py)
writes the configured `install` into that line and, when `colab` is set, puts an "Open in Colab"
badge under it. With no source, the cell on Colab installs a wheel the reader uploads (built by
`make wheel`), and says what to do if there is none.

    python tools/colab.py --rewrite book/*.py exercises/*.py   # give files the current first cell
    python tools/colab.py --check book/*.py exercises/*.py     # exit 1 if one differs
    python tools/colab.py --notebooks DIR book/*.py exercises/*.py   # configured .ipynb (make notebooks)
"""
from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_LINE = 'LINATTN_SOURCE = ""'

CELL = '''\
# Colab: install the book's library (elsewhere this cell does nothing). The source is set in one
# place, [tool.linattn] in pyproject.toml; "" means the wheel you upload (`make wheel` builds it).
LINATTN_SOURCE = ""
import glob, importlib.util, subprocess, sys
if "google.colab" in sys.modules and importlib.util.find_spec("linattn") is None:
    wheels = sorted(glob.glob("linattn-*.whl") + glob.glob("/content/linattn-*.whl"))
    if not (LINATTN_SOURCE or wheels):
        print("Upload the linattn wheel: run `make wheel` in a clone of the repository, "
              "then choose dist/linattn-*.whl below.")
        from google.colab import files
        wheels = sorted(n for n in files.upload() if n.startswith("linattn") and n.endswith(".whl"))
    if LINATTN_SOURCE or wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", LINATTN_SOURCE or wheels[-1]],
                       check=True)
    else:
        print("No wheel uploaded, so linattn is not installed: run this cell again and upload "
              "dist/linattn-*.whl, or read the book locally (README: `make book`).")'''


def config() -> dict:
    """[tool.linattn] of pyproject.toml: install (a pip requirement) and colab (a GitHub folder)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        cfg = tomllib.load(f).get("tool", {}).get("linattn", {})
    return {"install": cfg.get("install", ""), "colab": cfg.get("colab", "")}


def configured_cell(install: str) -> str:
    """CELL with the configured source written in (json.dumps: a valid Python string literal)."""
    return CELL.replace(SOURCE_LINE, f"LINATTN_SOURCE = {json.dumps(install)}") if install else CELL


def badge(name: str, colab: str) -> str | None:
    """Markdown for an "Open in Colab" badge of notebook `name` ("book/03_decay",
    "exercises/03_decay": its place in the `make notebooks` folder), or None if colab is unset."""
    if not colab:
        return None
    url = f"https://colab.research.google.com/github/{colab.strip('/')}/{name}.ipynb"
    return f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def configure(nb, name: str, cfg: dict | None = None) -> None:
    """Write the configured source into a notebook's first cell; add the badge after it if set."""
    import nbformat

    cfg = config() if cfg is None else cfg
    first = nb.cells[0]
    if first.cell_type != "code" or SOURCE_LINE not in first.source:
        raise ValueError(f"{name}: the first cell is not the Colab cell (tools/colab.py CELL)")
    first.source = configured_cell(cfg["install"])
    md = badge(name, cfg["colab"])
    if md:
        nb.cells.insert(1, nbformat.v4.new_markdown_cell(md))


def first_cell_span(lines: list[str]) -> tuple[int, int]:
    """[start, end) of the first code cell's body in a py:percent file (after its `# %%` line)."""
    start = next(i for i, line in enumerate(lines) if line.rstrip() == "# %%") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("# %%")), len(lines))
    while end > start and not lines[end - 1].strip():
        end -= 1
    return start, end


def first_cell(path: Path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    a, b = first_cell_span(lines)
    return "\n".join(lines[a:b])


def rewrite(path: Path) -> bool:
    """Give `path` the current first cell; True if it changed."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    a, b = first_cell_span(lines)
    new = "\n".join(lines[:a] + CELL.splitlines() + lines[b:]) + ("\n" if text.endswith("\n") else "")
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def notebooks(out: Path, paths: list[Path]) -> None:
    """Unexecuted .ipynb of each file, Colab cell configured: what [tool.linattn] colab points to."""
    import jupytext

    for p in paths:
        nb = jupytext.read(str(p))
        configure(nb, f"{p.parent.name}/{p.stem}")
        (out / p.parent.name).mkdir(parents=True, exist_ok=True)
        jupytext.write(nb, str(out / p.parent.name / f"{p.stem}.ipynb"), fmt="ipynb")
        print(f"  {out / p.parent.name / (p.stem + '.ipynb')}")


def main(argv) -> int:
    if argv[0] == "--notebooks":
        notebooks(Path(argv[1]), [Path(p) for p in argv[2:]])
        return 0
    mode, paths = argv[0], [Path(p) for p in argv[1:]]
    bad = [p for p in paths if first_cell(p) != CELL]
    if mode == "--rewrite":
        for p in bad:
            rewrite(p)
            print(f"rewrote the first cell of {p}")
        return 0
    for p in bad:
        print(f"{p}: first cell differs from tools/colab.py CELL (run: python tools/colab.py --rewrite {p})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
