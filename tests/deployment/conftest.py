"""Fixtures for the deployment tests: one real Airflow deployment for the whole module.

Started once (about 1.5 min on 2 cores) and shared by the tests of test_deployment.py, which
run in a fixed order and leave it as they found it (both workers up, speed_matrix unpaused).

What the deployment is given, as a user's env file would give it:
- a dags folder in a temp dir: the repo's three DAGs plus a probe DAG of the tests;
- a private recipe set (SPEEDMATRIX_RECIPES): two simulator recipes with a one-cell matrix and
  2 s windows (so runs take a minute, not an hour) and a schedule whose nightly cron fires
  every minute; the GitHub API points at a fake on loopback (tests/github_fake.py);
- HOME in a temp dir for the `local` host (its host lease and engine envs live there), and a
  second "host": an OpenSSH server on 127.0.0.1 whose sessions get another HOME (so another
  lease), reached through an Airflow SSH connection;
- an airflow_local_settings.py whose task_instance_mutation_hook pins a run's tasks to one
  worker's queue when its run id says so (`…pin-worker1…`): how a test makes two runs of one
  host land on different workers for certain.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from github_fake import FakeGitHub
from harness import REPO, Deployment, free_port

SIM_RECIPE = REPO / "include" / "recipes" / "sim" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"
SSH_CONN_ID = "host_b"
SSHD = "/usr/sbin/sshd"

PROBE_DAG = '''
"""Test probe: which Celery worker runs a task (SPEEDMATRIX_WORKER_NAME is per worker)."""
import os
import time

import pendulum
from airflow.sdk import dag, task


@dag(dag_id="deploy_probe", schedule=None, start_date=pendulum.datetime(2026, 1, 1),
     catchup=False, tags=["test"], default_args={"owner": "tests", "retries": 0})
def deploy_probe():
    @task
    def where(n: int) -> dict:
        time.sleep(1)
        return {"n": n, "worker": os.environ.get("SPEEDMATRIX_WORKER_NAME"), "pid": os.getpid()}

    where.expand(n=[0, 1, 2, 3])


deploy_probe()
'''

LOCAL_SETTINGS = '''
"""Test-only cluster policy: pin a run's tasks to a worker's own queue (see conftest)."""


def task_instance_mutation_hook(task_instance, dag_run=None):
    run_id = getattr(task_instance, "run_id", "") or ""
    for name in ("worker1", "worker2"):
        if f"pin-{name}" in run_id:
            task_instance.queue = name
'''

SCHEDULE = """
nightly:
  cron: "* * * * *"
commit_watch:
  cron: "0 0 1 1 *"
  max_commits_per_poll: 5
  wait_for_wheel: false
  wheel_url: "{wheel_index}/{sha}/vllm/"
  wheel_max_wait_s: 21600
github:
  api_url: https://api.github.com
  repo: vllm-project/vllm
  branch: main
  conn_id: github_default
  timeout_s: 10
  retries: 0
