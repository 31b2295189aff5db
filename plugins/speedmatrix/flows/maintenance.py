"""The task behind the DAG ``speedmatrix_warehouse_maintenance``: compact, checkpoint and
vacuum the warehouse (speedmatrix.store.maintain), the figures in the task log.

One job: the task's body, so the DAG file stays a declaration (and `speedmatrix warehouse
maintain` runs the same code)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def run_maintenance(warehouse: str | None = None) -> dict[str, dict]:
    """Maintain ``warehouse`` (None: $SPEEDMATRIX_WAREHOUSE or the default root); logs one
    line per table (files before and after, vacuumed, version, seconds) and returns them; a
    table that could not be maintained fails the task, once the others are done."""
    from speedmatrix.store.maintain import RETENTION_HOURS, failure_line, format_report, maintain
    from speedmatrix.store.warehouse import Warehouse

    wh = Warehouse(warehouse or None)
    log.info("maintaining %s (vacuum retention %s h)", wh.root, RETENTION_HOURS)
    report = maintain(wh)
    for line in format_report(report).splitlines():
        log.info("%s", line)
    failed = failure_line(report)
    if failed:  # the task fails, after every other table was maintained
        raise RuntimeError(failed)
    return report
