"""Whose DAG run holds a host's lease, and whether that run is provably gone: the Airflow side
of the lease (engine/lease.py itself knows nothing of Airflow).

A run that holds a host and then ends without releasing it (failed outside its teardown,
deleted, its worker lost) would keep every later run of the host waiting until the lease
expires. A lease records the deployment that took it (its origin); a holder of this
deployment whose DAG run has ended or no longer exists is taken over at once, with a line
saying so. Under dag.test one process runs the whole run, and that process's own metadata DB
says nothing of another process's runs: there the holder's process (its PID, recorded with
the lease) says when it is gone, and nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from speedmatrix.engine.lease import HOLDER_MAX
from speedmatrix.flows import matrix
from speedmatrix.flows.resolved import Resolved
from speedmatrix.settings import settings

RUN_LIVE_STATES = frozenset({"queued", "running"})
"""DAG run states whose run may still use its host; any other (success, failed) has ended."""


def run_gone_why(
    holder: str, dag_run_state: Callable[[str, str], str | None], cut_at: int = HOLDER_MAX
) -> str | None:
    """Why the DAG run that holds a lease is provably gone, or None while it may still run.

    `holder` is `holder_id(dag id, run id)`; `dag_run_state(dag_id, run_id)` reads that run's
    state from Airflow (None: no such run). A holder that may have been cut (as long as
    holder_id makes one) names no run for certain and is never judged: the lease waits."""
    dag_id, _, run_id = holder.partition("/")
    if not run_id or len(holder) >= cut_at:
        return None
    state = dag_run_state(dag_id, run_id)
    if state is None:
        return f"its DAG run {dag_id} {run_id} no longer exists"
    state = str(getattr(state, "value", state))
    if state in RUN_LIVE_STATES:
        return None
    return f"its DAG run {dag_id} {run_id} has ended ({state}) without releasing it"


ORIGIN_ENV = "SPEEDMATRIX_DEPLOYMENT"


def airflow_origin() -> str:
    """This Airflow deployment's name in the lease (lease.HostLease's origin): the workers'
    ``SPEEDMATRIX_DEPLOYMENT`` when set, else a digest of the execution API's URL (the API
    server every task of the deployment asks). Two deployments measuring one host name
    themselves apart by it, so neither judges the other's runs by its own DAG runs."""
    name = settings().deployment
    if not name:
        from airflow.sdk.configuration import conf

        name = (
            conf.get("core", "execution_api_server_url", fallback=None)
            or conf.get("api", "base_url", fallback=None)
            or "http://localhost:8080"
        )
    return "airflow-" + hashlib.sha1(name.encode()).hexdigest()[:12]


def airflow_run_state(ti: Any) -> Callable[[str, str], str | None]:
    """`dag_run_state` for :func:`run_gone_why`, read through the task's execution API client
    (airflow.sdk's RuntimeTaskInstance): a count first, since asking the state of a run that
    does not exist is an API error like any other, and only a count of 0 proves it absent."""

    def state(dag_id: str, run_id: str) -> str | None:
        if ti.get_dr_count(dag_id=dag_id, run_ids=[run_id]) == 0:
            return None
        state = ti.get_dagrun_state(dag_id=dag_id, run_id=run_id)
        # Airflow answers a DagRunState (a str enum whose str() is "DagRunState.RUNNING"):
        # its value is the state's name
        return str(getattr(state, "value", state))

    return state


def airflow_gone_why(ti: Any) -> Callable[[str], str | None]:
    """`gone_why` for matrix.take_lease inside an Airflow task: a holder of this deployment
    whose DAG run ended or no longer exists (read through the task's API client) is gone."""
    return lambda holder: run_gone_why(holder, airflow_run_state(ti))


def take_lease_in_task(resolved: Resolved, ti: Any, *, in_process: bool) -> dict[str, Any] | None:
    """The `wait_for_host` task's one attempt at the lease (matrix.take_lease): under dag.test
    (`in_process`) by the PID rule only; in a deployment a holder of this deployment whose
    DAG run ended or is gone is taken over too."""
    if in_process:
        return matrix.take_lease(resolved, one_process=True)
    return matrix.take_lease(resolved, origin=airflow_origin(), gone_why=airflow_gone_why(ti))
