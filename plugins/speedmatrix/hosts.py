"""Run commands on a host and copy files both ways: over SSH or on the local machine.

Why one interface: provisioning and the server lifecycle are written once and run the same on a
GPU host reached through an Airflow SSH connection and on the Airflow worker itself (``local``,
the demo's default). Both transports:

- run a command with bash, with a *total* timeout (enforced on the host by coreutils
  ``timeout``, so nothing keeps running on the host when it fires) separate from an *idle*
  timeout (no output for that long; the command's whole session is killed on the host then,
  over SSH too: the wrapper runs it in a session of its own and reports that session's id);
- tell a total timeout from a command that exited 124 or was SIGKILLed for another reason
  (an OOM kill reads 137): ``timeout --verbose`` writes to a stream of its own, and only when
  it did send a signal does the wrapper add a once-only marker line;
- capture stdout/stderr and the exit code, and stream lines to the ``speedmatrix.hosts`` logger
  (which an Airflow task log shows);
- copy files both ways (``put``/``get``), and write small text files with a mode (``put_text``,
  e.g. a 0600 secrets file, so a key never shows in a command line);
- apply a host-wide environment (``get_host(name, env={"HOME": ...})``): tests use it to put
  engine envs under a temporary HOME.

SSH uses the SSH provider's ``SSHHook``. Host-key checking stays on: the connection must carry
a ``host_key`` extra or the host must be in ``~/.ssh/known_hosts``; this module never turns the
check off. A dropped connection is retried only for calls marked ``idempotent=True`` and for
the copies (``put``/``get``/``put_text`` rewrite the target from the start, so a connection
lost in the middle of a transfer is retried like one lost before it); other calls raise
:class:`HostConnectionError` saying the step may have run partly, so a caller never repeats a
non-idempotent step blindly.

Env values given to ``run`` are exported in the command string: other users of the host can see
them in ``ps``. Put secrets in a 0600 file with ``put_text`` and source it instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("speedmatrix.hosts")
# The SSHHook logs each command and its output at INFO. Polls and probes (stream=False) go
# through a logger that only lets warnings through, so a long install's task log stays short.
_SSH_LOG = logging.getLogger("speedmatrix.hosts.ssh")
_SSH_QUIET_LOG = logging.getLogger("speedmatrix.hosts.ssh.quiet")
_SSH_QUIET_LOG.setLevel(logging.WARNING)

LOCAL = "local"
_RETRIES = 3
# Seconds between timeout's TERM and its KILL when the total timeout fires (`timeout -k`).
_KILL_AFTER_S = 10
# First stderr line of every SSH command: the id of the session (and process group) the
# wrapper made for it, so an idle timeout can kill it on the host. Stripped from the output.
_SID_TAG = "speedmatrix-hosts-sid="

# Every command runs as `bash -c _WRAPPER speedmatrix SCRIPT TOTAL MARKER SID_TAG KILL_AFTER`.
# Why a wrapper: the exit code alone cannot say "the total timeout fired". coreutils `timeout`
# exits 124 then, or dies by its own SIGKILL (137) when the command outlived TERM by
# KILL_AFTER s; but a command can exit 124 itself, and one killed by the OOM killer reads 137
# too. `timeout --verbose` says "sending signal ..." on its own stderr exactly when it fires: the
# wrapper gives that stderr a pipe of its own (the command gets the real stderr back via fd 3),
# and only when timeout said something and exited 124/137 does it print MARKER, a line unique
# to this call. The command is never exec'd by the wrapper, so a command killed by a signal is
# reported as 128+N on both transports (bash's own "Killed" notice about it goes to /dev/null).
_WRAPPER = r"""
[ -n "$4" ] && printf '%s%s\n' "$4" "$$" >&2
if [ -z "$2" ]; then
  { bash -c "$1" 2>&3 3>&-; } 3>&2 2>/dev/null
  exit $?
