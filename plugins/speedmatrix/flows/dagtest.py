"""dag.test() as `make demo` needs it: cells in the documented order, Ctrl-C that cleans up.

Why: dag.test() (Airflow 3.3) runs the task instances it found ready in set order, so mapped
cells ran in no fixed order (a later context's prefill found its prompt warm and was
measured twice), and a Ctrl-C only failed the task it hit: the loop went on, or left it with
the simulator running and the host leased. Within :func:`driving`, each task instance goes
through :func:`_run_in_order`:

- a `prefill` / `decode` cell waits (is put off to the loop's next pass) while a cell before
  it in the run order (prefill's map indexes, then decode's: plan.task_cells) is scheduled;
- after Ctrl-C (or SIGTERM) no task runs but the teardown `stop_server`: every other one is
  marked upstream_failed, so the run ends, its server stopped and its lease released, and a
  second Ctrl-C while that happens is put off. The interrupt cuts short only a task that runs
  (never the teardown), and only within the task's own code: caught in Airflow's steps around
  it (state updates, database sessions) it is tried again every RETRY_S. Between tasks it is
  noted and dag.test's loop goes on, since raised there it would end dag.test with the server
  running. The demo then runs the teardown once more (idempotent), whatever the DAG's
  teardown did.

`make demo` drives dag.test() within :func:`driving`; a bare `airflow dags test speed_matrix`
gets the same rules from its `wait_for_host` task on (:func:`install_for_process`), and were the
process killed outright, its lease names it as gone and the next run takes the host over.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

UNUSUAL_MODULE_PREFIX = "unusual_prefix_"  # how Airflow names a DAG file's module (DagBag)

CELL_TASKS = ("prefill", "decode")  # in run order (dags/speed_matrix.py, plan.task_cells)
TEARDOWN = "stop_server"
RETRY_S = 0.05  # how soon an interrupt put off (Airflow's own code was running) is tried again


class Interrupt:
    """Whether Ctrl-C was pressed during the run, and what to say when it is."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.pressed = False
        self.say = say
        self.in_task = False  # a task instance runs (inside dag.test's _run_task)
        self.cutting = False  # a cut is due and put off until the task's own code runs

    def handler(self, signum: int, frame: FrameType | None) -> None:
        first = not self.pressed
        if first:
            self.pressed = True
            self.say(
                "interrupted: stopping the server and releasing the lease (Ctrl-C again: no effect)"
            )
        elif not self.cutting:
            self.say("interrupt noted: the server is being stopped and the lease released")
        # Only a running task is cut short; between tasks dag.test's loop goes on, and its
        # next pass runs nothing but the teardown. Raised there, the interrupt would end
        # dag.test (and a bare `airflow dags test`) with the server running and the host leased.
        if not self.in_task:
            self.cutting = False
            return
        if not (first or self.cutting):
            return  # the second Ctrl-C: put off, the teardown must finish
        if in_task_code(frame):
            self.cutting = False
            raise KeyboardInterrupt
        # Airflow's own steps around the task (its state updates, the in-process API's
        # database session) are running: raised there, the interrupt left the task instance
        # detached from its session and ended dag.test before the teardown (SQLAlchemy's
        # DetachedInstanceError). Tried again shortly, until the task's own code runs or the
        # task has ended (then the loop's next pass runs the teardown alone).
        self.cutting = True
        timer = threading.Timer(RETRY_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()


def in_task_code(frame: FrameType | None) -> bool:
    """Whether `frame` is the task's own code (the DAG file's or the library's, within the
    operator's execute), not Airflow's or SQLAlchemy's, so an exception raised there unwinds
    through the task's execute as a task's failure does."""
    from airflow.sdk.execution_time import task_runner

    execute = task_runner._run_execute_callable.__code__
    ours = False  # a frame of ours seen, before any of Airflow's, from the innermost out
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not ours:
            if module.startswith(("airflow", "sqlalchemy")):
                return False  # Airflow's own work, even when the task called it
            ours = module.startswith(("speedmatrix", UNUSUAL_MODULE_PREFIX))
        if frame.f_code is execute:
            return ours
        frame = frame.f_back
    return False


def _earlier_cell_scheduled(ti: Any) -> bool:
    """Whether a cell before `ti` in the run order is scheduled in its DAG run."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState

    mine = (CELL_TASKS.index(ti.task_id), ti.map_index)
    with create_session() as session:
        rows = (
            session.query(TaskInstance.task_id, TaskInstance.map_index)
            .filter(
                TaskInstance.dag_id == ti.dag_id,
                TaskInstance.run_id == ti.run_id,
                TaskInstance.task_id.in_(CELL_TASKS),
                TaskInstance.state == TaskInstanceState.SCHEDULED,
            )
            .all()
        )
    return any((CELL_TASKS.index(t), m) < mine for t, m in rows)


_installed: list[Interrupt] = []
_kept: list[Any] = []


def install_for_process(say: Callable[[str], None] | None = None) -> bool:
    """The rules above for the rest of this dag.test() process (`airflow dags test`), unless
    the demo's :func:`driving` or an earlier call installed them. True when installed now."""
    if _installed or threading.current_thread() is not threading.main_thread():
        return False
    import logging

    interrupt = Interrupt(say or logging.getLogger("speedmatrix.pipeline").warning)
    rules = driving(interrupt)
    rules.__enter__()  # left only as the process ends
    _kept.append(rules)  # (a context manager collected would leave, restoring Airflow's)
    # left before the interpreter tears its modules down: a generator closed by the garbage
    # collector at that point finds this module's globals gone, and says so on stderr
    import atexit

    atexit.register(rules.__exit__, None, None, None)
    return True


@contextlib.contextmanager
def driving(interrupt: Interrupt) -> Iterator[None]:
    """dag.test() with the order and the interrupt rules above, for the block's length."""
    import airflow.sdk.definitions.dag as dag_module
    from airflow.utils.state import TaskInstanceState

    original = dag_module._run_task
    _installed.append(interrupt)

    def _run_in_order(*, ti: Any, task: Any, run_triggerer: bool = False) -> Any:
        if interrupt.pressed and ti.task_id != TEARDOWN:
            ti.set_state(TaskInstanceState.UPSTREAM_FAILED)
            return None
        if ti.task_id in CELL_TASKS and _earlier_cell_scheduled(ti):
            return None  # stays scheduled: the loop's next pass runs it, after that cell
        interrupt.in_task = ti.task_id != TEARDOWN  # the teardown is never cut short
        try:
            return original(ti=ti, task=task, run_triggerer=run_triggerer)
        except KeyboardInterrupt:
            # _run_task catches Exception only: an interrupt in its own steps around the task
            # (state updates, logging) ends here, the task failed, so the loop goes on to the
            # teardown
            with contextlib.suppress(Exception):
                ti.set_state(TaskInstanceState.FAILED)
            return None
        finally:
            interrupt.in_task = False

    main = threading.current_thread() is threading.main_thread()
    before = {}
    if main:
        before = {s: signal.signal(s, interrupt.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    dag_module._run_task = _run_in_order
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # a test may have put another list in place
            _installed.remove(interrupt)
        dag_module._run_task = original
        for s, handler in before.items():
            signal.signal(s, handler)
