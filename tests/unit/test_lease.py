"""The host lease: atomic, re-entrant for its holder, expiring, never released by another."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from speedmatrix.hosts import get_host
from speedmatrix.lease import HostLease, LeaseError, LeaseLost, holder_id


@pytest.fixture
def lease_dir(tmp_path: Path) -> str:
    return str(tmp_path / "lease")


def lease(holder: str, lease_dir: str, ttl: float = 60) -> HostLease:
    return HostLease(get_host("local"), holder, ttl_s=ttl, lease_dir=lease_dir)


def test_one_holder_at_a_time_and_reentrant(lease_dir):
    a, b = lease("run-a", lease_dir), lease("run-b", lease_dir)
    assert a.try_acquire().status == "ACQUIRED"
    held = b.try_acquire()
    assert (held.status, held.holder) == ("HELD", "run-a")
    assert 55 <= held.seconds_left <= 60
    assert a.try_acquire().status == "ACQUIRED"  # a retried setup of the same run
    assert b.release().status == "NOTMINE"
    assert b.try_acquire().status == "HELD"
    assert a.release().status == "RELEASED"
    assert b.try_acquire().status == "ACQUIRED"
    assert a.show().holder == "run-b"


def test_expired_lease_is_taken_over_and_old_holder_told(lease_dir):
    a, b = lease("run-a", lease_dir, ttl=1), lease("run-b", lease_dir)
    a.try_acquire()
    time.sleep(2.1)
    assert b.try_acquire().status == "ACQUIRED"
    with pytest.raises(LeaseLost, match="held by run-b"):
        a.renew()
    assert a.release().status == "NOTMINE"
    assert b.show().holder == "run-b"


def test_racing_acquirers_get_exactly_one_winner(lease_dir):
    results: list[str] = []
    barrier = threading.Barrier(6)

    def contend(i: int) -> None:
        contender = lease(f"run-{i}", lease_dir)
        barrier.wait()
        results.append(contender.try_acquire().status)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["ACQUIRED"] + ["HELD"] * 5


def test_renewer_keeps_lease_alive_past_ttl_then_it_expires(lease_dir):
    a, b = lease("run-a", lease_dir, ttl=2), lease("run-b", lease_dir)
    a.try_acquire()
    with a.renewing(interval_s=0.4) as renewer:
        time.sleep(3.0)
        assert b.try_acquire().status == "HELD"
    assert renewer.lost is None
    time.sleep(2.2)  # no one renews: the holder is "dead"
    assert b.try_acquire().status == "ACQUIRED"


def test_renewer_reports_a_lost_lease(lease_dir):
    # The renewer renews more slowly than the ttl: the lease lapses, run-b takes it, and the
    # renewer's next renewal finds out and says so instead of stealing it back.
    a, b = lease("run-a", lease_dir, ttl=1), lease("run-b", lease_dir, ttl=60)
    a.try_acquire()
    with a.renewing(interval_s=2.0) as renewer:
        time.sleep(1.3)
        assert b.try_acquire().status == "ACQUIRED"
        time.sleep(1.5)
    assert isinstance(renewer.lost, LeaseLost)
    assert b.show().holder == "run-b"


def test_acquire_waits_then_times_out(lease_dir):
    a, b = lease("run-a", lease_dir, ttl=1), lease("run-b", lease_dir)
    a.try_acquire()
    assert b.acquire(wait_s=5, poll_s=0.3).status == "ACQUIRED"
    with pytest.raises(LeaseError, match="still leased by run-b"):
        a.acquire(wait_s=0.5, poll_s=0.2)


def test_default_dir_is_under_the_hosts_home(tmp_path):
    host = get_host("local", env={"HOME": str(tmp_path)})
    HostLease(host, "run-a").try_acquire()
    line = (tmp_path / ".speedmatrix" / "lease" / "holder").read_text().split()
    assert line[0] == "run-a"
    assert int(line[1]) > int(line[2])


def test_holder_names_are_checked_and_sanitised():
    assert holder_id("speed_matrix", "manual__2026-11-29T20:30:00+00:00") == (
        "speed_matrix/manual__2026-11-29T20:30:00+00:00"
    )
    assert holder_id("a b", "c;d") == "a_b/c_d"
    with pytest.raises(ValueError):
        HostLease(get_host("local"), "bad holder")


def test_the_host_keeps_the_lease_while_the_server_group_lives(lease_dir, tmp_path):
    """Between tasks nothing of the run renews; the host-side keeper extends the lease while
    the server's group lives, stops when it dies (the lease then expires), and never retakes a
    released lease."""
    import os
    import signal
    import subprocess

    a, b = lease("run-a", lease_dir, ttl=2), lease("run-b", lease_dir)
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a server's group
    try:
        a.try_acquire()
        a.keep_while_group(server.pid, interval_s=0.4)
        time.sleep(3.0)  # past the ttl, with no renewal from this process
        assert b.try_acquire().status == "HELD"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    time.sleep(2.8)  # the keeper saw the group gone: the lease lapses
    assert b.try_acquire().status == "ACQUIRED"
    assert b.release().status == "RELEASED"

    # a released lease is not taken back by a keeper whose group still lives
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        a.try_acquire()
        a.keep_while_group(server.pid, interval_s=0.3)
        assert a.release().status == "RELEASED"
        time.sleep(1.0)
        assert a.show().holder is None
        assert b.try_acquire().status == "ACQUIRED"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
