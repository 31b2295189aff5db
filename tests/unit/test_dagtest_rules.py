"""`airflow dags test speed_matrix` gets the demo's dag.test() rules from its wait_for_host
task on (issue #34 items 6-7): installed once per process, never over the demo's own."""

from __future__ import annotations

import airflow.sdk.definitions.dag as dag_module

from speedmatrix.flows import dagtest


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
    interrupt.in_task = True  # a task runs: the interrupt cuts it short
    try:
        interrupt.handler(2, None)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the first Ctrl-C interrupts the task it hits")
    interrupt.handler(2, None)  # the second is put off: the teardown must finish
    assert interrupt.pressed and len(said) == 2
    import signal

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
