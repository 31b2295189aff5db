"""Ctrl-C while a run cleans up: the cleanup finishes, then the interrupt is honoured.

Why: Ctrl-C on a terminal is SIGINT to the whole foreground process group, and an impatient
user presses it twice. The first interrupts the measuring; a second one during the teardown
would leave the server running and the host leased. Inside
:func:`finishing`, SIGINT and SIGTERM are noted, not raised; when the block ends, a noted
signal is raised as KeyboardInterrupt.

And an interrupt is an interrupt whatever the moment it lands: every interrupt our handlers
see is remembered (:func:`interrupted`), so that an error it causes on its way out (a cleanup
that fails because it was cut short) still ends the command as an interrupt, exit code 130
(``cli.main``); one that lands while the command is still importing, or as it exits, too
(``speedmatrix/__main__.py``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

EXIT_INTERRUPTED = 130
"""The shell's code for a command ended by SIGINT (128 + 2)."""

_seen: list[int] = []


def interrupted() -> bool:
    """Has an interrupt (SIGINT, or SIGTERM under :func:`terminate_as_interrupt`) been seen
    since :func:`catch_interrupts`?"""
    return bool(_seen)


def _raise_interrupt(signum: int, frame: object) -> None:
    _seen.append(signum)
    raise KeyboardInterrupt


def catch_interrupts() -> dict[int, object]:
    """From now on Ctrl-C raises KeyboardInterrupt by a handler that remembers it (main thread
    only); forgets earlier ones. Returns the handlers it replaced, for :func:`restore`."""
    _seen.clear()
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signal.SIGINT: signal.signal(signal.SIGINT, _raise_interrupt)}


def restore(handlers: dict[int, object]) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler)  # type: ignore[arg-type]


def note_only() -> None:
    """As the process exits: an interrupt is remembered, no longer raised (there is nothing
    left to stop, and a KeyboardInterrupt in the interpreter's shutdown is a traceback)."""

    def note(signum: int, frame: object) -> None:
        _seen.append(signum)

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, note)


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
        _seen.append(signum)

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

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)
        signal.signal(signal.SIGINT, _raise_interrupt)
