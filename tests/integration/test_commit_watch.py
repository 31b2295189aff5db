"""vllm_commit_watch and speed_matrix_nightly on real Airflow against a loopback fake GitHub.

Each test gets its own Airflow home (a copy of one SQLite metadata DB migrated per session),
its own dags folder and recipes, and runs the DAGs with `airflow dags test` (dag.test()) in
subprocesses, exactly as the scheduler would run their tasks. The triggered `speed_matrix`
DagRuns are then read from the metadata DB. The fake GitHub (tests/github_fake.py) replays
recorded /commits answers on 127.0.0.1; nothing is fetched from GitHub.

The target DAG in these dags folders is a tiny STAND-IN with the id `speed_matrix` (test
only): the triggers only need a DAG with that id to exist; the real one (dags/speed_matrix.py)
is another engineer's and is tested on its own.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from github_fake import FakeGitHub

from speedmatrix import recipes as recipes_mod
from speedmatrix.flows import triggers as T

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRIGGER_DAG_FILES = ("vllm_commit_watch.py", "speed_matrix_nightly.py")

# TEST-ONLY stand-in for dags/speed_matrix.py (see the module docstring).
STAND_IN_SPEED_MATRIX = '''
"""Test stand-in: only the dag id `speed_matrix` matters to the trigger DAGs."""
from datetime import datetime
from airflow.sdk import dag, task


@dag(dag_id="speed_matrix", schedule=None, start_date=datetime(2026, 1, 1), tags=["test"])
def speed_matrix():
    @task
    def noop():
        pass

    noop()


speed_matrix()
'''

# TEST-ONLY: a no-op DAG a second Airflow process runs first, to pay its start-up early.
WARMUP_DAG = """
from datetime import datetime
from airflow.sdk import dag, task


@dag(dag_id="warmup", schedule=None, start_date=datetime(2026, 1, 1), tags=["test"])
def warmup():
    @task
    def noop():
        pass

    noop()


warmup()
"""

SCHEDULE = """
commit_watch:
  max_commits_per_poll: 5
github:
  repo: vllm-project/vllm
  branch: main
  conn_id: github_default
  timeout_s: 1
  retries: 0
"""


def _airflow_env(home: Path, dags: Path, recipes: Path, schedule: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "SPEEDMATRIX"))}
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__LOGGING__BASE_LOG_FOLDER=str(home / "logs"),
        SPEEDMATRIX_RECIPES=str(recipes),
        SPEEDMATRIX_SCHEDULE=str(schedule),
    )
    return env


@pytest.fixture(scope="session")
def migrated_db(tmp_path_factory) -> Path:
    """One migrated SQLite metadata DB per session; tests copy it."""
    home = tmp_path_factory.mktemp("airflow-template")
    env = _airflow_env(home, home / "dags", home, home / "none.yaml")
    out = subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return home / "airflow.db"


class Runner:
    """One tests/integration/airflow_runner.py process: dag.test() on request."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        self._log = open(log, "a")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("airflow_runner.py"))],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.ready = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"airflow runner died:\n{self.log.read_text()[-4000:]}"
        out = json.loads(line)
        assert "error" not in out, f"{out['error']}\n{self.log.read_text()[-4000:]}"
        return out

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, **cmd) -> dict:
        self.send(**cmd)
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@dataclass
class Sandbox:
    root: Path
    env: dict[str, str]
    fake: FakeGitHub
    runners: list[Runner] = field(default_factory=list)

    @property
    def db(self) -> Path:
        return self.root / "home" / "airflow.db"

    def runner(self, new: bool = False) -> Runner:
        """The first Airflow runner (started on first use), or a new one."""
        if new or not self.runners:
            self.runners.append(Runner(self.env, self.root / f"runner-{len(self.runners)}.log"))
            return self.runners[-1]
        return self.runners[0]

    def run(self, dag_id: str = "vllm_commit_watch", conf: dict | None = None, **kw) -> str:
        """Run one DagRun with dag.test() in the first runner; return its run id."""
        return self.runner().call(op="run", dag_id=dag_id, conf=conf, **kw)["run_id"]

    def last_log(self) -> str:
        """Everything the Airflow processes logged (task logs included)."""
        return "".join(r.log.read_text() for r in self.runners)

    def rows(self, sql: str, *args) -> list[tuple]:
        with sqlite3.connect(self.db, timeout=30) as con:
            return con.execute(sql, args).fetchall()

    def triggered(self) -> list[tuple[str, dict]]:
        """speed_matrix DagRuns, in the order the scheduler would start them (run_after)."""
        rows = self.rows(
            "select run_id, conf, run_type from dag_run where dag_id='speed_matrix' "
            "order by run_after, id"
        )
        assert all(rt == "operator_triggered" for _, _, rt in rows)
        return [(rid, json.loads(conf)) for rid, conf, _ in rows]

    def states(self, run_id: str, dag_id: str = "vllm_commit_watch") -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for task_id, state in self.rows(
            "select task_id, state from task_instance where dag_id=? and run_id=? "
            "order by task_id, map_index",
            dag_id,
            run_id,
        ):
            out.setdefault(task_id, []).append(state)
        return out

    def run_state(self, run_id: str, dag_id: str = "vllm_commit_watch") -> str:
        return self.rows("select state from dag_run where dag_id=? and run_id=?", dag_id, run_id)[
            0
        ][0]

    def poll_plan(self, run_id: str) -> dict:
        (value,) = self.rows(
            "select value from xcom where dag_id='vllm_commit_watch' and run_id=? "
            "and task_id='poll' and key='return_value'",
            run_id,
        )[0]
        return json.loads(value)

    def watch_state(self) -> dict | None:
        value = self.runner().call(op="var_get", key=T.STATE_VARIABLE)["value"]
        return None if value is None else json.loads(value)


