"""Helpers of the speed_matrix integration tests: run the DAG (via `python -m speedmatrix.cli.demo`)
in a subprocess with a private HOME and Airflow home, wait for log lines, read the outcome."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def finish(proc: subprocess.Popen, timeout: float = 600) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def wait_for_line(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 400) -> str:
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern)
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if rx.search(line):
                return line
        if proc.poll() is not None:
            raise AssertionError(f"run ended before {pattern!r}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} within {timeout} s")


def outcome(result: Path) -> dict:
    data = json.loads(result.read_text())
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
