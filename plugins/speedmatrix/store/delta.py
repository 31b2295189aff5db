"""One warehouse table as a Delta Lake table (delta-rs): where it is, how a run's rows replace
the old ones in one commit, and how a commit conflict is retried.

One job: the table format. Every table (runs, cells, requests and the extra ones) is a Delta
table at ``<root>/<table>``, partitioned by ``recipe_id`` and ``run_month``. delta-rs writes the
data files first and then commits by creating the next ``_delta_log/<version>.json`` only if
it does not exist yet (a rename-if-absent locally, a conditional ``PUT`` with
``If-None-Match: *`` on S3): of two writers racing for one version one wins, the other
re-reads the log, checks that the winner did not touch its rows and tries the next version.
So writers never lock or refuse each other, and a writer killed before its commit leaves only
unreferenced data files (``vacuum`` removes them, store/maintain.py). A landing of a run is one
``overwrite`` with the predicate ``run_id = '<id>'`` per table: the run's older rows go and the
new ones arrive in the same commit (no duplicates, ever).

S3: endpoint and credentials are the standard AWS environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``), read by delta-rs itself;
an ``http://`` endpoint (a server on the LAN or loopback) is allowed here explicitly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pyarrow as pa
from tenacity import RetryError, Retrying, retry_if_exception, stop_after_attempt, stop_after_delay

from speedmatrix.settings import settings
from speedmatrix.store.schemas import PARTITION_KEYS, WarehouseError

T = TypeVar("T")

log = logging.getLogger(__name__)
"""One INFO record per lost commit (:func:`with_retries`): how often writers contend, which
the concurrency tests assert did happen (tests/contention.py)."""

MAX_ATTEMPTS = 40
"""Our own attempts at one commit (each of which delta-rs retries itself up to its default 15
times against newer versions): past them a landing fails with :class:`CommitConflictError`."""
MAX_WAIT_S = 600.0
"""…or when conflicts kept it from committing for this long, whichever comes first."""
MAX_SEGMENT_BYTES = 200
"""The longest encoded partition directory name (``recipe_id=<value>``) we write: most
filesystems refuse names over 255 bytes (ENAMETOOLONG), and S3 keys over 1024 bytes."""


class CommitConflictError(WarehouseError):
    """Other writers kept committing to the same rows for longer than the retry bound."""


class DamagedLogError(WarehouseError):
    """A table's Delta log cannot be read (an entry cut short or not JSON, a checkpoint that is
    not Parquet): one line naming the table and the file, and where recovery is described."""


_LOG_WORDS = (
    "json",
    "parse",
    "deserializ",
    "truncated",
    "eof while",
    "invalid log",
    "checkpoint",
    "parquet",
    "corrupt",
)
"""What delta-rs says when a log entry or checkpoint cannot be read."""
MAX_LOG_ENTRIES_CHECKED = 2000
"""How many of the newest log entries are parsed to find the damaged one."""


def _damaged_entry(uri: str, storage_options: dict[str, str] | None) -> str | None:
    """The newest file of the table's ``_delta_log`` that cannot be read: ``_last_checkpoint``
    or a ``*.json`` entry that is not JSON lines, or a ``*.checkpoint.parquet`` whose Parquet
    footer does not read (None: none of the newest :data:`MAX_LOG_ENTRIES_CHECKED` files is)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, base = pafs.FileSystem.from_uri(uri)
    log_dir = posixpath.join(base.rstrip("/"), "_delta_log")
    infos = fs.get_file_info(pafs.FileSelector(log_dir, allow_not_found=True))
    names = {posixpath.basename(i.path): i.path for i in infos}
    logs = sorted(
        (
            n
            for n in names
            if n.endswith((".json", ".checkpoint.parquet")) or n == "_last_checkpoint"
        ),
        # the newest version first; at one version its checkpoint before its entry, and
        # _last_checkpoint (which points at the newest checkpoint) before everything
        key=lambda n: (n != "_last_checkpoint", n),
    )
    ordered = logs[:1] if logs[:1] == ["_last_checkpoint"] else []
    ordered += sorted((n for n in logs if n != "_last_checkpoint"), reverse=True)
    for name in ordered[:MAX_LOG_ENTRIES_CHECKED]:
        path = names[name]
        try:
            if name.endswith(".parquet"):
                with fs.open_input_file(path) as fh:
                    pq.ParquetFile(fh).metadata  # noqa: B018 (reading the footer is the check)
                continue
            with fs.open_input_stream(path) as fh:
                text = fh.read().decode("utf-8", errors="replace")
            for line in text.splitlines():
                if line.strip():
                    json.loads(line)
        except ValueError:  # pyarrow's ArrowInvalid (not Parquet) is a ValueError too
            return posixpath.join("_delta_log", name)
    return None


