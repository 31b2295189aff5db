"""A lease holder that cannot be seen is not proof of its death (issue #42 item 13).

On a host whose /proc is mounted with `hidepid`, another user's process is invisible: its
/proc/<pid>/stat cannot be read. The lease took that for a holder gone and took the lease
over from a live run. Now a takeover needs positive evidence (the kernel's "no such process"
from kill(pid, 0), or the PID's start time changed) and says what it saw.

The host is simulated for real: the taking run's lease script runs as `nobody` in a mount
namespace whose /proc is mounted `hidepid=2`, the holder's process is root's (the suite runs
as root).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import tempfile

import pytest

from speedmatrix.engine.hosts import get_host
from speedmatrix.engine.hosts.local import LocalHost
from speedmatrix.engine.lease import HostLease

HIDE = (
    "unshare -m --propagation private sh -c "
    + shlex.quote(
        "mount -t proc -o hidepid=2 proc /proc && "
        'exec setpriv --reuid=65534 --regid=65534 --clear-groups bash -c "$1"'
    )
    + " hidden"
)


class HiddenProcHost(LocalHost):
    """This machine as `nobody` sees it when /proc is mounted with hidepid=2."""

    def run(self, cmd, *args, **kwargs):
        return super().run(f"{HIDE} {shlex.quote(cmd)}", *args, **kwargs)


def _can_hide() -> bool:
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        return False
    probe = subprocess.run(
        ["bash", "-c", f"{HIDE} 'test ! -e /proc/1/stat'"], capture_output=True, check=False
    )
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _can_hide(), reason="needs root and a mount namespace to mount /proc with hidepid"
)


@pytest.fixture
def lease_dir():
    """A lease directory every user can reach (pytest's tmp_path is root's alone)."""
    d = tempfile.mkdtemp(prefix="sm-lease-", dir="/var/tmp")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def root_owner():
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def test_the_simulated_host_hides_the_holder(root_owner):
    host = HiddenProcHost("local")
    res = host.run(f"cat /proc/{root_owner.pid}/stat", stream=False)
    assert res.rc != 0  # what `started` reads is not there


def test_a_holder_hidden_from_proc_is_not_taken_over(lease_dir, root_owner, caplog):
    a = HostLease(
        get_host("local"), "run-a", ttl_s=900, lease_dir=lease_dir, owner_pid=root_owner.pid
    )
    assert a.try_acquire().status == "ACQUIRED"
    b = HostLease(HiddenProcHost("local"), "run-b", ttl_s=900, lease_dir=lease_dir)
    with caplog.at_level(logging.WARNING, logger="speedmatrix.lease"):
        state = b.try_acquire()
    assert (state.status, state.holder, state.gone) == ("HELD", "run-a", None)
    assert "taken over" not in caplog.text
    assert a.renew().status == "RENEWED"  # the live run keeps its lease


def test_a_hidden_holder_proved_gone_is_taken_over_saying_what_was_seen(
    lease_dir, root_owner, caplog
):
    a = HostLease(
        get_host("local"), "run-a", ttl_s=900, lease_dir=lease_dir, owner_pid=root_owner.pid
    )
    assert a.try_acquire().status == "ACQUIRED"
    pid = root_owner.pid
    root_owner.kill()
    root_owner.wait()
    b = HostLease(HiddenProcHost("local"), "run-b", ttl_s=900, lease_dir=lease_dir)
    with caplog.at_level(logging.WARNING, logger="speedmatrix.lease"):
        state = b.try_acquire()
    assert (state.status, state.gone) == ("ACQUIRED", "run-a")
    assert f"no process {pid}" in state.why and "no such process" in state.why
    assert f"no process {pid}" in caplog.text and "taken over by run-b" in caplog.text