def _write_recipes(root: Path) -> None:
    """Two per-commit recipes (one also nightly) and one nightly-only, from the CPU recipe."""
    src = (Path(recipes_mod.recipes_dir()) / "cpu" / "tiny" / "llama-tiny.yaml").read_text()
    flags = {"a": (True, True), "b": (False, True), "n": (True, False), "off": (False, False)}
    (root / "t").mkdir(parents=True)
    for name, (nightly, per_commit) in flags.items():
        body = src.replace("nightly: false", f"nightly: {str(nightly).lower()}")
        body = body.replace("per_commit: false", f"per_commit: {str(per_commit).lower()}")
        (root / "t" / f"{name}.yaml").write_text(body)


@pytest.fixture
def sandbox(tmp_path, migrated_db) -> Sandbox:
    home, dags, recipes = tmp_path / "home", tmp_path / "dags", tmp_path / "recipes"
    home.mkdir()
    dags.mkdir()
    shutil.copy(migrated_db, home / "airflow.db")
    for name in TRIGGER_DAG_FILES:
        shutil.copy(REPO / "dags" / name, dags / name)
    (dags / "speed_matrix.py").write_text(STAND_IN_SPEED_MATRIX)
    (dags / "warmup.py").write_text(WARMUP_DAG)
    _write_recipes(recipes)
    (tmp_path / "schedule.yaml").write_text(SCHEDULE)
    fake = FakeGitHub(head=1, token="ghp_loopback_only").start()
    env = _airflow_env(home, dags, recipes, tmp_path / "schedule.yaml")
    env["SPEEDMATRIX_GITHUB_API_URL"] = fake.base_url
    env["AIRFLOW_CONN_GITHUB_DEFAULT"] = json.dumps(
        {"conn_type": "http", "password": "ghp_loopback_only"}
    )
    box = Sandbox(tmp_path, env, fake)
    yield box
    for r in box.runners:
        r.close()
    fake.stop()


PER_COMMIT = ("t/a", "t/b")


def expected(fake: FakeGitHub, *idx: int) -> list[tuple[str, dict]]:
    return [
        (
            T.commit_run_id(r, fake.sha(i)),
            {"recipe": r, "engine_ref": fake.sha(i), "ssh_conn_id": "local"},
        )
        for i in idx
        for r in PER_COMMIT
    ]


