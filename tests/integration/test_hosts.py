"""speedmatrix.engine.hosts on both transports: a real sshd on 127.0.0.1 and the local machine."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
import uuid

import pytest
from processes import wait_gone
from waiting import poll_until

from speedmatrix.engine import hosts
from speedmatrix.engine.hosts import (
    CommandError,
    CommandTimeout,
    HostConnectionError,
    get_host,
)

pytestmark = pytest.mark.integration


@pytest.fixture(params=["local", "ssh"])
def host(request, tmp_path):
    """The same tests on both transports; HOME points at a temp dir."""
    if request.param == "local":
        h = get_host("local", env={"HOME": str(tmp_path)})
    else:
        conn = request.getfixturevalue("ssh_conn_id")
        h = get_host(conn, env={"HOME": str(tmp_path)})
    yield h
    h.close()


def _alive(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_run_returns_rc_stdout_stderr_separately(host):
    res = host.run("echo out; echo err >&2; exit 3")
    assert (res.rc, res.stdout, res.stderr) == (3, "out\n", "err\n")
    assert not res.ok


def test_check_raises_with_the_output_tail(host):
    with pytest.raises(CommandError, match=r"exit code 4[\s\S]*boom"):
        host.run("echo boom >&2; exit 4", check=True)


def test_env_and_host_env_reach_the_command_verbatim(host, tmp_path):
    weird = "a b;$(echo no) 'q' \"d\" `x`"
    res = host.run('printf "%s|%s" "$HOME" "$WEIRD"', env={"WEIRD": weird}, check=True)
    assert res.stdout == f"{tmp_path}|{weird}"


def test_total_timeout_kills_the_command_on_the_host(host):
    marker = f"sleep 3{uuid.uuid4().int % 1000:03d}"
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout, match="total timeout"):
        host.run(f"echo start; {marker}", timeout_s=1)
    assert time.monotonic() - t0 < 20
    poll_until(lambda: not _alive(marker), 5)
    assert _alive(marker) == []


def test_idle_timeout_is_separate_from_the_total(host):
    # Output every 0.3 s for ~2 s: never idle for 1 s, so it completes.
    res = host.run("for i in 1 2 3 4 5 6; do echo $i; sleep 0.3; done", idle_timeout_s=1.5)
    assert res.stdout.split() == ["1", "2", "3", "4", "5", "6"]
    with pytest.raises(CommandTimeout, match="no output"):
        host.run("echo x; sleep 5", idle_timeout_s=1)


@pytest.mark.parametrize("total", [None, 60], ids=["idle-only", "idle-and-total"])
def test_idle_timeout_kills_the_command_on_the_host(host, tmp_path, total):
    """Silent after one line: the idle timeout fires, and the command (its bash, recorded in a
    PID file, and the sleep it runs) is gone from the host, not just from our side."""
    pidfile = tmp_path / "cmd.pid"
    marker = f"sleep 4{uuid.uuid4().int % 1000:03d}"
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout, match="no output for 2 s") as exc:
        host.run(f"echo $$ > {pidfile}; echo once; {marker}", timeout_s=total, idle_timeout_s=2)
    assert time.monotonic() - t0 < 15
    assert exc.value.partial is not None and exc.value.partial.stdout == "once\n"
    pid = int(pidfile.read_text())
    assert wait_gone(pid), f"the command's bash (PID {pid}) still runs after the idle timeout"
    deadline = time.monotonic() + 5
    while _alive(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(marker) == []


@pytest.mark.parametrize("total", [None, 60], ids=["no-total", "total"])
@pytest.mark.parametrize(
    "cmd",
    [
        pytest.param("sleep 30 & p=$!; kill -KILL $p; wait $p", id="child-sigkilled"),
        pytest.param("kill -KILL $$", id="script-sigkilled"),
    ],
)
def test_a_sigkill_that_is_not_the_timeout_reports_137(host, cmd, total):
    """An OOM kill reads 137, as timeout's own KILL does: only the timeout's marker makes a
    CommandTimeout, so this is the command's exit code, on both transports alike."""
    t0 = time.monotonic()
    res = host.run(cmd, timeout_s=total, stream=False)
    assert res.rc == 137
    assert "speedmatrix-hosts" not in res.stdout + res.stderr
    assert time.monotonic() - t0 < 10


def test_a_command_that_exits_124_itself_is_not_a_timeout(host):
    res = host.run("echo x; exit 124", timeout_s=60)
    assert (res.rc, res.stdout) == (124, "x\n")
    with pytest.raises(CommandError, match="exit code 124"):
        host.run("exit 124", timeout_s=60, check=True)


