"""A command run on a real terminal (a pseudo-terminal from os.openpty), as a user sees it.

Why a pty and not a pipe: the CLI shows a live progress bar only when stderr is a terminal,
and Ctrl-C on a terminal is SIGINT to the whole foreground process group. `Terminal` starts
the command in a session of its own with the pty as its controlling terminal, reads what it
writes (stdout and stderr interleaved, as on a screen), waits for text, and types Ctrl-C.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


class Terminal:
    def __init__(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None
    ) -> None:
        primary, secondary = os.openpty()
        os.set_blocking(primary, False)
        self.fd = primary
        self.raw = b""
        self.proc = subprocess.Popen(
            list(argv),
            stdin=secondary,
            stdout=secondary,
            stderr=secondary,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,  # its own session, the pty its controlling terminal
            preexec_fn=None,
        )
        os.close(secondary)

    @property
    def text(self) -> str:
        """What was written so far, without the terminal's control sequences."""
        return ANSI.sub("", self.raw.decode("utf-8", "replace"))

    def _read(self, wait_s: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], wait_s)
        if ready:
            try:
                self.raw += os.read(self.fd, 65536)
            except OSError:  # EIO: every writer closed the pty
                time.sleep(min(wait_s, 0.05))

    def expect(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        """Wait until the output matches `pattern` (a regex); AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.text)):
            if (
                self.fd < 0
                or time.monotonic() > deadline
                or (self.proc.poll() is not None and not self._more())
            ):
                raise AssertionError(f"{pattern!r} not seen; output:\n{self.text[-4000:]}")
            self._read(0.2)
        return m

    def _more(self) -> bool:
        before = len(self.raw)
        self._read(0.2)
        return len(self.raw) > before

    def ctrl_c(self) -> None:
        """What the terminal does on Ctrl-C: SIGINT to the foreground process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self, timeout: float = 300) -> int:
        """The exit code, reading the output to its end."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"still running; output:\n{self.text[-4000:]}"
            self._read(0.2)
        while self._more():
            pass
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1  # what was read stays readable (`text`, `expect`)
