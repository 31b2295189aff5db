"""File names for ids (runs, recipes, models) in the static site: one rule for every page."""

from __future__ import annotations

import hashlib
import re

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def slug(name: str) -> str:
    """A file name for a run or recipe id: readable, safe on every filesystem and in a URL
    without escaping; a short hash keeps two ids that differ only in unsafe characters
    (``sim/a`` and ``sim_a``) apart."""
    clean = _SAFE.sub("_", name).strip("._") or "x"
    if clean == name:
        return name
    return f"{clean[:80]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