def damaged_log(
    exc: BaseException, uri: str, table: str, storage_options: dict[str, str] | None
) -> DamagedLogError | None:
    """``exc`` as a :class:`DamagedLogError` when it says the table's log cannot be read (a
    delta-rs error about its JSON, not a conflict) and an entry of the log is indeed not JSON
    lines (the entry it names); None otherwise."""
    from deltalake.exceptions import DeltaError

    if not isinstance(exc, DeltaError) or is_conflict(exc):
        return None
    text = str(exc).strip()
    first = text.splitlines()[0][:200] if text else type(exc).__name__
    if not any(w in text.lower() for w in _LOG_WORDS):
        return None
    try:
        entry = _damaged_entry(uri, storage_options)
    except OSError:
        entry = None
    if entry is None:  # no entry of the log is damaged: some other error, shown as it is
        return None
    return DamagedLogError(
        f"table {table}: its log entry {uri}/{entry} cannot be read ({first}); the table is not read or "
        "written until it is repaired: see warehouse/README.md, 'A damaged log' (move the "
        + (
            "checkpoint and _last_checkpoint aside: the entries before it are read instead)"
            if entry.endswith(("checkpoint.parquet", "_last_checkpoint"))
            else "entry aside: the table's earlier version)"
        )
    )


@contextlib.contextmanager
def readable_log(uri: str, table: str, storage_options: dict[str, str] | None) -> Iterator[None]:
    """Inside: a delta-rs error saying the table's log cannot be read becomes one line
    (:func:`damaged_log`), not a Python and a Rust traceback."""
    try:
        yield
    except Exception as exc:
        damaged = damaged_log(exc, uri, table, storage_options)
        if damaged is None:
            raise
        raise damaged from None


def storage_options(root: str) -> dict[str, str] | None:
    """delta-rs storage options for ``root``: None locally; on ``s3://`` only what the AWS
    environment cannot say (delta-rs reads the rest itself): an ``http://`` endpoint is
    allowed, and the region defaults to us-east-1 as the AWS CLI's does."""
    if not root.startswith(("s3://", "s3a://")):
        return None
    opts: dict[str, str] = {}
    s = settings()
    if (s.object_store_endpoint or "").startswith("http://"):
        opts["allow_http"] = "true"
    if not s.object_store_region:
        opts["region"] = "us-east-1"
    return opts


def sql_literal(value: str) -> str:
    """``value`` as a SQL string literal in a delta-rs predicate (quotes doubled)."""
    return "'" + str(value).replace("'", "''") + "'"


def check_partition_values(table: pa.Table) -> None:
    """Refuse, before anything is written, partition values whose directory names no
    filesystem would take (one over-long name must never make a landing fail half way). delta-rs percent-encodes the value in the path, as checked here."""
    import urllib.parse

    for key in PARTITION_KEYS:
        if key not in table.column_names:
            continue
        for value in table.column(key).unique().to_pylist():
            if value is None:
                continue
            segment = f"{key}={urllib.parse.quote(str(value), safe='')}"
            if len(segment.encode()) > MAX_SEGMENT_BYTES:
                raise WarehouseError(
                    f"{key} {str(value)[:60]!r}… is too long for a partition directory "
                    f"({len(segment.encode())} bytes encoded, at most {MAX_SEGMENT_BYTES})"
                )


def is_conflict(exc: BaseException) -> bool:
    """A commit that lost to another writer (delta-rs gave up on its own retries, or two
    writers created the table at once): worth trying again on the newer version."""
    from deltalake.exceptions import CommitFailedError, DeltaError

    if isinstance(exc, CommitFailedError):
        return True
    text = str(exc).lower()
    return isinstance(exc, DeltaError) and any(
        s in text
        for s in ("conflict", "already exists", "version mismatch", "concurrent", "transaction")
    )


