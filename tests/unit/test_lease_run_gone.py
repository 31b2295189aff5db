"""A lease whose holder's DAG run ended or no longer exists is taken over, saying so.

In a deployment a run's tasks live in many processes, so no PID stands for the run; its DAG
run's state does. `wait_for_host` asks Airflow (through the task's execution API client) about
a holder of its own deployment (the lease's origin) and takes over one whose run is provably
gone, instead of waiting out the lease's 900 s (issue #34 item 6). Fakes stand for Airflow."""

from __future__ import annotations

import logging

import pytest

from speedmatrix.engine.hosts import get_host
from speedmatrix.engine.lease import HOLDER_MAX, HostLease, LeaseLost, holder_id
from speedmatrix.flows import lease_holder, matrix, progress

HOLDER_A = "speed_matrix/manual__2026-12-04T22:00:00.123456+00:00"


class Runs:
    """Airflow's DAG runs as a fake: (dag_id, run_id) -> state; what was asked."""

    def __init__(self, **states: str) -> None:
        self.states = {("speed_matrix", k): v for k, v in states.items()}
        self.asked: list[tuple[str, str]] = []

    def __call__(self, dag_id: str, run_id: str) -> str | None:
        self.asked.append((dag_id, run_id))
        return self.states.get((dag_id, run_id))


@pytest.mark.parametrize("state", ["running", "queued"])
def test_a_holder_whose_run_may_still_run_is_waited_for(state: str) -> None:
    runs = Runs(**{HOLDER_A.split("/", 1)[1]: state})
    assert lease_holder.run_gone_why(HOLDER_A, runs) is None
    assert runs.asked == [tuple(HOLDER_A.split("/", 1))]


@pytest.mark.parametrize("state", ["failed", "success"])
def test_a_holder_whose_run_ended_is_gone(state: str) -> None:
    runs = Runs(**{HOLDER_A.split("/", 1)[1]: state})
    why = lease_holder.run_gone_why(HOLDER_A, runs)
    assert why == (
        f"its DAG run speed_matrix manual__2026-12-04T22:00:00.123456+00:00 has ended ({state}) "
        "without releasing it"
    )


def test_a_holder_whose_run_no_longer_exists_is_gone() -> None:
    why = lease_holder.run_gone_why(HOLDER_A, Runs())
    assert (
        why == "its DAG run speed_matrix manual__2026-12-04T22:00:00.123456+00:00 no longer exists"
    )


def test_a_holder_that_names_no_run_for_certain_is_never_judged() -> None:
    """A holder without a run id, or one as long as holder_id cuts to (its run id may be cut:
    a run not found by the cut name is not a run gone), is not looked up."""
    runs = Runs()
    cut = holder_id("speed_matrix", "x" * 300)
    assert len(cut) == HOLDER_MAX
    assert lease_holder.run_gone_why(cut, runs) is None
    assert lease_holder.run_gone_why("run-a", runs) is None
    assert runs.asked == []


def test_airflow_run_ids_stay_whole_in_the_holder() -> None:
    """Airflow's default allowed_run_id_pattern ([A-Za-z0-9_.~:+-]) is kept verbatim, so the run
    a holder names is the run that took the lease."""
    assert holder_id("speed_matrix", "my~run:1+x.y-z") == "speed_matrix/my~run:1+x.y-z"


def test_the_run_state_is_read_through_the_task_api_count_first() -> None:
    class Ti:
        def __init__(self, count: int) -> None:
            self.count = count
            self.calls: list[str] = []

        def get_dr_count(self, dag_id: str, run_ids: list[str]) -> int:
            self.calls.append(f"count {dag_id} {run_ids}")
            return self.count

        def get_dagrun_state(self, dag_id: str, run_id: str) -> str:
            self.calls.append(f"state {dag_id} {run_id}")
            return "failed"

    absent = Ti(0)
    assert lease_holder.airflow_run_state(absent)("speed_matrix", "r1") is None
    assert absent.calls == ["count speed_matrix ['r1']"]  # a missing run's state is never asked
    present = Ti(1)
    assert lease_holder.airflow_run_state(present)("speed_matrix", "r1") == "failed"
    assert present.calls == ["count speed_matrix ['r1']", "state speed_matrix r1"]


