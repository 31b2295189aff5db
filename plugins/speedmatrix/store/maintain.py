"""Warehouse maintenance: compaction, vacuum and checkpoints of every Delta table.

One job: keeping reads fast and storage bounded. Every landing adds a small file per table
and a log entry; answers slow down with the number of files (a fleet-wide query: 0.27 s
after compaction against 50-77 s before, on 5,460 runs). :func:`maintain` runs, per table:

1. the table's ``delta.deletedFileRetentionDuration`` set to the floor
   (:data:`MIN_RETENTION_HOURS`) once, so that delta-rs's own check
   (``enforce_retention_duration``) stays on and refuses any vacuum below it;
2. ``optimize.compact()``: small files of each partition (recipe x month) rewritten into few
   large ones;
3. the vacuum: data files no version of the last ``retention_hours`` needs are deleted (by
   the time their removal was committed), and so are files no version ever referenced (a
   writer killed before its commit) once their own age passes ``retention_hours``. The
   default, 24 h, is far longer than any reader holds a version (a ``speedmatrix query``
   stops at its timeout, minutes; readers of this package bring their table to the newest
   version before each read) and than any landing takes (a landing gives up after
   ``MAX_WAIT_S`` of conflicts), so no running reader or writer loses a file. Below the
   floor only with ``force`` (a landing under way could lose its files);
4. ``create_checkpoint()``: the log's state in one Parquet file, so opening a table reads it
   and the few entries after it, not every entry since the first landing;
5. ``cleanup_metadata()``: log entries older than the table's log retention (30 days) go.

The retention is kept to the second, fractions too (:func:`_vacuum`): delta-rs's
``vacuum(retention_hours=int)`` takes whole hours, so it is asked, with its check on, for the
files it would delete at the whole hours below (a dry run: a superset), and of those only the
files whose removal (the ``remove`` action's ``deletionTimestamp`` in the table's log; for a
file the log does not name, its own age) is older than the exact cutoff are deleted, through
the table's filesystem. delta-rs's Python API gives no remove actions, so the log's newest
entries are read for them (:func:`_removal_times`): its checkpoints keep no tombstone older
than the table's retention property (the floor), after which delta-rs itself judges a removed
file by its age on disk. The vacuum comes before the checkpoint so that delta-rs still knows
the tombstones the checkpoint would drop.

Every commit made here (the property, the compaction) is retried as a landing's is
(:func:`speedmatrix.store.delta.with_retries`): safe beside landing writers, which never wait
for it; the vacuum makes no commit. A table that still fails is reported (``error``) and the
others are maintained all the same. The vacuum's count is the files that were there before
and are gone after: delta-rs lists every expired removal of the log, also those deleted long
ago.

Run daily by the DAG ``speedmatrix_warehouse_maintenance`` and by ``speedmatrix warehouse
maintain``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from typing import Any
from urllib.parse import unquote

from deltalake import DeltaTable

from speedmatrix.errors import InputError
from speedmatrix.store.delta import MAX_WAIT_S, damaged_log, with_retries
from speedmatrix.store.protocol import Warehouse
from speedmatrix.store.schemas import view_tables

RETENTION_HOURS = 24.0
"""Files a version of the last 24 hours still needs are never vacuumed."""
MIN_RETENTION_HOURS = 1.0
"""The floor: at least twice the longest a landing can take (``MAX_WAIT_S`` of conflicts,
then one more attempt), so vacuum never deletes the files of a landing under way (on S3 at
``--retention-hours 0`` a landing died with NoSuchKey)."""
assert MIN_RETENTION_HOURS * 3600 >= 2 * MAX_WAIT_S
RETENTION_PROPERTY = "delta.deletedFileRetentionDuration"
"""The table property delta-rs checks a vacuum's retention against (its default: a week)."""
CLOCK_SLACK_MS = 3600 * 1000
"""How much further back than the cutoff the log is read for removals: commits are dated by
their writers' clocks, which may differ (S3 refuses a request 15 minutes off)."""


def retention_problem(hours: float, force: bool = False) -> str | None:
    """Why a vacuum retention of ``hours`` is refused (None: it is fine)."""
    if not math.isfinite(hours) or hours < 0:
        return f"--retention-hours must be a finite number of hours, 0 or more (got {hours:g})"
    if hours < MIN_RETENTION_HOURS and not force:
        return (
            f"--retention-hours {hours:g} is below the floor of {MIN_RETENTION_HOURS:g} h "
            "(the longest a landing can take: its files would be deleted under it); "
            "add --force to vacuum anyway"
        )
    return None


def _floor_interval() -> str:
    return f"interval {round(MIN_RETENTION_HOURS * 3600)} seconds"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def _present(fs: Any, base: str, files: list[str]) -> dict[str, Any]:
    """Which of ``files`` (paths relative to the table) exist now, with their file info."""
    import pyarrow.fs as pafs

    if not files:
        return {}
    infos = fs.get_file_info([f"{base}/{f}" for f in files])
    return {
        f: info for f, info in zip(files, infos, strict=True) if info.type != pafs.FileType.NotFound
    }


