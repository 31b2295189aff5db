"""The task path's heavy libraries loaded once per worker, not once per task (issue #19):
speedmatrix.flows.preload and the Celery configuration that names it. That a real Celery
worker's tasks find them loaded is held by the deployment test (its probe task); what the
preload saves is measured by benchmarks/pipeline_bench.py (benchmarks/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "deployment"))
from deploy_harness import deploy_setting  # noqa: E402

PROBE = """
import gc, json, sys, threading
import speedmatrix.flows.preload
import matplotlib
print(json.dumps({
    "modules": sorted(sys.modules),
    "threads": threading.active_count(),
    "frozen": gc.get_freeze_count(),
    "backend": matplotlib.get_backend(),
}))
"""


def test_preload_loads_the_libraries_and_none_of_our_code():
    """A fresh interpreter importing the preload: the heavy libraries are in, no module of ours
    beyond the preload itself (a long-lived worker would keep running old code after a deploy),
    no thread started (forking after it stays safe), the objects frozen for the children's
    collector, and matplotlib on Agg."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=300
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = {"duckdb", "great_expectations", "matplotlib.pyplot", "pandas", "pyarrow.parquet"}
    heavy |= {"airflow.dag_processing.dagbag", "airflow.dag_processing.bundles.local"}
    assert heavy | {"scipy.stats"} <= set(got["modules"])
    ours = {m for m in got["modules"] if m == "speedmatrix" or m.startswith("speedmatrix.")}
    assert ours == {"speedmatrix", "speedmatrix.flows", "speedmatrix.flows.preload"}
    assert got["threads"] == 1
    assert got["frozen"] > 100_000
    assert got["backend"].lower() == "agg"


def test_the_deployment_names_the_preload_for_both_executors():
    """deploy/airflow.env.example: Celery's configuration is Airflow's own plus `imports` naming
    the preload; the LocalExecutor lines preload it through Airflow's forkserver."""
    from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

    path = deploy_setting("AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS")
    module, _, name = path.rpartition(".")
    config = getattr(__import__(module, fromlist=[name]), name)
    assert config["imports"] == ["speedmatrix.flows.preload"]
    assert {k: v for k, v in config.items() if k != "imports"} == DEFAULT_CELERY_CONFIG
    assert deploy_setting("AIRFLOW__SCHEDULER__MP_START_METHOD", commented=True) == "forkserver"
    preload = deploy_setting("AIRFLOW__SCHEDULER__MP_FORKSERVER_PRELOAD", commented=True)
    assert preload.split(",")[-1] == "speedmatrix.flows.preload"
