"""A cell's turn on the host (flows/turn.py, issue #19): the next cell task starts while the
previous cell measures and touches the host only once that cell has finished."""

from __future__ import annotations

import logging

import pytest

from speedmatrix.flows import turn


class Clock:
    """A clock that moves only when the waiter sleeps (no idle waits in the tests)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def _states(*seq):
    it = iter(seq)
    seen = []

    def read():
        seen.append(next(it))
        return seen[-1]

    return read, seen


def test_the_first_cell_does_not_wait():
    clock = Clock()
    got = turn.wait_for_turn(None, sleep=clock.sleep, clock=clock)
    assert got == {"after": None, "waited_s": 0.0, "state": None} and clock.slept == []


def test_a_cell_waits_while_the_previous_one_is_queued_or_running():
    clock = Clock()
    read, seen = _states("queued", "running", "running", "success")
    got = turn.wait_for_turn(read, "decode[2]", poll_s=0.25, sleep=clock.sleep, clock=clock)
    assert seen == ["queued", "running", "running", "success"]
    assert clock.slept == [0.25, 0.25, 0.25]
    assert got == {"after": "decode[2]", "waited_s": 0.75, "state": "success"}


@pytest.mark.parametrize("state", ["success", "failed", "skipped", "upstream_failed", "removed"])
def test_a_finished_previous_cell_lets_it_go_whatever_became_of_it(state):
    clock = Clock()
    read, _ = _states("running", state)
    assert turn.wait_for_turn(read, sleep=clock.sleep, clock=clock)["state"] == state


@pytest.mark.parametrize("state", [None, "scheduled"])
def test_a_previous_cell_not_started_is_not_waited_for(state):
    """dag.test() runs mapped instances one at a time in no set order: a later cell can run
    while its predecessor is only scheduled, and waiting then would never end. (The real
    scheduler queues instances in map index order, so it never shows this state.)"""
    clock = Clock()
    read, seen = _states(state)
    got = turn.wait_for_turn(read, sleep=clock.sleep, clock=clock)
    assert got["state"] == state and clock.slept == [] and len(seen) == 1


@pytest.mark.parametrize("state", ["up_for_retry", "up_for_reschedule", "deferred", "restarting"])
def test_other_live_states_are_waited_for(state):
    """Only a finished or never-started predecessor lets the cell go: any state in which the
    previous cell may still (or again) use the host keeps it waiting."""
    clock = Clock()
    read, seen = _states(state, state, "success")
    assert turn.wait_for_turn(read, sleep=clock.sleep, clock=clock)["state"] == "success"
    assert len(clock.slept) == 2 and seen == [state, state, "success"]


def test_a_long_wait_says_so(caplog):
    clock = Clock()
    read, _ = _states(*["running"] * 250, "success")
    with caplog.at_level(logging.INFO, logger="speedmatrix.turn"):
        got = turn.wait_for_turn(
            read, "decode[4]", poll_s=0.25, progress_every_s=30, sleep=clock.sleep, clock=clock
        )
    notes = [r.getMessage() for r in caplog.records]
    assert got["waited_s"] == 62.5
    assert notes == [
        "waiting for decode[4] to finish (running) for 30 s",
        "waiting for decode[4] to finish (running) for 60 s",
    ]


class FakeTI:
    """The parts of airflow.sdk's RuntimeTaskInstance the reader uses; get_task_states answers
    as the execution API does (tests/dags checks the real one under dag.test)."""

    dag_id = "speed_matrix"
    run_id = "manual__r1"
    task_id = "decode"

    def __init__(self, map_index, states):
        self.map_index = map_index
        self.states = states
        self.asked = []

    def get_task_states(self, **kw):
        self.asked.append(kw)
        return {self.run_id: dict(self.states)}


def test_the_previous_cell_is_the_previous_map_index_of_the_same_task():
    ti = FakeTI(3, {"decode_2": "running"})
    read, name = turn.previous_cell_state(ti)
    assert name == "decode[2]" and read() == "running"
    assert ti.asked == [
        {
            "dag_id": "speed_matrix",
            "map_index": 2,
            "task_ids": ["decode"],
            "run_ids": ["manual__r1"],
        }
    ]
    ti.states = {}
    assert read() is None


@pytest.mark.parametrize("index", [0, -1, None])
def test_the_first_instance_and_an_unmapped_task_have_no_previous_cell(index):
    assert turn.previous_cell_state(FakeTI(index, {})) == (None, "")
