"""`airflow dags test speed_matrix` gets the demo's dag.test() rules from its wait_for_host
task on (issue #34 items 6-7): installed once per process, never over the demo's own."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import airflow.sdk.definitions.dag as dag_module
import pytest
from airflow.sdk.execution_time import task_runner
from waiting import poll_until

from speedmatrix.flows import dagtest


def _call_as(module: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), called from a frame of `module` (as the library or Airflow would call it)."""
    ns: dict[str, Any] = {"__name__": module}
    exec("def call(fn, *args):\n    return fn(*args)\n", ns)
    return ns["call"](fn, *args)


def _in_execute(fn: Callable[[], Any], *, via: tuple[str, ...]) -> Any:
    """fn() within Airflow's own call of a task's execute (task_runner._run_execute_callable),
    through frames of the modules `via`, outermost first."""

    def execute(context: Any) -> Any:
        call: Callable[[], Any] = fn
        for module in reversed(via):
            call = (lambda c, m: lambda: _call_as(m, c))(call, module)
        return call()

    task = SimpleNamespace(execution_timeout=None)
    return task_runner._run_execute_callable({}, execute, task)  # type: ignore[arg-type]


def _here() -> Any:
    return sys._getframe(1)


def _press_in_task_code(interrupt: dagtest.Interrupt) -> None:
    """Ctrl-C while the library runs within a task's execute."""
    _in_execute(lambda: interrupt.handler(2, _here()), via=("speedmatrix.loadgen.decode",))


def test_the_rules_are_installed_once_and_never_over_the_demos(monkeypatch) -> None:
    original = dag_module._run_task
    said: list[str] = []
    with dagtest.driving(dagtest.Interrupt(said.append)):
        assert dag_module._run_task is not original
        assert dagtest.install_for_process() is False  # the demo's rules stand
    assert dag_module._run_task is original
    monkeypatch.setattr(dagtest, "_installed", [])
    monkeypatch.setattr(dag_module, "_run_task", original)
    assert dagtest.install_for_process(said.append) is True
    assert dag_module._run_task is not original
    assert dagtest.install_for_process() is False
    interrupt = dagtest._installed[0]
    interrupt.in_task = True  # a task runs: the interrupt cuts its own code short
    with pytest.raises(KeyboardInterrupt):  # the first Ctrl-C interrupts the task it hits
        _press_in_task_code(interrupt)
    _press_in_task_code(interrupt)  # the second is put off: the teardown must finish
    assert interrupt.pressed and len(said) == 2
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_an_interrupt_between_tasks_lets_dag_test_go_on_to_the_teardown() -> None:
    """Raised in dag.test's own loop, the interrupt would end it with the server running."""
    said: list[str] = []
    interrupt = dagtest.Interrupt(said.append)
    interrupt.handler(2, None)  # no task runs: noted, not raised
    assert interrupt.pressed and said == [
        "interrupted: stopping the server and releasing the lease (Ctrl-C again: no effect)"
    ]


def test_the_task_s_own_code_is_told_from_airflow_s_steps_around_it() -> None:
    """Only within the operator's execute, and only where the library or the DAG file (not
    Airflow, not SQLAlchemy, even called by the task) runs, may the interrupt be raised."""
    ours, dag_file = "speedmatrix.loadgen.decode", "unusual_prefix_0123abcd_speed_matrix"

    def check() -> bool:
        return dagtest.in_task_code(sys._getframe())

    assert _in_execute(check, via=(ours,)) is True
    assert _in_execute(check, via=(dag_file,)) is True
    assert _in_execute(check, via=(ours, "json")) is True  # what the library calls is its own
    # Airflow's in-process API, or its database session, called by the task: not cut there
    assert _in_execute(check, via=(ours, "airflow.sdk.execution_time.supervisor")) is False
    assert _in_execute(check, via=(ours, "sqlalchemy.orm.session")) is False
    assert _in_execute(check, via=("airflow.providers.standard.operators.python",)) is False
    assert _call_as(ours, check) is False  # ours, but no task's execute around it
    assert dagtest.in_task_code(None) is False


def test_an_interrupt_in_airflow_s_steps_is_tried_again_until_the_task_s_code_runs() -> None:
    """Ctrl-C while Airflow queues the task (its state update) is put off, not lost: it comes
    back every RETRY_S, and cuts the task once the task's own code runs; the user's second
    Ctrl-C is then put off as before, and a cut left due when the task ended is dropped."""
    said: list[str] = []
    interrupt = dagtest.Interrupt(said.append)
    interrupt.in_task = True
    came: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        _call_as("sqlalchemy.orm.session", lambda: interrupt.handler(2, _here()))
        assert interrupt.pressed and interrupt.cutting and len(said) == 1
        poll_until(lambda: came, 10, every_s=dagtest.RETRY_S / 5)  # the re-sent signal
        assert came == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)
    with pytest.raises(KeyboardInterrupt):  # put off, it cuts the task once its code runs
        _press_in_task_code(interrupt)
    assert not interrupt.cutting and len(said) == 1  # one press, said once
    _press_in_task_code(interrupt)
    assert said[-1].startswith("interrupt noted")  # the second: put off, not raised
    interrupt.cutting, interrupt.in_task = True, False  # the task ended before the retry came
    interrupt.handler(2, None)
    assert not interrupt.cutting
