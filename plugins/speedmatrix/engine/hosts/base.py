"""One interface for running commands and copying files on a host, whatever the transport.

One job: what every caller relies on (see the package docstring): :class:`Host` runs a
command with bash under the wrapper (:mod:`.wrapper`), retries a dropped connection only
where that is safe, resolves ``$HOME`` paths, and copies files; the transports
(:mod:`.local`, :mod:`.ssh`) supply only ``_exec`` and the copies. Also the result and the
errors, one family (:class:`HostError`).
"""

from __future__ import annotations

import logging
import os
import shlex
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from speedmatrix.engine.hosts.wrapper import wrap_command

log = logging.getLogger("speedmatrix.hosts")

RETRIES = 3
"""Tries in all for an idempotent step whose connection dropped (a refusal is never retried)."""

RECONNECT_PAUSE_S = 2.0
"""A host's first wait before it reconnects (``get_host(..., reconnect_pause_s=...)``): long
enough for a restarting sshd or a flapping link to come back; see :func:`backoff`."""


def backoff(first_s: float) -> Callable[[int], float]:
    """The wait after the n-th failed try: ``n * first_s``, at most ``2.5 * first_s`` (for the
    default 2 s: 2, 4, then 5 s)."""
    return lambda attempt: min(first_s * attempt, 2.5 * first_s)


@dataclass(frozen=True)
class CommandResult:
    """What a command left behind: exit code and captured text."""

    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def last_line(self) -> str:
        """The last line of stdout ("" when it printed nothing): where a probe script leaves
        its answer after whatever a login shell printed before it."""
        text = self.stdout.strip()
        return text.splitlines()[-1] if text else ""

    def tail(self, lines: int = 40) -> str:
        """The last lines of stdout and stderr together, for error messages."""
        text = (self.stdout + ("\n" if self.stdout and self.stderr else "") + self.stderr).strip()
        return "\n".join(text.splitlines()[-lines:])


class HostError(RuntimeError):
    """Base class of every failure the hosts package raises."""


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


def reconnecting(
    host: str,
    attempts: int,
    *,
    pause: Callable[[int], float] | None = None,
    before: Callable[[], Any] | None = None,
    sleep: Callable[[float], Any] | None = None,
) -> Retrying:
    """The hosts' one retry rule: a :class:`HostConnectionError` is tried again, up to
    ``attempts`` tries in all, ``pause(n)`` seconds after the n-th (2, 4, then 5 s); anything
    else, and the last connection error itself, is raised as it is (``pause`` by default:
    ``backoff(RECONNECT_PAUSE_S)``). ``before`` runs before each
    wait (a reconnect); ``sleep`` waits (``time.sleep``, looked up when called). Call the result
    with the step: ``reconnecting(...)(step)``."""

    def warn(state: Any) -> None:
        exc = state.outcome.exception()
        log.warning("%s: connection problem (%s); retry %d", host, exc, state.attempt_number)
        if before is not None:
            before()

    return Retrying(
        stop=stop_after_attempt(attempts),
        wait=lambda state: (pause or backoff(RECONNECT_PAUSE_S))(state.attempt_number),
        retry=retry_if_exception_type(HostConnectionError),
        before_sleep=warn,
        sleep=sleep or time.sleep,
        reraise=True,
    )


class Host(ABC):
    """One machine commands run on. Get one with :func:`get_host`."""

    name: str

    def __init__(
        self,
        name: str,
        env: dict[str, str] | None = None,
        *,
        reconnect_pause_s: float = RECONNECT_PAUSE_S,
    ):
        self.name = name
        self.env = dict(env or {})
        self.reconnect_pause_s = reconnect_pause_s
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
        ``wrapper._KILL_AFTER_S`` later), ``idle_timeout_s`` the time without any output (the command's
        session is killed on the host). Either raises :class:`CommandTimeout` with the output so
        far; any other exit, 124 and 137 included, is returned as the command's own.
        ``idempotent=True`` allows a retry after a dropped connection (the dropped attempt is
        ended on the host first). ``check=True`` raises :class:`CommandError` on a non-zero exit.
        """
        attempts = RETRIES if idempotent else 1
        try:
            result = self._reconnecting(attempts)(
                self._run_once, cmd, timeout_s, idle_timeout_s, env, stream
            )
        except HostConnectionError as exc:
            if idempotent:
                raise
            raise HostConnectionError(
                f"{exc}; the step may have run partly and is not repeated "
                "automatically because it is not idempotent"
            ) from exc
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
        """The command line the transport runs: ``script`` under the wrapper."""
        return wrap_command(script, timeout_s, marker, reg)

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
        of the transfer) reconnects and retries, up to ``RETRIES`` tries in all."""
        self._reconnecting(RETRIES, before=self._reset)(fn)

    def _reconnecting(self, attempts: int, before: Callable[[], Any] | None = None) -> Retrying:
        """:func:`reconnecting` at this host's reconnect pause (``reconnect_pause_s``)."""
        return reconnecting(
            self.name, attempts, pause=backoff(self.reconnect_pause_s), before=before
        )

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


def joined_text(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode("utf-8", "replace")