def with_retries(
    what: str,
    commit: Callable[[], T],
    *,
    attempts: int = MAX_ATTEMPTS,
    max_wait_s: float = MAX_WAIT_S,
    sleep: Callable[[float], Any] = time.sleep,
) -> T:
    """Run ``commit`` until it does not lose to another writer: a conflict waits a jittered,
    growing moment (so racing writers spread out) and tries again on the newest version. Past
    ``attempts`` tries or ``max_wait_s`` seconds: :class:`CommitConflictError`."""
    retrying = Retrying(
        stop=stop_after_attempt(attempts) | stop_after_delay(max_wait_s),
        wait=lambda state: random.uniform(0.05, 0.2) * min(2 ** (state.attempt_number // 4), 10),
        retry=retry_if_exception(is_conflict),
        before_sleep=lambda state: log.info(
            "%s: lost commit attempt %d to another writer's; trying again",
            what,
            state.attempt_number,
        ),
        sleep=sleep,
    )
    try:
        return retrying(commit)
    except RetryError as gave_up:
        exc = gave_up.last_attempt.exception()
        tries = gave_up.last_attempt.attempt_number
        waited = retrying.statistics.get("delay_since_first_attempt", 0.0)
        raise CommitConflictError(
            f"{what}: still losing to other writers' commits after {tries} attempts "
            f"in {waited:.0f} s ({str(exc).splitlines()[0][:200]}); nothing of this "
            "commit landed: land it again"
        ) from exc


def _kept_metadata(uri: str, data: pa.Table, opts: dict[str, str] | None) -> pa.Table:
    """``data`` with the field metadata the table already has for its columns: delta-rs
    refuses to merge two values of one key (a field's `doc` edited in records.py would make
    every existing warehouse refuse its next landing), so an existing column keeps its
    description; a new column brings its own."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        have = {f.name: f.metadata for f in DeltaTable(uri, storage_options=opts).schema().fields}
    except TableNotFoundError:
        return data
    fields = [f.with_metadata(have[f.name] or {}) if f.name in have else f for f in data.schema]
    return data.cast(pa.schema(fields, metadata=data.schema.metadata))


def replace_rows(uri: str, data: pa.Table, predicate: str, root: str) -> None:
    """One commit to the Delta table at ``uri``: delete the rows matching ``predicate`` and add
    ``data`` (which must match it too). Creates the table, partitioned by PARTITION_KEYS, on
    its first commit. Conflicts retried (:func:`with_retries`)."""
    from deltalake import write_deltalake

    check_partition_values(data)
    # one record batch: delta-rs writes the batches of a table in parallel, and the rows of a
    # run keep the order they were landed in only when there is one
    data = data.combine_chunks()
    opts = storage_options(root)

    def commit() -> None:
        write_deltalake(
            uri,
            _kept_metadata(uri, data, opts),
            mode="overwrite",
            predicate=predicate,
            partition_by=[k for k in PARTITION_KEYS if k in data.column_names],
            storage_options=opts,
            schema_mode="merge",
        )

    with readable_log(uri, posixpath.basename(uri.rstrip("/")), opts):
        with_retries(f"landing into {uri}", commit)


def create_table(uri: str, schema: pa.Schema, root: str) -> bool:
    """An empty Delta table at ``uri`` with ``schema`` (partitioned by PARTITION_KEYS) unless
    one is there; True when this call made it. So that every table opens in every reader from
    the first landing on (a scan of a table not yet written raises). Two writers creating it
    at once: one commit wins, the other's is a conflict retried and then finds it."""
    from deltalake import DeltaTable

    opts = storage_options(root)

    def commit() -> bool:
        if DeltaTable.is_deltatable(uri, storage_options=opts):
            return False
        DeltaTable.create(
            uri,
            schema,
            mode="ignore",
            partition_by=[k for k in PARTITION_KEYS if k in schema.names],
            storage_options=opts,
        )
        return True

    return with_retries(f"creating {uri}", commit)


def delete_rows(uri: str, predicate: str, root: str) -> int:
    """Delete the rows matching ``predicate`` in one commit; the count deleted (0 when the
    table does not exist yet)."""
    from deltalake import DeltaTable

    opts = storage_options(root)
    if not DeltaTable.is_deltatable(uri, storage_options=opts):
        return 0

    def commit() -> int:
        metrics = DeltaTable(uri, storage_options=opts).delete(predicate)
        return int(metrics.get("num_deleted_rows", 0) or 0)

    with readable_log(uri, posixpath.basename(uri.rstrip("/")), opts):
        return with_retries(f"deleting from {uri}", commit)


def arrow_dataset(delta: Any, prune: str | None = None, views: bool = False):
    """The Arrow dataset of ``delta``'s current version (``prune``: a SQL predicate choosing
    the files from the log's statistics first), its string columns all ``string`` or, with
    ``views``, all ``string_view``.

    Why: delta-rs 1.6.6 writes the files it rewrites itself (compaction, and the rest of a
    file a delete or a re-landing took rows out of) with ``string_view`` columns, ours with
    ``string``; once a table mixes the two, a pyarrow filter of either type fails on the
    other's files ("no kernel matching input types (string, string_view)"). DuckDB filters a
    ``string_view`` dataset over both kinds of file fine (the query views); pyarrow readers
    fall back to filtering after the read (:meth:`Warehouse.read_table`)."""
    base = delta.to_pyarrow_dataset(file_pruning_predicate=prune)
    want = pa.string_view() if views else pa.string()
    schema = pa.schema(
        [
            f.with_type(want)
            if pa.types.is_string(f.type) or pa.types.is_string_view(f.type)
            else f
            for f in base.schema
        ]
    )
    if schema.equals(base.schema):
        return base
    return delta.to_pyarrow_dataset(file_pruning_predicate=prune, schema=schema)