def test_total_timeout_kills_a_command_that_ignores_sigterm(host, tmp_path, monkeypatch):
    """TERM is ignored, so timeout's KILL after -k ends it (timeout dies by that KILL too,
    137): still reported as the total timeout, and nothing is left."""
    monkeypatch.setattr(hosts.wrapper, "_KILL_AFTER_S", 1)
    pidfile = tmp_path / "cmd.pid"
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout, match="total timeout of 1 s") as exc:
        host.run(f"trap '' TERM; echo $$ > {pidfile}; echo up; while :; do sleep 0.2; done", 1)
    assert time.monotonic() - t0 < 10
    assert exc.value.partial is not None and exc.value.partial.rc == 137
    assert exc.value.partial.stdout == "up\n"
    assert "total timeout fired" not in exc.value.partial.stderr  # the marker is taken out
    assert wait_gone(int(pidfile.read_text()))


def test_put_get_and_put_text_with_mode(host, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 10)
    host.put(src, "$HOME/deep/dir/copy.bin")
    assert (tmp_path / "deep/dir/copy.bin").read_bytes() == src.read_bytes()
    back = tmp_path / "back" / "b.bin"
    host.get("$HOME/deep/dir/copy.bin", back)
    assert back.read_bytes() == src.read_bytes()
    host.put_text("secret=1\n", "$HOME/s/secrets.env", mode=0o600)
    path = tmp_path / "s/secrets.env"
    assert path.read_text() == "secret=1\n"
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)


def test_home_and_resolve_follow_the_host_env(host, tmp_path):
    assert host.home() == str(tmp_path)
    assert host.resolve("$HOME/x") == f"{tmp_path}/x"
    assert host.resolve("~/y") == f"{tmp_path}/y"
    assert host.resolve("/abs") == "/abs"


# ---------------------------------------------------------------- SSH only
def _bad_host_key_conn(sshd, bad: str, monkeypatch) -> None:
    """Connection ``hostkey_test``: the test sshd with another host key, or none."""
    conn = json.loads(os.environ[f"AIRFLOW_CONN_{sshd.conn_id.upper()}"])
    if bad == "wrong_key":
        key = f"{sshd.workdir}/other-{uuid.uuid4().hex}"
        other = subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], capture_output=True
        )
        assert other.returncode == 0
        with open(f"{key}.pub") as fh:
            conn["extra"]["host_key"] = " ".join(fh.read().split()[:2])
    else:
        del conn["extra"]["host_key"]
    monkeypatch.setenv("AIRFLOW_CONN_HOSTKEY_TEST", json.dumps(conn))
    monkeypatch.setenv("HOME", f"{sshd.workdir}/nohome")  # no ~/.ssh/known_hosts to fall back on


@pytest.mark.parametrize("bad", ["wrong_key", "no_key"])
def test_host_key_checking_is_on(sshd, bad, monkeypatch):
    """A connection whose host key does not match (or is unknown) is refused."""
    _bad_host_key_conn(sshd, bad, monkeypatch)
    h = get_host("hostkey_test")
    with pytest.raises(hosts.HostError, match="host key"):
        h.run("true")


def _sshd_children(sshd) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(sshd.pid)], capture_output=True, text=True
    ).stdout
    return [int(x) for x in out.split()]


# The first wait before a reconnect (2 s by default): the drops here are over at once, and what
# these tests prove (retried or not, ended on the host first) does not depend on the wait.
QUICK = 0.1


def test_dropped_connection_is_not_retried_for_a_non_idempotent_step(sshd, tmp_path):
    h = get_host(sshd.conn_id, env={"HOME": str(tmp_path)}, reconnect_pause_s=QUICK)
    h.run("true", check=True)  # connect first
    counter = tmp_path / "count"
    t = _drop_connections_when(sshd, lambda: _size(counter) > 0)  # dropped once it ran
    with pytest.raises(HostConnectionError, match="not repeated"):
        h.run(f"echo x >> {counter}; sleep 4", timeout_s=30)
    t.join()
    assert counter.read_text().count("x") == 1
    h.close()


def test_dropped_connection_is_retried_for_an_idempotent_step(sshd, tmp_path):
    h = get_host(sshd.conn_id, env={"HOME": str(tmp_path)}, reconnect_pause_s=QUICK)
    h.run("true", check=True)
    counter = tmp_path / "count"
    t = _drop_connections_when(sshd, lambda: _size(counter) > 0)  # dropped once it ran
    res = h.run(
        f"echo x >> {counter}; [ $(wc -l < {counter}) -ge 2 ] || sleep 4; echo done",
        timeout_s=60,
        idempotent=True,
    )
    t.join()
    assert res.stdout.strip().endswith("done")
    assert counter.read_text().count("x") == 2
    h.close()


