"""Run a task body's work on a thread of its own, whose Python frame stack starts empty.

Why: CPython 3.11 keeps a thread's frames in 16 KiB chunks,
maps a new chunk when a call does not fit the current one and unmaps it as soon as the first
frame in it returns. A hot loop whose calls cross a chunk's edge maps and unmaps a chunk on
every call. Where the edges fall depends on how deep the task body starts, and under the Celery
worker it starts deeper than under the LocalExecutor (Celery's pool loop, Airflow's workload
runner and the task supervisor sit below it in the forked task process). There, `validate`
crosses an edge on almost every call of a hot loop: 80,134 mmap/munmap pairs of 16 KiB in one
validation of the 55-cell published run (strace -c), 86-92 thousand page faults and 0.6-0.7 s
of system time, 1.5-2.0 s to validate against 0.65-0.9 s under the LocalExecutor. The same call
on a fresh thread in the same Celery task: one mmap, 7 thousand faults, 0.94 s. On a thread of
its own, where the edges fall depends only on our code and its libraries: the same under every
executor, `dag.test()` and the command line.

The work runs in a copy of the caller's context (contextvars: the task's log context goes with
it), on a daemon thread (a task killed or timed out in its main thread does not wait for it);
its result is returned and its exception raised in the caller.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def run_on_fresh_stack(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs) on a new thread; its result, or its exception raised here."""
    context = contextvars.copy_context()
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = context.run(fn, *args, **kwargs)
        except BaseException as exc:  # handed to the caller, who raises it
            outcome["error"] = exc

    thread = threading.Thread(target=work, name=f"fresh-stack:{fn.__name__}", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def on_fresh_stack(fn: Callable[P, T]) -> Callable[P, T]:
    """Decorator: every call of fn runs on a fresh stack (run_on_fresh_stack)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        return run_on_fresh_stack(fn, *args, **kwargs)

    return wrapper
