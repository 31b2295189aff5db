"""A cell's turn on its host: the cell task starts while the previous cell measures.

Why: a cell task's start is Airflow's cost (the scheduler's hand-off, a new process, the DAG
file, the task runner, our imports), and with one cell task at a time the GPU host sits idle for
all of it at every hand-off: 27.9 s over the 23 cells of the reference matrix (benchmarks/
README.md). The DAG lets two instances of a mapped cell task run at once
(`max_active_tis_per_dagrun=2`); the second one starts, imports, and then waits here until the
cell before it in map index order (the plan's run order) has left the host. So the host still
measures one cell at a time, in the plan's order, and a hand-off costs it 0.09-0.15 s
(median, measured with the "released" word below: one XCom push, then one poll of the next).

The rule, from the previous instance's state (Airflow's, read through the execution API):
- queued, running or any other live state: wait; it holds (or is about to hold) the host.
  It cannot wait forever: a cell bounds itself, its task has an execution timeout, and a task
  whose worker died is failed by the scheduler's heartbeat timeout. The waiting task holds a
  worker slot; the one it waits for was queued before it (the scheduler queues in map index
  order) and executors start queued tasks in order (LocalExecutor's queue, Celery's FIFO
  queue), so it has a slot. An executor that let the later instance take the last free slot
  first would leave it waiting until its execution timeout: not seen, and said here.
- running, and it has said "released" (below): go.
- finished (success, failed, skipped, upstream_failed, removed): go.
- not started (None, scheduled): go. The real scheduler queues a mapped task's instances in
  map index order (scheduler_job_runner orders by map_index), so a later cell never runs while
  its predecessor is merely scheduled; `dag.test()` does, since it runs mapped instances one at
  a time in no set order, and there waiting would never end. Cells one at a time hold there
  anyway (one process runs them in turn).

Across the two cell tasks: `prefill` maps the cells at the head of the run order and
`decode` the rest, so the first decode cell's predecessor is the last prefill cell. With an
Airflow edge (`decode` waiting for `prefill`) the host would sit idle at that one boundary
for a whole task start-up (0.71-1.52 s measured, the largest hand-off of a run). So
the two tasks are siblings and the first decode instance starts with the prefill cells and
waits here for the last one, as a cell waits for the one before it in its own task. Its
predecessor is then of another task, and a not-started one (None: not yet expanded, or
scheduled) is waited for: the order between two tasks' instances is the scheduler's priority
(`prefill` weighs more) and whatever slot each found, not map index order. The one exception
is dag.test(), which runs every task in its own process one at a time (:func:`in_process`):
there a predecessor not started starts only after this task, and waiting would never end.

The previous cell also says "released" as soon as it has left the host (an XCom it pushes when
its turn ends, :func:`cell_turn`), so the next one need not wait for its task's end to reach
the API server (its result's XCom push, then its state: ~0.15 s per hand-off). That
word is trusted only from a predecessor whose state is `running` and whose DAG run has not been
cleared since (the XCom carries the run's clear_number): a "released" left by an earlier try of
a cleared cell, which its next try erases only once it starts, is never taken for this try's.

This module owns the turn whole: the DAG's cell tasks get theirs from :func:`of_cell_task`
and hand it to `matrix.run_cell`, which takes it (:meth:`CellTurn.take`) and leaves it
(:meth:`CellTurn.leave`) around its measurement; how many instances run at once and which task
is queued first are named here too (:data:`INSTANCES_AT_ONCE`, :data:`EARLIER_TASK_PRIORITY`).
Pure of Airflow but for :func:`cell_turn` and :func:`of_cell_task`, so the rule is
unit-tested as is.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

log = logging.getLogger("speedmatrix.turn")

RELEASED = "released"
"""What the reader says for a running predecessor that has left the host (not an Airflow state)."""
RELEASED_KEY = "speedmatrix_turn_released"
FINISHED = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})
GO_STATES = FINISHED | {None, "scheduled", RELEASED}
"""What lets a cell go when its predecessor is the previous instance of its own task."""
ACROSS_GO_STATES = FINISHED | {RELEASED}
"""... when its predecessor is another task's instance (the first decode cell after the last
prefill cell): one not started yet is waited for."""
POLL_S = 0.1
"""How often the waiting cell reads its predecessor's state, one read of the execution API each
time (a GET the supervisor makes; ~300 over a 30 s window), two while the predecessor runs (its
"released" XCom too). Measured: median hand-off 0.25 s at a 0.25 s poll,
0.22-0.26 s at 0.1 s waiting for the previous task's end to reach the API server, 0.09-0.15 s
with the "released" word."""
PROGRESS_EVERY_S = 30.0
INSTANCES_AT_ONCE = 2
"""A cell task's instances running at once (`max_active_tis_per_dagrun`): one measuring, the
next one starting and waiting for its turn."""
EARLIER_TASK_PRIORITY = 2
"""The priority weight of the cell task whose cells come first in the run order (`prefill`;
the default is 1): the scheduler queues by weight, and a later task's first cell waits for the
earlier task's last one, so the earlier task must have its slot first."""


