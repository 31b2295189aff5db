"""Run the `speedmatrix` command in this process, as a test would run it in a subprocess.

A subprocess per call paid for a new interpreter and the command's imports each time (an
`ingest` imports pandas, Great Expectations and Delta: seconds per call, ~13 calls in
test_ingest.py alone). :func:`run_cli` calls ``speedmatrix.cli.main(argv)`` instead and returns
what ``subprocess.run(..., capture_output=True, text=True)`` would: the exit code (argparse's
``SystemExit`` included), and stdout and stderr captured both where Python writes them
(``sys.stdout``/``sys.stderr``) and at the file descriptors (1 and 2: C libraries, child
processes). ``env`` is set in ``os.environ`` for the call and put back after (settings are read
from it per call). Each command keeps one subprocess test of its own, so the entry point
(``python -m speedmatrix``) and a process's exit code stay proven end to end.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator, Mapping

PROG = [sys.executable, "-m", "speedmatrix"]


@contextlib.contextmanager
def _environ(env: Mapping[str, str] | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _fd_captured(fd: int) -> Iterator:
    """Point file descriptor ``fd`` at a temporary file for the block; yield the file."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(fd)
        os.dup2(sink.fileno(), fd)
        try:
            yield sink
        finally:
            os.dup2(saved, fd)
            os.close(saved)


def _read(sink) -> str:
    sink.seek(0)
    return sink.read().decode("utf-8", "replace")


def run_cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """``speedmatrix *args`` in this process; see the module docstring."""
    from speedmatrix.cli import main

    out, err = io.StringIO(), io.StringIO()
    sys.stdout.flush()
    sys.stderr.flush()
    with (
        _environ(env),
        _fd_captured(1) as fd_out,
        _fd_captured(2) as fd_err,
    ):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse: --help (0), a usage error (2)
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if isinstance(exc.code, str):  # as the interpreter prints SystemExit("why")
                    print(exc.code, file=err)
            except Exception:  # as the interpreter ends on an uncaught exception
                traceback.print_exc(file=err)
                code = 1
        stdout, stderr = out.getvalue() + _read(fd_out), err.getvalue() + _read(fd_err)
    return subprocess.CompletedProcess([*PROG, *args], int(code or 0), stdout, stderr)
