"""Helpers of the speed_matrix integration tests: run the DAG with a private HOME, in a
subprocess (`python -m speedmatrix.cli.demo`, :func:`start_run`) or in a module's long-lived
Airflow process (tests/integration/airflow_runner.py, :func:`start_in`), wait for log lines,
read the outcome."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from airflow_runner import Runner
from processes import group_running

from speedmatrix.engine.hosts import get_host
from speedmatrix.engine.lease import HostLease

KEY = "sk-simtest-4242abcd"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_run(tmp: Path, home: Path, airflow_home: Path, conf: dict, name: str):
    env = {
        **os.environ,
        "HOME": str(home),
        "AIRFLOW_HOME": str(airflow_home),
        "SPEEDMATRIX_API_KEY": KEY,
        "PYTHONUNBUFFERED": "1",
    }
    out = tmp / f"{name}.log"
    result = tmp / f"{name}.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "speedmatrix.cli.demo",
            "--conf",
            json.dumps(conf),
            "--result-json",
            str(result),
            "--airflow-log",
            "-",  # Airflow's log on stdout, where wait_for_line reads it
        ],
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(Path(__file__).resolve().parents[2]),
        start_new_session=True,
    )
    return proc, out, result


def start_in(runner: Runner, tmp: Path, home: Path, conf: dict, name: str) -> Path:
    """Start one speed_matrix run in `runner` (a long-lived Airflow process: the demo's code
    path, `speedmatrix.cli.demo.run_dag`, with the demo's conf under `conf`) in the environment
    this test would give a subprocess: its own, HOME `home`, the API key. Returns the file
    that gets Airflow's log of the run; :func:`result_of` waits for the outcome."""
    log = tmp / f"{name}.log"
    env = {**os.environ, "HOME": str(home), "SPEEDMATRIX_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
    runner.send(op="speed_matrix", conf=conf, env=env, log=str(log))
    return log


def result_of(runner: Runner) -> dict:
    """The outcome of the run started in `runner` (as :func:`outcome` reads it from a file)."""
    return _decoded(runner.answer())


def run_in(runner: Runner, tmp: Path, home: Path, conf: dict, name: str) -> tuple[dict, Path]:
    """One speed_matrix run in `runner` (:func:`start_in`), to its end: outcome and log."""
    log = start_in(runner, tmp, home, conf, name)
    return result_of(runner), log


def finish(proc: subprocess.Popen, timeout: float = 600) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def wait_for_line(log: Path, pattern: str, ended: Callable[[], bool], timeout: float = 400) -> str:
    """The first line of `log` that matches `pattern`, once written; fails as soon as
    `ended()` says the run is over without it."""
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern)
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        for line in text.splitlines():
            if rx.search(line):
                return line
        if ended():
            raise AssertionError(f"run ended before {pattern!r}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} within {timeout} s")


def outcome(result: Path) -> dict:
    return _decoded(json.loads(result.read_text()))


def _decoded(data: dict) -> dict:
    """The run's XComs as values (a hand-off may arrive as its JSON text)."""
    for k, v in data["xcom"].items():
        if isinstance(v, str):
            data["xcom"][k] = json.loads(v)
    return data


def no_server_left(home: Path) -> None:
    """Every server group recorded under the test HOME is gone, and the lease is free.

    A zombie is not running (tests/processes.py): a stopped group's leader, orphaned to PID 1
    by its setsid start, stays a zombie until this VM's init reaps it every few seconds (seen:
    a run failed here on group 5513 1.7 s after its verified stop)."""
    for pid_file in (home / ".speedmatrix" / "servers").glob("*/pid"):
        pgid = int(pid_file.read_text().split()[0])
        assert not group_running(pgid), f"server group {pgid} still running"
    state = HostLease(get_host("local", env={"HOME": str(home)}), "probe").show()
    assert state.holder is None or state.seconds_left == 0