def cells_task_id(cell_task_id: str) -> str:
    """The task that lists a cell task's cells (its map's input): how many instances the cell
    task maps, so that the next cell task's first instance knows its predecessor."""
    return f"{cell_task_id}_cells"


class TurnUnknown(RuntimeError):
    """The previous cell's state could not be read: the cell fails rather than measure beside
    a cell that may still be running."""


def wait_for_turn(
    previous_state: Callable[[], str | None] | None,
    previous: str = "the previous cell",
    *,
    go: frozenset[str | None] = GO_STATES,
    poll_s: float | None = None,
    progress_every_s: float = PROGRESS_EVERY_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Block until the previous cell leaves the host; say what happened.

    Returns {"after": previous or None, "waited_s", "state"} (the state that let it go), which
    the cell's result carries so the run shows each hand-off. A predecessor whose state cannot
    be read (the API failing) is not waited for blindly: the error is raised, the cell fails
    and says why (measuring beside a running cell would give numbers that are wrong)."""
    if previous_state is None:
        return {"after": None, "waited_s": 0.0, "state": None}
    poll_s = POLL_S if poll_s is None else poll_s
    t0 = clock()
    next_note = t0 + progress_every_s
    while True:
        state = previous_state()
        state = None if state is None else str(state)
        if state in go:
            return {"after": previous, "waited_s": round(clock() - t0, 3), "state": state}
        now = clock()
        if now >= next_note:
            log.info("waiting for %s to finish (%s) for %.0f s", previous, state, now - t0)
            next_note = now + progress_every_s
        sleep(poll_s)


class CellTurn(NamedTuple):
    """A cell task's side of the turn, handed whole from the DAG to `matrix.run_cell`, which
    only takes it and leaves it.

    `previous` reads the previous cell's state (None for the first one), `name` names it, `go`
    are the states that let this cell go (:data:`GO_STATES`, or :data:`ACROSS_GO_STATES` for a
    predecessor of another task), `release` tells the next cell that this one has left the
    host (None: nobody to tell, e.g. outside Airflow)."""

    previous: Callable[[], str | None] | None = None
    name: str = ""
    release: Callable[[], None] | None = None
    go: frozenset[str | None] = GO_STATES

    def take(self) -> dict[str, Any]:
        """Wait until the previous cell has left the host, then hold it: returns what the
        cell's result carries about its turn (:func:`wait_for_turn`'s, and `began`).

        Raises TurnUnknown, naming the previous cell, when its state cannot be read."""
        try:
            held = wait_for_turn(self.previous, self.name, go=self.go)
        except Exception as exc:
            raise TurnUnknown(
                f"could not learn whether {self.name} had finished: {type(exc).__name__}: {exc}"
            ) from exc
        held["began"] = stamp()
        return held

    def leave(self, held: dict[str, Any], label: str = "") -> dict[str, Any]:
        """Say that this cell has left the host: `held` (from :meth:`take`) gets `ended`, and
        the next cell hears it now rather than at this task's end. A word that cannot be said
        is logged, not raised: the measurement stands, and the next cell then goes on this
        task's end."""
        held["ended"] = stamp()
        if self.release is not None:
            try:
                self.release()
            except Exception as exc:
                log.warning("%s: could not say the host is released: %s", label, exc)
        return held


