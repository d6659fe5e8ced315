"""Progress views: a text table, and an ipywidgets dashboard in Jupyter."""
from __future__ import annotations

from itertools import groupby

from . import catalog, progress


def rows(done=None):
    """(chapter, exercise, passed, unlocks) for every exercise in book order."""
    done = progress.load()["passed"] if done is None else done
    return [(ex.chapter, ex, ex.name in done, ex.unlocks) for ex in catalog.all_exercises()]


def _level(unlocks) -> str:
    """What a pass gives impl='mine': a forward at a level, or (op, 'triton', 'backward') gradients."""
    if unlocks[2:] == ("backward",):
        return f"backward: it trains through its {unlocks[1]} forward"
    return f"{unlocks[1]} level"


def progress_text() -> str:
    data, problem = progress.status()
    lines = [f"progress in {progress.home()}"]
    if problem:
        lines.append(f"⚠️  your progress cannot be read or kept there: {problem}. Set LINATTN_HOME to "
                     "a writable folder (passes shown below come from what could be read).")
    for chapter, group in groupby(rows(data["passed"]), key=lambda r: r[0]):
        group = list(group)
        n = sum(r[2] for r in group)
        lines.append(f"chapter {chapter:02d}  {n}/{len(group)} passed")
        for _, ex, ok, unlocks in group:
            extra = f"  → impl='mine' for {unlocks[0]} ({_level(unlocks)})" if ok and unlocks else ""
            lines.append(f"   {'✓' if ok else '·'} {ex.name:<28} {ex.title}{extra}")
    return "\n".join(lines)


def dashboard():
    """An ipywidgets view of the same table with a refresh button (text if ipywidgets is missing)."""
    try:
        import ipywidgets as w
    except ImportError:
        print(progress_text())
        return None
    html = w.HTML()

    def refresh(_=None):
        body = "".join(
            f"<tr><td>{ex.chapter:02d}</td><td>{'✅' if ok else '⬜'}</td><td><code>{ex.name}</code>"
            f"</td><td>{ex.title}</td><td>{f'mine → {un[0]} ({_level(un)})' if ok and un else ''}</td></tr>"
            for _, ex, ok, un in rows())
        n = sum(r[2] for r in rows())
        html.value = (f"<b>{n}/{len(rows())} exercises passed</b><table><tr><th>ch</th><th></th>"
                      f"<th>exercise</th><th>what</th><th>unlocked</th></tr>{body}</table>")

    button = w.Button(description="refresh")
    button.on_click(refresh)
    refresh()
    return w.VBox([html, button])
