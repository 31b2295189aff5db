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
- capture stdout/stderr and the exit code, and stream lines to the ``speedmatrix.hosts`` logger
  (which an Airflow task log shows);
- copy files both ways (``put``/``get``), and write small text files with a mode (``put_text``,
  e.g. a 0600 secrets file, so a key never shows in a command line);
- apply a host-wide environment (``get_host(name, env={"HOME": ...})``): tests use it to put
  engine envs under a temporary HOME.

SSH uses the SSH provider's ``SSHHook``. Host-key checking stays on: the connection must carry
a ``host_key`` extra or the host must be in ``~/.ssh/known_hosts``; this package never turns the
check off. A host key that does not match or is unknown, refused credentials, or a connection
id that is not configured raise :class:`HostRefused` at once: final, never retried (retrying
cannot fix them). Other connection failures are retried (three connection attempts, 2 s then
4 s apart: `get_host(..., reconnect_pause_s=...)` sets the first wait).

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

One module per job:

=============  ==================================================================================
``wrapper``    the bash every command runs under (total timeout told apart, session recorded),
               and the bash that ends a registered command
``base``       :class:`Host`: the interface, the retry rules, ``$HOME`` paths; the result and errors
``local``      :class:`LocalHost`: subprocesses of this process
``ssh``        :class:`SSHHost`: the SSH transport, its channels, SFTP and the command-channel copy
=============  ==================================================================================
"""

from speedmatrix.engine.hosts.base import (
    RECONNECT_PAUSE_S,
    CommandError,
    CommandResult,
    CommandTimeout,
    Host,
    HostConnectionError,
    HostError,
    HostRefused,
)
from speedmatrix.engine.hosts.local import LocalHost
from speedmatrix.engine.hosts.ssh import SSHHost

LOCAL = "local"

__all__ = [
    "LOCAL",
    "CommandError",
    "CommandResult",
    "CommandTimeout",
    "Host",
    "HostConnectionError",
    "HostError",
    "HostRefused",
    "LocalHost",
    "SSHHost",
    "get_host",
]


def get_host(
    name: str = LOCAL,
    env: dict[str, str] | None = None,
    *,
    reconnect_pause_s: float = RECONNECT_PAUSE_S,
    **hook_kwargs,
) -> Host:
    """``"local"`` -> this machine; anything else is an Airflow SSH connection id.

    ``env`` is exported before every command on that host (e.g. ``{"HOME": "/tmp/h"}``).
    ``reconnect_pause_s`` is the first wait before a dropped connection is retried (then
    twice it, at most 2.5 times it: :func:`.base.backoff`).
    """
    if name == LOCAL:
        return LocalHost(LOCAL, env, reconnect_pause_s=reconnect_pause_s)
    return SSHHost(name, env, reconnect_pause_s=reconnect_pause_s, **hook_kwargs)