def test_airflows_own_state_enum_reads_as_its_name() -> None:
    """Airflow's API answers a DagRunState, whose str() is "DagRunState.RUNNING": a running
    holder read that way looked ended, and a second run took over a live lease."""
    from airflow.utils.state import DagRunState

    class Ti:
        def get_dr_count(self, dag_id: str, run_ids: list[str]) -> int:
            return 1

        def get_dagrun_state(self, dag_id: str, run_id: str) -> DagRunState:
            return self.state

    ti = Ti()
    for state, gone in [(DagRunState.RUNNING, False), (DagRunState.QUEUED, False),
                        (DagRunState.FAILED, True), (DagRunState.SUCCESS, True)]:  # fmt: skip
        ti.state = state
        assert lease_holder.airflow_run_state(ti)("speed_matrix", "r1") == state.value
        why = lease_holder.run_gone_why(HOLDER_A, lease_holder.airflow_run_state(ti))
        assert (why is not None) is gone, (state, why)
    assert lease_holder.run_gone_why(HOLDER_A, lambda d, r: DagRunState.RUNNING) is None


@pytest.fixture
def lease_dir(tmp_path) -> str:
    d = tmp_path / "leases"
    d.mkdir(mode=0o1777)
    return str(d)


def _lease(holder: str, lease_dir: str, origin: str | None) -> HostLease:
    return HostLease(get_host("local"), holder, ttl_s=900, lease_dir=lease_dir, origin=origin)


def test_a_holder_of_this_deployment_proved_gone_is_taken_over(lease_dir, caplog) -> None:
    a = _lease(HOLDER_A, lease_dir, "airflow-dep1")
    b = _lease("speed_matrix/manual__b", lease_dir, "airflow-dep1")
    assert a.try_acquire().status == "ACQUIRED"
    running = Runs(**{HOLDER_A.split("/", 1)[1]: "running"})
    state = b.try_acquire(lambda h: lease_holder.run_gone_why(h, running))
    assert state.status == "HELD" and state.holder == HOLDER_A and state.origin == "airflow-dep1"
    assert running.asked  # the holder's run was looked up, and it runs: waited for
    with caplog.at_level(logging.WARNING, logger="speedmatrix.lease"):
        state = b.try_acquire(lambda h: lease_holder.run_gone_why(h, Runs()))
    assert state.status == "ACQUIRED" and state.gone == HOLDER_A
    assert state.why is not None and "no longer exists" in state.why
    assert f"its holder {HOLDER_A} is gone (its DAG run speed_matrix" in caplog.text
    assert "taken over by speed_matrix/manual__b" in caplog.text
    assert b.renew().status == "RENEWED"  # the gone holder's record no longer counts
    with pytest.raises(LeaseLost):
        a.renew()


@pytest.mark.parametrize("origin", [None, "airflow-dep2"])
def test_a_holder_of_another_deployment_or_none_is_never_judged(lease_dir, origin) -> None:
    """A `speedmatrix run` (no origin) or another deployment's run is not one this deployment's
    Airflow knows: not found there proves nothing."""
    a = _lease(HOLDER_A, lease_dir, origin)
    b = _lease("speed_matrix/manual__b", lease_dir, "airflow-dep1")
    assert a.try_acquire().status == "ACQUIRED"
    runs = Runs()
    state = b.try_acquire(lambda h: lease_holder.run_gone_why(h, runs))
    assert state.status == "HELD" and state.holder == HOLDER_A and state.gone is None
    assert runs.asked == []


def test_take_lease_says_whose_run_is_gone_where_the_user_looks(tmp_path, monkeypatch) -> None:
    d = tmp_path / "machine"
    d.mkdir(mode=0o1777)
    monkeypatch.setenv("SPEEDMATRIX_LEASE_DIR", str(d))
    monkeypatch.setenv("HOME", str(tmp_path))  # no servers recorded: none to stop
    assert _lease(HOLDER_A, str(d), "airflow-dep1").try_acquire().status == "ACQUIRED"

    class Heard:
        def __init__(self) -> None:
            self.said: list[str] = []

        def step(self, text: str) -> None:
            self.said.append(text)

        def leased(self, resolved: object) -> None:
            pass

    failed = Runs(**{HOLDER_A.split("/", 1)[1]: "failed"})
    with progress.listening(Heard()) as heard:
        got = matrix.take_lease(
            {"host": "local", "holder": "speed_matrix/manual__b"},
            origin="airflow-dep1",
            gone_why=lambda h: lease_holder.run_gone_why(h, failed),
        )
    assert got is not None and got["taken_over_from"] == HOLDER_A
    assert got["gone_because"].endswith("has ended (failed) without releasing it")
    assert heard.said == [
        f"the lease on local was held by {HOLDER_A}: its DAG run speed_matrix "
        "manual__2026-12-04T22:00:00.123456+00:00 has ended (failed) without releasing it; "
        "taken over"
    ]


def test_the_origin_names_the_deployment(monkeypatch) -> None:
    monkeypatch.setenv(lease_holder.ORIGIN_ENV, "prod")
    prod = lease_holder.airflow_origin()
    monkeypatch.setenv(lease_holder.ORIGIN_ENV, "staging")
    assert prod.startswith("airflow-") and lease_holder.airflow_origin() != prod
