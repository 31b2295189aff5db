"""How the `speedmatrix` process ends (issue #42 item 14): a native call still under way on
another thread cannot abort the exit of a command that did its work.

`speedmatrix run` once ended with "terminate called ...", SIGABRT, after a successful landing.
The class: a thread inside a native library (DuckDB, Arrow, delta-rs) with the GIL released
when the interpreter finalizes. When that call returns, the thread asks for the GIL back,
CPython ends the thread where it stands (pthread_exit), and the unwinding meets a C++
destructor that may not throw: std::terminate. The query's timeout Timer, a daemon thread that
held the warehouse's DuckDB connection and freed it at exit, was one such thread.

Here a child process makes the class deterministic: a daemon thread is inside a DuckDB query
reading a pipe (the GIL released, blocked on the read) and the pipe is closed by an object
freed in the interpreter's module teardown, so the query ends exactly while the interpreter
finalizes. The command itself is real (`speedmatrix query`). Ending through the interpreter's
own exit (what `python -m speedmatrix` did before cli.exiting: `raise SystemExit(main())`)
aborts it every time (20 of 20 runs when this was written; `python -m speedmatrix` of the tree
before cli.exiting, commit b0fd99d^, 5 of 5); `python -m speedmatrix` (cli.entry, then
cli.exiting.end_process: what is open closed in order, then os._exit) exits 0 with the
command's output (20 of 20).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import os, runpy, sys, threading, time, types

import duckdb

fifo, how, *argv = sys.argv[1:]
writer = os.open(fifo, os.O_RDWR)  # the pipe's writer: a read of it waits until this is closed
con = duckdb.connect()
sql = f"SELECT count(*) FROM read_csv('{fifo}', columns={{'a': 'INTEGER'}}, header=false)"
thread = threading.Thread(target=lambda: con.cursor().execute(sql).fetchall(), daemon=True)
thread.start()


def opened_by_duckdb():
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.path.realpath(f"/proc/self/fd/{fd}") == fifo
        except OSError:
            pass
    return found >= 2  # ours and DuckDB's: the query is inside DuckDB, the GIL released


deadline = time.monotonic() + 60
while not opened_by_duckdb():
    assert time.monotonic() < deadline, "DuckDB never opened the pipe"
    time.sleep(0.001)


class EndsTheQueryAtTeardown:
    """Freed in the module teardown (after atexit, the interpreter finalizing): closes the
    pipe, so DuckDB's call returns now, then waits for that thread's end (or the process's)."""

    def __del__(self, close=os.close, exists=os.path.exists, clock=time.monotonic,
                sleep=time.sleep, task=f"/proc/self/task/{thread.native_id}"):
        close(writer)
        until = clock() + 10
        while exists(task) and clock() < until:
            sleep(0.001)


# in a module of its own: __main__'s namespace stays referenced by the thread and is not freed
holder = types.ModuleType("_ends_the_query")
holder.ender = EndsTheQueryAtTeardown()
sys.modules[holder.__name__] = holder
del holder
sys.argv = ["speedmatrix", *argv]
if how == "entry":  # python -m speedmatrix, as it is
    runpy.run_module("speedmatrix", run_name="__main__", alter_sys=True)
else:  # the exit before cli.exiting: main, then the interpreter's own exit
    from speedmatrix.cli import main

    raise SystemExit(main(argv))
'''


def _command_with_a_query_under_way(tmp_path: Path, how: str) -> subprocess.CompletedProcess:
    fifo = tmp_path / "rows.csv"
    os.mkfifo(fifo)
    (tmp_path / "wh").mkdir()
    argv = ["query", "SELECT 42 AS answer", "--warehouse", str(tmp_path / "wh")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), *sys.path])}
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(fifo), how, *argv],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=180,
    )  # fmt: skip


def test_the_interpreters_own_exit_is_aborted_by_a_native_call_that_ends_then(tmp_path) -> None:
    """The class, reproduced: the command did its work, then the process aborted."""
    done = _command_with_a_query_under_way(tmp_path, "interpreter")
    assert "42" in done.stdout, done.stderr[-2000:]
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
    assert "terminate called" in done.stderr, done.stderr[-2000:]


def test_python_m_speedmatrix_exits_0_with_a_native_call_under_way(tmp_path) -> None:
    """The same command and thread through `python -m speedmatrix`: 0, its output, no abort."""
    done = _command_with_a_query_under_way(tmp_path, "entry")
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["answer", "42"], done.stdout
