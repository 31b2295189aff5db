"""The deployment tests' world: a second SSH host, tiny recipes, the probe DAG, the policy.

Kept apart from conftest.py so that test modules can import these names by a module name of
their own (several conftest.py files exist under tests/).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_harness import REPO, Deployment, free_port
from github_fake import FakeGitHub

SIM_RECIPE = REPO / "include" / "recipes" / "sim" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"
SSH_CONN_ID = "host_b"
SSHD = "/usr/sbin/sshd"

PROBE_DAG = '''
"""Test probe: which Celery worker runs a task (SPEEDMATRIX_WORKER_NAME is per worker), and
whether the worker had loaded the task path's libraries before the task began (preloaded: the
task imports none of them; speedmatrix.flows.preload)."""
import os
import sys
import time

import pendulum
from airflow.sdk import dag, task


@dag(dag_id="deploy_probe", schedule=None, start_date=pendulum.datetime(2026, 1, 1),
     catchup=False, tags=["test"], default_args={"owner": "tests", "retries": 0})
def deploy_probe():
    @task
    def where(n: int) -> dict:
        time.sleep(1)
        return {
            "n": n,
            "worker": os.environ.get("SPEEDMATRIX_WORKER_NAME"),
            "pid": os.getpid(),
            "preloaded": sorted(
                m for m in ("great_expectations", "scipy.stats", "matplotlib.pyplot")
                if m in sys.modules
            ),
        }

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


# How long setup waits for a test recipe's server to answer /health. The simulator is ready
# within seconds on a quiet box, but its start (a Python process importing the simulator) is at
# the machine's pace: beside other test workers on 2 cores the recipe's 30 s could fail a run
# for no fault of ours. A limit that only catches a hang.
READY_TIMEOUT_S = 300


def tiny_recipe(nightly: bool, per_commit: bool, window_s: int = 2) -> str:
    """The calibrated simulator recipe with a one-cell matrix and short windows."""
    text = SIM_RECIPE.read_text()
    assert "  ready_timeout_s: 30\n" in text
    text = text.replace("  ready_timeout_s: 30\n", f"  ready_timeout_s: {READY_TIMEOUT_S}\n")
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


def slow_start_recipe(delay_s: int = 900) -> str:
    """tiny_recipe on no schedule whose server waits ``delay_s`` before the simulator starts
    (bash sleeping in the server's process group, then exec): a setup that is still waiting
    for it to be ready when a test kills the worker running that setup. Nothing waits out the
    delay (the teardown stops the server), so it is long: on a loaded machine the kill must
    still come before the server is ready."""
    text = tiny_recipe(nightly=False, per_commit=False)
    head = 'command: ["{python}",'
    assert head in text
    text = text.replace(
        head, f'command: [bash, -c, \'sleep {delay_s}; exec "$0" "$@"\', "{{python}}",'
    )
    ready = f"  ready_timeout_s: {READY_TIMEOUT_S}\n"
    assert ready in text
    return text.replace(ready, f"  ready_timeout_s: {2 * delay_s}\n")


def bisect_recipe(profiles: Path, port: int) -> str:
    """tiny_recipe on no schedule whose simulator serves `<profiles>/<engine ref>.yaml`: a test
    writes one profile per "commit" and so plants a regression at the commit it chooses. Its
    own port: the bisection's runs cannot pass one (its conf has no port)."""
    text = tiny_recipe(nightly=False, per_commit=False)
    profile = '"{include}/sim-profiles/kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"'
    assert profile in text and "  port: 8000\n" in text
    text = text.replace(profile, f'"{profiles}/{{ref}}.yaml"')
    return text.replace("  port: 8000\n", f"  port: {port}\n")


@dataclass
class SshHost:
    conn_id: str
    port: int
    home: Path
    proc: subprocess.Popen


def start_sshd(work: Path, home: Path, lease_dir: Path) -> tuple[SshHost, dict]:
    """An OpenSSH server on 127.0.0.1 whose sessions have HOME=`home`: a second host.

    Its sessions also find the project's venv first on PATH: the simulator recipe runs
    `python3 -m speedmatrix sim serve` on the host, as a GPU host runs its engine env. The
    host lease is the machine's: this host names its own machine-wide directory (`lease_dir`,
    SetEnv SPEEDMATRIX_LEASE_DIR, as a real host may), so it is another machine as far as
    leases go, while being this box.
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
        f"SetEnv HOME={home} PATH={REPO / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin "
        f"SPEEDMATRIX_LEASE_DIR={lease_dir}\n"
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


@dataclass
class Env:
    """Everything a deployment test needs."""

    dep: Deployment
    github: FakeGitHub
    ssh: SshHost
    root: Path
