"""How the `speedmatrix` process ends: what it opened closed in order, then an exit that leaves
nothing for a native library's static destructors to find running.

Why: `speedmatrix run` once aborted after a successful landing ("terminate called without an
active exception", SIGABRT, exit -6 where 0 was due): a C++ thread object still joinable when
the interpreter finalized and the libraries' static destructors ran. DuckDB (its task
scheduler, per database: the warehouses' connections and its module-level default
connection), Arrow's thread pools and delta-rs' runtime all hold such threads; the query
timer that outlived a command was one case of the class. So the process ends in this order:
the warehouses' DuckDB connections closed (`store.query.close_all`), DuckDB's default
connection closed, our own threads joined, Python's exit work run (atexit: logging's flush,
temporary folders), the streams flushed, and then `os._exit`: no finalizer or static
destructor runs after the work is done, so none can abort it. The mechanism, reproduced by
tests/unit/test_cli_exiting.py: a thread whose native call (the GIL released) returns while the
interpreter finalizes is ended by CPython where it stands (pthread_exit), and the unwinding
through the library's C++ frames calls std::terminate. Only the process's own entry
points call this (`speedmatrix`, `python -m speedmatrix`), never `cli.main`, which tests call
in process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def close_native() -> None:
    """Close, in order, the native handles a command may leave open."""
    if "speedmatrix.store.query" in sys.modules:
        from speedmatrix.store.query import close_all

        close_all()
    duckdb = sys.modules.get("duckdb")
    if duckdb is not None and hasattr(duckdb, "default_connection"):
        with contextlib.suppress(Exception):
            default = duckdb.default_connection
            (default() if callable(default) else default).close()


def join_threads(timeout_s: float = 30.0) -> None:
    """Wait for our non-daemon threads, as the interpreter would at exit (a daemon thread,
    a library's monitor, is ended with the process)."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(timeout_s)


def end_process(rc: int) -> NoReturn:
    """Exit with `rc` after closing what is open (see the module docstring)."""
    with contextlib.suppress(Exception):
        close_native()
    with contextlib.suppress(Exception):
        join_threads()
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)
