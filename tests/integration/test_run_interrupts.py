"""A `speedmatrix run` ends as it should: 0 after a landing, 130 after Ctrl-C (issue #42
items 14 and 15).

Item 14: `speedmatrix run` aborted at exit after a successful landing ("terminate called
without an active exception", SIGABRT) on a loaded machine: a native thread still joinable when
the interpreter finalized. Here the command runs many times beside a busy core and every run
exits 0, with no abort (cli.exiting closes what is open in order, then exits before any
static destructor runs).

Item 15: Ctrl-C is an interrupt whatever the moment it lands.

On a loaded machine Ctrl-C once exited 1, not 130: the moment decided the exit code. Here
SIGINT is sent to `speedmatrix` at distinct moments, each known by what the command has said
(never after a sleep): while it imports (its `-X importtime` lines), while it sets up, while
it measures, while it lands. Every one ends with exit code 130, the line `speedmatrix:
interrupted`, and no traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from speedmatrix.sim.runner import run_in_process

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "include" / "sim-profiles" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"
MODEL = "Kimi-K2.7-Code-NVFP4"


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    with run_in_process(PROFILE) as url:
        yield url


def interrupt_when(argv: list[str], pattern: str) -> tuple[int, str]:
    """Run `python -X importtime -m speedmatrix ARGV`, send SIGINT once its stderr (or stdout)
    says `pattern`; (exit code, everything it wrote but the import times)."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "speedmatrix", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(ROOT),
    )
    assert proc.stdout is not None
    said: list[str] = []
    for line in proc.stdout:
        said.append(line)
        if re.search(pattern, line):
            proc.send_signal(signal.SIGINT)
            break
    else:
        proc.wait()
        pytest.fail(f"never said {pattern!r}:\n{''.join(said)[-3000:]}")
    said.append(proc.stdout.read())
    rc = proc.wait(timeout=300)
    # the import times, written by the interpreter to stderr, may share a line with our own
    text = re.sub(r"import time:[^\n]*?\|\s+[\w.]+(?=\n|$|speedmatrix)", "", "".join(said))
    return rc, text


@pytest.mark.parametrize(
    "module", ["speedmatrix.cli", "pyarrow", "duckdb", "speedmatrix.store.query"]
)
def test_ctrl_c_while_importing_is_an_interrupt(module, tmp_path):
    # a query that outlasts the signal's way from this process to the child: with `SELECT 1`
    # a loaded box let the child finish and exit 0 before this process read the import line
    # and signalled (seen in a fresh clone's suite); unanswered, this one runs for minutes
    sql = "SELECT count(*) FROM range(100000000000)"
    rc, text = interrupt_when(
        ["query", sql, "--warehouse", str(tmp_path)], rf"\|\s+{re.escape(module)}$"
    )
    assert rc == 130, text
    assert "Traceback" not in text and "speedmatrix: interrupted" in text, text


@pytest.mark.parametrize(
    "moment",
    [
        "inspecting",  # setup: the server is being inspected
        r"\[1/3\]",  # measuring: the first cell is done, the next one runs
        "validating, landing",  # the cells measured, the run being landed
    ],
)
def test_ctrl_c_during_a_run_is_an_interrupt(moment, sim_url, tmp_path):
    argv = ["run", "--base-url", sim_url, "--model", MODEL, "--prefill-contexts", "8K",
            "--contexts", "8K", "--concurrencies", "1", "2", "--window-s", "1",
            "--max-output-tokens", "256", "--warehouse", str(tmp_path / "wh")]  # fmt: skip
    rc, text = interrupt_when(argv, moment)
    assert rc == 130, text
    assert "Traceback" not in text and "speedmatrix: interrupted" in text, text


RUNS = 3
"""The abort came at exit, after the landing, whatever the matrix: each run is the smallest
matrix that lands (one prefill and one decode cell, 1 s windows): ~21 s beside the busy core on
the shared 2-core machine (load ~5), where the default decode matrix's 13 cells took ~80 s a
run (3 runs were 4 minutes of phase 2). Three runs, not a frequency estimate: the abort was
never seen in 9 runs before the fix."""


@pytest.mark.alone  # it loads a core itself: nothing else beside it (Makefile `test`, phase 2)
@pytest.mark.timeout(1800)
def test_a_run_exits_0_every_time_beside_a_busy_core(sim_url, tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    lease_dir = tmp_path / "lease"
    lease_dir.mkdir(mode=0o1777)
    env = {**os.environ, "SPEEDMATRIX_LEASE_DIR": str(lease_dir)}
    env.pop("SPEEDMATRIX_API_KEY", None)
    argv = ["run", "--base-url", sim_url, "--model", MODEL, "--prefill-contexts", "8K",
            "--contexts", "8K", "--concurrencies", "1", "--window-s", "1",
            "--max-output-tokens", "256"]  # fmt: skip
    codes = []
    try:
        for i in range(RUNS):
            done = subprocess.run(
                [sys.executable, "-m", "speedmatrix", *argv, "--warehouse", str(tmp_path / "wh")],
                capture_output=True, text=True, env=env, timeout=300, cwd=str(ROOT),
            )  # fmt: skip
            codes.append(done.returncode)
            assert "terminate called" not in done.stderr, done.stderr[-2000:]
            assert done.returncode == 0, (i, done.returncode, done.stderr[-2000:])
            # it landed (a cell the busy core made invalid lands too: the run is partial)
            assert re.search(r": (success|partial) \(2 cells", done.stdout), done.stdout[-2000:]
    finally:
        busy.kill()
        busy.wait()
    assert codes == [0] * RUNS
