"""speed_matrix_bisect: name the vLLM commit that made some cells slower.

Given a recipe, a good and a bad commit and the regressed cells, it bisects over the commits
in between (those with wheels), running only the regressed cells: each step triggers a real
`speed_matrix` run (host lease, provision, validate, land) at the chosen commit and compares
the landed cells with the known-good run. Steps are unrolled (MAX_STEPS, enough for 1024
commits); once the first bad commit is known the remaining steps are skipped.

A step's run takes as long as a matrix does (minutes to hours, waiting for its host included),
so the measure steps are deferrable: a worker slot is held only to trigger the run and to read
its end; in between the triggerer polls its state. A failed run counts as finished (the
judge then says "skip" and the search goes around that commit) rather than failing the
bisection.

Orchestration only: every task body is a function in `speedmatrix.flows.bisect_steps`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import Param, dag, get_current_context, task
from airflow.sdk.exceptions import AirflowSkipException

from speedmatrix.flows import bisect_steps

COMMIT = r"^[0-9a-f]{7,40}$"


@dag(
    dag_id="speed_matrix_bisect",
    description="Bisect vLLM commits for the first one that regressed some speed matrix cells",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=4,
    tags=["speedmatrix", "regressions", "vllm"],
    default_args={"owner": "speedmatrix", "retries": 0},
    params={
        "recipe": Param(type="string", minLength=1, description="recipe id"),
        "good": Param(type="string", pattern=COMMIT, description="last known-good commit"),
        "bad": Param(type="string", pattern=COMMIT, description="first known-bad commit"),
        "cells": Param(
            type="array",
            minItems=1,
            items={"type": "string"},
            description="regressed cells: 64Kx16 (decode) or 'prefill 64K'",
        ),
        "commits": Param(
            None,
            type=["null", "array"],
            items={"type": "string", "pattern": COMMIT},
            description="commits after good up to and including bad, oldest first "
            "(default: GitHub's compare API)",
        ),
        "good_run_id": Param(None, type=["null", "string"], description="the good run"),
        "ssh_conn_id": Param(None, type=["null", "string"], description="host (recipe's)"),
        "warehouse": Param(None, type=["null", "string"], description="warehouse root"),
        "window_s": Param(None, type=["null", "number"], exclusiveMinimum=0),
        "max_output_tokens": Param(None, type=["null", "integer"], minimum=2),
        "threshold_pct": Param(None, type=["null", "number"], minimum=0),
    },
    render_template_as_native_obj=False,
    doc_md=__doc__,
)
def speed_matrix_bisect():
    @task(execution_timeout=timedelta(minutes=10))
    def prepare(params: dict | None = None) -> dict:
        return bisect_steps.prepare_job(dict(params or {}))

    @task(execution_timeout=timedelta(minutes=2))
    def choose(job: dict, step: int) -> dict:
        chosen = bisect_steps.choose_step(job, step, salt=get_current_context()["dag_run"].run_id)
        if chosen is None:
            raise AirflowSkipException("first bad commit already known")
        return chosen

    @task(execution_timeout=timedelta(minutes=10))
    def judge(chosen: dict) -> dict:
        return bisect_steps.judge_step(chosen)

    @task(trigger_rule="none_failed")
    def conclude() -> dict:
        """The last state (later steps were skipped once the answer was known)."""
        ti = get_current_context()["ti"]
        ids = ["prepare"] + [f"judge_{i}" for i in range(bisect_steps.MAX_STEPS)]
        jobs = [ti.xcom_pull(task_ids=task_id) for task_id in ids]
        result = bisect_steps.conclude_job(jobs)
        print(result["summary"])
        return result

    job = prepare()
    jobs = [job]
    for step in range(bisect_steps.MAX_STEPS):
        chosen = choose.override(task_id=f"choose_{step}")(job, step)
        run = TriggerDagRunOperator(
            task_id=f"measure_{step}",
            trigger_dag_id="speed_matrix",
            trigger_run_id=f"{{{{ ti.xcom_pull(task_ids='choose_{step}')['trigger_run_id'] }}}}",
            conf=f"{{{{ ti.xcom_pull(task_ids='choose_{step}')['conf'] | tojson }}}}",
            wait_for_completion=True,
            # The triggerer waits, not a worker. One light state query per poll; 30 s of
            # latency per step is nothing next to a matrix run (SPEEDMATRIX_BISECT_POLL_S in
            # the DAG processor's environment changes it; the deployment test uses 5 s).
            deferrable=True,
            poke_interval=bisect_steps.poll_s(),
            allowed_states=["success", "failed"],  # a failed run is judged "skip"
            failed_states=[],
            # Bounds the trigger call and the resumed completion only: Airflow 3.3 puts no
            # timeout on the deferred wait; speed_matrix's own task timeouts end its run.
            execution_timeout=timedelta(minutes=10),
        )
        chosen >> run
        job = judge.override(task_id=f"judge_{step}")(chosen)
        run >> job
        jobs.append(job)
    jobs >> conclude()


speed_matrix_bisect()
