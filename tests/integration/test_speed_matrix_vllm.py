"""speed_matrix end to end through a real OpenSSH server on 127.0.0.1 against real vLLM on
this CPU (recipe cpu/tiny/llama-tiny): provisioned env reused from the `vllm_cpu_env` fixture
(same HOME on the host: `host_home`), server started and stopped by the DAG, load generator
shipped as a zipapp and run on the host next to the server, results read back over SSH.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from speed_matrix_helpers import KEY, finish, free_port, outcome, start_run

from speedmatrix.store.warehouse import Warehouse

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timing]


@pytest.fixture(scope="module")
def migrated(airflow_db: Path) -> Path:
    import airflow

    (airflow_db / f".migrated-{airflow.__version__}").write_text("ok\n")
    return airflow_db


def _figures(cell: dict) -> dict:
    """What the cells suite judges a cell by: shown when a cell is quarantined."""
    keys = [
        "phase",
        "context_tokens",
        "concurrency",
        "status",
        "error",
        "quarantine_reasons",
        "avg_active_requests",
        "active_source",
        "measured_s",
        "window_s",
        "output_tokens",
        "total_tok_s",
        "per_request_tok_s",
        "tbt_ms",
        "ttft_ms",
        "samples",
        "requests_started",
        "completed_requests",
        "loop_lag_p99_ms",
    ]
    return {k: cell.get(k) for k in keys}


def test_speed_matrix_real_vllm_cpu_through_sshd(
    migrated, tmp_path, ssh_conn_id, vllm_cpu_env, vllm_home
):
    # KV cache: --num-gpu-blocks-override 160, and vLLM's CPU backend uses blocks of 128
    # tokens: with 960 output tokens, 256 x 16 needs 16 x 10 = 160 blocks > 159 (over
    # capacity, by one block), while C = 1 and 4 fit. One decode context: the 1K row (C = 1
    # and 4 valid, 16 over capacity) measured the same outcomes again, two 4 s cells of
    # this run's ~80 s; the prefill cells keep both contexts (one request each).
    conf = {
        "recipe": "cpu/tiny/llama-tiny",
        "ssh_conn_id": ssh_conn_id,
        "host_home": vllm_home,
        "prefill_contexts": [256, "1K"],
        "contexts": [256],
        "concurrencies": [1, 4, 16],
        "window_s": 4,
        "max_output_tokens": 960,
        "port": free_port(),
    }
    home = tmp_path / "home"  # the worker side's HOME (the host's is vllm_home)
    home.mkdir()
    proc, log, result = start_run(tmp_path, home, migrated, conf, "vllm")
    finish(proc, timeout=1500)
    out = outcome(result)
    assert out["state"] == "success", log.read_text()[-5000:]
    run_id = out["xcom"]["resolve"]["run_id"]
    wh = Warehouse(os.environ["SPEEDMATRIX_WAREHOUSE"])
    run, cells, requests = wh.read_run(run_id)
    assert run["host"] == ssh_conn_id and run["engine_version"]
    assert KEY not in run["launch_command"]
    by_cell = {(c["phase"], c["context_tokens"], c["concurrency"]): c for c in cells}
    # pytest shows this when an assertion below fails (CI once saw only a missing cell)
    print("cells:", json.dumps([_figures(c) for c in cells], indent=1))
    quarantined = wh.read_quarantine(run_id, "cells")
    assert quarantined is None, json.dumps([_figures(c) for c in quarantined[0]], indent=1)
    for key in (("prefill", 256, 1), ("prefill", 1024, 1)):
        assert by_cell[key]["status"] == "valid", by_cell[key]
    for key in (("decode", 256, 1), ("decode", 256, 4)):
        assert by_cell[key]["status"] == "valid", by_cell[key]
        assert by_cell[key]["total_tok_s"] > 0
    assert by_cell[("decode", 256, 16)]["status"] == "over_capacity", by_cell[("decode", 256, 16)]
    assert len(cells) == 5  # the plan's cells, each landed once
    assert requests
    assert wh.read_artifact(run_id, "validation/gx-results.json")
    assert Path(out["xcom"]["report"]["md"]).exists()
    assert out["xcom"]["stop_server"]["stopped"]["left"] == []
