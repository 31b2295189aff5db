"""speedmatrix_warehouse_maintenance: keep the warehouse's Delta tables fast, daily.

Compacts each table's small files (one per landing) into few per recipe and month, writes a
checkpoint of each log, and vacuums files no version of the last 24 hours needs
(speedmatrix.store.maintain); the figures go to the task log. Landings go on meanwhile (Delta's
optimistic concurrency: neither waits for the other). The same as `speedmatrix warehouse
maintain`.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import Param, dag, task


@dag(
    dag_id="speedmatrix_warehouse_maintenance",
    description="Compact, checkpoint and vacuum the warehouse's Delta tables",
    schedule="@daily",
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    tags=["speedmatrix", "warehouse"],
    params={
        "warehouse": Param(
            None,
            type=["null", "string"],
            description="warehouse root (default $SPEEDMATRIX_WAREHOUSE)",
        )
    },
    default_args={
        "owner": "speedmatrix",
        "retries": 2,  # idempotent: compaction and vacuum start again from the current version
        "retry_delay": timedelta(minutes=5),
        "execution_timeout": timedelta(hours=2),
    },
    doc_md=__doc__,
)
def speedmatrix_warehouse_maintenance():
    @task
    def maintain(params: dict | None = None) -> dict:
        from speedmatrix.flows.maintenance import run_maintenance

        return run_maintenance((params or {}).get("warehouse"))

    maintain()


speedmatrix_warehouse_maintenance()
