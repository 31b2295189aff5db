"""The host lease: atomic, re-entrant for its holder, expiring, never released by another."""

from __future__ import annotations

import stat
import threading
import time
from pathlib import Path

import pytest

from speedmatrix.engine import lease as lease_mod
from speedmatrix.engine.hosts import get_host
from speedmatrix.engine.lease import HostLease, LeaseError, LeaseLost, holder_id


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


def test_a_renewer_entered_just_after_a_renewal_does_not_renew_again(lease_dir, monkeypatch):
    """A cell renews before its health check, then measures under a renewer: one host command
    on entry, not two (issue #19); any other caller still gets a renewal on entry."""
    a = lease("run-a", lease_dir, ttl=60)
    a.try_acquire()
    calls = []
    real = a.renew
    monkeypatch.setattr(a, "renew", lambda: (calls.append(1), real())[1])
    with a.renewing(interval_s=30, renewed=True):
        pass
    assert calls == []
    with a.renewing(interval_s=30):
        pass
    assert calls == [1]


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


def test_two_homes_on_one_machine_share_one_lease(tmp_path, monkeypatch):
    """The lease is the machine's, not the $HOME's: two runs with a different host_home (or
    two SSH users) on one box must not both hold it. The default directory is machine-wide
    (/var/tmp/speedmatrix; the test points SPEEDMATRIX_LEASE_DIR at a directory of its own)."""
    machine = tmp_path / "machine"
    monkeypatch.setenv("SPEEDMATRIX_LEASE_DIR", str(machine))
    homes = [tmp_path / "home-a", tmp_path / "home-b"]
    a, b = (
        HostLease(get_host("local", env={"HOME": str(h)}), name, ttl_s=60)
        for h, name in zip(homes, ("run-a", "run-b"), strict=True)
    )
    assert a.try_acquire().status == "ACQUIRED"
    held = b.try_acquire()
    assert (held.status, held.holder) == ("HELD", "run-a")
    assert b.release().status == "NOTMINE" and a.show().holder == "run-a"
    assert a.release().status == "RELEASED"
    assert b.try_acquire().status == "ACQUIRED"
    # nothing under either HOME; the lease lives in the machine-wide directory, shared: a
    # sticky 1777 directory (any user may add a record, none may remove another's), records
    # readable by every user
    assert not any((h / ".speedmatrix").exists() for h in homes)
    assert stat.S_IMODE(machine.stat().st_mode) == 0o1777
    records = list(machine.glob("holder*"))
    assert records and all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in records)
    assert stat.S_IMODE((machine / "lock").stat().st_mode) & 0o044 == 0o044
    assert lease_mod.MACHINE_DIR == "/var/tmp/speedmatrix"


def test_the_hosts_own_setting_names_its_machine_dir(tmp_path, monkeypatch):
    """A host whose /var/tmp is not shared by its users says where instead, in its own
    environment (sshd SetEnv, /etc/environment): it beats the deployment's default."""
    monkeypatch.setenv("SPEEDMATRIX_LEASE_DIR", str(tmp_path / "deployment-default"))
    own = tmp_path / "host-b-machine"
    a = HostLease(get_host("local"), "run-a", ttl_s=60)
    b = HostLease(get_host("local", env={"SPEEDMATRIX_LEASE_DIR": str(own)}), "run-b", ttl_s=60)
    assert a.try_acquire().status == "ACQUIRED"
    assert b.try_acquire().status == "ACQUIRED"  # another machine, as far as leases go
    assert list(own.glob("holder*")) and list((tmp_path / "deployment-default").glob("holder*"))


def test_a_lease_taken_before_a_reboot_is_void(lease_dir):
    """The directory outlives a reboot (/var/tmp), the runs and servers do not: a record from
    another boot is free at once, not after its TTL."""
    a, b = lease("run-a", lease_dir, ttl=600), lease("run-b", lease_dir)
    assert a.try_acquire().status == "ACQUIRED"
    for record in Path(lease_dir).glob("holder*"):
        holder, expiry, taken, *_ = record.read_text().split()
        record.write_text(f"{holder} {expiry} {taken} 00000000-0000-0000-0000-000000000000\n")
    assert b.try_acquire().status == "ACQUIRED"
    assert b.show().holder == "run-b"


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
