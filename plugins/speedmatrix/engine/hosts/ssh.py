"""Commands and copies over SSH, through an Airflow SSH connection (the provider's ``SSHHook``).

One job: the SSH transport (its rules are in the package docstring): connecting (a refusal is
final, other failures retried), one channel per command read until the server's EOF, ending a
dropped or idle command on the host (:data:`.wrapper.ENDER`), and copies by SFTP or, on a
host without it, through the command channel checked by sha256.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import logging
import selectors
import shlex
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedmatrix.engine.hosts.base import (
    RECONNECT_PAUSE_S,
    RETRIES,
    CommandResult,
    CommandTimeout,
    Host,
    HostConnectionError,
    HostError,
    HostRefused,
    backoff,
    joined_text,
    reconnecting,
)
from speedmatrix.engine.hosts.wrapper import CMD_DIR, END_GRACE_S, ENDED, ENDER

log = logging.getLogger("speedmatrix.hosts")
# The SSHHook logs each command and its output at INFO. Polls and probes (stream=False) go
# through a logger that only lets warnings through, so a long install's task log stays short.
_SSH_LOG = logging.getLogger("speedmatrix.hosts.ssh")
_SSH_QUIET_LOG = logging.getLogger("speedmatrix.hosts.ssh.quiet")
_SSH_QUIET_LOG.setLevel(logging.WARNING)


class SSHHost(Host):
    """Commands over SSH through an Airflow SSH connection (the provider's ``SSHHook``)."""

    def __init__(
        self,
        ssh_conn_id: str,
        env: dict[str, str] | None = None,
        *,
        reconnect_pause_s: float = RECONNECT_PAUSE_S,
        **hook_kwargs,
    ):
        super().__init__(ssh_conn_id, env, reconnect_pause_s=reconnect_pause_s)
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
        """The connection, made on first use: up to ``RETRIES`` attempts for a transient
        failure, one for a refusal (:class:`HostRefused`)."""

        def connect():
            try:
                return self.hook.get_conn()
            except Exception as exc:  # paramiko raises many types; most mean "no connection"
                why = f"{type(exc).__name__}: {exc}"
                refusal = _refusal(exc)
                if refusal:
                    raise HostRefused(
                        f"cannot connect to {self.name}: {refusal} ({why}); not retried"
                    ) from exc
                raise HostConnectionError(f"cannot connect to {self.name}: {why}") from exc

        return self._reconnecting(RETRIES)(connect)

    def _registration(self) -> str:
        """A file of this command's own, under the host-wide env's HOME when it sets one (the
        wrapper runs before that env is exported), else under the login's $HOME."""
        home = self.env.get("HOME")
        where = f"{home.rstrip('/')}/{CMD_DIR}" if home else CMD_DIR
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
        transport, chan = _open_channel(client, self.name, "cannot open a channel")
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
        return CommandResult(rc, joined_text(out), joined_text(err))

    def _end_remote(self, reg: str) -> str:
        """End the command registered at ``reg`` on the host (:data:`ENDER`: TERM to its
        session, KILL what outlives ``END_GRACE_S``, check none is left; a command not started
        yet never starts). Over a fresh connection, a few tries (the last one just dropped).
        Returns what became of it, for the error message; a failure to end it is logged."""
        cmd = f"bash -c {shlex.quote(ENDER)} ender {shlex.quote(reg)} {int(END_GRACE_S * 10)}"
        res: CommandResult | None = None
        why = ""
        try:  # a connection error is tried again (by default 1 s, then 2 s later), no other
            pause = backoff(self.reconnect_pause_s / 2)
            res = reconnecting(self.name, RETRIES, pause=pause)(
                self._run_once, cmd, 30 + END_GRACE_S, None, None, False, track=False
            )
        except HostError as exc:
            why = str(exc)
        word = res.stdout.split()[0] if res is not None and res.stdout.split() else ""
        if res is not None and res.rc == 0 and word in ENDED:
            return ENDED[word]
        why = why or (res.tail(3) if res is not None else "") or "no answer"
        fate = f"it may still be running on the host (could not end it: {why})"
        log.warning("%s: %s", self.name, fate)
        return fate

    # ------------------------------------------------------------- copies
    def _open_sftp(self, client: Any, what: str):
        """An SFTP client on a fresh channel of ``client``. :class:`_NoSftp` when the host
        refuses the subsystem (or it does not answer as SFTP) while the connection is fine."""
        import paramiko

        transport, chan = _open_channel(client, self.name, f"sftp {what} could not open a channel")
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
                    partial = CommandResult(-9, joined_text(out), joined_text(err))
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


def _connection_gone(client: Any, exc: BaseException) -> bool:
    """Whether ``exc`` (raised by an SFTP call) means the SSH connection itself went away."""
    import paramiko

    if isinstance(exc, paramiko.SSHException | EOFError | ConnectionError | TimeoutError):
        return True
    transport = client.get_transport()
    # paramiko raises a bare OSError("Socket is closed") when it sends on a dropped channel,
    # the same type as an SFTP status error: the transport's state tells them apart.
    return transport is None or not transport.is_active()


def _open_channel(client: Any, host: str, failed: str) -> tuple[Any, Any]:
    """A fresh session channel of ``client``, and its transport. A closed connection or a
    channel that cannot be opened is a :class:`HostConnectionError` (``failed`` says what
    could not be done), which callers retry where that is safe."""
    transport = client.get_transport()
    try:
        if transport is None or not transport.is_active():
            raise HostConnectionError(f"{host}: the connection is closed")
        return transport, transport.open_session(timeout=60)
    except HostConnectionError:
        raise
    except Exception as exc:
        raise HostConnectionError(f"{host}: {failed}: {type(exc).__name__}: {exc}") from exc
