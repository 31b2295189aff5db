"""What code that is handed a warehouse may use of it: the ``Warehouse`` protocols.

What travels between the layers is one object, the store's warehouse
(:class:`speedmatrix.store.warehouse.Warehouse`), not a root location: readers query it and
read runs and artifacts through it, writers land tables, quarantine rows and keep artifacts
beside a run, and the maintenance opens its Delta tables; each keeps the tables it opened and
its DuckDB connection between calls, which a path or URI would not. So a root string or a
union would not say what a function needs; these protocols do, member by member, as the
concrete class has them (tests/unit/test_warehouse_protocol.py holds the signatures equal).

Why protocols rather than the class: report/, analysis/, flows/, cli/ and quality.py annotate
with them without importing store/warehouse.py (pyarrow, deltalake, DuckDB: the DAG files and
`speedmatrix --help` must stay light), and a test may hand in a double of only what a function
uses. Two of them: :class:`WarehouseReader` (what reading a run, its artifacts and the tables
needs) and :class:`Warehouse` (the reader plus what writing needs).

Typing only: nothing here runs, and the types named below are imported for checkers only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa
    from deltalake import DeltaTable


class WarehouseReader(Protocol):
    """A warehouse as its readers use it: the root, the tables' current versions, one run
    whole, SQL over the views, the artifacts beside a run."""

    root: str
    """The warehouse root: a local path or ``s3://bucket/prefix``."""
    storage_options: dict[str, str] | None
    """delta-rs storage options for the root (None on a local path)."""

    def table_uri(self, table: str) -> str: ...

    def delta_table(self, table: str, refresh: bool = True) -> DeltaTable | None: ...

    def read_table(
        self,
        table: str,
        filter_expr: Any = None,
        columns: list[str] | None = None,
        prune: str | None = None,
    ) -> pa.Table: ...

    def read_run(
        self, run_id: str, recipe_id: str | None = None
    ) -> tuple[dict, list[dict], list[dict]]: ...

    def query(
        self, sql: str, params: Iterable[Any] | None = None, timeout_s: float | None = None
    ) -> pd.DataFrame: ...

    def query_arrow(
        self,
        sql: str,
        params: Iterable[Any] | None = None,
        timeout_s: float | None = None,
        max_bytes: int | None = None,
    ) -> pa.Table: ...

    def artifact_path(self, run_id: str, name: str) -> str: ...

    def read_artifact(self, run_id: str, name: str) -> bytes: ...


class Warehouse(WarehouseReader, Protocol):
    """A warehouse as its writers use it: a reader that also lands a table's rows of a run,
    quarantines rows that failed validation, keeps an artifact beside a run, and forgets a
    table it opened (after maintenance rewrote it)."""

    def land_table(self, table: str, run_id: str, data: pa.Table) -> None: ...

    def quarantine(self, run_id: str, table: str, rows: list[dict], result: dict) -> str: ...

    def write_artifact(self, run_id: str, name: str, data: bytes | str) -> str: ...

    def forget(self, table: str) -> None: ...
