"""`make site`: Jupyter Book builds the executed notebooks into a website, offline, and checks it.

Built here from two small executed notebooks and one workbook (the real chapters take minutes to
execute): pages in order, math marked up for the bundled MathJax, figures as image files that
exist, the chapter-to-workbook links, the download links, no broken internal link.
"""
from __future__ import annotations

import base64
import io
import re
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import colab  # noqa: E402
import site_book  # noqa: E402

# The site's toolchain comes with requirements.txt (CI, a reader's `make site`); the GPU machine's
# image runs the kernels and notebooks only, without it: there this file has nothing to check.
for _module in ("jupyter_book", "mathjax"):
    pytest.importorskip(_module, reason="the site toolchain of requirements.txt is not installed")


def png() -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot([16, 32, 64], [3, 2, 1], "o-")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def chapter(path: Path, n: str, title: str, workbook_link: bool) -> Path:
    """An executed notebook shaped like a chapter: Colab cell, title, math, a figure, a table."""
    link = f"\n\n**Workbook:** [`exercises/{n}_alpha.py`](../exercises/{n}_alpha.py)" if workbook_link else ""
    fig = nbformat.v4.new_code_cell("plt.show()", outputs=[nbformat.v4.new_output(
        "display_data", data={"image/png": png(), "text/plain": "<Figure>"})])
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(colab.CELL),
        nbformat.v4.new_markdown_cell(f"# {n} — {title}\n\nThe state $S_t = S_{{t-1}} + k_t^\\top v_t$ and\n\n"
                                      f"$$o_t = q_t S_t .$$"),
        fig,
        nbformat.v4.new_markdown_cell("| T | ms |\n|---|---|\n| 1024 | 0.28 |" + link),
    ])
    out = path / f"{n}_{title.lower()}.ipynb"
    nbformat.write(nb, out)
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("site")
    (tmp / "exec").mkdir()
    chapters = [chapter(tmp / "exec", "01", "Alpha", True), chapter(tmp / "exec", "02", "Beta", True)]
    wb = tmp / "01_alpha.py"
    wb.write_text(jupytext.writes(nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(colab.CELL),
        nbformat.v4.new_markdown_cell("# Workbook 01 — alpha\n\nWrite $S_t$; see [the chapter](../book/01_alpha.py)."),
        nbformat.v4.new_code_cell("def f():\n    raise NotImplementedError('write me')")]), fmt="py:percent"))
    html = site_book.build(chapters, [wb], tmp / "site")
    return html


def test_pages_in_order_with_navigation(site):
    index = (site / "intro.html").read_text()                   # index.html redirects here
    pos = [index.find(f"book/{n}.html") for n in ("01_alpha", "02_beta")] + [index.find("exercises/01_alpha.html")]
    assert all(p > 0 for p in pos) and pos == sorted(pos), "toc order: chapters, then workbooks"


def test_math_figures_links(site):
    page = (site / "book" / "01_alpha.html").read_text()
    assert page.count('class="math') >= 2                      # inline and display math for MathJax
    assert "_static/mathjax/tex-mml-chtml.js" in page and "cdn.jsdelivr" not in page
    assert page.count('src="../_static/mathjax/') == 1             # MathJax's entry point only
    assert re.search(r'<img[^>]+src="[^"]+\.png"', page)      # the figure, as a file
    assert 'href="../exercises/01_alpha.html"' in page          # the chapter links its workbook
    assert 'href="../notebooks/book/01_alpha.ipynb"' in page    # and its notebook
    assert (site / "notebooks" / "book" / "01_alpha.ipynb").exists()
    assert (site / "_static" / "mathjax" / "tex-mml-chtml.js").exists()
    workbook = (site / "exercises" / "01_alpha.html").read_text()
    assert 'href="../book/01_alpha.html"' in workbook
    beta = (site / "book" / "02_beta.html").read_text()         # links to a workbook the site lacks
    assert 'href="../exercises/02_alpha' not in beta              # become plain text, not broken links


def test_no_missing_images_or_broken_links(site):
    res = site_book.check(site)
    assert res["pages"] >= 4 and res["images"] >= 2 and not res["problems"], res["problems"]


def test_check_finds_a_broken_link(site, tmp_path):
    import shutil

    copy = tmp_path / "html"
    shutil.copytree(site, copy)
    page = copy / "book" / "01_alpha.html"
    page.write_text(page.read_text().replace("../exercises/01_alpha.html", "../exercises/99_gone.html"))
    next((copy / "_images").glob("*.png")).unlink()             # a chapter's figure
    problems = site_book.check(copy)["problems"]
    assert any("99_gone" in p for p in problems) and any(".png" in p for p in problems)
