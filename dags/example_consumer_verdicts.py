"""example_consumer_verdicts: how a downstream DAG follows speed_matrix runs (an example).

Scheduled on the `speedmatrix_comparisons` Asset, which speed_matrix's `verdicts` task emits
once `regressions` has landed this run's verdicts (also when it found a regression and failed):
scheduling on `speedmatrix_cells` instead would start before the verdicts exist. Each event's
extra says which run (run_id, baseline_run_id, regressions, improvements, warehouse); this
example reads that run's verdicts from the warehouse and logs a summary. It writes nothing,
and is paused when created: unpause it (or copy it) to use it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from airflow.sdk import Asset, dag, get_current_context, task

log = logging.getLogger(__name__)


@dag(
    dag_id="example_consumer_verdicts",
    description="Example: log each speed_matrix run's verdicts once they are landed",
    schedule=[Asset.ref(name="speedmatrix_comparisons")],
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    is_paused_upon_creation=True,
    max_active_runs=1,
    tags=["speedmatrix", "example"],
    default_args={
        "owner": "speedmatrix",
        "retries": 1,  # reads only
        "retry_delay": timedelta(seconds=30),
        "execution_timeout": timedelta(minutes=5),
    },
    doc_md=__doc__,
)
def example_consumer_verdicts():
    @task
    def summarize() -> list[dict]:
        from speedmatrix.store.extra import read_extra
        from speedmatrix.store.warehouse import Warehouse

        events = get_current_context()["triggering_asset_events"]
        out = []
        for asset_events in events.values():
            for event in asset_events:
                extra = dict(event.extra or {})
                run_id = extra.get("run_id")
                if not run_id:
                    continue
                rows = read_extra(Warehouse(extra.get("warehouse")), "comparisons", run_id=run_id)
                counts = rows["verdict"].value_counts().to_dict() if not rows.empty else {}
                log.info(
                    "run %s against %s: %s",
                    run_id,
                    extra.get("baseline_run_id"),
                    counts or "no comparison (no baseline)",
                )
                out.append({"run_id": run_id, "verdicts": {k: int(v) for k, v in counts.items()}})
        return out

    summarize()


example_consumer_verdicts()