def _removal_times(fs: Any, base: str, version: int, since_ms: float) -> dict[str, int]:
    """When each data file the log's entries from ``since_ms`` on removed was removed (ms
    since the epoch, by path relative to the table as stored): the entries read from
    ``version`` back until one committed before ``since_ms`` (or the first one kept)."""
    times: dict[str, int] = {}
    for v in range(version, -1, -1):
        try:
            with fs.open_input_stream(f"{base}/_delta_log/{v:020d}.json") as fh:
                lines = fh.read().decode().splitlines()
        except FileNotFoundError:  # cleaned up: older than the log's retention
            break
        actions = [json.loads(line) for line in lines if line.strip()]
        committed = next(
            (a["commitInfo"].get("timestamp") for a in actions if "commitInfo" in a), None
        )
        for a in actions:
            remove = a.get("remove")
            if remove and "://" not in remove["path"] and not remove["path"].startswith("/"):
                when = remove.get("deletionTimestamp") or committed
                if when is not None:
                    times.setdefault(unquote(remove["path"]), int(when))
        if committed is not None and committed < since_ms:
            break
    return times


def _vacuum(delta: DeltaTable, uri: str, retention_hours: float) -> int:
    """Delete the data files no version of the last ``retention_hours`` needs (a fraction
    kept: see the module docstring); returns how many were there and are gone."""
    import pyarrow.fs as pafs

    below_floor = retention_hours < MIN_RETENTION_HOURS  # allowed by maintain() with force
    delta.update_incremental()
    candidates = delta.vacuum(
        retention_hours=math.floor(retention_hours),
        dry_run=True,
        enforce_retention_duration=not below_floor,
        full=True,
    )
    cutoff_ms = time.time() * 1000 - retention_hours * 3600 * 1000
    fs, base = pafs.FileSystem.from_uri(uri)
    base = base.rstrip("/")
    present = _present(fs, base, candidates)
    since_ms = cutoff_ms - CLOCK_SLACK_MS
    removed = _removal_times(fs, base, delta.version(), since_ms) if present else {}

    def expired(path: str) -> bool:
        if path in removed:
            return removed[path] < cutoff_ms
        mtime_ns = present[path].mtime_ns  # never referenced, or removed before the cutoff
        return mtime_ns is not None and mtime_ns / 1e6 < cutoff_ms

    doomed = sorted(p for p in present if expired(p))
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):  # gone already
            fs.delete_file(f"{base}/{path}")
    return len(doomed) - len(_present(fs, base, doomed))


def _maintain_table(warehouse: Warehouse, table: str, retention_hours: float) -> dict[str, Any]:
    uri = warehouse.table_uri(table)
    # a DeltaTable of its own: one that ran optimize reads its new files' statistics as
    # string_view afterwards, and a later filter on it fails (delta-rs 1.6.6)
    delta = DeltaTable(uri, storage_options=warehouse.storage_options)
    t0 = time.monotonic()
    before = len(delta.file_uris())

    def set_floor() -> None:
        delta.update_incremental()
        if delta.metadata().configuration.get(RETENTION_PROPERTY) != _floor_interval():
            delta.alter.set_table_properties({RETENTION_PROPERTY: _floor_interval()})

    def compact() -> dict:
        delta.update_incremental()
        return delta.optimize.compact()

    with_retries(f"setting {table}'s vacuum floor", set_floor)
    metrics = with_retries(f"compacting {table}", compact)
    removed = _vacuum(delta, uri, retention_hours)
    delta.update_incremental()
    delta.create_checkpoint()
    delta.cleanup_metadata()
    delta.update_incremental()
    return {
        "files_before": before,
        "files_after": len(delta.file_uris()),
        "files_added": int(metrics.get("numFilesAdded", 0) or 0),
        "files_removed": int(metrics.get("numFilesRemoved", 0) or 0),
        "files_vacuumed": removed,
        "version": delta.version(),
        "seconds": round(time.monotonic() - t0, 2),
    }


def maintain(
    warehouse: Warehouse, retention_hours: float = RETENTION_HOURS, *, force: bool = False
) -> dict[str, dict]:
    """Compact, checkpoint and vacuum every table of ``warehouse``; returns per table: files
    before / after compaction, files vacuumed, the version and seconds taken, or ``error``
    (one line) for a table that failed, after which the next table is maintained all the
    same. A retention below the floor without ``force`` is an InputError, before anything."""
    problem = retention_problem(retention_hours, force)
    if problem:
        raise InputError(problem)
    report: dict[str, dict] = {}
    for table in view_tables():
        try:
            if warehouse.delta_table(table) is None:
                continue
            report[table] = _maintain_table(warehouse, table, retention_hours)
        except Exception as exc:
            damaged = damaged_log(exc, warehouse.table_uri(table), table, warehouse.storage_options)
            report[table] = {"error": _one_line(damaged or exc)}
        finally:
            warehouse.forget(table)
    return report


def failed_tables(report: dict[str, dict]) -> dict[str, str]:
    """The tables whose maintenance failed, with the reason."""
    return {table: r["error"] for table, r in report.items() if r.get("error")}


def format_report(report: dict[str, dict]) -> str:
    """One line per table, for the task log and the command's output."""
    if not report:
        return "no table has a commit yet: nothing to maintain\n"
    lines = []
    for table, r in report.items():
        if r.get("error"):
            lines.append(f"{table}: FAILED: {r['error']}")
            continue
        lines.append(
            f"{table}: {r['files_before']} -> {r['files_after']} files (compaction added "
            f"{r['files_added']}, removed {r['files_removed']}), {r['files_vacuumed']} "
            f"vacuumed, version {r['version']}, {r['seconds']:.2f} s"
        )
    return "\n".join(lines) + "\n"


def failure_line(report: dict[str, dict]) -> str | None:
    """One line saying which tables failed and why (None: none did)."""
    failed = failed_tables(report)
    if not failed:
        return None
    reasons = "; ".join(f"{t}: {why}" for t, why in failed.items())
    return f"{len(failed)} of {len(report)} tables not maintained ({reasons})"
