"""All exercises, one module per chapter (chNN.py, each defining EXERCISES), in chapter order."""
from __future__ import annotations

import importlib
import pkgutil

_cache: list | None = None


def all_exercises() -> list:
    global _cache
    if _cache is None:
        mods = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("ch"))
        _cache = [ex for m in mods for ex in importlib.import_module(f"{__name__}.{m}").EXERCISES]
    return _cache


def get(name: str):
    for ex in all_exercises():
        if ex.name == name:
            return ex
    raise KeyError(f"no exercise named {name!r}; known: {', '.join(e.name for e in all_exercises())}")