fi
exec 3>&2
{ m=$(timeout --verbose -k "$5" "$2" bash -c 'exec 2>&3 3>&-; exec bash -c "$1"' sm "$1" 2>&1 >&4 4>&-); } 4>&1
rc=$?
exec 3>&-
[ -n "$m" ] && printf '%s\n' "$m" >&2
case $rc in 124|137) [ -n "$m" ] && printf '\n%s\n' "$3" >&2 ;; esac
exit $rc
"""


@dataclass(frozen=True)
class CommandResult:
    """What a command left behind: exit code and captured text."""

    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def tail(self, lines: int = 40) -> str:
        """The last lines of stdout and stderr together, for error messages."""
        text = (self.stdout + ("\n" if self.stdout and self.stderr else "") + self.stderr).strip()
        return "\n".join(text.splitlines()[-lines:])


class HostError(RuntimeError):
    """Base class of every failure this module raises."""


class CommandError(HostError):
    """A command exited non-zero (raised by ``run(..., check=True)``)."""

    def __init__(self, host: str, cmd: str, result: CommandResult):
        self.host, self.cmd, self.result = host, cmd, result
        short = cmd if len(cmd) < 200 else cmd[:197] + "..."
        super().__init__(
            f"on {host}: command failed with exit code {result.rc}: {short}\n{result.tail()}"
        )


class CommandTimeout(HostError):
    """A command ran longer than its total timeout, or was silent longer than its idle one."""

    def __init__(self, host: str, cmd: str, why: str, partial: CommandResult | None = None):
        self.host, self.cmd, self.partial = host, cmd, partial
        short = cmd if len(cmd) < 200 else cmd[:197] + "..."
        super().__init__(f"on {host}: {why}: {short}")


class HostConnectionError(HostError):
    """The connection to the host failed or dropped."""


class Host(ABC):
    """One machine commands run on. Get one with :func:`get_host`."""

    name: str

    def __init__(self, name: str, env: dict[str, str] | None = None):
        self.name = name
        self.env = dict(env or {})
        self._home: str | None = None

    # ---------------------------------------------------------------- commands
    def run(
        self,
        cmd: str,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        check: bool = False,
        *,
        idempotent: bool = False,
        stream: bool = True,
    ) -> CommandResult:
        """Run ``cmd`` with bash on the host and return its exit code and output.

        ``timeout_s`` bounds the total time (the host kills the command: TERM, then KILL
        ``_KILL_AFTER_S`` later), ``idle_timeout_s`` the time without any output (the command's
        session is killed on the host). Either raises :class:`CommandTimeout` with the output so
        far; any other exit, 124 and 137 included, is returned as the command's own.
        ``idempotent=True`` allows a retry after a dropped connection. ``check=True`` raises
        :class:`CommandError` on a non-zero exit.
        """
        script = self._script(cmd, env)
        marker = f"speedmatrix-hosts: total timeout fired {uuid.uuid4().hex}"
        wrapped = self._wrap(script, timeout_s, marker)
        attempts = _RETRIES if idempotent else 1
        for attempt in range(1, attempts + 1):
            try:
                result = self._exec(wrapped, cmd, timeout_s, idle_timeout_s, stream)
                break
            except HostConnectionError as exc:
                if attempt == attempts:
                    if not idempotent:
                        raise HostConnectionError(
                            f"{exc}; the step may have run partly and is not repeated "
                            "automatically because it is not idempotent"
                        ) from exc
                    raise
                log.warning("%s: connection problem (%s); retry %d", self.name, exc, attempt)
                self._reset()
                time.sleep(min(2 * attempt, 5))
        if marker in result.stderr:
            stderr = result.stderr.replace(f"\n{marker}\n", "").replace(marker, "")
            result = CommandResult(result.rc, result.stdout, stderr)
            raise CommandTimeout(
                self.name, cmd, f"no exit within the total timeout of {timeout_s:g} s", result
            )
        if check and result.rc != 0:
            raise CommandError(self.name, cmd, result)
        return result

    def _wrap(self, script: str, timeout_s: float | None, marker: str, sid_tag: str = "") -> str:
        """The command line the transport runs: ``script`` under :data:`_WRAPPER`."""
        total = "" if timeout_s is None else str(max(1, int(timeout_s + 0.999)))
        args = (_WRAPPER, "speedmatrix", script, total, marker, sid_tag, str(_KILL_AFTER_S))
        return "bash -c " + " ".join(shlex.quote(a) for a in args)

    def _script(self, cmd: str, env: dict[str, str] | None) -> str:
        merged = {**self.env, **(env or {})}
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in merged.items())
        return exports + cmd

    # ---------------------------------------------------------------- files
    def home(self) -> str:
        """$HOME on the host (after the host-wide env), asked once."""
        if self._home is None:
            res = self.run('printf %s "$HOME"', timeout_s=60, idempotent=True, stream=False)
            if res.rc != 0 or not res.stdout.startswith("/"):
                raise HostError(f"on {self.name}: cannot tell $HOME: {res.tail()}")
            self._home = res.stdout.strip()
        return self._home

    def resolve(self, path: str) -> str:
        """Expand a leading ``$HOME`` / ``~`` into the host's home directory."""
        for prefix in ("$HOME/", "${HOME}/", "~/"):
            if path.startswith(prefix):
                return self.home().rstrip("/") + "/" + path[len(prefix) :]
        if path in ("$HOME", "${HOME}", "~"):
            return self.home()
        return path

    def put(self, local: str | os.PathLike[str], remote: str) -> None:
        """Copy a local file to the host (parent directories are created)."""
        remote = self.resolve(remote)
        self.run(f"mkdir -p {shlex.quote(os.path.dirname(remote) or '.')}", 60, idempotent=True)
        self._retrying(lambda: self._put(str(local), remote))

    def put_text(self, text: str, remote: str, mode: int = 0o600) -> None:
        """Write text to a file on the host with ``mode`` set before any content lands."""
        remote = self.resolve(remote)
        self.run(f"mkdir -p {shlex.quote(os.path.dirname(remote) or '.')}", 60, idempotent=True)
        self._retrying(lambda: self._put_text(text, remote, mode))

    def get(self, remote: str, local: str | os.PathLike[str]) -> None:
        """Copy a file from the host to a local path (parent directories are created)."""
        remote = self.resolve(remote)
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        self._retrying(lambda: self._get(remote, str(local)))

    def _retrying(self, fn: Callable[[], None]) -> None:
        """Run an idempotent file copy; a dropped connection (at connect time or in the middle
        of the transfer) reconnects and retries, up to ``_RETRIES`` tries in all."""
        for attempt in range(1, _RETRIES + 1):
            try:
                fn()
                return
            except HostConnectionError as exc:
                if attempt == _RETRIES:
                    raise
                log.warning("%s: connection problem (%s); retry %d", self.name, exc, attempt)
                self._reset()
                time.sleep(min(2 * attempt, 5))

    # ---------------------------------------------------------------- transport
    @abstractmethod
    def _exec(
        self,
        wrapped: str,
        cmd: str,
        timeout_s: float | None,
        idle_timeout_s: float | None,
        stream: bool,
    ) -> CommandResult: ...

    @abstractmethod
    def _put(self, local: str, remote: str) -> None: ...

    @abstractmethod
    def _put_text(self, text: str, remote: str, mode: int) -> None: ...

    @abstractmethod
    def _get(self, remote: str, local: str) -> None: ...

    def _reset(self) -> None:  # noqa: B027 - a no-op unless the transport caches a connection
        """Drop a cached connection so the next call reconnects."""

    def close(self) -> None:  # noqa: B027 - a no-op unless the transport holds a connection
        """Release the connection (a no-op for ``local``)."""

    @property
    def is_local(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class LocalHost(Host):
    """Commands as subprocesses of this process, on this machine."""

    @property
    def is_local(self) -> bool:
        return True

    def _exec(self, wrapped, cmd, timeout_s, idle_timeout_s, stream) -> CommandResult:
        proc = subprocess.Popen(
            ["bash", "-c", wrapped],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        out: list[bytes] = []
        err: list[bytes] = []
        sel = selectors.DefaultSelector()
        assert proc.stdout is not None and proc.stderr is not None
        sel.register(proc.stdout, selectors.EVENT_READ, (out, logging.INFO))
        sel.register(proc.stderr, selectors.EVENT_READ, (err, logging.WARNING))
        last_output = time.monotonic()
        open_streams = 2
        try:
            while open_streams:
                wait = None if idle_timeout_s is None else idle_timeout_s
                events = sel.select(wait)
                if not events:
                    if idle_timeout_s is not None and time.monotonic() - last_output >= wait:
                        _kill_session(proc)
                        partial = CommandResult(-9, _txt(out), _txt(err))
                        raise CommandTimeout(
                            self.name, cmd, f"no output for {idle_timeout_s:g} s", partial
                        )
                    continue
                for key, _ in events:
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        open_streams -= 1
                        continue
                    last_output = time.monotonic()
                    buf, level = key.data
                    buf.append(chunk)
                    if stream:
                        for line in chunk.decode("utf-8", "replace").splitlines():
                            log.log(level, "%s| %s", self.name, line)
            rc = proc.wait()
        finally:
            sel.close()
            if proc.poll() is None:
                _kill_session(proc)
        return CommandResult(rc, _txt(out), _txt(err))

    def home(self) -> str:
        return self.env.get("HOME") or os.path.expanduser("~")

    def _put(self, local: str, remote: str) -> None:
        shutil.copyfile(local, remote)

    def _put_text(self, text: str, remote: str, mode: int) -> None:
        fd = os.open(remote, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(text)

    def _get(self, remote: str, local: str) -> None:
        shutil.copyfile(remote, local)


class SSHHost(Host):
    """Commands over SSH through an Airflow SSH connection (the provider's ``SSHHook``)."""

    def __init__(self, ssh_conn_id: str, env: dict[str, str] | None = None, **hook_kwargs):
        super().__init__(ssh_conn_id, env)
        self.ssh_conn_id = ssh_conn_id
        self._hook_kwargs = hook_kwargs
        self._hook = None

    @property
    def hook(self):
        if self._hook is None:
            from airflow.providers.ssh.hooks.ssh import SSHHook

            # cmd_timeout is given per call; the connection's host-key settings are used as
            # they are (checking on unless the connection itself says otherwise).
            self._hook = SSHHook(ssh_conn_id=self.ssh_conn_id, **self._hook_kwargs)
        return self._hook

    def _client(self):
        try:
            return self.hook.get_conn()
        except Exception as exc:  # paramiko raises many types; all mean "no connection"
            raise HostConnectionError(
                f"cannot connect to {self.name}: {type(exc).__name__}: {exc}"
            ) from exc

    def _wrap(self, script: str, timeout_s: float | None, marker: str, sid_tag: str = "") -> str:
        """Under ``setsid -w``: the command gets a session (and process group) of its own on the
        host, whose id the wrapper reports first, so an idle timeout can kill all of it (closing
        the channel does not: without a pty, sshd leaves the command running)."""
        return "setsid -w " + super()._wrap(script, timeout_s, marker, _SID_TAG)

    def _exec(self, wrapped, cmd, timeout_s, idle_timeout_s, stream) -> CommandResult:
        """Run ``wrapped`` on a fresh channel and read until the server's EOF.

        Not the hook's ``exec_ssh_client_command``: it stops reading as soon as the exit
        status has arrived and no data is buffered at that instant, but sshd may send the exit
        status before the last of the output (seen here: a 17 kB ``tail`` of a server log came
        back as 8 kB once in ~120 reads while vLLM loaded the CPU), and a truncated answer is
        read as a wrong one (a marker "unreadable", a log without its KV-cache line). EOF
        comes after all output, so this reads until EOF on both streams; the exit status
        follows. ``idle_timeout_s`` bounds the time without any output; when it hits, the
        command's session on the host is killed over a fresh channel before this raises.
        """
        client = self._client()
        logger = _SSH_LOG if stream else _SSH_QUIET_LOG
        logger.info("Running command: %s", cmd)
        try:
            transport = client.get_transport()
            if transport is None or not transport.is_active():
                raise HostConnectionError(f"{self.name}: the connection is closed")
            chan = transport.open_session(timeout=60)
        except HostConnectionError:
            raise
        except Exception as exc:
            raise HostConnectionError(
                f"{self.name}: cannot open a channel: {type(exc).__name__}: {exc}"
            ) from exc
        sid: list[int] = []
        try:
            chan.exec_command(wrapped)
            chan.shutdown_write()
            out, err = _read_channel(chan, self.name, cmd, idle_timeout_s, logger, sid)
            # Set by the exit-status message, or -1 once the channel closed without one.
            rc = chan.recv_exit_status()
        except CommandTimeout:
            self._kill_remote_session(sid[0] if sid else None, cmd)
            raise
        except HostConnectionError:
            raise
        except Exception as exc:
            raise HostConnectionError(
                f"{self.name}: connection failed during a command: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            with contextlib.suppress(Exception):
                chan.close()
        if rc is None or rc < 0:
            # paramiko reports -1 when the channel closed without an exit status.
            raise HostConnectionError(f"{self.name}: the channel closed without an exit status")
        return CommandResult(rc, _txt(out), _txt(err))

    def _kill_remote_session(self, sid: int | None, cmd: str) -> None:
        """SIGKILL every process of session ``sid`` on the host (the command of an idle
        timeout), until none is left; a failure is logged, as the command may still run."""
        if sid is None:
            log.warning(
                "%s: idle timeout, but the command never reported its session id: it may "
                "still be running on the host: %s",
                self.name,
                cmd[:200],
            )
            return
        kill = (
            f"s={int(sid)}; kill -KILL -- -$s 2>/dev/null; for i in $(seq 20); do "
            "p=$(ps -eo pid=,sid= | awk -v s=$s '$2 == s {print $1}'); "
            '[ -z "$p" ] && exit 0; kill -KILL $p 2>/dev/null; sleep 0.1; done; '
            'echo "still there: $p"; exit 1'
        )
        try:
            res = self.run(kill, timeout_s=30, idempotent=True, stream=False)
        except HostError as exc:
            res = CommandResult(-1, "", str(exc))
        if res.rc == 0:
            log.info("%s: killed session %d of the command that timed out", self.name, sid)
        else:
            log.warning(
                "%s: could not kill session %d of the command that timed out (%s): it may "
                "still be running on the host",
                self.name,
                sid,
                res.tail(3) or f"exit code {res.rc}",
            )

    def _sftp_op(self, what: str, op: Callable[[Any], None]) -> None:
        """Run one SFTP operation on a fresh SFTP channel, sorting its failures.

        A copy is idempotent (the target is rewritten from the start), so a failure that means
        "the connection went away" (paramiko's ``SSHException`` such as "Server connection
        dropped", ``EOFError``, a socket error, or any error once the transport is dead) becomes
        :class:`HostConnectionError`, which :meth:`_retrying` answers with a reconnect and a
        retry. A missing file or a permission problem is raised as it is, and an SFTP status
        error on a live connection (e.g. a full disk) as :class:`HostError`: neither gets
        better by retrying.
        """
        client = self._client()
        try:
            sftp = client.open_sftp()
        except Exception as exc:
            raise HostConnectionError(
                f"{self.name}: sftp {what} could not open a channel: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            op(sftp)
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError):
            raise
        except Exception as exc:
            text = f"{self.name}: sftp {what} failed: {type(exc).__name__}: {exc}"
            if _connection_gone(client, exc):
                raise HostConnectionError(text) from exc
            raise HostError(text) from exc
        finally:
            # Closing a channel of a dead connection raises too; that must not hide the cause.
            with contextlib.suppress(Exception):
                sftp.close()

    def _put(self, local: str, remote: str) -> None:
        self._sftp_op(f"put {remote}", lambda sftp: sftp.put(local, remote))

    def _put_text(self, text: str, remote: str, mode: int) -> None:
        def write(sftp) -> None:
            with sftp.open(remote, "w") as fh:
                fh.chmod(mode)
                fh.write(text.encode())

        self._sftp_op(f"put_text {remote}", write)

    def _get(self, remote: str, local: str) -> None:
        self._sftp_op(f"get {remote}", lambda sftp: sftp.get(remote, local))

    def _reset(self) -> None:
        if self._hook is not None and self._hook.client is not None:
            with contextlib.suppress(Exception):
                self._hook.client.close()
            self._hook.client = None

    def close(self) -> None:
        self._reset()


def get_host(name: str = LOCAL, env: dict[str, str] | None = None, **hook_kwargs) -> Host:
    """``"local"`` -> this machine; anything else is an Airflow SSH connection id.

    ``env`` is exported before every command on that host (e.g. ``{"HOME": "/tmp/h"}``).
    """
    if name == LOCAL:
        return LocalHost(LOCAL, env)
    return SSHHost(name, env, **hook_kwargs)


def _txt(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode("utf-8", "replace")


# Once the exit status is in, how long to keep reading without EOF: a background process the
# command left holding its output open would otherwise keep the call waiting for ever.
_EOF_GRACE_S = 10.0


def _read_channel(
    chan: Any,
    host: str,
    cmd: str,
    idle_timeout_s: float | None,
    logger: logging.Logger,
    sid: list[int] | None = None,
) -> tuple[list[bytes], list[bytes]]:
    """Read stdout and stderr of an exec channel until the server's EOF (all output sent).

    With ``sid`` given, the first stderr line is the wrapper's ``_SID_TAG<sid>`` line: it is
    taken out of the output and its number appended to ``sid`` (for the idle-timeout kill).
    """
    out: list[bytes] = []
    err: list[bytes] = []
    tag = _SID_TAG.encode()
    head: bytes | None = b"" if sid is not None else None  # stderr before the tag line ended
    last_output = time.monotonic()
    exit_seen: float | None = None

    def stderr_chunk(chunk: bytes) -> None:
        nonlocal head
        if head is not None:
            head += chunk
            if b"\n" not in head and len(head) < 200:
                return
            line, nl, rest = head.partition(b"\n")
            head = None
            if line.startswith(tag) and line[len(tag) :].isdigit() and sid is not None:
                sid.append(int(line[len(tag) :]))
                chunk = rest
            else:
                chunk = line + nl + rest
            if not chunk:
                return
        err.append(chunk)
        for line in chunk.decode("utf-8", "replace").splitlines():
            logger.warning(line)

    def flush_head() -> None:
        """Output ends before the tag line did: what came is ordinary stderr."""
        nonlocal head
        if head:
            err.append(head)
        head = None

    with selectors.DefaultSelector() as sel:
        sel.register(chan, selectors.EVENT_READ)
        while True:
            got = False
            while chan.recv_ready():
                chunk = chan.recv(65536)
                if not chunk:
                    break
                out.append(chunk)
                got = True
                for line in chunk.decode("utf-8", "replace").splitlines():
                    logger.info(line)
            while chan.recv_stderr_ready():
                chunk = chan.recv_stderr(65536)
                if not chunk:
                    break
                stderr_chunk(chunk)
                got = True
            now = time.monotonic()
            if got:
                last_output = now
            if chan.eof_received or chan.closed:
                if not chan.recv_ready() and not chan.recv_stderr_ready():
                    flush_head()
                    return out, err
                continue
            if chan.exit_status_ready():
                exit_seen = exit_seen or now
                if now - exit_seen > _EOF_GRACE_S:
                    logger.warning(
                        "%s: no end of output %g s after the exit status (a background "
                        "process holds it open?): output may be incomplete: %s",
                        host,
                        _EOF_GRACE_S,
                        cmd[:200],
                    )
                    flush_head()
                    return out, err
            wait = 1.0
            if idle_timeout_s is not None:
                left = idle_timeout_s - (now - last_output)
                if left <= 0:
                    flush_head()
                    partial = CommandResult(-9, _txt(out), _txt(err))
                    raise CommandTimeout(
                        host, cmd, f"no output for {idle_timeout_s:g} s (idle timeout)", partial
                    )
                wait = min(wait, left)
            sel.select(wait)


def _connection_gone(client: Any, exc: BaseException) -> bool:
    """Whether ``exc`` (raised by an SFTP call) means the SSH connection itself went away."""
    import paramiko

    if isinstance(exc, paramiko.SSHException | EOFError | ConnectionError | TimeoutError):
        return True
    transport = client.get_transport()
    # paramiko raises a bare OSError("Socket is closed") when it sends on a dropped channel,
    # the same type as an SFTP status error: the transport's state tells them apart.
    return transport is None or not transport.is_active()


def _session_pids(sid: int) -> list[int]:
    """PIDs of the processes in session ``sid`` on this machine (from /proc/<pid>/stat)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:
            continue
        # After "pid (comm)": state ppid pgrp session ...
        if len(fields) > 3 and fields[3] == str(sid):
            pids.append(int(entry))
    return pids


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the command's session (``start_new_session``), not just its
    first process group: coreutils ``timeout`` moves itself and the command into a group of
    its own inside that session. A process that left the session (a server started with
    ``setsid``) is not touched, on purpose."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for _ in range(10):
        pids = [p for p in _session_pids(proc.pid) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    proc.wait()
