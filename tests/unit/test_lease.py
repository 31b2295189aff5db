"""The host lease: atomic, re-entrant for its holder, expiring, never released by another."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import pytest
from waiting import poll_until

from speedmatrix.engine import lease as lease_mod
from speedmatrix.engine.hosts import get_host
from speedmatrix.engine.lease import HostLease, LeaseError, LeaseLost, holder_id


@pytest.fixture
def lease_dir(tmp_path: Path) -> str:
    return str(tmp_path / "lease")


def lease(holder: str, lease_dir: str, ttl: float = 60, host=None) -> HostLease:
    return HostLease(host or get_host("local"), holder, ttl_s=ttl, lease_dir=lease_dir)


_FAKE_DATE = """#!/bin/sh
# the host's clock, as the lease script reads it: seconds in $SM_TEST_CLOCK (the test moves it)
c=$(cat "$SM_TEST_CLOCK")
case "$1" in
  +%s) awk -v c="$c" 'BEGIN { printf "%d\\n", c }' ;;
  +%s%N) awk -v c="$c" 'BEGIN { printf "%.0f\\n", c * 1e9 }' ;;
  *) exec {real} "$@" ;;
esac
"""


class HostClock:
    """The local host's clock, injected: a `date` first on the host's PATH that reads the time
    from a file, so expiry is decided by the test's clock, not by real seconds (issue #33: the
    parallel phase slept with 0.2-0.3 s margins)."""

    def __init__(self, tmp_path: Path) -> None:
        import os
        import shutil

        bin_dir = tmp_path / "clock-bin"
        bin_dir.mkdir()
        (bin_dir / "date").write_text(_FAKE_DATE.replace("{real}", shutil.which("date")))
        (bin_dir / "date").chmod(0o755)
        self.file = tmp_path / "clock"
        self.now = 1_000_000.0
        self.set(self.now)
        self.env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SM_TEST_CLOCK": str(self.file)}

    def set(self, now: float) -> None:
        self.now = now
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(f"{now}\n")
        tmp.replace(self.file)

    def advance(self, seconds: float) -> None:
        self.set(self.now + seconds)

    def host(self):
        return get_host("local", env=self.env)

    def processes(self) -> list[int]:
        """Live processes running with this clock (the keeper loop on the host)."""
        import os

        marker = f"\0SM_TEST_CLOCK={self.file}\0".encode()
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    env = b"\0" + Path(f"/proc/{entry}/environ").read_bytes()
                except OSError:
                    continue
                if marker in env:
                    found.append(int(entry))
        return found


def wait_until(predicate, timeout_s: float = 30.0, what: str = "") -> None:
    """Poll until `predicate()` holds (the event waited for), failing after `timeout_s`."""
    assert poll_until(predicate, timeout_s, every_s=0.02), f"not within {timeout_s} s: {what}"


class Ticks:
    """The renewer's clock (Renewer.wait): it renews once per tick(), never on its own."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._pending = 0
        self._arrivals = 0  # times the renewer came to wait
        self._consumed = 0  # ticks it took
        self._done = False

    def wait(self, _interval_s: float) -> bool:
        with self._cv:
            self._arrivals += 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._pending or self._done)
            if self._done:
                return True
            self._pending -= 1
            self._consumed += 1
            return False

    def _fire(self) -> int:
        """Let one renewal go once the renewer waits; returns the arrival that follows it."""
        assert self._cv.wait_for(lambda: self._arrivals > self._consumed, timeout=30)
        self._pending += 1
        self._cv.notify_all()
        return self._arrivals + 1

    def tick(self) -> None:
        """One renewal; returns once the renewer waits again (so the renewal is done)."""
        with self._cv:
            back = self._fire()
            assert self._cv.wait_for(lambda: self._arrivals >= back, timeout=30)

    def release(self) -> None:
        """One renewal, not waited for (the renewer may stop: a lost lease)."""
        with self._cv:
            self._fire()

    def finish(self) -> None:
        with self._cv:
            self._done = True
            self._cv.notify_all()


@pytest.fixture
def clock(tmp_path: Path) -> HostClock:
    return HostClock(tmp_path)


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


def test_expired_lease_is_taken_over_and_old_holder_told(lease_dir, clock):
    host = clock.host()
    a, b = lease("run-a", lease_dir, ttl=1, host=host), lease("run-b", lease_dir, host=host)
    a.try_acquire()
    assert b.try_acquire().status == "HELD"
    clock.advance(1)  # expiry is exclusive: at the expiry second the lease is free
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


