"""`make demo` on a real terminal (issue #34 items 6 and 7): the run shown as `speedmatrix run`
shows it, Airflow's log in the file the summary names, the cells in the documented order under
dag.test, and Ctrl-C that stops the server and releases the lease.

One subprocess per run on a pseudo-terminal (tests/terminal.py), with the session's migrated
Airflow DB, a private HOME and warehouse, 1 s windows."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from speed_matrix_helpers import free_port, no_server_left
from terminal import Terminal

from speedmatrix.store.warehouse import Warehouse

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONF = {"prefill_contexts": ["8K", "16K"], "contexts": ["8K", "16K"], "concurrencies": [1],
        "window_s": 1, "max_output_tokens": 256}  # fmt: skip
ORDER = ["8K", "8K x 1", "prefill 16K", "16K x 1"]  # plan.run_order: per context


@pytest.fixture(scope="module")
def migrated(airflow_db: Path) -> Path:
    import airflow

    (airflow_db / f".migrated-{airflow.__version__}").write_text("ok\n")
    return airflow_db


def _demo(tmp_path: Path, migrated: Path, name: str) -> Terminal:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "AIRFLOW_HOME": str(migrated), "COLUMNS": "120",
           "SPEEDMATRIX_WAREHOUSE": str(tmp_path / "wh"), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    conf = json.dumps({**CONF, "port": free_port()})
    log = tmp_path / f"{name}.airflow.log"
    argv = [sys.executable, "-m", "speedmatrix.cli.demo", "--conf", conf, "--airflow-log", str(log)]
    return Terminal(argv, env=env, cwd=str(ROOT))


def test_the_demo_shows_the_run_in_order_and_keeps_airflows_log_in_a_file(migrated, tmp_path):
    term = _demo(tmp_path, migrated, "run")
    try:
        rc = term.wait(timeout=600)
    finally:
        term.close()
    out = term.text
    assert rc == 0, out[-3000:]
    log = Path(term.expect(r"Airflow's log: (\S+\.log)").group(1))
    assert log == tmp_path / "run.airflow.log" and "[DAG TEST]" in log.read_text()
    assert "[DAG TEST]" not in out and "Pushing xcom" not in out  # Airflow's lines: in the file
    assert re.search(r"cells .*ETA \d+:\d\d", out)  # the live bar, as `speedmatrix run` shows
    assert "verdict: not compared (no earlier successful run of sim/" in out  # and its verdict
    # each cell's line as it ends (the bar's redraws run into it on the captured screen)
    done = re.findall(r"(prefill 16K|16K x 1|8K x 1|8K): [\d,.]+ tok/s", out)
    assert done == ORDER, done
    # and measured in that order: the cells' windows, as landed
    run_id = term.expect(r"run id:\s+(\S+)").group(1)
    _, cells, _ = Warehouse(str(tmp_path / "wh")).read_run(run_id)
    measured = sorted(cells, key=lambda c: c["started_at"])
    labels = [c["context_label"] if c["phase"] == "decode" else f"prefill {c['context_label']}"
              for c in measured]  # fmt: skip
    assert labels == ["prefill 8K", "8K", "prefill 16K", "16K"], labels
    assert all(c["status"] == "valid" for c in cells if c["phase"] == "prefill"), [
        (c["context_label"], c["error"]) for c in cells
    ]


def test_ctrl_c_on_the_demo_stops_the_server_and_releases_the_lease(migrated, tmp_path):
    term = _demo(tmp_path, migrated, "interrupted")
    try:
        term.expect(r"8K x 1", timeout=300)  # the first decode cell measures
        term.ctrl_c()
        rc = term.wait(timeout=300)
    finally:
        term.close()
    assert rc == 130, term.text[-3000:]
    assert "interrupted: stopped what the run started, released the lease on local" in term.text
    no_server_left(tmp_path / "home")


def test_ctrl_c_on_a_bare_dags_test_stops_the_server_and_releases_the_lease(migrated, tmp_path):
    """`airflow dags test speed_matrix`, no demo around it: its wait_for_host task installs the
    interrupt rules (flows/dagtest.install_for_process), and the DAG's own teardown is all that
    stops the server and releases the lease (the demo runs it once more; nothing does here)."""
    home = tmp_path / "home"
    home.mkdir()
    conf = {**CONF, "recipe": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "ssh_conn_id": "local",
            "port": free_port()}  # fmt: skip
    env = {**os.environ, "HOME": str(home), "AIRFLOW_HOME": str(migrated), "COLUMNS": "120",
           "SPEEDMATRIX_WAREHOUSE": str(tmp_path / "wh"), "PYTHONUNBUFFERED": "1",
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
           "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
           "SPEEDMATRIX_API_KEY": "sk-test-bare-dags-test"}  # fmt: skip
    argv = [sys.executable, "-m", "airflow", "dags", "test", "speed_matrix", "-c", json.dumps(conf)]
    term = Terminal(argv, env=env, cwd=str(ROOT))
    try:
        term.expect(r"starting task_id=decode_cells", timeout=300)  # the server is up, cells next
        term.ctrl_c()
        rc = term.wait(timeout=300)
    finally:
        term.close()
    out = term.text
    assert "interrupted: stopping the server and releasing the lease" in out, out[-3000:]
    assert "[DAG TEST] end task task_id=stop_server" in out, out[-3000:]  # the DAG's teardown
    assert re.search(r"lease on local released by speed_matrix/\S+ \(RELEASED\)", out), out[-3000:]
    assert "KeyboardInterrupt" not in out, out[-3000:]  # dag.test ended, not cut out of its loop
    assert rc != 0, out[-3000:]  # the run is not reported a success
    no_server_left(home)
