"""Session-wide test isolation, set before anything imports Airflow.

Airflow reads its configuration once, at import: every test process therefore gets one private
AIRFLOW_HOME (SQLite metadata DB inside it), the repo's dags/ and plugins/ folders, no example
DAGs, and a private warehouse root, so no test ever writes into the checkout's warehouse/ or
the demo's .airflow/. Fixtures that need the metadata DB ask for `airflow_db`.
"""

from __future__ import annotations

import itertools
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
# The host lease and the record of running servers are machine-wide (/var/tmp/speedmatrix
# unless SPEEDMATRIX_LEASE_DIR says otherwise): this process gets a "machine" of its own, and
# each test another one (below), so that tests side by side (xdist workers, other checkouts
# on this box) never wait for nor refuse one another. Session fixtures that start a server
# name a directory of their own.
os.environ["SPEEDMATRIX_LEASE_DIR"] = str(_SESSION_DIR / "machine")
# Tests contact loopback only. A run's `regressions` asks the GitHub API for the commits
# between it and its baseline (upstream.schedule.github_api_url): unless a test points it at a
# fake of its own (monkeypatch), it goes to a loopback port where nothing listens, so the
# lookup fails at once and is logged, as it would on a host without GitHub; api.github.com is
# never tried.
os.environ["SPEEDMATRIX_GITHUB_API_URL"] = "http://127.0.0.1:9"
# A test-only cluster policy (AIRFLOW_HOME/config/airflow_local_settings.py, applied to every
# task the DagBag parses): a retried task retries after 1 s, not the DAGs' 30 s. A DAG run
# whose resolve failed waited 30 s for its teardown tasks' retry under dag.test (39 s of the
# 40 s test_unknown_recipe_fails_in_resolve test in a fresh clone's suite); the retries
# themselves still happen, as many as each task has. A sensor pokes every 1 s, not 15 s: a
# run waiting for the host lease starts within a second of its release.
TEST_LOCAL_SETTINGS = '''"""Test-only cluster policy of the test session (tests/conftest.py)."""

from datetime import timedelta


def task_policy(task):
    if task.retries:
        task.retry_delay = timedelta(seconds=1)
    if getattr(task, "poke_interval", 0) > 1:  # a sensor (the host lease) looks again in 1 s
        task.poke_interval = 1.0
'''
(Path(os.environ["AIRFLOW_HOME"]) / "config").mkdir(exist_ok=True)
(Path(os.environ["AIRFLOW_HOME"]) / "config" / "airflow_local_settings.py").write_text(
    TEST_LOCAL_SETTINGS
)
_machines = itertools.count()


@pytest.fixture(autouse=True)
def _machine_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own machine-wide lease directory (created when first used)."""
    monkeypatch.setenv("SPEEDMATRIX_LEASE_DIR", str(_SESSION_DIR / f"machine-{next(_machines)}"))


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


@pytest.fixture(scope="session")
def browser():
    """Headless Chromium (tests/browser.py): console messages, screenshots, link walking.
    Fails when Debian's `chromium` is missing (`make test-deps` installs it): a page test that
    did not run must not count as passed."""
    from browser import Browser, find_chromium

    binary = find_chromium()
    if binary is None:
        pytest.fail("chromium is not installed: apt-get install -y chromium (make test-deps)")
    return Browser(binary)


# pytest-xdist's `--dist loadgroup` does not group under pytest 9.2 here (checked: tests of one
# `xdist_group` still spread over workers), so the parallel phase uses `--dist loadfile` (a
# file's tests stay in one worker: module fixtures such as a DAG run start once) with
# `--no-loadscope-reorder` (xdist's default hands out the files with the most tests first, which
# put the few long integration files last, each worker idling in turn at the end), and the order
# below decides what each worker starts with.
_ENV_FIXTURES = {"vllm_cpu_env", "vllm_cpu_host"}


# Modules whose tests one worker takes together under `--dist loadgroup` (make test's phase 3):
# their module-scoped fixture measures for about a minute, paid once, not once per worker.
ONE_WORKER_MODULES = frozenset({"tests/integration/test_regression_http.py"})


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: ranked on the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest chains first, because xdist hands files out in this order: the Airflow
    deployment (~5 min of one worker), then the files that provision the vllm-cpu env (~8 min
    where it is not cached yet), then the integration files (the long ones), the unit files
    (many short ones fill the workers' ends), and last the files that need the session's vLLM
    server (by then the env exists). Before all, tests marked `long` (and in phase 1 their
    files): each takes minutes of one worker, and started late it would be its phase's tail."""

    def rank(item: pytest.Item) -> int:
        names = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("long"):
            return -1
        if item.get_closest_marker("deployment"):
            return 0
        if "vllm_cpu_server" in names:
            return 4
        if names & _ENV_FIXTURES:
            return 1
        if item.get_closest_marker("integration"):
            return 2
        return 3

    # stable: file order within each rank; a file's tests share its first test's rank, but a
    # test marked `long` goes first on its own (phase 3 hands out tests, not files)
    first: dict[str, int] = {}
    for item in items:
        first.setdefault(item.nodeid.split("::")[0], rank(item))

    def key(item: pytest.Item) -> int:
        module = item.nodeid.split("::")[0]
        if item.get_closest_marker("long"):
            return -2 if module in ONE_WORKER_MODULES else -1  # a whole module: the longest
        return first[module]

    items.sort(key=key)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: pytest -p no:xdist still runs
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup`: each test apart, but a module of ONE_WORKER_MODULES whole, in
    collection order. xdist's own loadgroup marks its groups by rewriting node ids, which pytest
    9.2 no longer honours, so nothing was grouped (pytest-xdist issue #1386)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


@pytest.fixture(scope="session")
def s3_server():
    """moto's standalone S3-compatible server on loopback, for the session (tests/s3server.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from s3server import running_s3_server

    with running_s3_server() as server:
        yield server


@pytest.fixture
def s3_warehouse(s3_server, monkeypatch) -> str:
    """``s3://<a fresh bucket>/warehouse`` on the loopback S3 server, with the standard AWS
    environment set (this process and the subprocesses it starts)."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return f"s3://{s3_server.new_bucket()}/warehouse"