def test_renewer_keeps_lease_alive_past_ttl_then_it_expires(lease_dir, clock):
    host = clock.host()
    a, b = lease("run-a", lease_dir, ttl=2, host=host), lease("run-b", lease_dir, host=host)
    a.try_acquire()
    ticks = Ticks()
    renewer = a.renewing(interval_s=1)
    renewer.wait = ticks.wait
    with renewer:
        for _ in range(3):  # 3 s on the host's clock, past the 2 s ttl: renewed each second
            clock.advance(1)
            ticks.tick()
            assert a.show().expires_at == clock.now + 2
        assert b.try_acquire().status == "HELD"
        ticks.finish()
    assert renewer.lost is None
    clock.advance(1)
    assert b.try_acquire().status == "HELD"  # 1 s left
    clock.advance(1)  # no one renews: the holder is "dead"
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


def test_renewer_reports_a_lost_lease(lease_dir, clock):
    # The renewer renews more slowly than the ttl: the lease lapses, run-b takes it, and the
    # renewer's next renewal finds out and says so instead of stealing it back.
    host = clock.host()
    a = lease("run-a", lease_dir, ttl=1, host=host)
    b = lease("run-b", lease_dir, ttl=60, host=host)
    a.try_acquire()
    ticks = Ticks()
    renewer = a.renewing(interval_s=2.0)
    renewer.wait = ticks.wait
    with renewer:
        clock.advance(1.3)
        assert b.try_acquire().status == "ACQUIRED"
        clock.advance(0.7)
        ticks.release()  # the renewer's next renewal: it finds run-b's lease and stops
        renewer._thread.join(timeout=30)
        assert not renewer._thread.is_alive()
    assert isinstance(renewer.lost, LeaseLost)
    assert b.show().holder == "run-b"


def test_acquire_waits_then_times_out(lease_dir, clock, monkeypatch):
    """acquire polls until the lease is free, or its wait is over: both on injected clocks
    (the host's, and acquire's own monotonic clock and sleep, moved together)."""

    class Waiting:
        @staticmethod
        def monotonic() -> float:
            return clock.now

        @staticmethod
        def sleep(seconds: float) -> None:
            clock.advance(seconds)

    monkeypatch.setattr(lease_mod, "time", Waiting)
    host = clock.host()
    a, b = lease("run-a", lease_dir, ttl=1, host=host), lease("run-b", lease_dir, host=host)
    a.try_acquire()
    start = clock.now
    assert b.acquire(wait_s=5, poll_s=0.3).status == "ACQUIRED"
    assert 1 <= clock.now - start < 1.3  # taken at the first poll after a's expiry
    start = clock.now
    with pytest.raises(LeaseError, match="still leased by run-b"):
        a.acquire(wait_s=0.5, poll_s=0.2)
    assert 0.5 <= clock.now - start < 0.7


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


def test_the_host_keeps_the_lease_while_the_server_group_lives(lease_dir, clock):
    """Between tasks nothing of the run renews; the host-side keeper extends the lease while
    the server's group lives, stops when it dies (the lease then expires), and never retakes a
    released lease."""
    import os
    import signal
    import subprocess

    host = clock.host()
    a, b = lease("run-a", lease_dir, ttl=2, host=host), lease("run-b", lease_dir, host=host)
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a server's group
    try:
        a.try_acquire()
        a.keep_while_group(server.pid, interval_s=0.4)
        wait_until(lambda: clock.processes(), what="the keeper started")
        for _ in range(3):  # 3 s on the host's clock, past the ttl, no renewal from here
            clock.advance(1)
            wait_until(lambda: a.show().expires_at == clock.now + 2, what="the keeper extended")
        assert b.try_acquire().status == "HELD"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    wait_until(lambda: not clock.processes(), what="the keeper saw the group gone")
    clock.advance(1)
    assert b.try_acquire().status == "HELD"  # not extended any more: 1 s left
    clock.advance(1)  # the lease lapses
    assert b.try_acquire().status == "ACQUIRED"
    assert b.release().status == "RELEASED"

    # a released lease is not taken back by a keeper whose group still lives
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        a.try_acquire()
        a.keep_while_group(server.pid, interval_s=0.3)
        wait_until(lambda: clock.processes(), what="the keeper started")
        assert a.release().status == "RELEASED"
        clock.advance(1)  # the keeper's next extension finds the lease gone, and ends
        wait_until(lambda: not clock.processes(), what="the keeper ended")
        assert a.show().holder is None
        assert b.try_acquire().status == "ACQUIRED"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
