"""Build the book as a website (Jupyter Book 1.x / Sphinx) from the executed notebooks, and check it.

    python tools/site_book.py                       # after `make book`: _build/book/*.ipynb -> _build/site/
    python tools/site_book.py --check _build/site   # only check a built site
    python tools/site_book.py --partial             # only the chapters executed so far

Pages, in chapter order: every book/NN_*.py as its executed notebook from `make book` (outputs,
figures and recorded tables included), then every exercises/NN_*.py as a workbook page (not
executed: stubs are for the reader). Each chapter page links to its workbook, its notebook
(download) and, when [tool.linattn] colab is set, Colab; each workbook page to its chapter. Math is
rendered by a MathJax copy served with the site (no CDN), so the site works offline. The build
then checks every page: images that exist, internal links that resolve, math that was rendered
into MathJax's markup.
"""
from __future__ import annotations

import argparse
import html.parser
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import jupytext
import nbformat

import colab  # tools/colab.py

ROOT = Path(__file__).resolve().parent.parent
TITLE = "Linear attention kernels"
CONFIG = """\
title: {title}
author: linattn
copyright: "2026"
only_build_toc_files: true
exclude_patterns: [_build, "**.ipynb_checkpoints"]
execute:
  execute_notebooks: "off"      # executed by `make book`; workbooks stay stubs
parse:
  myst_enable_extensions: [colon_fence, dollarmath, amsmath]
html:
  use_repository_button: false
  home_page_in_navbar: true
launch_buttons:
  notebook_interface: jupyterlab
sphinx:
  config:
    mathjax_path: mathjax/tex-mml-chtml.js   # in _static: math renders without a network
    # vendor/, not _static/: Jupyter Book would add every .js under _static/ to every page
    html_static_path: [vendor]
    html_extra_path: [extra]                 # notebooks for download, at /notebooks/
    nb_merge_streams: true
"""
# A chapter or workbook cell that links a markdown reference to a .py file: on the site, the page.
PY_LINK = re.compile(r"\]\((?:\.\./)?(book|exercises)/(\d\d_\w+)\.py\)")


def mathjax_dir() -> Path:
    """MathJax 3's browser build, shipped on PyPI by django-static-mathjax (pinned in requirements)."""
    import mathjax  # the package of django-static-mathjax

    return Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"


def page_links(kind: str, stem: str, others: dict, cfg: dict) -> str:
    """The line under a page's title: its companion page, its notebook, Colab if configured."""
    parts = []
    if kind == "book" and stem[:2] in others:
        parts.append(f"**Workbook:** [](../exercises/{others[stem[:2]]}.ipynb)")   # MyST fills in its title
    if kind == "exercises" and stem[:2] in others:
        parts.append(f"**Chapter:** [](../book/{others[stem[:2]]}.ipynb)")
    parts.append(f'<a href="../notebooks/{kind}/{stem}.ipynb" download>Download the notebook</a>')
    url = colab.badge(f"{kind}/{stem}", cfg["colab"])
    parts.append(url if url else "run it on Colab: upload the notebook, then the wheel from `make wheel` "
                                 "when its first cell asks")
    return " · ".join(parts)


def prepare(nb, kind: str, stem: str, others: dict, cfg: dict, pages: set):
    """Colab cell configured and folded away, .py links pointed at pages (or plain text where the
    site has no such page), the links line added. `pages`: {"book/03_decay", ...} on the site."""
    if nb.cells and nb.cells[0].cell_type == "code" and colab.SOURCE_LINE in nb.cells[0].source:
        nb.cells[0].source = colab.configured_cell(cfg["install"])
        nb.cells[0].metadata.setdefault("tags", []).append("hide-input")
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = PY_LINK.sub(lambda m: f"](../{m[1]}/{m[2]}.ipynb)", cell.source)
            cell.source = re.sub(r"\[([^\]]+)\]\(\.\./(book|exercises)/(\d\d_\w+)\.ipynb\)",
                                 lambda m: m[0] if f"{m[2]}/{m[3]}" in pages else m[1], cell.source)
    title = next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"), 0)
    nb.cells.insert(title + 1, nbformat.v4.new_markdown_cell(page_links(kind, stem, others, cfg)))
    return nb