def test_new_commits_trigger_once_each_oldest_first_then_nothing(sandbox):
    fake = sandbox.fake
    first = sandbox.run()  # no watermark yet: only the head
    assert sandbox.triggered() == expected(fake, 0)
    assert all(
        r.headers.get("Authorization") == "Bearer ghp_loopback_only" for r in fake.requests
    )  # token from the Airflow connection

    fake.head = 4  # three new commits
    second = sandbox.run()
    assert sandbox.triggered() == expected(fake, 0, 1, 2, 3)
    assert sandbox.states(second)["trigger_speed_matrix"] == ["success"] * 6
    assert sandbox.states(second)["save_state"] == ["success"]
    assert sandbox.watch_state()["sha"] == fake.sha(3)

    third = sandbox.run()  # nothing new: GitHub answers 304 to the stored ETag
    assert fake.commits_requests()[-1].status == 304
    assert fake.commits_requests()[-1].headers.get("If-None-Match")
    assert sandbox.poll_plan(third)["status"] == "not_modified"
    assert sandbox.triggered() == expected(fake, 0, 1, 2, 3)
    assert sandbox.states(third)["trigger_speed_matrix"] == ["skipped"]  # empty map
    assert {sandbox.run_state(r) for r in (first, second, third)} == {"success"}

    # Even with the watermark lost (Variable deleted), the run ids refuse a second trigger.
    assert sandbox.runner().call(op="var_delete", key=T.STATE_VARIABLE)["deleted"] == 1
    fourth = sandbox.run()
    assert sandbox.poll_plan(fourth)["commits"] == [fake.sha(3)]  # planned again from the head
    assert sandbox.states(fourth)["trigger_speed_matrix"] == ["skipped", "skipped"]
    assert sandbox.triggered() == expected(fake, 0, 1, 2, 3)
    assert sandbox.run_state(fourth) == "success"


def test_two_racing_polls_trigger_each_commit_once(sandbox):
    fake = sandbox.fake
    first = sandbox.runner()
    first.call(op="run", dag_id="vllm_commit_watch")  # watermark at commit 0
    # A second Airflow process; a no-op run first pays its start-up before the race.
    # (Not in parallel with the first run: two processes writing the first DAG sync into
    # one fresh SQLite DB collide, which is a property of the harness, not of the triggers.)
    second = sandbox.runner(new=True)
    second.call(op="run", dag_id="warmup")
    fake.head = 4
    # The racers may run at different speeds on a busy machine: wait long for each other.
    schedule = sandbox.root / "schedule.yaml"
    schedule.write_text(schedule.read_text().replace("timeout_s: 1", "timeout_s: 90"))
    # Both polls must read the state and GitHub's answer before either triggers.
    fake.barrier = threading.Barrier(2)
    for r in (first, second):
        r.send(op="run", dag_id="vllm_commit_watch")
    answers = [r._answer() for r in (first, second)]
    assert all("run_id" in a for a in answers), answers
    fake.barrier = None
    assert len(fake.commits_requests()) == 3  # both racers really polled
    assert sandbox.triggered() == expected(fake, 0, 1, 2, 3)  # each commit once per recipe
    trigger_states = [
        s
        for (rid,) in sandbox.rows("select run_id from dag_run where dag_id='vllm_commit_watch'")
        for s in sandbox.states(rid).get("trigger_speed_matrix", [])
    ]
    # 2 (first poll) + 6 (winner) succeeded; the loser's 6 were refused by the run ids.
    assert trigger_states.count("success") == 8
    assert trigger_states.count("skipped") == 6


