"""The book reads as a textbook: no run histories in its text, and every chapter points to its workbook.

Commit hashes, clock times ("… UTC") and issue numbers belong in the git log, not in
chapters, workbooks or library comments: a reader needs the setting that produced a number
(device, versions, date), not the story of the runs.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HISTORY = re.compile(r"\b[0-9a-f]{7,40}\b|UTC|issue #")
TEXT = {".py", ".md", ".txt", ".toml", ".cfg"}
# Code, not prose: tools/bench.py stamps the time of a GPU run into the data it records.
ALLOWED = {("linattn/bench.py", 'strftime("%Y-%m-%d %H:%M UTC")')}


def history_hits(roots) -> list[str]:
    """`path:line: text` for every line of text that looks like a run history; for JSON data,
    only string values count (numbers like 0.2980799973 are data, not hashes)."""
    hits = []
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
            if path.suffix in TEXT:
                for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    if HISTORY.search(line) and not any(rel == f and s in line for f, s in ALLOWED):
                        hits.append(f"{rel}:{n}: {line.strip()[:120]}")
            elif path.suffix == ".json":
                hits += [f"{rel}: {s[:120]}" for s in _strings(json.loads(path.read_text())) if HISTORY.search(s)]
    return hits


# Keys of recorded data whose strings are not text (none: a recorded run carries its day, device
# and versions, never a clock time or a commit; the commit that ran it belongs in the git log).
PROVENANCE: set = set()


def _strings(x):
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for k, v in x.items():
            if k not in PROVENANCE:
                yield from _strings(k)
                yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)


def test_book_exercises_library_have_no_run_history():
    hits = history_hits([ROOT / "book", ROOT / "exercises", ROOT / "linattn"])
    assert not hits, "run history in textbook text:\n" + "\n".join(hits)


@pytest.mark.parametrize("text", ["kernels at commit b1d9f6b", "the run of 15:53 UTC", "see issue #5"])
def test_detector_sees_history(tmp_path, text):
    (tmp_path / "ch.py").write_text(f"# %% [markdown]\n# {text}\n")
    assert history_hits([tmp_path])


def test_detector_ignores_numbers_in_data(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"env": {"date": "2026-11-21"}, "ms": 0.2980799973011017}))
    assert not history_hits([tmp_path])
    (tmp_path / "run.json").write_text(json.dumps({"note": "measured at commit b1d9f6b"}))
    assert history_hits([tmp_path])


def chapters():
    return sorted((ROOT / "book").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("chapter", chapters(), ids=lambda p: p.stem)
def test_chapter_points_to_its_workbook(chapter):
    """A chapter whose workbook exists names it (the site turns the name into a link)."""
    workbooks = sorted((ROOT / "exercises").glob(chapter.name[:3] + "*.py"))
    if not workbooks:
        pytest.skip(f"no workbook for {chapter.name}")
    assert f"exercises/{workbooks[0].name}" in chapter.read_text(encoding="utf-8")
