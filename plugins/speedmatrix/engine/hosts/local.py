"""Commands as subprocesses of this process, on this machine (the ``local`` host).

One job: the local transport. A command runs in a session of its own
(``start_new_session``), so an idle timeout or an abandoned call kills the whole session,
never a process that left it on purpose (a server started with ``setsid``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from typing import Any

from speedmatrix.engine.hosts.base import CommandResult, CommandTimeout, Host, joined_text

log = logging.getLogger("speedmatrix.hosts")


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
                        partial = CommandResult(-9, joined_text(out), joined_text(err))
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
        return CommandResult(rc, joined_text(out), joined_text(err))

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


def _feed(pipe: Any, data: bytes) -> None:
    """Write ``data`` to a subprocess's stdin and close it (a reader that stops early is no
    error here: its exit code says why)."""
    with contextlib.suppress(OSError):
        pipe.write(data)
    with contextlib.suppress(OSError):
        pipe.close()


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
