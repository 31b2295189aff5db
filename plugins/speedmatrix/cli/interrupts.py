"""Ctrl-C while a run cleans up: the cleanup finishes, then the interrupt is honoured.

Why: Ctrl-C on a terminal is SIGINT to the whole foreground process group, and an impatient
user presses it twice. The first interrupts the measuring; a second one during the teardown
would leave the server running and the host leased. Inside
:func:`finishing`, SIGINT and SIGTERM are noted, not raised; when the block ends, a noted
signal is raised as KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def finishing(say: object = None) -> Iterator[None]:
    """Run the block to its end whatever Ctrl-C is pressed meanwhile (main thread only).
    `say(text)`: told once when an interrupt is put off."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []

    def note(signum: int, frame: object) -> None:
        if not noted and callable(say):
            say("interrupt noted: finishing the cleanup first (stopping the server, the lease)")
        noted.append(signum)

    before = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    if noted:
        raise KeyboardInterrupt


def terminate_as_interrupt() -> None:
    """SIGTERM (a CI job cancelled, `kill`) ends the run as Ctrl-C does: through the cleanup,
    not by dying at once with the server left running. And Ctrl-C itself raises at once, by a
    handler of ours: under Python's default one, asyncio.run (which measures each cell) turns
    SIGINT into a cancellation of the cell's task, which a cell awaiting its own subtasks may
    absorb, and the run would go on as if nothing was pressed."""

    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_interrupt)
        signal.signal(signal.SIGINT, raise_interrupt)
