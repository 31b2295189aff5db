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
    """The parts of airflow.sdk's RuntimeTaskInstance the turn uses; get_task_states and
    xcom_pull answer as the execution API does (tests/integration checks the real ones under
    dag.test, tests/deployment under the scheduler)."""

    dag_id = "speed_matrix"
    run_id = "manual__r1"
    task_id = "decode"

    def __init__(self, map_index, states, xcoms=None):
        self.map_index = map_index
        self.states = states
        self.xcoms = dict(xcoms or {})
        self.asked = []
        self.pulled = []

    def get_task_states(self, **kw):
        self.asked.append(kw)
        return {self.run_id: dict(self.states)}

    def xcom_pull(self, **kw):
        self.pulled.append(kw)
        return self.xcoms.get((kw["task_ids"], kw["map_indexes"], kw["key"]))

    def xcom_push(self, key, value):
        self.xcoms[(self.task_id, self.map_index, key)] = value


class Run:
    def __init__(self, clear_number=0):
        self.clear_number = clear_number


def _asked(task_id: str, map_index: int) -> dict:
    """The execution API query for one instance's state, as cell_turn makes it."""
    return {
        "dag_id": "speed_matrix",
        "map_index": map_index,
        "task_ids": [task_id],
        "run_ids": ["manual__r1"],
    }


def test_the_previous_cell_is_the_previous_map_index_of_the_same_task():
    ti = FakeTI(3, {"decode_2": "running"})
    t = turn.cell_turn(ti, Run())
    assert t.name == "decode[2]" and t.previous() == "running"
    assert ti.asked == [_asked("decode", 2)]
    assert ti.pulled == [{"task_ids": "decode", "key": turn.RELEASED_KEY, "map_indexes": 2}]
    ti.states = {}
    assert t.previous() is None


@pytest.mark.parametrize("index", [0, -1, None])
def test_the_first_instance_and_an_unmapped_task_have_no_previous_cell(index):
    t = turn.cell_turn(FakeTI(index, {}), Run())
    assert (t.previous, t.name) == (None, "") and t.release is not None


def _released_by(prev: FakeTI, run: Run) -> dict:
    turn.cell_turn(prev, run).release()
    return prev.xcoms


def test_a_running_previous_cell_that_released_the_host_lets_the_next_one_go():
    """Issue #19: the hand-off need not wait for the previous task's end to reach the API
    server; the cell says it has left the host as its turn ends."""
    xcoms = _released_by(FakeTI(2, {}), Run(0))
    (value,) = xcoms.values()
    assert value["clear_number"] == 0 and value["at"]
    ti = FakeTI(3, {"decode_2": "running"}, xcoms)
    t = turn.cell_turn(ti, Run(0))
    assert t.previous() == turn.RELEASED
    clock = Clock()
    got = turn.wait_for_turn(t.previous, t.name, sleep=clock.sleep, clock=clock)
    assert got == {"after": "decode[2]", "waited_s": 0.0, "state": "released"}
    assert clock.slept == []


@pytest.mark.parametrize("state", ["queued", "restarting", "up_for_retry"])
def test_released_counts_only_from_a_running_previous_cell(state):
    """A "released" beside a predecessor that is not running comes from an earlier try (a
    cleared cell erases its XComs only once its next try starts): it is not read at all."""
    xcoms = _released_by(FakeTI(2, {}), Run(0))
    ti = FakeTI(3, {"decode_2": state}, xcoms)
    assert turn.cell_turn(ti, Run(0)).previous() == state and ti.pulled == []


def test_released_before_the_run_was_cleared_is_not_this_tries_word():
    """A cleared run counts its clears: the earlier try's "released" (clear 0) is stale once
    the new try runs (clear 1), even in the moment before that try erases it."""
    xcoms = _released_by(FakeTI(2, {}), Run(0))
    ti = FakeTI(3, {"decode_2": "running"}, xcoms)
    assert turn.cell_turn(ti, Run(1)).previous() == "running"
    assert turn.cell_turn(ti, Run(0)).previous() == turn.RELEASED


def test_no_word_yet_keeps_the_next_cell_waiting():
    ti = FakeTI(3, {"decode_2": "running"}, {("decode", 2, "other"): {"clear_number": 0}})
    assert turn.cell_turn(ti, Run()).previous() == "running"


# -- across the two cell tasks: decode's first cell after prefill's last (issue #19) -----------


def test_the_first_decode_cell_follows_the_last_prefill_cell():
    ti = FakeTI(0, {"prefill_1": "running"})
    t = turn.cell_turn(ti, Run(), ("prefill", 2))
    assert t.name == "prefill[1]" and t.previous() == "running"
    assert t.go == turn.ACROSS_GO_STATES
    assert ti.asked == [_asked("prefill", 1)]
    assert ti.pulled == [{"task_ids": "prefill", "key": turn.RELEASED_KEY, "map_indexes": 1}]