def _session_of(pid_file) -> int:
    """The session id a command recorded with ``echo $$ $(ps -o sid= -p $$) > pid_file``."""
    return int(pid_file.read_text().split()[1])


def _stops_growing(path, within_s: float = 2.0, quiet_s: float = 0.6) -> bool:
    """Whether ``path`` (written every 0.2 s while its writer lives) stops growing within
    ``within_s``: unchanged for ``quiet_s``, three of the writer's ticks."""
    deadline = time.monotonic() + within_s
    last, since = _size(path), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _size(path)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return True
    return False


def _session_gone(sid: int, within_s: float = 2.0) -> bool:
    return poll_until(lambda: not hosts.local._session_pids(sid), within_s)


_TICKER = "echo $$ $(ps -o sid= -p $$) > {pids}; while :; do echo t >> {ticks}; sleep 0.2; done"


def test_a_dropped_command_is_ended_on_the_host(sshd, tmp_path, log_messages):
    """Without a pty, sshd leaves a command running when the connection drops. The reconnecting
    side ends it (its whole session: the bash and its sleeps) before it raises."""
    h = get_host(sshd.conn_id, env={"HOME": str(tmp_path)}, reconnect_pause_s=QUICK)
    h.run("true", check=True)
    ticks, pids = tmp_path / "ticks", tmp_path / "pids"
    t = _drop_connections_when(sshd, lambda: _size(ticks) > 0)
    with log_messages("speedmatrix.hosts") as msgs, pytest.raises(HostConnectionError) as exc:
        h.run(_TICKER.format(pids=pids, ticks=ticks), timeout_s=60)
    t.join()
    assert "not repeated" in str(exc.value)
    assert "ended on the host" in str(exc.value), str(exc.value)
    assert _stops_growing(ticks), "the command still writes after the error returned"
    assert _session_gone(_session_of(pids)), "processes of the command's session are left"
    assert any("ended on the host" in m for m in msgs), msgs
    h.close()


def test_a_dropped_idempotent_command_is_ended_before_its_retry(sshd, tmp_path):
    """The retry starts only once the dropped attempt is gone from the host: the second attempt
    finds the first one's bash dead (a zombie is dead: it waits only for its new parent, the
    sshd session having been killed, to reap it)."""
    h = get_host(sshd.conn_id, env={"HOME": str(tmp_path)}, reconnect_pause_s=QUICK)
    h.run("true", check=True)
    ticks, pids = tmp_path / "ticks", tmp_path / "pids"
    cmd = (
        f"if [ -s {pids} ]; then p=$(cut -d' ' -f1 {pids}); "
        f'case "$(ps -o stat= -p $p)" in ""|Z*) echo FIRST-GONE;; *) echo FIRST-ALIVE;; esac; '
        f"exit 0; fi; " + _TICKER.format(pids=pids, ticks=ticks)
    )
    t = _drop_connections_when(sshd, lambda: _size(ticks) > 0)
    res = h.run(cmd, timeout_s=60, idempotent=True)
    t.join()
    assert res.stdout.strip() == "FIRST-GONE", res.stdout
    assert _stops_growing(ticks)
    assert _session_gone(_session_of(pids))
    h.close()


@pytest.mark.parametrize("bad", ["wrong_key", "no_key"])
def test_a_rejected_host_key_is_final(sshd, bad, monkeypatch, log_messages):
    """Not a transient problem: one connection attempt, even for a retried (idempotent) call,
    and an error that says what to fix."""
    import paramiko

    _bad_host_key_conn(sshd, bad, monkeypatch)
    attempts = []
    connect = paramiko.SSHClient.connect

    def counting(self, *args, **kwargs):
        attempts.append(1)
        return connect(self, *args, **kwargs)

    monkeypatch.setattr(paramiko.SSHClient, "connect", counting)
    h = get_host("hostkey_test")
    with log_messages("speedmatrix.hosts") as msgs, pytest.raises(hosts.HostRefused) as exc:
        h.run("true", idempotent=True)
    assert len(attempts) == 1
    assert "host key" in str(exc.value) and "not retried" in str(exc.value)
    assert not any("retry" in m for m in msgs), msgs
    # and the copies, which retry dropped connections, do not retry it either
    with pytest.raises(hosts.HostRefused):
        h.put_text("x", "/tmp/never-written-speedmatrix")
    assert len(attempts) == 2


