"""An engine ref, the one rule: what kind it is (a release, a commit, a pull request, main)
and how it reads in env directory names and run ids.

Apart from the recipe model because everything that takes a ref (a run's conf, the command
line, provisioning, the run id) checks it by this rule, and none of them needs a recipe to.
"""

from __future__ import annotations

import re
from typing import Literal

from speedmatrix.errors import InputError

_RELEASE = re.compile(r"^v\d+\.\d+\.\d+([.\-+]?[0-9A-Za-z.]+)?$")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
_PR = re.compile(r"^pr/(\d+)$")


def classify_ref(ref: str) -> tuple[Literal["release", "commit", "pr", "main"], str]:
    """Tell what kind of engine ref this is; raise InputError (a ValueError) on anything else."""
    ref = str(ref).strip()
    if ref == "main":
        return "main", ref
    if _RELEASE.match(ref):
        return "release", ref
    if m := _PR.match(ref):
        return "pr", m.group(1)
    if _COMMIT.match(ref):
        return "commit", ref
    raise InputError(
        f"engine ref {ref!r} is none of: a release (v0.29.0), a commit (7 to 40 hex digits), "
        "pr/<number>, main"
    )


def ref_slug(ref: str) -> str:
    """The ref as it appears in env directory names: v0.29.0 -> v0290, pr/60762 -> pr-60762,
    a commit -> its first 12 hex digits (as the published env names use them)."""
    kind, value = classify_ref(ref)
    if kind == "release":
        return re.sub(r"[^0-9A-Za-z]", "", ref)
    if kind == "pr":
        return f"pr-{value}"
    if kind == "commit":
        return value[:12]
    return "main"
