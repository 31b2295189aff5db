"""vllm_commit_watch: run the per-commit recipes once for every new commit on vLLM main.

Thin on purpose: what is new, what is skipped, the run ids and the state are decided in
speedmatrix.flows.triggers (see its docstring for why a commit is never benchmarked twice).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import Param, dag, task

from speedmatrix.flows import triggers

CFG = triggers.load_schedule_config()


@dag(
    dag_id="vllm_commit_watch",
    description="Trigger speed_matrix once per new vLLM main commit for every per-commit recipe",
    schedule=CFG.commit_watch.cron,
    start_date=datetime(2026, 1, 1, tzinfo=UTC),
    catchup=False,
    max_active_runs=1,
    tags=["speedmatrix", "trigger", "vllm"],
    default_args={
        "owner": "speedmatrix",
        "retries": 1,  # every task here is idempotent (run ids dedupe the triggers)
        "retry_delay": timedelta(seconds=30),
        "execution_timeout": timedelta(minutes=5),
    },
    params={
        "max_commits": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            description="cap of commits per poll (default: schedule config)",
        ),
        "wait_for_wheel": Param(
            None,
            type=["null", "boolean"],
            description="trigger a commit only once its wheel exists (default: schedule config)",
        ),
    },
    doc_md=__doc__,
)
def vllm_commit_watch():
    @task
    def poll(params: dict | None = None) -> dict:
        return triggers.run_commit_poll(params)

    @task
    def to_trigger(plan: dict) -> list[dict]:
        """The plan's triggers, as the list the mapped trigger task expands over."""
        return plan["triggers"]

    plan = poll()
    trigger = TriggerDagRunOperator.partial(
        task_id="trigger_speed_matrix",
        trigger_dag_id=triggers.TARGET_DAG_ID,
        skip_when_already_exists=True,  # the run id already exists: this commit is done
        map_index_template="{{ task.trigger_run_id }}",
    ).expand_kwargs(to_trigger(plan))

    @task(trigger_rule="none_failed_min_one_success")
    def save_state(plan: dict) -> None:
        """Advance the watermark only once every trigger succeeded or already existed."""
        triggers.save_watch_state(plan["state"])

    trigger >> save_state(plan)


vllm_commit_watch()
