"""What the concurrency tests read to know that their writers did contend (one place).

A test of concurrent writers proves something only if their commits did overlap; with a few
writers and a few landings that is likely, not certain, so each such test asserts it from
what the code records, in two layers:

- delta-rs retries a commit that lost the race for its version itself, against the winner's
  commit, and writes how often into the commit it finally makes (``commitInfo``'s
  ``operationMetrics.num_retries`` in the table's ``_delta_log``): :func:`delta_retries`;
- a commit delta-rs gave up on (or two writers creating a table at once) is retried by
  ``store/delta.py``'s ``with_retries``, which logs one INFO record per lost attempt:
  :func:`counting_lost_commits`, called in each writer process.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Callable

import pyarrow.fs as pafs

DELTA_LOGGER = "speedmatrix.store.delta"


def counting_lost_commits() -> list[str]:
    """From now on, every commit ``with_retries`` lost in this process appends its log message
    to the list returned."""
    lost: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lost.append(record.getMessage())

    logger = logging.getLogger(DELTA_LOGGER)
    logger.setLevel(logging.INFO)
    logger.addHandler(Count())
    return lost


def delta_retries(wh, tables: tuple[str, ...] = ("runs", "cells", "requests")) -> int:
    """The retries delta-rs made for the commits in ``tables``' logs (local or S3), summed:
    each one a commit attempt that overlapped another writer's commit and lost to it."""
    total = 0
    for table in tables:
        log_dir = posixpath.join(wh.base, table, "_delta_log")
        infos = wh.fs.get_file_info(pafs.FileSelector(log_dir, allow_not_found=True))
        for info in infos:
            if not info.path.endswith(".json"):
                continue
            with wh.fs.open_input_stream(info.path) as fh:
                for line in fh.read().decode().splitlines():
                    action = json.loads(line) if line.strip() else {}
                    metrics = action.get("commitInfo", {}).get("operationMetrics", {})
                    total += int(metrics.get("num_retries") or 0)
    return total


def until_contended(land_round: Callable[[int], list[dict]], wh, rounds: int = 3):
    """Call ``land_round(0)``, ``land_round(1)`` … (each starts writer processes that land into
    ``wh`` together and returns their reports, each with its ``lost`` commits) until the
    writers' commits have overlapped at least once, at most ``rounds`` times; returns every
    report and how many commits were retried for it (0: never, and the caller fails)."""
    reports: list[dict] = []
    contended = 0
    for n in range(rounds):
        reports += land_round(n)
        contended = delta_retries(wh) + sum(len(r["lost"]) for r in reports)
        if contended:
            break
    return reports, contended
