"""The retry bounds (issue #41): the hosts' reconnects and the warehouse's commit conflicts are
tenacity policies with the bounds the hand-written loops had. Each policy is the one the code
runs (not a copy), driven with real exception types and a recorded sleep instead of waiting."""

from __future__ import annotations

import pytest
from deltalake.exceptions import CommitFailedError

from speedmatrix.engine.hosts import LocalHost, base, get_host
from speedmatrix.engine.hosts.base import (
    RETRIES,
    CommandError,
    CommandResult,
    HostConnectionError,
    backoff,
    reconnecting,
)
from speedmatrix.store.delta import MAX_ATTEMPTS, CommitConflictError, with_retries


class Flaky:
    """Fails with ``exc`` the first ``failures`` calls, then answers "ok"."""

    def __init__(self, failures: int, exc: BaseException) -> None:
        self.failures, self.exc, self.calls = failures, exc, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return "ok"


def test_a_dropped_connection_is_retried_up_to_three_tries_waiting_2_then_4_s():
    slept: list[float] = []
    flaky = Flaky(RETRIES - 1, HostConnectionError("dropped"))
    assert reconnecting("h", RETRIES, sleep=slept.append)(flaky) == "ok"
    assert RETRIES == 3 and flaky.calls == 3 and slept == [2, 4]


def test_past_three_tries_the_connection_error_itself_is_raised():
    slept: list[float] = []
    flaky = Flaky(99, HostConnectionError("dropped"))
    with pytest.raises(HostConnectionError, match="dropped"):
        reconnecting("h", RETRIES, sleep=slept.append)(flaky)
    assert flaky.calls == 3 and slept == [2, 4]


def test_waits_are_capped_at_5_s_and_a_step_that_is_not_idempotent_runs_once():
    slept: list[float] = []
    reconnecting("h", 5, sleep=slept.append)(Flaky(4, HostConnectionError("x")))
    assert slept == [2, 4, 5, 5]
    once = Flaky(99, HostConnectionError("x"))
    with pytest.raises(HostConnectionError):
        reconnecting("h", 1, sleep=slept.append)(once)
    assert once.calls == 1


def test_a_command_that_failed_is_not_a_connection_problem_and_is_not_retried():
    flaky = Flaky(1, CommandError("h", "false", CommandResult(1, "", "")))
    with pytest.raises(CommandError):
        reconnecting("h", RETRIES, sleep=lambda s: None)(flaky)
    assert flaky.calls == 1


def test_each_retry_runs_the_hook_before_it_sleeps():
    seen: list[str] = []
    reconnecting(
        "h", RETRIES, sleep=lambda s: seen.append("sleep"), before=lambda: seen.append("reset")
    )(Flaky(2, HostConnectionError("x")))
    assert seen == ["reset", "sleep", "reset", "sleep"]


def test_a_commit_conflict_is_retried_then_lands():
    slept: list[float] = []
    flaky = Flaky(5, CommitFailedError("lost to a concurrent commit"))
    assert with_retries("landing", flaky, sleep=slept.append) == "ok"
    assert flaky.calls == 6 and len(slept) == 5
    # jittered, growing with the attempt: 0.05-0.2 s for the first three, doubled from the 4th
    assert all(0.05 <= s <= 0.2 for s in slept[:3]) and all(0.1 <= s <= 0.4 for s in slept[3:])


def test_conflicts_past_the_attempts_bound_are_a_commit_conflict_error():
    flaky = Flaky(999, CommitFailedError("conflict"))
    with pytest.raises(CommitConflictError, match=f"after {MAX_ATTEMPTS} attempts"):
        with_retries("landing", flaky, sleep=lambda s: None)
    assert MAX_ATTEMPTS == 40 and flaky.calls == 40


def test_conflicts_past_the_time_bound_stop_early():
    flaky = Flaky(999, CommitFailedError("conflict"))
    with pytest.raises(CommitConflictError, match="after 1 attempts"):
        with_retries("landing", flaky, max_wait_s=0, sleep=lambda s: None)
    assert flaky.calls == 1


def test_an_error_that_is_not_a_conflict_is_raised_at_once():
    flaky = Flaky(1, OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        with_retries("landing", flaky, sleep=lambda s: None)
    assert flaky.calls == 1


def test_each_lost_commit_is_logged_before_it_is_tried_again(caplog):
    """What the concurrency tests count to know writers did contend (tests/contention.py):
    one INFO record of speedmatrix.store.delta per lost commit, naming what and the attempt."""
    caplog.set_level("INFO", logger="speedmatrix.store.delta")
    with_retries("landing into t", Flaky(2, CommitFailedError("lost")), sleep=lambda s: None)
    lost = [r for r in caplog.records if r.name == "speedmatrix.store.delta"]
    assert [r.getMessage() for r in lost] == [
        "landing into t: lost commit attempt 1 to another writer's; trying again",
        "landing into t: lost commit attempt 2 to another writer's; trying again",
    ]
    caplog.clear()
    with_retries("landing into t", Flaky(0, CommitFailedError("lost")), sleep=lambda s: None)
    assert not [r for r in caplog.records if r.name == "speedmatrix.store.delta"]


class _DropsTwice(LocalHost):
    """The local transport whose first two text copies lose their connection."""

    drops = 2

    def _put_text(self, text: str, remote: str, mode: int) -> None:
        if self.drops:
            self.drops -= 1
            raise HostConnectionError("dropped")
        super()._put_text(text, remote, mode)


def test_a_host_waits_the_reconnect_pause_it_was_given(tmp_path, monkeypatch):
    """`get_host(..., reconnect_pause_s=p)`: the n-th wait is n * p, at most 2.5 * p (the
    default p of 2 s gives 2, 4, then 5 s); a test or an impatient caller sets it small."""
    slept: list[float] = []
    monkeypatch.setattr(base.time, "sleep", slept.append)
    assert [backoff(0.1)(n) for n in (1, 2, 3, 4)] == pytest.approx([0.1, 0.2, 0.25, 0.25])
    host = _DropsTwice("local", reconnect_pause_s=0.1)
    host.put_text("x", str(tmp_path / "f"), mode=0o600)
    assert (tmp_path / "f").read_text() == "x" and slept == pytest.approx([0.1, 0.2])
    assert get_host("local").reconnect_pause_s == 2.0
    assert get_host("local", reconnect_pause_s=0.5).reconnect_pause_s == 0.5
