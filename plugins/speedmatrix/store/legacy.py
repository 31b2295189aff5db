"""The older, hand-written warehouse layout (before Delta Lake), read by the migration only.

One job: reading a warehouse of that layout row for row. It was
``<root>/<table>/recipe_id=<URL-encoded>/run_month=<YYYY-MM>/<run_date>_<run_id>.parquet`` (one
file per table per run, the partition columns in the directory names only); the extra tables
may still hold files of the even older ``run_date=<d>/<run_id>.parquet`` form and files that
hold ``recipe_id`` too. ``_staging/`` (landings in progress) is never read.
"""

from __future__ import annotations

import datetime as dt
import urllib.parse
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from speedmatrix import renames
from speedmatrix.store.schemas import view_schema

NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"


def _decode(raw: str) -> str | None:
    return None if raw == NULL_PARTITION else urllib.parse.unquote(raw)


def legacy_files(fs: pafs.FileSystem, base: str, table: str) -> list[tuple[str, dict[str, Any]]]:
    """Every data file of ``table`` with what its path says: recipe_id, run_month or
    run_date, and run_date / run_id from the file name where it has them."""
    where = f"{base.rstrip('/')}/{table}"
    infos = fs.get_file_info(pafs.FileSelector(where, recursive=True, allow_not_found=True))
    out = []
    for info in infos:
        if info.type != pafs.FileType.File or not info.path.endswith(".parquet"):
            continue
        parts = info.path[len(where) + 1 :].split("/")
        if len(parts) != 3:
            continue
        known: dict[str, Any] = {}
        for segment in parts[:2]:
            key, sep, raw = segment.partition("=")
            if sep:
                known[key] = _decode(raw)
        name = parts[2][: -len(".parquet")]
        if len(name) > 11 and name[10] == "_":
            try:
                known["run_date"] = dt.date.fromisoformat(name[:10])
                name = name[11:]
            except ValueError:
                pass
        elif "run_date" in known and known["run_date"] is not None:
            known["run_date"] = dt.date.fromisoformat(known["run_date"])
        known["run_id"] = urllib.parse.unquote(name)
        if "recipe_id" not in known or "run_id" not in known:
            continue
        out.append((info.path, known))
    return sorted(out)


def read_legacy_file(fs: pafs.FileSystem, table: str, path: str, known: dict) -> pa.Table:
    """One file as a table of ``table``'s view schema: partition values from the path (they
    win over copies inside the file), columns a file lacks null, ``run_month`` from
    ``run_date`` where the path had none."""
    data = pq.read_table(path, filesystem=fs, partitioning=None)
    old = renames.COLUMNS.get(table, {})  # a renamed column, under its name now
    data = data.rename_columns(
        [old[c] if c in old and old[c] not in data.column_names else c for c in data.column_names]
    )
    schema = view_schema(table)
    n = data.num_rows
    cols = []
    for f in schema:
        value = known.get(f.name)
        if f.name == "run_month" and value is None and known.get("run_date"):
            value = known["run_date"].strftime("%Y-%m")
        if f.name in ("recipe_id", "run_month") and (value is not None or f.name in known):
            cols.append(pa.array([value] * n, type=f.type))
        elif f.name in data.column_names:
            cols.append(data.column(f.name).cast(f.type))
        elif value is not None:
            cols.append(pa.array([value] * n, type=f.type))
        else:
            cols.append(pa.nulls(n, type=f.type))
    return pa.Table.from_arrays(cols, schema=schema)