def test_rate_limit_5xx_timeout_end_the_poll_cleanly_bad_token_fails_it(sandbox):
    fake = sandbox.fake
    sandbox.run()
    fake.head = 3
    for mode in ("ratelimit", "5xx", "timeout"):  # 429 + Retry-After: tests/unit
        fake.mode, fake.delay_s = mode, 3.0
        run_id = sandbox.run()
        states = sandbox.states(run_id)
        assert states["poll"] == ["skipped"], (mode, states)
        assert states["save_state"] == ["skipped"], (mode, states)
        assert sandbox.run_state(run_id) == "success"
        assert sandbox.triggered() == expected(fake, 0), mode  # nothing new, nothing wrong
    fake.mode = "ok"

    fake.token = "rotated"  # the connection's token is now wrong: a human must act
    run_id = sandbox.run()
    assert sandbox.states(run_id)["poll"] == ["failed"]
    assert sandbox.run_state(run_id) == "failed"
    assert "GitHub API misconfigured" in sandbox.last_log() and "401" in sandbox.last_log()
    (tries,) = sandbox.rows(
        "select try_number from task_instance where run_id=? and task_id='poll'", run_id
    )[0]
    assert tries == 1  # failed at once: no retry can fix a bad token
    assert sandbox.triggered() == expected(fake, 0)

    fake.token = "ghp_loopback_only"
    sandbox.run()  # the state was left alone: the next good poll picks up 1 and 2
    assert sandbox.triggered() == expected(fake, 0, 1, 2)


def test_a_conf_cannot_send_the_token_elsewhere(sandbox):
    """api_url in a conf (either trigger DAG) is refused: the API base is the deployment's
    (SPEEDMATRIX_GITHUB_API_URL here), so whoever may trigger a DAG cannot receive the token
    or choose the commit (issue #16 item 1)."""
    evil = FakeGitHub(head=3).start()
    try:
        watch = sandbox.run(conf={"api_url": evil.base_url})
        nightly = sandbox.run(
            "speed_matrix_nightly",
            conf={"api_url": evil.base_url},
            logical_date="2026-11-29T02:00:00+00:00",
        )
        assert evil.requests == []
        assert sandbox.run_state(watch) == "failed"
        assert sandbox.run_state(nightly, "speed_matrix_nightly") == "failed"
        assert sandbox.triggered() == []
        assert "api_url" in sandbox.last_log()
    finally:
        evil.stop()


def test_cap_triggers_the_newest_and_records_the_skipped(sandbox):
    fake = sandbox.fake
    sandbox.run()
    fake.head = 8  # seven new commits, cap 2 for this run
    run_id = sandbox.run(conf={"max_commits": 2})
    assert sandbox.triggered() == expected(fake, 0, 6, 7)
    plan = sandbox.poll_plan(run_id)
    skipped = [fake.sha(i) for i in range(1, 6)]
    assert [s["sha"] for s in plan["skipped"]] == skipped
    state = sandbox.watch_state()
    assert state["sha"] == fake.sha(7)
    assert [s["sha"] for s in state["skipped"]] == skipped
    assert all(s["reason"] == "cap of 2 per poll" for s in state["skipped"])
    assert "skipped commit" in sandbox.last_log()


NIGHTLY = ("t/a", "t/n")


def test_nightly_resolves_head_once_and_a_second_run_that_night_is_a_no_op(sandbox):
    fake = sandbox.fake
    fake.head = 5
    first = sandbox.run("speed_matrix_nightly", logical_date="2026-11-29T02:00:00+00:00")
    head_requests = [r for r in fake.requests if r.path.endswith("/commits/main")]
    assert len(head_requests) == 1
    want = [
        (
            f"nightly__{r.replace('/', '~')}__2026-11-29",
            {"recipe": r, "engine_ref": fake.sha(4), "ssh_conn_id": "local"},
        )
        for r in NIGHTLY
    ]
    assert sandbox.triggered() == want
    assert sandbox.states(first, "speed_matrix_nightly")["trigger_speed_matrix"] == ["success"] * 2

    fake.head = 6  # main moved; the same night again (a retry, a manual re-run)
    again = sandbox.run("speed_matrix_nightly", logical_date="2026-11-29T02:30:00+00:00")
    assert sandbox.triggered() == want
    assert sandbox.states(again, "speed_matrix_nightly")["trigger_speed_matrix"] == ["skipped"] * 2
    assert sandbox.run_state(again, "speed_matrix_nightly") == "success"

    sandbox.run("speed_matrix_nightly", logical_date="2026-11-30T02:00:00+00:00")
    assert [rid for rid, _ in sandbox.triggered()][2:] == [
        f"nightly__{r.replace('/', '~')}__2026-11-30" for r in NIGHTLY
    ]
    assert {c["engine_ref"] for _, c in sandbox.triggered()[2:]} == {fake.sha(5)}