"""


def tiny_recipe(nightly: bool, per_commit: bool, window_s: int = 2) -> str:
    """The calibrated simulator recipe with a one-cell matrix and short windows."""
    text = SIM_RECIPE.read_text()
    out = []
    section = None
    for line in text.splitlines():
        if line and not line.startswith(" "):
            section = line.split(":")[0]
        key = line.strip().split(":")[0]
        if section == "matrix" and line.startswith("  "):
            line = {
                "prefill_contexts": "  prefill_contexts: [8K]",
                "contexts": "  contexts: [8K]",
                "concurrencies": "  concurrencies: [1]",
                "window_s": f"  window_s: {window_s}",
                "max_output_tokens": "  max_output_tokens: 64",
            }.get(key, line)
        if section == "schedule" and line.startswith("  "):
            line = {
                "nightly": f"  nightly: {str(nightly).lower()}",
                "per_commit": f"  per_commit: {str(per_commit).lower()}",
            }.get(key, line)
        out.append(line)
    return "\n".join(out) + "\n"


@dataclass
class SshHost:
    conn_id: str
    port: int
    home: Path
    proc: subprocess.Popen


def start_sshd(work: Path, home: Path) -> tuple[SshHost, dict]:
    """An OpenSSH server on 127.0.0.1 whose sessions have HOME=`home`: a second host.

    Its sessions also find the project's venv first on PATH: the simulator recipe runs
    `python3 -m speedmatrix sim serve` on the host, as a GPU host runs its engine env.
    """
    if not os.path.exists(SSHD):
        pytest.fail("sshd not installed: run `make test-deps`")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    host_key, client_key = work / "ssh_host_ed25519_key", work / "id_ed25519"
    for key in (host_key, client_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    shutil.copy(f"{client_key}.pub", work / "authorized_keys")
    port = free_port()
    (work / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nPidFile {work}/sshd.pid\n"
        f"AuthorizedKeysFile {work}/authorized_keys\nStrictModes no\n"
        "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nSubsystem sftp internal-sftp\n"
        f"MaxSessions 50\nMaxStartups 50:30:100\nLogLevel ERROR\n"
        f"SetEnv HOME={home} PATH={REPO / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin\n"
    )
    proc = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(work / "sshd_config")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=(work / "sshd.log").open("wb"),
    )
    deadline = time.monotonic() + 20
    import socket

    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    pub = Path(f"{host_key}.pub").read_text().split()
    conn = {
        "conn_type": "ssh",
        "host": "127.0.0.1",
        "port": port,
        "login": "root",
        "extra": {"key_file": str(client_key), "host_key": f"{pub[0]} {pub[1]}"},
    }
    return SshHost(SSH_CONN_ID, port, home, proc), conn


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing deployment test shows the tail of every component's log under its report."""
    outcome = yield
    report = outcome.get_result()
    env = getattr(item, "funcargs", {}).get("env")
    if report.failed and isinstance(env, Env):
        report.sections.append(("deployment component logs", env.dep.log_tails(lines=30)))


@dataclass
class Env:
    """Everything a deployment test needs."""

    dep: Deployment
    github: FakeGitHub
    ssh: SshHost
    root: Path


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="sm-deployment-"))
    os.chmod(root, 0o755)
    dags = root / "dags"
    dags.mkdir()
    for name in ("speed_matrix.py", "speed_matrix_nightly.py", "vllm_commit_watch.py"):
        shutil.copy(REPO / "dags" / name, dags / name)
    (dags / "deploy_probe.py").write_text(PROBE_DAG)
    recipes = root / "recipes"
    (recipes / "sim").mkdir(parents=True)
    (recipes / "_schedule.yaml").write_text(SCHEDULE)
    (recipes / "sim" / "deploy-tiny.yaml").write_text(tiny_recipe(nightly=True, per_commit=True))
    (recipes / "sim" / "deploy-tiny-b.yaml").write_text(tiny_recipe(nightly=False, per_commit=True))
    homes = {n: root / f"home-{n}" for n in ("local", "b")}
    for h in homes.values():
        h.mkdir()
    (root / "sshd").mkdir()
    ssh, conn = start_sshd(root / "sshd", homes["b"])
    github = FakeGitHub().start()
    github.head = 1
    dep = Deployment(
        root,
        dags,
        extra_env={
            "HOME": str(homes["local"]),
            "SPEEDMATRIX_RECIPES": str(recipes),
            "SPEEDMATRIX_GITHUB_API_URL": github.base_url,
            "SPEEDMATRIX_API_KEY": "sk-deployment-test",
            # A killed worker's run gives its host back within a minute, not 15.
            "SPEEDMATRIX_LEASE_TTL_S": "60",
            f"AIRFLOW_CONN_{SSH_CONN_ID.upper()}": json.dumps(conn),
        },
    )
    (dep.airflow_home / "config").mkdir(parents=True)
    (dep.airflow_home / "config" / "airflow_local_settings.py").write_text(LOCAL_SETTINGS)
    try:
        dep.start()
        yield Env(dep, github, ssh, root)
    finally:
        left = dep.stop()
        github.stop()
        ssh.proc.terminate()
        ssh.proc.wait(10)
        print(f"deployment logs kept in {dep.logs}")
        assert not left, f"processes left after the deployment stopped: {left}"
