"""What a run is doing, told to whoever in this process listens: the terminal of `make demo`.

Why: under dag.test (`make demo`, `airflow dags test`) every task body runs in the test's own
process, so the demo can show the run as `speedmatrix run` does (cells done, the current cell,
time left) from the steps themselves, with Airflow's own log in a file. In a deployment nobody
listens (each task runs in a worker process of its own) and telling costs nothing. A listener
that fails is logged and never fails the step.

Events (a listener implements those it wants): ``step(text)``, ``planned(resolved, planned)``,
``cell_started(resolved, server, cell)``, ``cell_done(cell, record)``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("speedmatrix.pipeline")

_listeners: list[Any] = []


@contextlib.contextmanager
def listening(listener: Any) -> Iterator[Any]:
    """Tell `listener` what the run's steps do in this process while the block runs."""
    _listeners.append(listener)
    try:
        yield listener
    finally:
        _listeners.remove(listener)


def tell(event: str, *args: Any) -> None:
    for listener in list(_listeners):
        method = getattr(listener, event, None)
        if method is None:
            continue
        try:
            method(*args)
        except Exception as exc:  # a display must never fail a step
            log.warning("progress listener %s failed on %s: %s", listener, event, exc)
