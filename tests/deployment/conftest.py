"""Fixtures for the deployment tests: one real Airflow deployment for the whole module.

Started once (about 1.5 min on 2 cores) and shared by the tests of test_deployment.py, which
run in a fixed order and leave it as they found it (both workers up, speed_matrix unpaused).

What the deployment is given, as a user's env file would give it:
- a dags folder in a temp dir: the repo's four DAGs plus a probe DAG of the tests;
- a private recipe set (SPEEDMATRIX_RECIPES): two simulator recipes with a one-cell matrix and
  2 s windows (so runs take a minute, not an hour) and a schedule whose nightly cron fires
  every minute; a third one on no schedule for the bisection, whose simulator profile is
  picked by the engine ref from bisect-profiles/ (the test writes them); the GitHub API points
  at a fake on loopback (tests/github_fake.py);
- HOME in a temp dir for the `local` host (its engine envs live there), its machine-wide
  lease directory (SPEEDMATRIX_LEASE_DIR, as a deployment whose hosts' /var/tmp is not shared
  sets it), and a second "host": an OpenSSH server on 127.0.0.1 whose sessions get another
  HOME and name another lease directory (so another machine as far as leases go), reached
  through an Airflow SSH connection;
- the warehouse on object storage: `s3://<bucket>/warehouse` on moto's standalone S3 server on
  loopback (tests/s3server.py, the session's `s3_server`), its endpoint and credentials as the
  standard AWS_* settings of the env file, and the site (SPEEDMATRIX_SITE_DIR) in a local
  folder, which a warehouse on s3:// needs: every run's `land` writes through S3's conditional
  commits, the way a fleet's Celery workers do;
- an airflow_local_settings.py whose task_instance_mutation_hook pins a run's tasks to one
  worker's queue when its run id says so (`…pin-worker1…`): how a test makes two runs of one
  host land on different workers for certain.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from deploy_env import (
    LOCAL_SETTINGS,
    PROBE_DAG,
    SCHEDULE,
    SSH_CONN_ID,
    Env,
    bisect_recipe,
    slow_start_recipe,
    start_sshd,
    tiny_recipe,
)
from deploy_harness import REPO, Deployment, free_port
from github_fake import FakeGitHub


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing deployment test shows the tail of every component's log under its report."""
    outcome = yield
    report = outcome.get_result()
    env = getattr(item, "funcargs", {}).get("env")
    if report.failed and isinstance(env, Env):
        report.sections.append(("deployment component logs", env.dep.log_tails(lines=30)))


@pytest.fixture(scope="module")
def env(s3_server) -> Iterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="sm-deployment-"))
    os.chmod(root, 0o755)
    dags = root / "dags"
    dags.mkdir()
    for name in (
        "speed_matrix.py",
        "speed_matrix_nightly.py",
        "vllm_commit_watch.py",
        "speed_matrix_bisect.py",
    ):
        shutil.copy(REPO / "dags" / name, dags / name)
    (dags / "deploy_probe.py").write_text(PROBE_DAG)
    recipes = root / "recipes"
    (recipes / "sim").mkdir(parents=True)
    (recipes / "_schedule.yaml").write_text(SCHEDULE)
    (recipes / "sim" / "deploy-tiny.yaml").write_text(tiny_recipe(nightly=True, per_commit=True))
    (recipes / "sim" / "deploy-tiny-b.yaml").write_text(tiny_recipe(nightly=False, per_commit=True))
    (recipes / "sim" / "deploy-slow-start.yaml").write_text(slow_start_recipe())
    (root / "bisect-profiles").mkdir()
    (recipes / "sim" / "deploy-bisect.yaml").write_text(
        bisect_recipe(root / "bisect-profiles", free_port())
    )
    homes = {n: root / f"home-{n}" for n in ("local", "b")}
    for h in homes.values():
        h.mkdir()
    (root / "sshd").mkdir()
    # the bucket before anything that must be stopped: a failure here leaves nothing running
    warehouse = f"s3://{s3_server.new_bucket()}/warehouse"
    machines = {n: root / f"machine-{n}" for n in ("local", "b")}
    ssh, conn = start_sshd(root / "sshd", homes["b"], machines["b"])
    github = FakeGitHub().start()
    github.head = 1
    dep = Deployment(
        root,
        dags,
        warehouse=warehouse,
        extra_env={
            **s3_server.env(),
            "SPEEDMATRIX_SITE_DIR": str(root / "site"),
            "HOME": str(homes["local"]),
            "SPEEDMATRIX_LEASE_DIR": str(machines["local"]),
            "SPEEDMATRIX_RECIPES": str(recipes),
            "SPEEDMATRIX_GITHUB_API_URL": github.base_url,
            "SPEEDMATRIX_API_KEY": "sk-deployment-test",
            # Bisection steps: poll each speed_matrix run every 2 s, not 30 (a 33 s run was
            # seen whole only at the second 30 s poll; one read of the run's state per poll).
            "SPEEDMATRIX_BISECT_POLL_S": "2",
            # The host lease keeps its default TTL (900 s): the lease is renewed while a task
            # works, not between tasks, so a TTL shorter than the longest gap between two
            # tasks of a run (a scheduler restart on a busy machine took > 60 s) lets a
            # second run take the host. Seen here with 60 s; setup then refused to start a
            # second server ("a previous server of ours is still alive").
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
