"""The Colab cell: the same first cell everywhere, and on a (simulated) Colab it installs linattn.

Colab is simulated by a `google.colab` module in sys.modules; pip installs a locally built wheel
into a temporary target (--no-deps, no index: offline and fast). The cell runs under `python -S`,
so the checkout's own editable install is not importable and the cell must install it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import colab  # noqa: E402

FILES = sorted((ROOT / "book").glob("[0-9][0-9]_*.py")) + sorted((ROOT / "exercises").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_first_cell_is_the_colab_cell(path):
    assert colab.first_cell(path) == colab.CELL, f"run: python tools/colab.py --rewrite {path.relative_to(ROOT)}"


def test_configure_writes_source_and_badge():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(colab.CELL), nbformat.v4.new_markdown_cell("# 03")])
    colab.configure(nb, "book/03_decay", {"install": "linattn @ git+https://example.org/x/linattn",
                                          "colab": "x/linattn/blob/main/nb"})
    assert 'LINATTN_SOURCE = "linattn @ git+https://example.org/x/linattn"' in nb.cells[0].source
    assert "colab.research.google.com/github/x/linattn/blob/main/nb/book/03_decay.ipynb" in nb.cells[1].source
    plain = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(colab.CELL)])
    colab.configure(plain, "book/03_decay", {"install": "", "colab": ""})
    assert plain.cells[0].source == colab.CELL and len(plain.cells) == 1
    with pytest.raises(ValueError, match="first cell"):
        colab.configure(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import torch")]), "x", {})


def test_config_has_both_keys():
    assert set(colab.config()) == {"install", "colab"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """linattn's wheel, built from a copy of the sources (no build/ litter in the shared tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "linattn", src / "linattn", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(out), str(src)], check=True)
    (whl,) = out.glob("linattn-*.whl")
    return whl


FAKE_COLAB = """\
import sys, types, shutil
google, colab = types.ModuleType("google"), types.ModuleType("google.colab")
files = types.ModuleType("google.colab.files")
def upload():                       # the reader picks UPLOAD (or cancels: UPLOAD empty)
    if not UPLOAD:
        return {}
    shutil.copy(UPLOAD, ".")
    return {UPLOAD.rsplit("/", 1)[-1]: b""}
files.upload = upload
google.colab, colab.files = colab, files
sys.modules.update({"google": google, "google.colab": colab, "google.colab.files": files})
"""


def run_cell(cell: str, cwd: Path, target: Path, upload: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_TARGET=str(target), PIP_NO_DEPS="1", PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    code = f"UPLOAD = {upload!r}\n" + FAKE_COLAB + cell
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def imports_from(target: Path) -> str:
    """Where `import linattn` finds it with the target first on the path (not the checkout's copy)."""
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", "import linattn, linattn.grade; print(linattn.__file__)"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=target.parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_cell_installs_a_wheel_next_to_the_notebook(tmp_path, wheel):
    shutil.copy(wheel, tmp_path)
    res = run_cell(colab.CELL, tmp_path, tmp_path / "site")
    assert res.returncode == 0, res.stderr
    assert imports_from(tmp_path / "site").startswith(str(tmp_path / "site"))


def test_cell_asks_for_an_upload_and_installs_it(tmp_path, wheel):
    res = run_cell(colab.CELL, tmp_path, tmp_path / "site", upload=str(wheel))
    assert res.returncode == 0, res.stderr
    assert "make wheel" in res.stdout
    assert imports_from(tmp_path / "site").startswith(str(tmp_path / "site"))


def test_cell_without_wheel_says_what_to_do(tmp_path):
    res = run_cell(colab.CELL, tmp_path, tmp_path / "site")
    assert res.returncode == 0, res.stderr
    assert "No wheel uploaded" in res.stdout and "make book" in res.stdout
    assert not (tmp_path / "site").exists()


def test_configured_source_is_installed(tmp_path, wheel):
    res = run_cell(colab.configured_cell(str(wheel)), tmp_path, tmp_path / "site")
    assert res.returncode == 0, res.stderr
    assert imports_from(tmp_path / "site").startswith(str(tmp_path / "site"))


def test_cell_does_nothing_off_colab(tmp_path):
    res = subprocess.run([sys.executable, "-S", "-c", colab.CELL], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout == ""
