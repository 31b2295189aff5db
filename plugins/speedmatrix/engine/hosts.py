"""Run commands on a host and copy files both ways: over SSH or on the local machine.

Why one interface: provisioning and the server lifecycle are written once and run the same on a
GPU host reached through an Airflow SSH connection and on the Airflow worker itself (``local``,
the demo's default). Both transports:

- run a command with bash, with a *total* timeout (enforced on the host by coreutils
  ``timeout``, so nothing keeps running on the host when it fires) separate from an *idle*
  timeout (no output for that long; the command's whole session is ended on the host then);
- tell a total timeout from a command that exited 124 or was SIGKILLed for another reason
  (an OOM kill reads 137): ``timeout --verbose`` writes to a stream of its own, and only when
  it did send a signal does the wrapper add a once-only marker line;
- capture stdout/stderr and the exit code, and stream lines to the ``speedmatrix.engine.hosts`` logger
  (which an Airflow task log shows);
- copy files both ways (``put``/``get``), and write small text files with a mode (``put_text``,
  e.g. a 0600 secrets file, so a key never shows in a command line);
- apply a host-wide environment (``get_host(name, env={"HOME": ...})``): tests use it to put
  engine envs under a temporary HOME.

SSH uses the SSH provider's ``SSHHook``. Host-key checking stays on: the connection must carry
a ``host_key`` extra or the host must be in ``~/.ssh/known_hosts``; this module never turns the
check off. A host key that does not match or is unknown, refused credentials, or a connection
id that is not configured raise :class:`HostRefused` at once: final, never retried (retrying
cannot fix them). Other connection failures are retried (three connection attempts).

A dropped connection does not stop a command on the host (without a pty, sshd leaves it
running). So every SSH command runs in a session (and process group) of its own, ``setsid``,
and records that session's id and start time in a file of its own under
``$HOME/.speedmatrix/run/commands/`` on the host (``HOME`` of the host-wide env when it sets
one); the file goes when the command ends. When the connection drops during a command, this
side reconnects and ends it before retrying or raising: TERM to every process of the session,
up to 2 s for them to go, KILL to what is left, then a check that none is left (the same is
done to a command whose idle timeout fired). A command whose start raced the drop is kept from
starting (its file is claimed first). The error, or the retry's log line, says which happened,
or that the host could not be reached to end it. A process that left the session on purpose (a
server or an install started with ``setsid``) is never touched.

A dropped connection is retried only for calls marked ``idempotent=True`` and for the copies
(``put``/``get``/``put_text`` rewrite the target from the start, so a connection lost in the
middle of a transfer is retried like one lost before it); other calls raise
:class:`HostConnectionError` saying the step may have run partly, so a caller never repeats a
non-idempotent step blindly.

Copies use SFTP. A host without it (``Subsystem sftp`` off, as on some hardened hosts: the
subsystem request is refused while the connection is fine) gets its files through the command
channel instead: the bytes are streamed on a command's stdin into a temporary file next to the
target, checked by sha256 on the host, then renamed into place (``get``: the host sends the
file's sha256, then the file, checked here). Said once per host in the log.

Env values given to ``run`` are exported in the command string: other users of the host can see
them in ``ps``. Put secrets in a 0600 file with ``put_text`` and source it instead.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import logging
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import threading
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
# Where an SSH command records its session (relative to $HOME on the host, see the docstring).
_CMD_DIR = ".speedmatrix/run/commands"
# How long a dropped or idle command gets between TERM and KILL.
_END_GRACE_S = 2

# Every command runs as `bash -c _WRAPPER speedmatrix SCRIPT TOTAL MARKER REGFILE KILL_AFTER`.
# Why a wrapper: the exit code alone cannot say "the total timeout fired". coreutils `timeout`
# exits 124 then, or dies by its own SIGKILL (137) when the command outlived TERM by
# KILL_AFTER s; but a command can exit 124 itself, and one killed by the OOM killer reads 137
# too. `timeout --verbose` says "sending signal ..." on its own stderr exactly when it fires: the
# wrapper gives that stderr a pipe of its own (the command gets the real stderr back via fd 3),
# and only when timeout said something and exited 124/137 does it print MARKER, a line unique
# to this call. The command is never exec'd by the wrapper, so a command killed by a signal is
# reported as 128+N on both transports (bash's own "Killed" notice about it goes to /dev/null).
# REGFILE (SSH only; relative paths are under $HOME): where the wrapper, the leader of the
# command's session under `setsid`, records "<session id> <start time>" (created exclusively:
# if _ENDER claimed it first, the connection dropped before the command started, and it does
# not start). Removed when the command ends.
_WRAPPER = r"""
r=$4
if [ -n "$r" ]; then
  case $r in /*) ;; *) r=$HOME/$r ;; esac
  mkdir -p "${r%/*}" 2>/dev/null
  read -r st < /proc/$$/stat; st=${st##*) }; f=($st)
  if ! (set -C; printf '%s %s\n' "$$" "${f[19]}" > "$r") 2>/dev/null; then
    if [ "$(cat "$r" 2>/dev/null)" = cancelled ]; then
      echo "speedmatrix-hosts: not started: its connection dropped first" >&2; exit 1
    fi
    r=
  fi
fi
if [ -z "$2" ]; then
  { bash -c "$1" 2>&3 3>&-; } 3>&2 2>/dev/null
  rc=$?
else
  exec 3>&2
  { m=$(timeout --verbose -k "$5" "$2" bash -c 'exec 2>&3 3>&-; exec bash -c "$1"' sm "$1" 2>&1 >&4 4>&-); } 4>&1
  rc=$?
  exec 3>&-
  [ -n "$m" ] && printf '%s\n' "$m" >&2
  case $rc in 124|137) [ -n "$m" ] && printf '\n%s\n' "$3" >&2 ;; esac
fi
[ -n "$r" ] && rm -f "$r"
exit $rc
"""

# Ends the command registered at $1 (see _WRAPPER) after its connection dropped or its idle
# timeout fired; $2 the grace in tenths of a second between TERM and KILL. Prints one word:
# NOTSTARTED (claimed before the command could start: it never will), GONE (already ended),
# TERM / KILL (ended by that signal), LEFT <pids> (still there after KILL, exit 1).
# The session is ours while its leader has the start time recorded or, the leader gone, while
# it has members (Linux hands out no PID that is still a session's id). Zombies are not counted.
_ENDER = r"""
r=$1; case $r in /*) ;; *) r=$HOME/$r ;; esac
mkdir -p "${r%/*}" 2>/dev/null
if (set -C; echo cancelled > "$r") 2>/dev/null; then echo NOTSTARTED; exit 0; fi
read -r s st _ < "$r" 2>/dev/null
case $s in cancelled) echo NOTSTARTED; exit 0 ;; ''|*[!0-9]*) echo "UNREADABLE $r"; exit 3 ;; esac
if x=$(cat /proc/$s/stat 2>/dev/null); then
  x=${x##*) }; f=($x)
  if [ "${f[3]}" = "$s" ] && [ "${f[19]}" != "$st" ]; then rm -f "$r"; echo GONE; exit 0; fi
fi
members() { ps -eo pid=,sid=,stat= | awk -v s="$s" '$2 == s && $3 !~ /^Z/ {print $1}'; }
p=$(members)
if [ -z "$p" ]; then rm -f "$r"; echo GONE; exit 0; fi
kill -TERM $p 2>/dev/null
for i in $(seq "$2"); do
  sleep 0.1; p=$(members); if [ -z "$p" ]; then rm -f "$r"; echo TERM; exit 0; fi
done
for i in $(seq 20); do
  kill -KILL $p 2>/dev/null; sleep 0.1
  p=$(members); if [ -z "$p" ]; then rm -f "$r"; echo KILL; exit 0; fi
done
echo LEFT $p; exit 1
"""
_ENDED = {
    "NOTSTARTED": "it had not started on the host, and will not",
    "GONE": "it had already ended on the host",
    "TERM": "it was ended on the host (SIGTERM to its session)",
    "KILL": "it was ended on the host (SIGKILL to its session, which outlived SIGTERM)",
}


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
    """The connection to the host failed or dropped: transient, retried where that is safe.

    ``sent`` is true when it happened after a command was sent (it may have started)."""

    sent: bool = False


class HostRefused(HostError):
    """The host's key did not match or is unknown, the credentials were refused, or the
    connection id is not configured. Final: never retried, as retrying cannot fix it."""


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
        ``idempotent=True`` allows a retry after a dropped connection (the dropped attempt is
        ended on the host first). ``check=True`` raises :class:`CommandError` on a non-zero exit.
        """
        attempts = _RETRIES if idempotent else 1
        for attempt in range(1, attempts + 1):
            try:
                result = self._run_once(cmd, timeout_s, idle_timeout_s, env, stream)
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
                time.sleep(min(2 * attempt, 5))
        if check and result.rc != 0:
            raise CommandError(self.name, cmd, result)
        return result

    def _run_once(
        self,
        cmd: str,
        timeout_s: float | None,
        idle_timeout_s: float | None,
        env: dict[str, str] | None,
        stream: bool,
        stdin: bytes | None = None,
        *,
        track: bool = True,
    ) -> CommandResult:
        """One attempt of :meth:`run` (``stdin``: bytes sent to the command's stdin).

        A dropped connection is answered here, before it is raised: the connection is reset
        and, if the command had been sent, it is ended on the host (:meth:`_end_remote`); the
        error says what became of it. ``track=False`` runs a command without a registration
        (the ender itself).
        """
        script = self._script(cmd, env)
        marker = f"speedmatrix-hosts: total timeout fired {uuid.uuid4().hex}"
        reg = self._registration() if track else ""
        wrapped = self._wrap(script, timeout_s, marker, reg)
        try:
            result = self._exec(wrapped, cmd, timeout_s, idle_timeout_s, stream, reg, stdin)
        except HostConnectionError as exc:
            self._reset()
            if not (exc.sent and reg):
                raise
            fate = self._end_remote(reg)
            log.warning(
                "%s: the connection dropped during a command; %s: %s", self.name, fate, cmd[:200]
            )
            dropped = HostConnectionError(f"{exc}; {fate}")
            dropped.sent = True
            raise dropped from exc
        if marker in result.stderr:
            stderr = result.stderr.replace(f"\n{marker}\n", "").replace(marker, "")
            result = CommandResult(result.rc, result.stdout, stderr)
            raise CommandTimeout(
                self.name, cmd, f"no exit within the total timeout of {timeout_s:g} s", result
            )
        return result

    def _wrap(self, script: str, timeout_s: float | None, marker: str, reg: str = "") -> str:
        """The command line the transport runs: ``script`` under :data:`_WRAPPER`."""
        total = "" if timeout_s is None else str(max(1, int(timeout_s + 0.999)))
        args = (_WRAPPER, "speedmatrix", script, total, marker, reg, str(_KILL_AFTER_S))
        return "bash -c " + " ".join(shlex.quote(a) for a in args)

    def _registration(self) -> str:
        """Where a command records its session on the host ("" when the transport ends its
        commands itself)."""
        return ""

    def _end_remote(self, reg: str) -> str:
        """End the command registered at ``reg`` on the host; say what became of it."""
        return "it may still be running on the host"

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
        reg: str = "",
        stdin: bytes | None = None,
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

    def _exec(
        self, wrapped, cmd, timeout_s, idle_timeout_s, stream, reg="", stdin=None
    ) -> CommandResult:
        proc = subprocess.Popen(
            ["bash", "-c", wrapped],
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        if stdin is not None:
            threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
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
        # The hook's own connection retries would retry a refused host key too: one attempt
        # per get_conn, the retries are _client's, which knows what not to retry.
        self._hook_kwargs = {"conn_retry_attempts": 1, **hook_kwargs}
        self._hook = None
        self._sftp_ok: bool | None = None  # None: not tried yet; False: copy via commands

    @property
    def hook(self):
        if self._hook is None:
            from airflow.providers.ssh.hooks.ssh import SSHHook

            # cmd_timeout is given per call; the connection's host-key settings are used as
            # they are (checking on unless the connection itself says otherwise).
            self._hook = SSHHook(ssh_conn_id=self.ssh_conn_id, **self._hook_kwargs)
        return self._hook

    def _client(self):
        """The connection, made on first use: up to ``_RETRIES`` attempts for a transient
        failure, one for a refusal (:class:`HostRefused`)."""
        for attempt in range(1, _RETRIES + 1):
            try:
                return self.hook.get_conn()
            except Exception as exc:  # paramiko raises many types; most mean "no connection"
                why = f"{type(exc).__name__}: {exc}"
                refusal = _refusal(exc)
                if refusal:
                    raise HostRefused(
                        f"cannot connect to {self.name}: {refusal} ({why}); not retried"
                    ) from exc
                if attempt == _RETRIES:
                    raise HostConnectionError(f"cannot connect to {self.name}: {why}") from exc
                log.warning("%s: cannot connect (%s); attempt %d", self.name, why, attempt + 1)
                time.sleep(min(2 * attempt, 5))
        raise AssertionError("unreachable")

    def _registration(self) -> str:
        """A file of this command's own, under the host-wide env's HOME when it sets one (the
        wrapper runs before that env is exported), else under the login's $HOME."""
        home = self.env.get("HOME")
        where = f"{home.rstrip('/')}/{_CMD_DIR}" if home else _CMD_DIR
        return f"{where}/{uuid.uuid4().hex}"

    def _wrap(self, script: str, timeout_s: float | None, marker: str, reg: str = "") -> str:
        """Under ``setsid -w``: the command gets a session (and process group) of its own on the
        host, which the wrapper records in ``reg``, so a dropped or idle command can be ended
        whole (closing the channel does not end it: without a pty, sshd leaves it running)."""
        return "setsid -w " + super()._wrap(script, timeout_s, marker, reg)

    def _exec(
        self, wrapped, cmd, timeout_s, idle_timeout_s, stream, reg="", stdin=None
    ) -> CommandResult:
        """Run ``wrapped`` on a fresh channel and read until the server's EOF.

        Not the hook's ``exec_ssh_client_command``: it stops reading as soon as the exit
        status has arrived and no data is buffered at that instant, but sshd may send the exit
        status before the last of the output (seen here: a 17 kB ``tail`` of a server log came
        back as 8 kB once in ~120 reads while vLLM loaded the CPU), and a truncated answer is
        read as a wrong one (a marker "unreadable", a log without its KV-cache line). EOF
        comes after all output, so this reads until EOF on both streams; the exit status
        follows. ``idle_timeout_s`` bounds the time without any output; when it hits, the
        command is ended on the host (:meth:`_end_remote`) before this raises. ``stdin`` is
        sent first, then EOF; a command that stops reading it early is not a dropped
        connection (its exit status says why).
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
        sent = False
        try:
            sent = True  # from here on the command may run on the host
            chan.exec_command(wrapped)
            if stdin is not None:
                try:
                    chan.sendall(stdin)
                except Exception:
                    if not transport.is_active():
                        raise
            with contextlib.suppress(Exception):
                chan.shutdown_write()
            out, err = _read_channel(chan, self.name, cmd, idle_timeout_s, logger)
            # Set by the exit-status message, or -1 once the channel closed without one.
            rc = chan.recv_exit_status()
        except CommandTimeout:
            fate = self._end_remote(reg) if reg else "it may still be running on the host"
            log.warning("%s: idle timeout; %s: %s", self.name, fate, cmd[:200])
            raise
        except HostConnectionError as exc:
            exc.sent = sent
            raise
        except Exception as exc:
            lost = HostConnectionError(
                f"{self.name}: connection failed during a command: {type(exc).__name__}: {exc}"
            )
            lost.sent = sent
            raise lost from exc
        finally:
            with contextlib.suppress(Exception):
                chan.close()
        if rc is None or rc < 0:
            # paramiko reports -1 when the channel closed without an exit status.
            lost = HostConnectionError(f"{self.name}: the channel closed without an exit status")
            lost.sent = True
            raise lost
        return CommandResult(rc, _txt(out), _txt(err))

    def _end_remote(self, reg: str) -> str:
        """End the command registered at ``reg`` on the host (:data:`_ENDER`: TERM to its
        session, KILL what outlives ``_END_GRACE_S``, check none is left; a command not started
        yet never starts). Over a fresh connection, a few tries (the last one just dropped).
        Returns what became of it, for the error message; a failure to end it is logged."""
        cmd = f"bash -c {shlex.quote(_ENDER)} ender {shlex.quote(reg)} {int(_END_GRACE_S * 10)}"
        res: CommandResult | None = None
        why = ""
        for attempt in range(1, _RETRIES + 1):
            try:
                res = self._run_once(cmd, 30 + _END_GRACE_S, None, None, False, track=False)
                break
            except HostConnectionError as exc:
                why = str(exc)
                time.sleep(min(attempt, 3))
            except HostError as exc:
                why = str(exc)
                break
        word = res.stdout.split()[0] if res is not None and res.stdout.split() else ""
        if res is not None and res.rc == 0 and word in _ENDED:
            return _ENDED[word]
        why = why or (res.tail(3) if res is not None else "") or "no answer"
        fate = f"it may still be running on the host (could not end it: {why})"
        log.warning("%s: %s", self.name, fate)
        return fate

    # ------------------------------------------------------------- copies
    def _open_sftp(self, client: Any, what: str):
        """An SFTP client on a fresh channel of ``client``. :class:`_NoSftp` when the host
        refuses the subsystem (or it does not answer as SFTP) while the connection is fine."""
        import paramiko

        transport = client.get_transport()
        try:
            if transport is None or not transport.is_active():
                raise HostConnectionError(f"{self.name}: the connection is closed")
            chan = transport.open_session(timeout=60)
        except HostConnectionError:
            raise
        except Exception as exc:
            raise HostConnectionError(
                f"{self.name}: sftp {what} could not open a channel: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            chan.invoke_subsystem("sftp")
            return paramiko.SFTPClient(chan)
        except Exception as exc:
            with contextlib.suppress(Exception):
                chan.close()
            text = f"{type(exc).__name__}: {exc}"
            if transport.is_active():
                raise _NoSftp(f"the sftp subsystem request failed: {text}") from exc
            raise HostConnectionError(
                f"{self.name}: sftp {what} could not open a channel: {text}"
            ) from exc

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
        sftp = self._open_sftp(client, what)
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

    def _copy(self, what: str, op: Callable[[Any], None], fallback: Callable[[], None]) -> None:
        """SFTP while the host has it, else (from the first refusal on) ``fallback``."""
        if self._sftp_ok is not False:
            try:
                self._sftp_op(what, op)
                self._sftp_ok = True
                return
            except _NoSftp as exc:
                self._sftp_ok = False
                if self.name not in _NO_SFTP_SAID:
                    _NO_SFTP_SAID.add(self.name)
                    log.warning(
                        "%s: no SFTP on this host (%s): files are copied through the command "
                        "channel instead, checked by sha256",
                        self.name,
                        exc,
                    )
        fallback()

    def _put(self, local: str, remote: str) -> None:
        self._copy(
            f"put {remote}",
            lambda sftp: sftp.put(local, remote),
            lambda: self._shell_put(Path(local).read_bytes(), remote, None),
        )

    def _put_text(self, text: str, remote: str, mode: int) -> None:
        def write(sftp) -> None:
            with sftp.open(remote, "w") as fh:
                fh.chmod(mode)
                fh.write(text.encode())

        self._copy(
            f"put_text {remote}", write, lambda: self._shell_put(text.encode(), remote, mode)
        )

    def _get(self, remote: str, local: str) -> None:
        self._copy(
            f"get {remote}",
            lambda sftp: sftp.get(remote, local),
            lambda: self._shell_get(remote, local),
        )

    def _shell_put(self, data: bytes, remote: str, mode: int | None) -> None:
        """Write ``data`` to ``remote`` through a command: streamed on its stdin into a
        temporary file beside the target (created with ``mode`` before any byte lands), its
        sha256 checked on the host, then renamed over the target. A digest that differs (the
        stream was cut) is a :class:`HostConnectionError`, so :meth:`_retrying` sends again."""
        want = hashlib.sha256(data).hexdigest()
        tmp = f"{remote}.speedmatrix-part-{uuid.uuid4().hex[:12]}"
        args = (remote, tmp, "" if mode is None else format(mode, "o"), want)
        res = self._run_once(
            f"bash -c {shlex.quote(_SHELL_PUT)} put " + " ".join(shlex.quote(a) for a in args),
            timeout_s=600,
            idle_timeout_s=None,
            env=None,
            stream=False,
            stdin=data,
        )
        if res.rc == 9:
            raise HostConnectionError(
                f"{self.name}: copy to {remote} through the command channel arrived damaged "
                f"(sha256 differs: {res.tail(1)})"
            )
        if res.rc != 0:
            raise HostError(
                f"{self.name}: copy to {remote} through the command channel failed "
                f"(exit code {res.rc}): {res.tail(5)}"
            )

    def _shell_get(self, remote: str, local: str) -> None:
        """Read ``remote`` through a command: the host sends its sha256, then its bytes in
        base64 (command output is text); the digest is checked here before the local file is
        written."""
        cmd = f"bash -c {shlex.quote(_SHELL_GET)} get {shlex.quote(remote)}"
        res = self._run_once(cmd, 600, None, None, False)
        if res.rc == 66:
            raise FileNotFoundError(errno.ENOENT, f"{self.name}: no such file", remote)
        if res.rc == 77:
            raise PermissionError(errno.EACCES, f"{self.name}: cannot read", remote)
        if res.rc != 0:
            raise HostError(
                f"{self.name}: copy of {remote} through the command channel failed "
                f"(exit code {res.rc}): {res.tail(5)}"
            )
        want, _, b64 = res.stdout.partition("\n")
        try:
            data = base64.b64decode(b64, validate=True)
        except ValueError:
            data = None
        if data is None or hashlib.sha256(data).hexdigest() != want.strip():
            raise HostConnectionError(
                f"{self.name}: copy of {remote} through the command channel arrived damaged "
                "(sha256 differs)"
            )
        Path(local).write_bytes(data)

    def _reset(self) -> None:
        if self._hook is not None and self._hook.client is not None:
            with contextlib.suppress(Exception):
                self._hook.client.close()
            self._hook.client = None

    def close(self) -> None:
        self._reset()


class _NoSftp(HostError):
    """The host refused the sftp subsystem on a live connection."""


_NO_SFTP_SAID: set[str] = set()  # hosts whose lack of SFTP this process has logged

# $1 target, $2 temporary file beside it, $3 octal mode ("" for the umask's), $4 sha256. The
# bytes come on stdin. Exit 9 when they arrived damaged.
_SHELL_PUT = r"""
f=$1; t=$2; mode=$3; want=$4
trap 'rm -f "$t"' EXIT
trap 'exit 143' TERM
if [ -n "$mode" ]; then (umask 077; : > "$t") && chmod "$mode" "$t" || exit 3; fi
cat > "$t" || exit 3
got=$(sha256sum < "$t") || exit 3
got=${got%% *}
if [ "$got" != "$want" ]; then echo "got $got" >&2; exit 9; fi
mv -f "$t" "$f" || exit 3
"""
# $1 the file: its sha256 (64 hex and a newline), then its bytes in base64, on stdout.
# 66: no such file, 77: not readable.
_SHELL_GET = r"""
f=$1
[ -e "$f" ] || exit 66
[ -r "$f" ] || exit 77
d=$(sha256sum < "$f") || exit 3
printf '%s\n' "${d%% *}"
exec base64 -w 0 < "$f"
"""


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
) -> tuple[list[bytes], list[bytes]]:
    """Read stdout and stderr of an exec channel until the server's EOF (all output sent)."""
    out: list[bytes] = []
    err: list[bytes] = []
    last_output = time.monotonic()
    exit_seen: float | None = None
    echo_stdout = logger.isEnabledFor(logging.INFO)  # a quiet call's stdout is not split

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
                if echo_stdout:
                    for line in chunk.decode("utf-8", "replace").splitlines():
                        logger.info(line)
            while chan.recv_stderr_ready():
                chunk = chan.recv_stderr(65536)
                if not chunk:
                    break
                err.append(chunk)
                got = True
                for line in chunk.decode("utf-8", "replace").splitlines():
                    logger.warning(line)
            now = time.monotonic()
            if got:
                last_output = now
            if chan.eof_received or chan.closed:
                if not chan.recv_ready() and not chan.recv_stderr_ready():
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
                    return out, err
            wait = 1.0
            if idle_timeout_s is not None:
                left = idle_timeout_s - (now - last_output)
                if left <= 0:
                    partial = CommandResult(-9, _txt(out), _txt(err))
                    raise CommandTimeout(
                        host, cmd, f"no output for {idle_timeout_s:g} s (idle timeout)", partial
                    )
                wait = min(wait, left)
            sel.select(wait)


def _refusal(exc: BaseException) -> str | None:
    """What is wrong when ``exc`` (from connecting) is a refusal no retry can fix, else None."""
    import paramiko

    if isinstance(exc, paramiko.BadHostKeyException):
        return "the host key does not match the one configured"
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        return "the host key is unknown (no host_key extra, not in known_hosts)"
    if isinstance(exc, paramiko.AuthenticationException):
        return "authentication was refused"
    if type(exc).__name__ == "AirflowNotFoundException" or isinstance(exc, ValueError):
        return "the connection is not configured right"
    return None


def _feed(pipe: Any, data: bytes) -> None:
    """Write ``data`` to a subprocess's stdin and close it (a reader that stops early is no
    error here: its exit code says why)."""
    with contextlib.suppress(OSError):
        pipe.write(data)
    with contextlib.suppress(OSError):
        pipe.close()


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
