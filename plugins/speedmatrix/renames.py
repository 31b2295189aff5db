"""Names that changed, and how their old names still read.

Why one place: a name lives in a command line, a run's conf, a recipe and a table at once
(the measurement window was `--duration`, `--duration-s`, `duration_s`, `window_s` and
`measure_s`); renaming it in one of them only splits it again. Each renamed name is listed here
once with every old spelling, and each reader (the CLI's options, resolve's conf, the recipe
loader, the warehouse's reader of tables landed before) reads an old one as the new one with a
deprecation note, and refuses the two given with different values rather than guess.
Stdlib only: the bottom layer.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping
from typing import Any

WINDOW = "window_s"
"""The measurement window of a decode cell, in seconds, in every place it is named: the
recipe's `matrix.window_s`, the conf's `window_s`, the `runs` and `cells` tables' `window_s`,
`DecodeConfig.window_s`, and `--window-s` on the command line (`speedmatrix run`, `loadgen
decode`, the demo)."""

CONF_KEYS: dict[str, str] = {"duration_s": WINDOW}
"""A speed_matrix (or bisect) conf's old key -> its name now."""
RECIPE_MATRIX_KEYS: dict[str, str] = {"duration_s": WINDOW, "measure_s": WINDOW}
"""A recipe's `matrix` section's old spellings -> the field (the conf's and the table's)."""
OPTIONS: dict[str, str] = {"--duration-s": "--window-s", "--duration": "--window-s"}
"""An old command-line option -> the option now."""
COLUMNS: dict[str, dict[str, str]] = {"runs": {"measure_s": WINDOW}}
"""Per table: a column's name in tables landed before (schema 6 and older) -> its name now
(schema 7, store/schemas.SCHEMA_VERSION)."""
MIRRORED: dict[str, dict[str, str]] = {"runs": {"measure_s": WINDOW}}
"""Per table: an old column name still written beside its new one, with the same value. The
design's table contract names the runs table's window `measure_s`, and readers of that contract
(DuckDB, pandas or Polars reading the Delta files directly) must still find it; everything of
ours reads and writes the new name."""

log = logging.getLogger("speedmatrix.renames")


class RenameConflict(ValueError):
    """An old name and its new one both given, with different values."""


def note(old: str, new: str, where: str = "") -> str:
    """The one wording of a deprecation: `duration_s is deprecated: ...`."""
    place = f"{where}{old}"
    return f"{place} is deprecated: it is read as {new} (use {new}; the old name still works)"


def renamed(
    values: Mapping[str, Any], renames: Mapping[str, str], where: str = ""
) -> tuple[dict[str, Any], list[str]]:
    """`values` with each old key given under its new name, and the deprecation notes (logged
    too). An old key whose value is None is dropped (a form sends every key, empty ones as
    None). Both names given with different values: RenameConflict naming both."""
    out = dict(values)
    notes: list[str] = []
    for old, new in renames.items():
        if old not in out:
            continue
        value = out.pop(old)
        if value is None:
            continue
        if out.get(new) is not None and out[new] != value:
            raise RenameConflict(
                f"{where}{old} ({value!r}) and {where}{new} ({out[new]!r}) are one setting "
                f"under its old and new name: give {where}{new} only"
            )
        out[new] = value
        notes.append(note(old, new, where))
    for n in notes:
        log.warning("%s", n)
    return out, notes


class StoreRenamed(argparse._StoreAction):
    """An option's store action that, given an old spelling (OPTIONS), says it is deprecated on
    stderr and stores the value as the new one does."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        if option_string in OPTIONS:
            sys.stderr.write(f"{parser.prog}: {note(option_string, OPTIONS[option_string])}\n")
        super().__call__(parser, namespace, values, option_string)


def add_window_option(group: Any, *old: str, **kwargs: Any) -> None:
    """`--window-s S` on a parser (or group), with the `old` spellings (OPTIONS) still read
    (dest `window_s`), each with a deprecation note when used."""
    unknown = [o for o in old if OPTIONS.get(o) != "--window-s"]
    if unknown:
        raise ValueError(f"not old names of --window-s: {unknown}")
    help_text = kwargs.pop("help", "the measurement window of each decode cell, seconds")
    if old:
        help_text += f" ({', '.join(old)}: the old name, deprecated)"
    group.add_argument(
        "--window-s",
        *old,
        dest=WINDOW,
        type=float,
        metavar="S",
        action=StoreRenamed,
        help=help_text,
        **kwargs,
    )