NO_TURN = CellTurn()
"""A cell run outside a mapped task: nobody before it, nobody to tell."""


def cell_turn(ti: Any, dag_run: Any = None, after: tuple[str, int] | None = None) -> CellTurn:
    """The turn of the running mapped cell task instance `ti` (airflow.sdk's
    RuntimeTaskInstance: get_task_states, xcom_pull and xcom_push ask the API server).

    The previous cell is the instance before `ti` in map index order. The first instance's is
    the last of `after` = (task id, how many instances it maps), the cell task whose cells
    come before this task's in the run order (decode's: prefill's); none when `after` maps
    none, or is not given, and none for an unmapped task. `dag_run` (the task's context's)
    gives the run's clear_number."""
    clears = int(getattr(dag_run, "clear_number", 0) or 0)

    def release() -> None:
        ti.xcom_push(RELEASED_KEY, {"clear_number": clears, "at": stamp()})

    index = getattr(ti, "map_index", -1)
    if index is not None and index > 0:
        task_id, prev, go = ti.task_id, index - 1, GO_STATES
    elif index == 0 and after is not None and after[1] > 0:
        task_id, prev = after[0], after[1] - 1
        go = GO_STATES if in_process() else ACROSS_GO_STATES
    else:
        return CellTurn(None, "", release)
    key = f"{task_id}_{prev}"  # how the execution API names a mapped instance

    def read() -> str | None:
        states = ti.get_task_states(
            dag_id=ti.dag_id, map_index=prev, task_ids=[task_id], run_ids=[ti.run_id]
        )
        state = (states.get(ti.run_id) or {}).get(key)
        if state != "running":
            return state
        said = ti.xcom_pull(task_ids=task_id, key=RELEASED_KEY, map_indexes=prev)
        if isinstance(said, dict) and said.get("clear_number") == clears:
            return RELEASED
        return state

    return CellTurn(read, f"{task_id}[{prev}]", release, go)


def of_cell_task(after: str | None = None) -> CellTurn:
    """The turn of the running mapped cell task (Airflow's current context), for the DAG's
    cell tasks to hand to `matrix.run_cell`.

    `after`: the cell task whose cells come before this task's in the run order (decode's:
    prefill); its last instance is this task's first instance's predecessor, and how many it
    maps is the length of its cell list (:func:`cells_task_id`)."""
    from airflow.sdk import get_current_context

    ctx = get_current_context()
    ti = ctx["ti"]
    before = None
    if after is not None and ti.map_index == 0:
        before = (after, len(ti.xcom_pull(task_ids=cells_task_id(after)) or []))
    return cell_turn(ti, ctx["dag_run"], before)


def in_process() -> bool:
    """True under dag.test() (and `airflow dags test`): Airflow runs each task in the test's
    own process, one at a time, through its in-process supervisor, instead of a process of
    its own beside others."""
    try:
        from airflow.sdk.execution_time import task_runner
        from airflow.sdk.execution_time.supervisor import InProcessSupervisorComms
    except ImportError:  # another Airflow: not the test runner we know
        return False
    return isinstance(getattr(task_runner, "SUPERVISOR_COMMS", None), InProcessSupervisorComms)


def stamp() -> str:
    """Now, UTC, ISO 8601: when a cell's hold on the host began or ended."""
    return dt.datetime.now(dt.UTC).isoformat()