@pytest.mark.parametrize("state", [None, "scheduled", "queued", "running"])
def test_a_prefill_cell_not_started_or_not_done_keeps_the_first_decode_cell_waiting(state):
    """Between two tasks the scheduler's map index order says nothing: a last prefill cell not
    yet started (or not yet expanded: no state) will still measure, so it is waited for."""
    t = turn.cell_turn(FakeTI(0, {"prefill_0": state} if state else {}), Run(), ("prefill", 1))
    clock = Clock()
    read, seen = _states(t.previous(), t.previous(), "success")
    got = turn.wait_for_turn(read, t.name, go=t.go, sleep=clock.sleep, clock=clock)
    assert got["state"] == "success" and seen == [state, state, "success"]
    assert len(clock.slept) == 2


@pytest.mark.parametrize("state", ["success", "failed", "upstream_failed", "skipped"])
def test_a_finished_last_prefill_cell_lets_the_first_decode_cell_go(state):
    t = turn.cell_turn(FakeTI(0, {"prefill_2": state}), Run(), ("prefill", 3))
    assert t.previous() == state and state in t.go


def test_a_last_prefill_cell_that_released_the_host_lets_the_first_decode_cell_go():
    xcoms = _released_by(FakeTI(0, {}), Run(0))
    xcoms = {("prefill", 0, k): v for (_, _, k), v in xcoms.items()}
    t = turn.cell_turn(FakeTI(0, {"prefill_0": "running"}, xcoms), Run(0), ("prefill", 1))
    assert t.previous() == turn.RELEASED and turn.RELEASED in t.go


@pytest.mark.parametrize("after", [None, ("prefill", 0)])
def test_no_prefill_cells_no_wait(after):
    t = turn.cell_turn(FakeTI(0, {}), Run(), after)
    assert t.previous is None


def test_a_later_decode_cell_still_follows_its_own_tasks_previous_instance():
    t = turn.cell_turn(FakeTI(4, {"decode_3": "scheduled"}), Run(), ("prefill", 2))
    assert t.name == "decode[3]" and t.go == turn.GO_STATES


def test_under_dag_test_a_prefill_cell_not_started_is_not_waited_for(monkeypatch):
    """dag.test() runs one task at a time in its own process: a prefill cell not started yet
    starts only after this one, so waiting for it would never end (the cell then finds the
    context's prompt cached and measures again cold: matrix._warm_prefill)."""
    from airflow.sdk.execution_time.supervisor import InProcessSupervisorComms

    assert turn.in_process() is False  # pytest's own process: no supervisor at all
    comms = InProcessSupervisorComms.__new__(InProcessSupervisorComms)
    from airflow.sdk.execution_time import task_runner

    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", comms, raising=False)
    assert turn.in_process() is True
    t = turn.cell_turn(FakeTI(0, {"prefill_0": "scheduled"}), Run(), ("prefill", 1))
    assert t.go == turn.GO_STATES and t.previous() in t.go


def test_the_cell_task_finds_its_turn_from_its_context(monkeypatch):
    """The DAG's cell tasks ask this module for their turn: the first decode instance's
    predecessor is the last of the prefill cells the prefill cell list mapped."""
    import airflow.sdk

    class CellTaskTI(FakeTI):
        def xcom_pull(self, **kw):
            if kw == {"task_ids": turn.cells_task_id("prefill")}:
                return [{}, {}, {}]  # the prefill cell list: three instances
            return super().xcom_pull(**kw)

    ti = CellTaskTI(0, {"prefill_2": "running"})
    monkeypatch.setattr(airflow.sdk, "get_current_context", lambda: {"ti": ti, "dag_run": Run()})
    t = turn.of_cell_task(after="prefill")
    assert t.name == "prefill[2]" and t.go == turn.ACROSS_GO_STATES
    assert turn.of_cell_task().name == ""  # decode[0] of a task with nothing before it


def test_a_turn_taken_and_left_says_when_and_tells_the_next_cell(caplog):
    told = []
    t = turn.CellTurn(lambda: "success", "decode[0]", lambda: told.append("released"))
    held = t.take()
    assert held["after"] == "decode[0]" and held["state"] == "success" and "began" in held
    assert t.leave(held, "8K x 1") is held and held["began"] <= held["ended"]
    assert told == ["released"]

    def gone():
        raise ConnectionError("API server gone")

    with pytest.raises(turn.TurnUnknown, match="could not learn whether decode\\[0\\]"):
        turn.CellTurn(gone, "decode[0]").take()
    turn.CellTurn(None, "", gone).leave({}, "8K x 1")  # logged, not raised
    assert "8K x 1: could not say the host is released: API server gone" in caplog.text
