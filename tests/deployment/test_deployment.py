"""speedmatrix's guarantees under a real Airflow deployment (scheduler + two Celery workers).

One deployment (conftest.py) serves every test here, in file order; each test leaves both
workers up. Its warehouse is s3:// on moto's standalone S3 server on loopback: every run the
tests trigger lands there, and the checks read it back through s3://. The time limits only catch hangs: they are generous because the machine may be
busy (a 2-core box at load 20 made a 4-task probe run take minutes). On failure, the harness's messages carry the tails of every component's log.
Run alone: `uv run pytest -m deployment`.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import processes
import pytest
import yaml
from deploy_env import SSH_CONN_ID, Env
from deploy_harness import REPO, VENV_BIN, Deployment, free_port

from speedmatrix.flows.bisect_steps import MAX_STEPS

pytestmark = [pytest.mark.deployment, pytest.mark.integration, pytest.mark.timeout(1500)]

SM = "speed_matrix"
TINY = "sim/deploy-tiny"
TINY_B = "sim/deploy-tiny-b"
SLOW_START = "sim/deploy-slow-start"
BISECT = "sim/deploy-bisect"
BISECT_DAG = "speed_matrix_bisect"
SIM_PROFILE = REPO / "include" / "sim-profiles" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"


def _ts(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def _xcom(dep: Deployment, dag_id: str, run_id: str, task_id: str, map_index: int = -1):
    """A task's return value through the REST API (decoded when it comes back as text)."""
    entry = dep.api(
        "GET",
        f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value",
        params={"map_index": map_index},
    )
    value = entry["value"]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = ast.literal_eval(value)
    return value


def _tis(dep: Deployment, run_id: str) -> dict[tuple[str, int], dict]:
    return {(t["task_id"], t["map_index"]): t for t in dep.task_instances(SM, run_id)}


def server_spans(dep: Deployment, run_id: str) -> tuple[tuple[datetime, datetime], ...]:
    """Two bounds of the time the run's server lived on its host, from the task records.

    outer: setup_server's start -> stop_server's end; the server cannot live outside it.
    inner: setup_server's end (server ready) -> stop_server's start; it surely lived inside.
    Disjoint outer spans prove two servers never coexisted; overlapping inner spans prove they
    did.
    """
    tis = _tis(dep, run_id)
    setup, stop = tis[("setup_server", -1)], tis[("stop_server", -1)]
    outer = (_ts(setup["start_date"]), _ts(stop["end_date"]))
    inner = (_ts(setup["end_date"]), _ts(stop["start_date"]))
    assert all(outer) and all(inner), f"{run_id}: setup/stop never ran: {tis}"
    return outer, inner


def _overlap(x: tuple[datetime, datetime], y: tuple[datetime, datetime]) -> bool:
    return x[0] < y[1] and y[0] < x[1]


@contextlib.contextmanager
def _warehouse(dep: Deployment) -> Iterator:
    """The deployment's warehouse (s3:// on the loopback S3 server), opened with the settings
    of the deployment's env file (SPEEDMATRIX_WAREHOUSE, AWS_*), as a reader beside the
    workers opens it."""
    from speedmatrix.store.warehouse import Warehouse

    settings = dep.warehouse_env()
    assert settings["SPEEDMATRIX_WAREHOUSE"].startswith("s3://"), settings
    with pytest.MonkeyPatch.context() as mp:
        for key, value in settings.items():
            mp.setenv(key, value)
        yield Warehouse(settings["SPEEDMATRIX_WAREHOUSE"])


