"""Where the warehouse is and the names inside it that are not Delta's own.

One job: names. The tables are Delta tables at ``<root>/<table>`` (store/delta.py names their
files); beside them ``<root>/artifacts/<run_id>/…`` and ``<root>/_quarantine/<table>/<run_id>/``
(store/warehouse.py). The older hand-written layout's names are in store/legacy.py, read only
by the migration.
"""

from __future__ import annotations

import datetime as dt
import urllib.parse

from speedmatrix.settings import settings

QUARANTINE = "_quarantine"
ARTIFACTS = "artifacts"


def default_root() -> str:
    """``$SPEEDMATRIX_WAREHOUSE``, else ``warehouse/`` in the checkout (else in the cwd): the
    ``warehouse`` setting."""
    return settings().warehouse


def run_month_of(run_date: dt.date) -> str:
    return f"{run_date.year:04d}-{run_date.month:02d}"


def file_name(run_id: str) -> str:
    """``<run_id>.parquet`` with characters unsafe in a path segment URL-encoded (artifacts'
    and quarantine's directory names are this without the suffix)."""
    return urllib.parse.quote(run_id, safe="-_.~+=,@:") + ".parquet"
