"""A lease whose holder is provably gone is taken over, saying so (issue #34 item 6).

A run that one process runs whole (`speedmatrix run`, dag.test) records that process with the
lease; once it no longer runs (killed, its terminal closed) the next run takes the host at
once instead of waiting out the lease's 900 s."""

from __future__ import annotations

import logging
import subprocess

import pytest

from speedmatrix.engine.hosts import get_host
from speedmatrix.engine.lease import HostLease, LeaseLost


@pytest.fixture
def lease_dir(tmp_path) -> str:
    d = tmp_path / "leases"
    d.mkdir(mode=0o1777)
    return str(d)


def test_a_lease_of_a_gone_process_is_taken_over_with_a_message(lease_dir, caplog) -> None:
    owner = subprocess.Popen(["sleep", "300"])
    try:
        a = HostLease(
            get_host("local"), "run-a", ttl_s=900, lease_dir=lease_dir, owner_pid=owner.pid
        )
        b = HostLease(get_host("local"), "run-b", ttl_s=900, lease_dir=lease_dir, owner_pid=None)
        assert a.try_acquire().status == "ACQUIRED"
        assert b.try_acquire().status == "HELD"  # its process runs: a live lease is waited for
    finally:
        owner.kill()
        owner.wait()
    with caplog.at_level(logging.WARNING, logger="speedmatrix.lease"):
        state = b.try_acquire()
    assert state.status == "ACQUIRED" and state.gone == "run-a"
    assert "its holder run-a is gone" in caplog.text and "taken over by run-b" in caplog.text
    assert b.renew().status == "RENEWED"  # the gone holder's record no longer counts
    with pytest.raises(LeaseLost):  # were it back, it is told
        a.renew()


def test_a_lease_without_a_recorded_process_is_waited_for(lease_dir) -> None:
    """A DAG run's lease in a deployment (its tasks in many processes) records none."""
    a = HostLease(get_host("local"), "run-a", ttl_s=900, lease_dir=lease_dir)
    b = HostLease(get_host("local"), "run-b", ttl_s=900, lease_dir=lease_dir)
    assert a.try_acquire().status == "ACQUIRED"
    state = b.try_acquire()
    assert state.status == "HELD" and state.holder == "run-a" and state.gone is None
    assert a.release().status == "RELEASED"
    assert b.try_acquire().status == "ACQUIRED"


def test_a_run_waiting_for_its_host_says_so_where_the_user_looks(tmp_path, monkeypatch) -> None:
    """dag.test's wait_for_host pokes every 15 s; the demo's terminal hears why it waits."""
    from speedmatrix.flows import matrix, progress

    d = tmp_path / "machine"
    d.mkdir(mode=0o1777)
    monkeypatch.setenv("SPEEDMATRIX_LEASE_DIR", str(d))
    other = HostLease(get_host("local"), "speed_matrix/other", ttl_s=900)
    assert other.try_acquire().status == "ACQUIRED"

    class Heard:
        def __init__(self) -> None:
            self.said: list[str] = []

        def step(self, text: str) -> None:
            self.said.append(text)

    with progress.listening(Heard()) as heard:
        assert matrix.take_lease({"host": "local", "holder": "speed_matrix/me"}) is None
    assert len(heard.said) == 1
    assert "waiting for host local: its lease is held by speed_matrix/other for" in heard.said[0]