def _holds_open(path) -> int:
    """How many processes on this machine have ``path`` open."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            fds = os.listdir(f"/proc/{pid}/fd")
            n += any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in fds)
    return n


def test_lease_acquire_survives_a_drop(sshd, tmp_path):
    """The acquire is re-entrant (the holder takes its own lease again), so a drop while it
    runs is retried: here it waits for the lease's lock, which the test holds, when the
    connection drops; the lock is let go after the drop and the retry takes the lease."""
    import fcntl

    from speedmatrix.engine.lease import HostLease

    h = get_host(sshd.conn_id, env={"HOME": str(tmp_path)}, reconnect_pause_s=QUICK)
    h.run("true", check=True)
    lease_dir = tmp_path / "lease"
    lease_dir.mkdir()
    lease = HostLease(h, "run-1", ttl_s=60, lease_dir=str(lease_dir))
    with open(lease_dir / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # dropped while the acquire waits for the lock (its flock is running on the host)
        t = _drop_connections_when(sshd, lambda: _holds_open(lease_dir / "lock") > 1)
        released = threading.Thread(target=lambda: (t.join(), fcntl.flock(lock, fcntl.LOCK_UN)))
        released.start()
        state = lease.try_acquire()
        released.join()
    assert state.status == "ACQUIRED" and state.holder == "run-1"
    assert lease.show().holder == "run-1"
    h.close()


def _drop_connections_when(sshd, ready) -> threading.Thread:
    """Kill the per-connection sshd processes once ``ready()`` is true (polled), once."""

    def go():
        deadline = time.monotonic() + 60
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.002)
        for pid in _sshd_children(sshd):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _size(path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


_MIB = 1024 * 1024


# Sizes large enough that the copy is still running well after the watcher saw its first
# quarter MiB land (at least ~0.6 s more): on loopback paramiko's get moves ~50 MB/s, put
# ~10 MB/s, and put_text (an unpipelined file write) ~1 MB/s. A copy over before the drop
# fails the test (no "retry 1" in the log): a load that slows copies only widens the margin.
@pytest.mark.parametrize(
    ("op", "size"),
    [
        pytest.param("put", 8 * _MIB, id="put"),
        pytest.param("get", 32 * _MIB, id="get"),
        pytest.param("put_text", 1 * _MIB, id="put_text"),
    ],
)
def test_connection_dropped_during_a_copy_is_retried(sshd, tmp_path, log_messages, op, size):
    """The sshd session is killed while the bytes are moving (the target file has started to
    grow), not before the copy: the copy reconnects, starts over and lands complete."""
    h = get_host(sshd.conn_id, env={"HOME": str(tmp_path)}, reconnect_pause_s=QUICK)
    h.run("true", check=True)  # connected before the copy starts
    payload = os.urandom(size)
    src = tmp_path / "src.bin"
    target = tmp_path / "target.bin"
    if op in ("put", "get"):
        src.write_bytes(payload)
    t = _drop_connections_when(sshd, lambda: _size(target) > _MIB // 4)
    with log_messages("speedmatrix.hosts") as warnings:
        if op == "put":
            h.put(src, "$HOME/target.bin")
        elif op == "get":
            h.get("$HOME/src.bin", target)
        else:
            text = payload.hex()[:size]
            h.put_text(text, "$HOME/target.bin", mode=0o640)
    t.join()
    # The drop happened during this copy, and the copy was retried after it...
    text_of_log = "\n".join(warnings)
    assert "connection problem" in text_of_log and "retry 1" in text_of_log, text_of_log
    assert f"sftp {op}" in text_of_log
    # ...and what landed is whole.
    if op == "put_text":
        assert target.read_text() == text
        assert oct(target.stat().st_mode & 0o777) == oct(0o640)
    else:
        assert target.read_bytes() == payload
    h.close()


def test_output_that_arrives_after_the_exit_status_is_kept(host, tmp_path):
    """The command exits at once while a child it leaves writes the rest of the output a
    moment later, so the exit status reaches us before the last output does, as it sometimes
    does when sshd is busy. All the output is returned, not what had arrived by then."""
    data = tmp_path / "data.txt"
    data.write_text("".join(f"line {i:05d} {'x' * 100}\n" for i in range(400)))
    res = host.run(
        f"head -c 8000 {data}; (sleep 0.5; tail -c +8001 {data}) &", timeout_s=60, stream=False
    )
    assert res.rc == 0
    assert res.stdout == data.read_text()


# ---------------------------------------------------------------- a host without SFTP
@pytest.fixture
def no_sftp_host(sshd_no_sftp, tmp_path):
    h = get_host(sshd_no_sftp.conn_id, env={"HOME": str(tmp_path)})
    yield h
    h.close()


def test_files_go_through_the_command_channel_without_sftp(no_sftp_host, tmp_path, log_messages):
    """`Subsystem sftp` off: put, put_text and get still work, byte for byte (every byte value,
    a mode set before the content lands, a target replaced), and the log says so once."""
    h = no_sftp_host
    assert h.run("true").ok  # commands work on this host
    payload = bytes(range(256)) * 4096 + os.urandom(12345)
    src = tmp_path / "src.bin"
    src.write_bytes(payload)
    with log_messages("speedmatrix.hosts") as msgs:
        h.put(src, "$HOME/deep/dir/copy.bin")
        assert (tmp_path / "deep/dir/copy.bin").read_bytes() == payload
        back = tmp_path / "back" / "b.bin"
        h.get("$HOME/deep/dir/copy.bin", back)
        assert back.read_bytes() == payload
        h.put_text("old\n", "$HOME/s/secrets.env", mode=0o644)
        h.put_text("secret=1\n", "$HOME/s/secrets.env", mode=0o600)
        path = tmp_path / "s/secrets.env"
        assert path.read_text() == "secret=1\n"
        assert oct(path.stat().st_mode & 0o777) == oct(0o600)
        with pytest.raises(FileNotFoundError):
            h.get("$HOME/no/such/file", tmp_path / "never")
        # a second Host object for the same host (as the lease renewer makes) says nothing new
        other = get_host(h.name, env={"HOME": str(tmp_path)})
        other.put_text("x", "$HOME/other.txt")
        other.close()
    said = [m for m in msgs if "no SFTP" in m]
    assert len(said) <= 1, said  # once per host and process (an earlier test may have said it)
    assert not any("retry" in m for m in msgs), msgs  # no "channel closed" retries
    assert not list(tmp_path.rglob("*.speedmatrix-part-*"))  # no temporary file left


def test_without_sftp_the_first_copy_says_so_in_the_log(sshd_no_sftp, tmp_path, log_messages):
    h = get_host(sshd_no_sftp.conn_id, env={"HOME": str(tmp_path)})
    hosts.ssh._NO_SFTP_SAID.discard(h.name)  # as in a fresh worker process
    with log_messages("speedmatrix.hosts") as msgs:
        h.put_text("a", "$HOME/a.txt")
        h.put_text("b", "$HOME/b.txt")
    said = [m for m in msgs if "no SFTP" in m]
    assert len(said) == 1 and "command channel" in said[0] and "sha256" in said[0], msgs
    h.close()


def test_shipping_the_load_generator_without_sftp(no_sftp_host, tmp_path):
    """Provisioning's copy path (the zipapp, include/ and shipped.json, staged and renamed
    into place) lands whole on a host without SFTP, and the shipped load generator runs."""
    import sys

    from speedmatrix.engine.provision import build_shipment, refresh_shipped

    h = no_sftp_host
    state = f"{tmp_path}/state"
    h.run(f"mkdir -p {state}", check=True)
    ship = build_shipment()
    assert sorted(refresh_shipped(h, state, ship)) == sorted(ship.digests)
    assert json.loads((tmp_path / "state/shipped.json").read_text()) == {
        "format": 1,
        **ship.digests,
    }
    assert refresh_shipped(h, state, ship) == []  # what landed is what this speedmatrix ships
    res = h.run(f"{sys.executable} {state}/loadgen.pyz --help", timeout_s=120, stream=False)
    assert res.rc == 0 and "decode" in res.stdout, res.tail()
    assert (tmp_path / "state/include/model-setup").is_dir()


def test_a_drop_during_a_copy_without_sftp_is_retried(sshd_no_sftp, tmp_path, log_messages):
    """The copy's command is ended on the host and the copy starts over: what lands is whole,
    and no temporary file is left."""
    h = get_host(sshd_no_sftp.conn_id, env={"HOME": str(tmp_path)}, reconnect_pause_s=QUICK)
    h.run("true", check=True)
    payload = os.urandom(16 * _MIB)
    src = tmp_path / "src.bin"
    src.write_bytes(payload)

    def partial() -> int:
        return max((_size(p) for p in tmp_path.glob("target.bin.speedmatrix-part-*")), default=0)

    t = _drop_connections_when(sshd_no_sftp, lambda: partial() > _MIB // 4)
    with log_messages("speedmatrix.hosts") as msgs:
        h.put(src, "$HOME/target.bin")
    t.join()
    text = "\n".join(msgs)
    assert "connection problem" in text and "retry 1" in text, text
    assert (tmp_path / "target.bin").read_bytes() == payload
    assert not list(tmp_path.glob("*.speedmatrix-part-*"))
    h.close()
