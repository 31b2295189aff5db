"""Which folder is ours to write into: the one marker rule for every folder a command fills.

Why one rule: a command that rewrites its output folder (`speedmatrix site --out`, `speedmatrix
export`) replaces what it finds there under its own names (`runs/`, `index.html`…), and a
folder given by mistake (a thesis with its own `runs/`) must never lose a file. So a folder is
ours only when it was new or empty when we first wrote into it, which we record with a marker
file named for the kind of output (`.speedmatrix-site`, `.speedmatrix-export`): a site folder
is not an export folder, nor the other way round. Anything else is refused, untouched.

Standard library only, so any layer may import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from speedmatrix.errors import InputError


def marker_name(kind: str) -> str:
    """The marker file that says a folder holds speedmatrix output of ``kind``."""
    return f".speedmatrix-{kind}"


def claim_dir(root: Path, kind: str, *, also_ours: Iterable[str] = ()) -> Path:
    """Make ``root`` a folder of ours for ``kind`` output, or refuse: a new or empty folder
    gets the marker; one holding it (or a file named in ``also_ours``, what older versions
    left there) is ours already; anything else is an InputError naming the path, one line, and
    nothing in it is touched. Returns the marker's path."""
    root = Path(root)
    marker = root / marker_name(kind)
    root.mkdir(parents=True, exist_ok=True)
    if marker.exists() or any((root / name).exists() for name in also_ours):
        return marker
    if any(root.iterdir()):
        raise InputError(
            f"{root} is not empty and not a speedmatrix {kind} folder (no {marker.name} in "
            f"it): {kind} output is written only into a new or empty folder or its own; "
            "nothing was written"
        )
    marker.write_text(f"speedmatrix {kind}: the {kind} command writes here\n")
    return marker
