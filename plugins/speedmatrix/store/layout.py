"""Where every warehouse file lives: the Hive layout's directory and file names.

One job: names. ``<root>/<table>/recipe_id=<r>/run_month=<YYYY-MM>/<run_date>_<run_id>.parquet``
for every table (the core ones and the extra ones, store/extra.py), plus the private
directories (staging, quarantine, artifacts) and the writers' lock file. Why months, why the
date in front of the file name: store/warehouse.py's docstring and docs/.
"""

from __future__ import annotations

import datetime as dt
import os
import urllib.parse
from pathlib import Path
from typing import Any

from speedmatrix.store.schemas import PARTITION_KEYS

NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
STAGING = "_staging"
QUARANTINE = "_quarantine"
ARTIFACTS = "artifacts"
LOCK_FILE = "_warehouse.lock"
"""``<root>/_warehouse.lock``: the writers' cross-process lock on a local or shared filesystem
(:meth:`Warehouse._writer_lock`)."""


def default_root() -> str:
    """``$SPEEDMATRIX_WAREHOUSE``, else ``warehouse/`` in the checkout (else in the cwd)."""
    env = os.environ.get("SPEEDMATRIX_WAREHOUSE")
    if env:
        return env
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "pyproject.toml").exists():
        return str(checkout / "warehouse")
    return str(Path.cwd() / "warehouse")


def partition_value(value: Any) -> str:
    """The directory-name form of a partition value (URL-encoded; null -> hive default)."""
    if value is None:
        return NULL_PARTITION
    if isinstance(value, dt.date):
        return value.isoformat()
    return urllib.parse.quote(str(value), safe="-_.~+=,@")


def partition_of(path: str) -> dict[str, Any]:
    """``…/recipe_id=cpu%2Ftiny/run_month=2026-03/x.parquet`` -> the decoded partition values."""
    out: dict[str, Any] = {}
    for segment in path.replace("\\", "/").split("/")[-3:-1]:
        key, sep, raw = segment.partition("=")
        if not sep or key not in PARTITION_KEYS:
            continue
        out[key] = None if raw == NULL_PARTITION else urllib.parse.unquote(raw)
    return out


def run_month_of(run_date: dt.date) -> str:
    return f"{run_date.year:04d}-{run_date.month:02d}"


def partition_dirs(recipe_id: str, run_date: dt.date) -> str:
    """``recipe_id=<encoded>/run_month=<YYYY-MM>``: where a run's files go in every table
    (also for tables other code lands beside runs / cells / requests)."""
    return (
        f"recipe_id={partition_value(recipe_id)}/"
        f"run_month={partition_value(run_month_of(run_date))}"
    )


def data_file_name(run_id: str, run_date: dt.date) -> str:
    """``<run_date>_<run_id>.parquet``: the name of a run's file in runs / cells / requests.
    The date in front lets a plain glob pick one day's runs
    (``cells/*/run_month=2026-03/2026-03-14_*.parquet``) without opening the month's others."""
    return f"{run_date.isoformat()}_{file_name(run_id)}"


def _is_data_file_of(basename: str, name: str) -> bool:
    """Is ``basename`` ``<YYYY-MM-DD>_<name>``?"""
    return (
        len(basename) == 11 + len(name)
        and basename[10] == "_"
        and basename.endswith(name)
        and basename[4] == "-"
        and basename[7] == "-"
    )


def file_name(run_id: str) -> str:
    """``<run_id>.parquet`` with characters unsafe in a path segment URL-encoded."""
    return urllib.parse.quote(run_id, safe="-_.~+=,@:") + ".parquet"
