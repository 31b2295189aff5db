"""What the tests ask of the machine's process table (one place: a zombie is not running)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from waiting import poll_until


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running. A zombie has exited (no memory, port or GPU left) and
    only awaits its reaper, which on this machine's init comes ~2 s late; the stop does not
    wait for it either (engine.vllm_server.registry.group_pids)."""
    return [p for p in pids if alive(p)]


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses): field 0
    is the state (Z for a zombie), field 19 the start time in clock ticks after boot; None
    once the PID is gone. A process that exits between the open and the read fails the read
    with ESRCH (ProcessLookupError), not ENOENT: both mean gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def cmdline(pid: int) -> bytes:
    """/proc/PID/cmdline (arguments NUL-separated); empty once the PID is gone or a zombie."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def state(pid: int) -> str | None:
    fields = stat_fields(pid)
    return fields[0] if fields else None


def start_ticks(pid: int) -> str:
    """The process's start time in clock ticks after boot, as the server's identity records it."""
    fields = stat_fields(pid)
    assert fields is not None, f"PID {pid} is gone"
    return fields[19]


def alive(pid: int) -> bool:
    """Whether ``pid`` is running (neither gone nor a zombie)."""
    return state(pid) not in (None, "Z")


def group_running(pgid: int) -> list[int]:
    """The running members of process group ``pgid`` (zombies not, as in ``running``)."""
    members = []
    for entry in Path("/proc").iterdir():
        fields = stat_fields(int(entry.name)) if entry.name.isdigit() else None
        if fields and fields[2] == str(pgid) and fields[0] != "Z":  # field 2: the group
            members.append(int(entry.name))
    return members


def wait_gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` stops running (is gone or a zombie) within ``within_s``."""
    return poll_until(lambda: not alive(pid), within_s)


START_TOGETHER = """
def start_together():
    # every script of this run_scripts call is past its imports: go (waits on that, not a clock)
    import os, time
    folder, n = os.environ["SPEEDMATRIX_TEST_BARRIER"], int(os.environ["SPEEDMATRIX_TEST_BARRIER_N"])
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 600
    while len(os.listdir(folder)) < n:
        if time.monotonic() > deadline:
            raise SystemExit("not every script reached start_together() within 600 s")
        time.sleep(0.005)
"""


def run_scripts(scripts: list[str], timeout_s: float) -> list[dict]:
    """Run each Python `script` in a process of its own, all at once (the tests' concurrent
    writers), and return what each printed last, a JSON object; a process that failed fails
    the test with its stderr's tail. A script may call ``start_together()``: it returns once
    every script has called it (after their imports, which take seconds on a loaded box and
    would spread the writers out)."""
    import tempfile

    barrier = tempfile.mkdtemp(prefix="sm-barrier-")
    env = {**os.environ, "SPEEDMATRIX_TEST_BARRIER": barrier,
           "SPEEDMATRIX_TEST_BARRIER_N": str(len(scripts))}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", START_TOGETHER + script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for script in scripts
    ]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(barrier, ignore_errors=True)
    return reports
