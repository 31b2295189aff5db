"""speed_matrix_nightly: every nightly recipe at vLLM main's head commit, once per night.

The head is resolved once per night, so all recipes measure the same commit; the run ids
(`nightly__<recipe>__<date>`) make a re-run of the same night a no-op.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import CronTriggerTimetable, dag, task

from speedmatrix.flows import triggers

CFG = triggers.load_schedule_config()


@dag(
    dag_id="speed_matrix_nightly",
    description="Trigger speed_matrix for every nightly recipe at vLLM main's head",
    schedule=CronTriggerTimetable(CFG.nightly.cron, timezone="UTC"),
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    tags=["speedmatrix", "trigger", "nightly"],
    default_args={
        "owner": "speedmatrix",
        "retries": 2,  # idempotent: the head lookup is a GET, triggers dedupe by run id
        "retry_delay": timedelta(minutes=2),
        "execution_timeout": timedelta(minutes=5),
    },
    doc_md=__doc__,
)
def speed_matrix_nightly():
    @task
    def resolve_head(params: dict | None = None) -> str:
        return triggers.run_nightly_resolve(params)

    @task
    def plan(sha: str, dag_run=None) -> list[dict]:
        return triggers.run_nightly_plan(sha, dag_run.logical_date, dag_run.run_after)

    TriggerDagRunOperator.partial(
        task_id="trigger_speed_matrix",
        trigger_dag_id=triggers.TARGET_DAG_ID,
        skip_when_already_exists=True,  # this night's run of the recipe exists already
        map_index_template="{{ task.trigger_run_id }}",
    ).expand_kwargs(plan(resolve_head()))


speed_matrix_nightly()