def write_source(src: Path, chapters: list[Path], workbooks: list[Path], cfg: dict) -> None:
    """The Jupyter Book source tree: book/, exercises/, extra/notebooks/, vendor/mathjax/, config, toc."""
    if src.exists():
        shutil.rmtree(src)
    stems = {"book": {p.stem[:2]: p.stem for p in chapters}, "exercises": {p.stem[:2]: p.stem for p in workbooks}}
    for kind, paths in (("book", chapters), ("exercises", workbooks)):
        (src / kind).mkdir(parents=True)
        (src / "extra" / "notebooks" / kind).mkdir(parents=True)
        other = stems["exercises" if kind == "book" else "book"]
        pages = {f"{k}/{p.stem}" for k, ps in (("book", chapters), ("exercises", workbooks)) for p in ps}
        for p in paths:
            nb = nbformat.read(p, as_version=4) if p.suffix == ".ipynb" else jupytext.read(str(p))
            nbformat.write(nb, src / "extra" / "notebooks" / kind / f"{p.stem}.ipynb")   # as run/shipped
            nbformat.write(prepare(nb, kind, p.stem, other, cfg, pages), src / kind / f"{p.stem}.ipynb")
    shutil.copytree(mathjax_dir(), src / "vendor" / "mathjax")
    (src / "_config.yml").write_text(CONFIG.format(title=TITLE))
    (src / "intro.md").write_text(intro(chapters, workbooks))
    toc = ["format: jb-book", "root: intro", "parts:"]
    for caption, kind, paths in (("Chapters", "book", chapters), ("Workbooks", "exercises", workbooks)):
        if paths:
            toc += [f"  - caption: {caption}", "    chapters:"]
            toc += [f"      - file: {kind}/{p.stem}" for p in paths]
    (src / "_toc.yml").write_text("\n".join(toc) + "\n")


def intro(chapters, workbooks) -> str:
    return f"""# {TITLE}

A notebook-first textbook on linear attention kernels, from the recurrence to chunked algorithms
(GLA, DeltaNet, KDA) and Triton kernels, with the small library `linattn` it builds.

Each chapter is shown here as it ran with `make book` (on a CPU, through Triton's interpreter;
benchmark tables and figures come from recorded GPU runs, each captioned with its device, date
and software). Each chapter has a workbook: exercises you solve in the notebook, graded by
`linattn.grade`. Download any page's notebook from the link under its title; to run it on Colab,
upload it there and let its first cell install the library.

$$o_t = q_t S_t,\\qquad S_t = S_{{t-1}} + k_t^\\top v_t$$

{len(chapters)} chapters, {len(workbooks)} workbooks.
"""


def jupyter_book() -> list[str]:
    exe = Path(sys.executable).parent / "jupyter-book"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "jupyter_book.cli.main"]


def build(chapters: list[Path], workbooks: list[Path], out: Path, src: Path | None = None) -> Path:
    """Build the site into `out`; return the directory holding index.html."""
    src = src or out.parent / (out.name + "_src")
    write_source(src, chapters, workbooks, colab.config())
    if out.exists():
        shutil.rmtree(out)
    subprocess.run(jupyter_book() + ["build", str(src), "--path-output", str(out), "--builder", "html", "-q"],
                   check=True)
    return out / "_build" / "html"


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.links, self.math = [], [], 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img" and a.get("src"):
            self.images.append(a["src"])
        if tag in ("a", "link") and a.get("href"):
            self.links.append(a["href"])
        if tag == "script" and a.get("src"):
            self.links.append(a["src"])
        if "math" in (a.get("class") or "").split():
            self.math += 1


def check(html_dir: Path) -> dict:
    """Every page's images and internal links resolve to files; count pages, images and math.

    Returns {"pages", "images", "math", "problems"}: problems lists `page: what`."""
    pages = sorted(p for p in html_dir.rglob("*.html") if "_static" not in p.relative_to(html_dir).parts)
    problems, n_img, n_math = [], 0, 0
    for page in pages:
        p = _Page()
        p.feed(page.read_text(encoding="utf-8"))
        n_img += len(p.images)
        n_math += p.math
        for ref in p.images + p.links:
            parts = urlsplit(ref)
            if parts.scheme or ref.startswith(("//", "#", "mailto:")) or not parts.path:
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                problems.append(f"{page.relative_to(html_dir)}: missing {ref}")
    return {"pages": len(pages), "images": n_img, "math": n_math, "problems": problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executed", type=Path, default=ROOT / "_build" / "book", help="executed chapters (make book)")
    ap.add_argument("--out", type=Path, default=ROOT / "_build" / "site")
    ap.add_argument("--check", type=Path, help="only check this built site (its _build/html or the html dir)")
    ap.add_argument("--partial", action="store_true", help="build from the chapters executed so far")
    args = ap.parse_args(argv)
    if args.check:
        html_dir = args.check / "_build" / "html" if (args.check / "_build" / "html").exists() else args.check
    else:
        sources = sorted((ROOT / "book").glob("[0-9][0-9]_*.py"))
        chapters = [args.executed / f"{p.stem}.ipynb" for p in sources]
        missing = [c.name for c in chapters if not c.exists()]
        if missing:
            print(f"not executed yet: {', '.join(missing)} — run `make book` first"
                  + (" (left out: --partial)" if args.partial else ""))
            if not args.partial:
                return 1
            chapters = [c for c in chapters if c.exists()]
        workbooks = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.py"))
        html_dir = build(chapters, workbooks, args.out)
    res = check(html_dir)
    print(f"site: {html_dir}/index.html — {res['pages']} pages, {res['images']} images, "
          f"{res['math']} math elements, {len(res['problems'])} problems")
    for p in res["problems"][:50]:
        print("  ", p)
    return 1 if res["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
