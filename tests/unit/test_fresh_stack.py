"""flows.fresh_stack: the work after the host's stop runs on a thread of its own (issue #19)."""

from __future__ import annotations

import contextvars
import threading

import pytest

from speedmatrix.flows.fresh_stack import on_fresh_stack, run_on_fresh_stack

WHO = contextvars.ContextVar("who", default="nobody")


def test_the_work_runs_on_another_thread_with_the_callers_context_and_returns_its_value():
    WHO.set("the task")

    def work(a, b=0):
        return threading.current_thread() is not threading.main_thread(), WHO.get(), a + b

    assert run_on_fresh_stack(work, 2, b=3) == (True, "the task", 5)


def test_the_works_exception_is_raised_in_the_caller_as_it_was():
    class Refused(RuntimeError):
        pass

    @on_fresh_stack
    def fails(what):
        """Docstring kept."""
        raise Refused(what)

    with pytest.raises(Refused, match="regression in 64Kx2") as info:
        fails("regression in 64Kx2")
    assert any(entry.name == "fails" for entry in info.traceback)  # where it was raised
    assert fails.__name__ == "fails" and fails.__doc__ == "Docstring kept."


def test_the_task_bodies_after_the_stop_run_on_a_fresh_stack(monkeypatch):
    """validate, land, report, regressions and the site's refresh do their work off the task's
    main thread (where the Celery worker's deep stack made validation thrash)."""
    from speedmatrix.flows import matrix, site

    class Seen(Exception):
        pass

    def seen(*_args, **_kwargs):
        raise Seen(threading.current_thread().name)

    monkeypatch.setattr(matrix, "warehouse_of", seen)
    monkeypatch.setattr(matrix, "collect_cells", seen)
    resolved = {"run_id": "r", "warehouse": "/nonexistent"}
    # what `validate` hands `land` (contracts.VALIDATED, checked before any work), empty
    validated = {
        "run": {},
        "cells": [],
        "requests": [],
        "repeats": [],
        "quarantined": [],
        "gx_results": "",
    }
    calls = {
        "validate": lambda: matrix.validate(resolved, {}, {}, {"prefill": [], "decode": []}, []),
        "land": lambda: matrix.land(resolved, validated),
        "report": lambda: matrix.report(resolved, {"run_id": "r"}),
        "regressions": lambda: matrix.regressions(resolved, {"run_id": "r"}),
        "refresh": lambda: site.refresh(resolved),
    }
    for name, call in calls.items():
        with pytest.raises(Seen) as info:
            call()
        assert str(info.value) == f"fresh-stack:{name}", name
