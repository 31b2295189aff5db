"""Waiting on a condition in the tests: one poll loop, never a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def poll_until(predicate: Callable[[], object], within_s: float, every_s: float = 0.05) -> bool:
    """Whether ``predicate()`` holds within ``within_s`` (tried every ``every_s``, and once more
    at the deadline); the caller asserts what it waited for, so its message stays its own."""
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(every_s)
    return True
