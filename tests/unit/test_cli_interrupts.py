"""Ctrl-C during a cell ends `speedmatrix run` (through its cleanup), whatever the cell's code
does with a cancellation: under Python's default SIGINT handler, asyncio.run turns the signal
into a cancellation of the main task, and a cell awaiting its own subtasks under
`suppress(CancelledError)` absorbs it, so the run went on and exited 0 (seen in the pty test
under load)."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import pytest

from speedmatrix.cli.interrupts import terminate_as_interrupt
from speedmatrix.loadgen.runner import run_loop


async def _cell_that_absorbs_a_cancellation() -> str:
    """What a cell's cleanup does: wait for a subtask, a cancellation of its own ignored."""
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, signal.raise_signal, signal.SIGINT)  # Ctrl-C while it waits
    sub = asyncio.ensure_future(asyncio.sleep(0.5))
    with contextlib.suppress(asyncio.CancelledError):
        await sub
    return "measured"


@pytest.fixture
def restored_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def test_under_the_default_handler_a_cell_absorbs_ctrl_c(restored_handlers) -> None:
    """Why the command installs a handler of its own: this is what it guards against."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert run_loop(_cell_that_absorbs_a_cancellation()) == "measured"


def test_the_commands_handler_raises_out_of_the_cell(restored_handlers) -> None:
    terminate_as_interrupt()
    with pytest.raises(KeyboardInterrupt):
        run_loop(_cell_that_absorbs_a_cancellation())
    assert signal.getsignal(signal.SIGTERM) is signal.getsignal(signal.SIGINT)


def test_an_error_an_interrupt_causes_is_still_an_interrupt(monkeypatch, capsys) -> None:
    """Issue #42 item 15: a cleanup cut short by Ctrl-C fails in its own way (an event loop
    closed, a session gone); the command still ends as interrupted, 130, in one line."""
    import os
    import signal

    from speedmatrix import cli
    from speedmatrix.cli import warehouse as warehouse_cli

    def command(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the terminal sends it
            for _ in range(10**7):  # the handler runs at the next bytecode
                pass
        except KeyboardInterrupt:
            raise RuntimeError("Event loop is closed") from None
        return 0

    monkeypatch.setattr(warehouse_cli, "cmd_query", command)
    assert cli.main(["query", "SELECT 1"]) == 130
    err = capsys.readouterr().err
    assert err == "speedmatrix: interrupted\n", err

    # and an error with no interrupt behind it is still the error
    def failing(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(warehouse_cli, "cmd_query", failing)
    capsys.readouterr()
    assert cli.main(["query", "SELECT 1"]) == 1  # a bug: its traceback, exit 1 (issue #41)
    err = capsys.readouterr().err
    assert "RuntimeError: a bug" in err and "internal error (traceback above)" in err


def test_the_process_end_closes_every_warehouse_connection(tmp_path) -> None:
    """Issue #42 item 14: what a command opened is closed before the process exits
    (cli.exiting.close_native), a DuckDB connection first among them."""
    from speedmatrix.cli.exiting import close_native
    from speedmatrix.store import query
    from speedmatrix.store.warehouse import Warehouse

    a, b = Warehouse(str(tmp_path / "a")), Warehouse(str(tmp_path / "b"))
    assert a.query_arrow("SELECT 1 AS one").num_rows == 1
    assert b.query_arrow("SELECT 2 AS two").num_rows == 1
    assert a._con is not None and b._con is not None
    close_native()
    assert a._con is None and b._con is None and len(query._OPEN) == 0
    assert a.query_arrow("SELECT 1 AS one").num_rows == 1  # a later query opens anew
    a.close()