def _query_cli(dep: Deployment, sql: str) -> list[dict]:
    """`speedmatrix query --format json` in a process whose only warehouse settings are the
    deployment env file's (no --warehouse: SPEEDMATRIX_WAREHOUSE names it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SPEEDMATRIX_"))}
    env.update(dep.warehouse_env())
    out = subprocess.run(
        [str(VENV_BIN / "speedmatrix"), "query", sql, "--format", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _landed_whole(dep: Deployment, site: Path, expected: dict[str, set[tuple[str, int]]]) -> None:
    """Each Airflow run of `expected` (run id -> its cells as (phase, concurrency)) landed
    whole in the s3:// warehouse: one runs row, every cell of its plan once, no request row
    twice; and its page is in the local site folder (SPEEDMATRIX_SITE_DIR)."""
    from speedmatrix.report.site import run_page

    ids = {r: _xcom(dep, SM, r, "resolve")["run_id"] for r in expected}
    # Runs of one recipe, ref and trigger resolved in the same second get one warehouse id
    # (resolution.make_run_id stamps seconds), and each landing then replaces the one before:
    # only one of them would be left to find.
    assert len(set(ids.values())) == len(ids), f"Airflow runs share a warehouse run id: {ids}"
    listed = ", ".join(f"'{i}'" for i in ids.values())
    runs = _query_cli(dep, f"select run_id, status from runs where run_id in ({listed})")
    assert sorted(r["run_id"] for r in runs) == sorted(ids.values()), runs
    with _warehouse(dep) as wh:
        cells = wh.query(
            "select run_id, phase, concurrency, count(*) as n from cells "
            f"where run_id in ({listed}) group by all"
        ).to_dict("records")
        dup_requests = wh.query(
            "select run_id, phase, context_tokens, concurrency, request_index, count(*) as n "
            f"from requests where run_id in ({listed}) group by all having count(*) > 1"
        ).to_dict("records")
    assert not dup_requests, f"request rows landed twice: {dup_requests[:5]}"
    for run_id, plan in expected.items():
        got = {(c["phase"], c["concurrency"]): c["n"] for c in cells if c["run_id"] == ids[run_id]}
        assert got == dict.fromkeys(plan, 1), (run_id, got)
        assert (site / run_page(ids[run_id])).is_file(), f"{run_id}: no page in {site}"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def in_flight_now(dep: Deployment, run_ids) -> list[str]:
    """The runs of `run_ids` that are still running."""
    return [r for r in run_ids if dep.run(SM, r)["state"] == "running"]


def _decode_streaming(port: int) -> bool:
    """Whether the simulated server on `port` is streaming a decode request right now: a live
    request asking for more than one token (prefill cells and the cache warm-up ask for one)
    that has produced some (the simulator's ground truth, /sim/requests)."""
    import requests

    try:
        reqs = requests.get(f"http://127.0.0.1:{port}/sim/requests", timeout=10).json()
    except (requests.RequestException, ValueError):
        return False
    return any(
        r["finished_at"] is None and r["max_tokens"] > 1 and r["output_tokens"] >= 1 for r in reqs
    )


def test_trivial_dag_runs_on_each_celery_worker(env: Env) -> None:
    """(1) The deployment is up (conftest), and tasks run on the Celery workers: a run pinned
    to each worker's queue executes there (the task reports the worker it ran in), and finds
    the task path's heavy libraries already loaded by its worker (deploy/'s
    celery_config_options: speedmatrix.flows.preload, issue #19)."""
    dep = env.dep
    assert dep.celery_workers() == sorted(
        f"{n}@{socket.gethostname()}" for n in ("worker1", "worker2")
    )
    dep.wait_dag("deploy_probe")
    runs = {
        w: dep.trigger("deploy_probe", run_id=f"manual__probe-pin-{w}")
        for w in ("worker1", "worker2")
    }
    states = dep.wait_runs("deploy_probe", list(runs.values()), timeout_s=600)
    assert set(states.values()) == {"success"}, states
    for worker, run_id in runs.items():
        tis = dep.task_instances("deploy_probe", run_id)
        assert len(tis) == 4
        for ti in tis:
            assert ti["queue"] == worker
            got = _xcom(dep, "deploy_probe", run_id, "where", ti["map_index"])
            assert got["worker"] == worker, got
            assert got["preloaded"] == ["great_expectations", "matplotlib.pyplot", "scipy.stats"]


def test_one_run_per_host_across_workers_and_scheduler_restart(env: Env) -> None:
    """(2) Two speed_matrix runs of one host, forced onto different workers, never overlap
    from server start to server stop; a run of another host (SSH) overlaps them.
    (5) The scheduler is restarted while the runs are in flight: all three complete.
    (7) The three land through both workers into the s3:// warehouse (moto's server): each
    landed whole (its runs row and every cell once), read back through s3://."""
    dep = env.dep
    dep.wait_dag(SM)
    base = {"recipe": TINY}
    runs = {
        "a": dep.trigger(
            SM, {**base, "ssh_conn_id": "local", "port": free_port()}, "manual__lease-a-pin-worker1"
        ),
        "b": dep.trigger(
            SM, {**base, "ssh_conn_id": "local", "port": free_port()}, "manual__lease-b-pin-worker2"
        ),
        # Three decode cells: their hand-offs are checked below (issue #19's turn).
        "c": dep.trigger(
            SM,
            {**base, "ssh_conn_id": SSH_CONN_ID, "port": free_port(), "concurrencies": [1, 2, 4]},
            "manual__lease-c",
        ),
    }

    def a_server_started() -> bool:
        return any(
            _tis(dep, r).get(("setup_server", -1), {}).get("state") == "success"
            for r in runs.values()
        )

    dep.wait_for("a server started by one of the runs", a_server_started, timeout_s=600, every_s=2)
    assert in_flight_now(dep, runs.values()), (
        "every run finished before the scheduler restart: nothing was proven"
    )
    dep.stop_component("scheduler")  # SIGTERM, as a systemd restart or a redeploy does
    assert not dep.procs["scheduler"].alive()
    # The runs are in flight with no scheduler (its whole process group is gone): what the
    # restart must survive. A pause before the start would prove nothing more.
    assert in_flight_now(dep, runs.values()), "every run finished while the scheduler stopped"
    dep.start_component("scheduler")

    states = dep.wait_runs(SM, list(runs.values()), timeout_s=1200)
    assert set(states.values()) == {"success"}, states

    spans = {k: server_spans(dep, r) for k, r in runs.items()}
    for key, worker in (("a", "worker1"), ("b", "worker2")):
        assert _tis(dep, runs[key])[("setup_server", -1)]["queue"] == worker
    outer = {k: v[0] for k, v in spans.items()}
    inner = {k: v[1] for k, v in spans.items()}
    assert not _overlap(outer["a"], outer["b"]), f"same-host runs overlapped: {outer}"
    assert _overlap(inner["c"], inner["a"]) or _overlap(inner["c"], inner["b"]), (
        f"the other host's run did not overlap: {inner}"
    )
    print({k: [t.isoformat() for t in v] for k, v in outer.items()})
    _cells_took_turns(dep, runs["c"], 3)

    # Three runs, two workers, one s3:// warehouse: every run landed whole, none twice.
    one_cell = {("prefill", 1), ("decode", 1)}
    _landed_whole(
        dep,
        env.root / "site",
        {
            runs["a"]: one_cell,
            runs["b"]: one_cell,
            runs["c"]: {("prefill", 1), ("decode", 1), ("decode", 2), ("decode", 4)},
        },
    )
    # Whether two `land` tasks overlapped depends on the machine's pace (no test can force
    # it without another run): printed, so a log shows when S3 took concurrent commits.
    lands = {k: _tis(dep, r)[("land", -1)] for k, r in runs.items()}
    spans = {k: (_ts(t["start_date"]), _ts(t["end_date"])) for k, t in lands.items()}
    print(
        {
            "land": {k: [t.isoformat() for t in v] for k, v in spans.items()},
            "queues": {k: t["queue"] for k, t in lands.items()},
            "overlapping": [
                (x, y)
                for x, y in (("a", "b"), ("a", "c"), ("b", "c"))
                if _overlap(spans[x], spans[y])
            ],
        }
    )


def _cells_took_turns(dep: Deployment, run_id: str, n: int) -> None:
    """(#19) Under the real scheduler two decode cell tasks run at once, yet the host measured
    one cell at a time in map index order: each cell's hold on the host (`turn`, from its
    result) began after the previous one's ended, and each waited for a predecessor that had
    left the host; the first decode cell after the run's one prefill cell, another task's
    instance (its sibling, no Airflow edge between them).
    And the hand-off was hidden: some cell task started before the previous one ended."""
    tis = _tis(dep, run_id)
    cells = [("prefill", 0)] + [("decode", i) for i in range(n)]
    turns = [_xcom(dep, SM, run_id, task, i)["turn"] for task, i in cells]
    assert turns[0]["after"] is None, turns
    for k in range(1, len(cells)):
        assert turns[k]["after"] == "{}[{}]".format(*cells[k - 1]), turns
        # never "scheduled" under a scheduler: the predecessor said it had left the host
        # (flows/turn.py's "released", read while its task still ran) or its task had ended
        assert turns[k]["state"] in ("released", "success"), turns
        assert _ts(turns[k]["began"]) >= _ts(turns[k - 1]["ended"]), turns
    spans = [(_ts(tis[c]["start_date"]), _ts(tis[c]["end_date"])) for c in cells]
    early = [cells[k] for k in range(1, len(cells)) if spans[k][0] < spans[k - 1][1]]
    assert early, f"no cell task started before the previous one ended: {spans}"
    print({"turns": turns, "started early": early})


def test_worker_killed_mid_decode_cell(env: Env) -> None:
    """(4) The worker running a decode cell is SIGKILLed: the run ends (failed), teardown stops
    the server and frees the host, the prefill cell measured before lands, no duplicates."""
    dep = env.dep
    port = free_port()
    # The window only has to outlast the time from the first decode token to the kill (two
    # polls away): nothing waits it out, as the kill ends the cell. Long, so that a loaded
    # machine's slow polls still kill the cell mid-window.
    run_id = dep.trigger(
        SM,
        {"recipe": TINY, "ssh_conn_id": "local", "port": port, "window_s": 300},
        "manual__kill-pin-worker1",
    )

    def decode_measuring() -> bool:
        """The prefill cell's task has ended (its result is in, on the same worker) and the
        decode cell has the host: a decode request is streaming. A decode task merely
        `running` is not enough: it starts beside the prefill cell and waits for its turn
        (flows/turn.py), and a kill then (after a fixed 6 s, on a loaded machine) took the
        prefill cell with it."""
        tis = _tis(dep, run_id)
        prefill, decode = tis.get(("prefill", 0), {}), tis.get(("decode", 0), {})
        return (
            prefill.get("state") == "success"
            and decode.get("state") == "running"
            and _decode_streaming(port)
        )

    dep.wait_for("the decode cell to measure", decode_measuring, timeout_s=600, every_s=0.5)
    dep.stop_component("worker1", signal.SIGKILL)
    dep.start_component("worker1")
    dep.wait_for("worker1 back", lambda: len(dep.celery_workers()) == 2, timeout_s=300, every_s=3)

    states = dep.wait_runs(SM, [run_id], timeout_s=900)
    tis = _tis(dep, run_id)
    assert states[run_id] == "failed", states
    assert tis[("decode", 0)]["state"] == "failed"
    assert tis[("stop_server", -1)]["state"] == "success"
    assert tis[("land", -1)]["state"] == "success"
    assert not _port_open(port), "teardown left the server running"
    servers = [p for p in dep.leftovers() if b"sim" in processes.cmdline(p)]
    assert not servers, f"simulated servers still running: {servers}"
    assert _lease_free(env.root / "machine-local"), "host lease not released"

    wh_run_id = _xcom(dep, SM, run_id, "resolve")["run_id"]
    with _warehouse(dep) as wh:
        cells = wh.query(
            "select phase, context_tokens, concurrency, status from cells "
            f"where run_id = '{wh_run_id}'"
        )
    rows = cells.to_dict("records")
    keys = [(r["phase"], r["context_tokens"], r["concurrency"]) for r in rows]
    assert len(keys) == len(set(keys)), f"duplicate cells landed: {rows}"
    by_phase = {r["phase"]: r["status"] for r in rows}
    assert by_phase.get("prefill") == "valid", rows
    assert by_phase.get("decode") == "failed", rows


def _lease_free(machine: Path) -> bool:
    """No live record in a machine-wide lease directory (lease.py: holder.<uid> files, one
    line: holder, expiry, ...)."""
    now = time.time()
    for record in machine.glob("holder.*"):
        fields = record.read_text().split()
        if len(fields) >= 2 and fields[1].isdigit() and int(fields[1]) > now:
            return False
    return True


def _group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields and fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def test_worker_killed_during_setup(env: Env) -> None:
    """(#16 item 8) The worker running setup_server is SIGKILLed after the server was
    launched and before it was ready: no handle ever reaches XCom, yet the teardown finds the
    run's server in the host's own records, stops it, and only then releases the host."""
    dep = env.dep
    dep.wait_dag(SM)  # unpaused, so that the test also runs alone (-k)
    port = free_port()
    run_id = dep.trigger(
        SM,
        {"recipe": SLOW_START, "ssh_conn_id": "local", "port": port},
        "manual__setupkill-pin-worker1",
    )
    pid_file = env.root / "home-local" / ".speedmatrix" / "servers" / str(port) / "pid"

    def launched() -> bool:
        return pid_file.is_file() and pid_file.read_text().strip().isdigit()

    # the recipe's server sleeps 900 s before it serves: setup is waiting for it to be ready
    dep.wait_for("the run's server to be launched", launched, timeout_s=600, every_s=0.5)
    pgid = int(pid_file.read_text())
    assert _tis(dep, run_id)[("setup_server", -1)]["state"] == "running"
    dep.stop_component("worker1", signal.SIGKILL)
    assert _group_alive(pgid), "the server should outlive the worker (its own session)"
    dep.start_component("worker1")
    dep.wait_for("worker1 back", lambda: len(dep.celery_workers()) == 2, timeout_s=300, every_s=3)

    def torn_down() -> bool:
        ti = _tis(dep, run_id).get(("stop_server", -1), {})
        return ti.get("state") in ("success", "failed", "upstream_failed")

    dep.wait_for("the teardown", torn_down, timeout_s=900, every_s=2)
    tis = _tis(dep, run_id)
    assert tis[("setup_server", -1)]["state"] == "failed"
    assert tis[("stop_server", -1)]["state"] == "success"
    teardown = _xcom(dep, SM, run_id, "stop_server")
    assert teardown["from_records"] == [str(pid_file.parent)], teardown
    assert teardown["lease"] == "RELEASED", teardown
    assert not _group_alive(pgid), "teardown left the server running"
    assert _lease_free(env.root / "machine-local"), "host lease not released"
    assert dep.wait_runs(SM, [run_id], timeout_s=900)[run_id] == "failed"


def _plant(profiles: Path, commits: list[str], planted: int) -> None:
    """One simulator profile per commit: each reports its commit in its version (as a build at
    that commit does, so the noise model never pools two commits), and from `planted` on the
    8Kx1 decode step takes 1/0.7 as long (its tok/s ~30% lower; nothing else changes)."""
    base = yaml.safe_load(SIM_PROFILE.read_text())
    for i, commit in enumerate(commits):
        prof = copy.deepcopy(base)
        prof["version"] = f"0.1.dev1+g{commit[:9]}"
        for point in prof["decode"]["correction"]:
            if i >= planted and (point["context"], point["batch"]) == (8192, 1):
                point["factor"] /= 0.7
        (profiles / f"{commit}.yaml").write_text(yaml.safe_dump(prof))


def test_bisect_names_the_planted_commit(env: Env) -> None:
    """speed_matrix_bisect through the scheduler: a good speed_matrix run, then a bisection of
    two commits whose first made 8Kx1 slower (the second, the known-bad end, inherits it). It
    names that commit, which only a step's measurement can tell (naming the bad end without
    measuring, or judging the planted commit good, names the other one), in one speed_matrix
    run, skips the steps after, and its measure step waits deferred (on the triggerer, no
    worker slot). The search itself (halving, skips, suspects, its step bound) is the pure
    analysis/bisection.py, held by tests/unit/test_bisect.py, and judging good and bad steps
    from landed runs by test_bisect_dag.py and test_regression_sim.py; here one step is what the
    deployment adds: a speed_matrix run triggered, waited for deferred, landed and judged."""
    dep = env.dep
    commits = [hashlib.sha1(f"bisect-{i}".encode()).hexdigest() for i in range(3)]
    good, after = commits[0], commits[1:]
    planted = 1
    _plant(env.root / "bisect-profiles", commits, planted=planted)
    dep.wait_dag(SM)  # unpaused, so that the test also runs alone (-k bisect)
    dep.wait_dag(BISECT_DAG)
    good_run = dep.trigger(SM, {"recipe": BISECT, "engine_ref": good}, "manual__bisect-good")
    assert dep.wait_runs(SM, [good_run], timeout_s=900) == {good_run: "success"}

    conf = {
        "recipe": BISECT,
        "good": good,
        "bad": after[-1],
        "cells": ["8Kx1"],
        "commits": after,
        "warehouse": dep.warehouse,
        "window_s": 2,
        # The planted change is 30-40% on tok/s and time between tokens; the recipe's 3% would
        # let a loaded 2-core box's jitter on an 87 ms TTFT call a good commit bad.
        "threshold_pct": 20,
    }
    run_id = dep.trigger(BISECT_DAG, conf, "manual__bisect")
    seen: set[tuple[str, str]] = set()

    def finished() -> bool:
        seen.update(
            (t["task_id"], t["state"])
            for t in dep.task_instances(BISECT_DAG, run_id)
            if t["task_id"].startswith("measure_")
        )
        return dep.run(BISECT_DAG, run_id)["state"] in ("success", "failed")

    dep.wait_for("the bisection", finished, timeout_s=1200, every_s=2)
    tis = {t["task_id"]: t["state"] for t in dep.task_instances(BISECT_DAG, run_id)}
    assert dep.run(BISECT_DAG, run_id)["state"] == "success", tis
    result = _xcom(dep, BISECT_DAG, run_id, "conclude")
    assert result["first_bad"] == commits[planted] != after[-1], result
    assert result["skipped"] == [], result
    # one step, at the planted commit, judged bad
    assert [tuple(m) for m in result["measured"]] == [(commits[planted], "bad")], result
    steps = [r["dag_run_id"] for r in dep.runs(SM) if r["dag_run_id"].startswith("bisect__")]
    assert 1 <= len(steps) <= math.ceil(math.log2(len(after))) + 1, steps
    n = len(result["measured"])
    assert n == len(steps), (result, steps)
    for step in steps:
        # Every step landed its cells; one at a bad commit then fails its run in
        # `regressions` (the run's own alert), which ends the wait like a success.
        sm_tis = {t["task_id"]: t["state"] for t in dep.task_instances(SM, step)}
        assert sm_tis["land"] == "success", (step, sm_tis)
    for i in range(MAX_STEPS):
        states = {tis[f"{kind}_{i}"] for kind in ("choose", "measure", "judge")}
        assert states == ({"success"} if i < n else {"skipped"}), (i, tis)
        if i < n:
            assert (f"measure_{i}", "deferred") in seen, seen


def _runs_by_prefix(dep: Deployment, prefix: str) -> list[dict]:
    return [r for r in dep.runs(SM) if r["dag_run_id"].startswith(prefix)]


def _poll(dep: Deployment, n: int = 1) -> None:
    """Trigger `n` polls of vllm_commit_watch at once and wait until every poll is done."""
    ids = [dep.trigger("vllm_commit_watch") for _ in range(n)]
    states = dep.wait_runs("vllm_commit_watch", ids, timeout_s=600)
    assert set(states.values()) == {"success"}, states


def test_commit_watch_triggers_each_commit_once(env: Env) -> None:
    """(3) vllm_commit_watch against a GitHub stand-in: three new commits -> three runs per
    per-commit recipe; polling again -> none; two polls at once -> each commit once.
    speed_matrix is paused meanwhile: the triggered runs are counted, not executed. The
    nightly DAG is unpaused here too (its cron fires every minute) and checked next."""
    dep, gh = env.dep, env.github
    dep.api("PATCH", f"/dags/{SM}", json={"is_paused": True})
    dep.wait_dag("speed_matrix_nightly")
    dep.wait_dag("vllm_commit_watch")

    gh.head = 1
    _poll(dep)  # a fresh watch starts from the head
    first = _runs_by_prefix(dep, "commit__")
    assert sorted(r["conf"]["recipe"] for r in first) == [TINY, TINY_B]
    assert {r["conf"]["engine_ref"] for r in first} == {gh.sha(0)}

    gh.head = 4
    _poll(dep)
    after = _runs_by_prefix(dep, "commit__")
    new = [r for r in after if r["dag_run_id"] not in {f["dag_run_id"] for f in first}]
    pairs = sorted((r["conf"]["recipe"], r["conf"]["engine_ref"]) for r in new)
    assert pairs == sorted((rec, gh.sha(i)) for rec in (TINY, TINY_B) for i in (1, 2, 3)), pairs

    _poll(dep)
    assert len(_runs_by_prefix(dep, "commit__")) == len(after), "a poll without news triggered"

    gh.head = 6
    _poll(dep, n=2)
    final = _runs_by_prefix(dep, "commit__")
    pairs = [(r["conf"]["recipe"], r["conf"]["engine_ref"]) for r in final]
    assert len(pairs) == len(set(pairs)) == 2 * 6, pairs


def test_nightly_fires_on_its_schedule(env: Env) -> None:
    """(6) speed_matrix_nightly, on a cron of every minute, fires by itself (a scheduled run)
    and triggers speed_matrix once per nightly recipe (deploy-tiny, not deploy-tiny-b) at the
    head commit; later firings the same night trigger nothing more (it was unpaused in the
    commit-watch test, so it has usually fired more than once by now)."""
    dep, gh = env.dep, env.github

    def scheduled_done() -> list[dict]:
        runs = dep.api("GET", "/dags/speed_matrix_nightly/dagRuns", params={"limit": 50})[
            "dag_runs"
        ]
        return [r for r in runs if r["run_type"] == "scheduled" and r["state"] == "success"]

    fired = dep.wait_for("a scheduled nightly run", scheduled_done, timeout_s=600, every_s=3)
    nightly = _runs_by_prefix(dep, "nightly__")
    assert [r["conf"]["recipe"] for r in nightly] == [TINY], nightly
    # The head when it fired: the commit-watch test moved it from 1 to 4 to 6 commits.
    assert nightly[0]["conf"]["engine_ref"] in {gh.sha(0), gh.sha(3), gh.sha(5)}
    assert fired
    dep.api("PATCH", "/dags/speed_matrix_nightly", json={"is_paused": True})
    # Leave speed_matrix as found: nothing queued behind the paused DAG, DAG unpaused.
    for r in _runs_by_prefix(dep, "commit__") + _runs_by_prefix(dep, "nightly__"):
        dep.api("DELETE", f"/dags/{SM}/dagRuns/{r['dag_run_id']}")
    dep.api("PATCH", f"/dags/{SM}", json={"is_paused": False})
