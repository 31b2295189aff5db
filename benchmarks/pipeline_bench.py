"""Overhead of the pipeline itself: a whole speed_matrix run against the simulator.

    uv run python benchmarks/pipeline_bench.py [--duration 30] [--short] [--runner local|celery]

Runs the DAG once, with a private HOME, Airflow home and warehouse, either through
`python -m speedmatrix.cli.demo` (`--runner dag-test`, the default: every task through Airflow's
task runner and execution API, one at a time, in one process; no scheduler; mapped cells in no
fixed order) or (`--runner local`) on a real deployment with the LocalExecutor: PostgreSQL,
api-server, scheduler, dag-processor and triggerer as separate processes (the deployment
tests' harness, tests/deployment/deploy_harness.py, with no Celery worker), the run triggered
through the REST API; cells then run in map index order, the plan's run order. Then reports

    host idle share = (wall - windows - warm-up - server start) / wall      (issue #19)
    overhead        = (wall - sum of cell windows - server start) / wall    (#7's, kept)

with wall from the first task's start to the last task's end, windows the decode windows plus
the prefill cells' TTFTs, warm-up the decode cells' recorded `warmup_s`; and the warm-up floor
of the matrix it ran (`warmup_floor`) beside the warm-up it measured. `--runner celery` runs
the CeleryExecutor deployment with one worker of deploy/'s concurrency. A deployment run first
runs a warm-up DAG (WARMUP_DAG), as on a deployment that has run before; `--cold` does not.

and where the time goes: every task's duration, cache warm-up inside the cells (each decode
cell first puts its C prompts in the prefix cache; each prefill cell's window is its TTFT),
and the gaps between tasks (scheduling). Writes benchmarks/out/pipeline_bench-<stamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FULL = {"recipe": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"}
SHORT = {"prefill_contexts": ["8K", "16K"], "contexts": ["8K", "16K"]}
# Run on the deployment before the measured run (unless --cold): what a deployment that has
# served runs before has done once and a fresh one does in the measured run's first tasks.
# Measured on a fresh deployment (2026-12-03, Celery): the api-server answered its first
# execution-API call (`resolve`'s PATCH .../run) after 4.99 s, later ones in ~15 ms; the first
# `report` on a new HOME builds matplotlib's font list (~/.cache/matplotlib; 0.1-0.3 s here),
# which every later report reuses. Four parallel tasks, so every Celery pool process has run
# one before the measured run.
WARMUP_DAG = '''"""pipeline_bench's warm-up: the execution API and the workers used once, matplotlib's
font list built, as on a deployment that has run before (benchmarks/pipeline_bench.py)."""
from datetime import datetime

from airflow.sdk import dag, task


@dag(dag_id="bench_warmup", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bench_warmup():
    @task
    def touch(i: int) -> None:
        from matplotlib import font_manager

        font_manager.fontManager.get_default_size()

    touch.expand(i=[0, 1, 2, 3])


bench_warmup()
'''


def _ts(value: str | None) -> float | None:
    return dt.datetime.fromisoformat(value).timestamp() if value else None


def run(conf: dict) -> dict:
    work = Path(tempfile.mkdtemp(prefix="speedmatrix-bench-"))
    env = {
        **os.environ,
        "HOME": str(work / "home"),
        "AIRFLOW_HOME": str(work / "airflow"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "SPEEDMATRIX_WAREHOUSE": str(work / "warehouse"),
    }
    (work / "home").mkdir()
    result = work / "result.json"
    cmd = [sys.executable, "-m", "speedmatrix.cli.demo", "--conf", json.dumps(conf)]
    cmd += ["--result-json", str(result), "--full"]  # conf's keys override the full matrix
    subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        env=env,
        check=True,
        capture_output=True,
    )
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    outer_wall = time.monotonic() - t0
    if not result.exists():
        raise SystemExit(f"the run left no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = json.loads(result.read_text())
    out["outer_wall_s"] = outer_wall
    out["work"] = str(work)
    return out


def deployment(work: Path, dags: Path, *, celery: bool, env: dict[str, str]):
    """(a Deployment of deploy/'s topology, its Celery slots per worker), not started: the
    LocalExecutor with deploy/'s forkserver preload, or the CeleryExecutor with one worker of
    deploy/'s concurrency. `env` gets the LocalExecutor's settings."""
    sys.path.insert(0, str(REPO / "tests" / "deployment"))
    from deploy_harness import Deployment, deploy_setting

    if not celery:
        env["AIRFLOW__CORE__EXECUTOR"] = "LocalExecutor"
        # deploy/'s preload for a LocalExecutor deployment (speedmatrix.flows.preload); the
        # Celery worker gets its own from the deployment's settings (celery_config_options)
        for key in (
            "AIRFLOW__SCHEDULER__MP_START_METHOD",
            "AIRFLOW__SCHEDULER__MP_FORKSERVER_PRELOAD",
        ):
            env[key] = deploy_setting(key, commented=True)
    # deploy/'s worker concurrency (8; 4 until 2026-12-04), not the deployment tests' 2: with
    # 2, a pool process whose task had ended stayed busy 5 s more for 9 tasks of 26 (Airflow's
    # supervisor noticed its task process's exit only at its next 5 s wake-up,
    # min_heartbeat_interval), and the next task waited for it: `plan` 2.95-3.2 s in three
    # runs (2026-12-03); with 4, `site` waited 0.9 s after the stop (2026-12-04).
    concurrency = int(deploy_setting("AIRFLOW__CELERY__WORKER_CONCURRENCY"))
    dep = Deployment(
        work, dags, workers=1 if celery else 0, worker_concurrency=concurrency, extra_env=env
    )
    return dep, concurrency


def run_local_executor(
    conf: dict, celery: bool = False, scheduler_idle_sleep: float | None = None, cold: bool = False
) -> dict:
    """One speed_matrix run on a deployment (deploy/'s topology, started as the deployment
    tests start it): the LocalExecutor, or with `celery` the CeleryExecutor with one worker
    of deploy/'s concurrency (Redis broker, PostgreSQL result backend); the same result shape
    as `run`. Unless `cold`, a warm-up run (WARMUP_DAG) goes first."""
    sys.path.insert(0, str(REPO / "tests" / "deployment"))
    from deploy_harness import deploy_setting

    work = Path(tempfile.mkdtemp(prefix="speedmatrix-bench-"))
    os.chmod(work, 0o755)
    dags = work / "dags"
    dags.mkdir()
    shutil.copy(REPO / "dags" / "speed_matrix.py", dags / "speed_matrix.py")
    if not cold:
        (dags / "bench_warmup.py").write_text(WARMUP_DAG)
    home = work / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "SPEEDMATRIX_WAREHOUSE": str(work / "warehouse"),
        "SPEEDMATRIX_API_KEY": "sk-bench-" + secrets.token_hex(8),
        # The task supervisor's first execution-API call waited 38 s for a cold api-server
        # on the loaded shared machine (2026-12-02), past the default 5 s x 5 tries: the task
        # was killed before it started. A bench setting only; the deployment keeps its own.
        # the run's own host lease (the deployment tests' way): the machine-wide default
        # would make a bench wait for any other run on this shared machine, and count it
        "SPEEDMATRIX_LEASE_DIR": str(work / "lease"),
        "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": os.environ.get(
            "BENCH_EXECUTION_API_TIMEOUT", "60"
        ),
    }
    if scheduler_idle_sleep is None:  # deploy/'s, as the deployment applies it
        scheduler_idle_sleep = float(
            deploy_setting("AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME")
        )
    else:
        env["AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME"] = f"{scheduler_idle_sleep:g}"
    dep, concurrency = deployment(work, dags, celery=celery, env=env)
    dep.start()
    try:
        dep.wait_dag("speed_matrix")
        if not cold:
            dep.wait_dag("bench_warmup")
            warm = dep.trigger("bench_warmup", {}, "manual__bench-warmup")
            warm_state = dep.wait_runs("bench_warmup", [warm], timeout_s=600)[warm]
            if warm_state != "success":
                raise SystemExit(f"the warm-up run {warm_state}; logs under {work}")
        t0 = time.monotonic()
        run_id = dep.trigger("speed_matrix", conf, "manual__pipeline-bench")
        state = dep.wait_runs("speed_matrix", [run_id], timeout_s=4 * 3600)[run_id]
        outer_wall = time.monotonic() - t0
        tasks = {}
        for ti in dep.task_instances("speed_matrix", run_id):
            key = (
                ti["task_id"]
                if ti.get("map_index", -1) < 0
                else f"{ti['task_id']}[{ti['map_index']}]"
            )
            tasks[key] = {
                "scheduled": ti.get("scheduled_when"),
                "queued": ti.get("queued_when"),
                "start": ti.get("start_date"),
                "end": ti.get("end_date"),
                "duration_s": ti.get("duration"),
                "state": ti.get("state"),
                "label": ti.get("rendered_map_index"),
            }
        if state != "success":  # still analysed: what was measured says where time went
            print(
                f"run {state}: {[(k, t['state']) for k, t in tasks.items()]}; logs under {work}",
                file=sys.stderr,
            )
        xcom = {}
        for task_id in ("resolve", "setup_server"):
            entry = dep.api(
                "GET",
                f"/dags/speed_matrix/dagRuns/{run_id}/taskInstances/{task_id}"
                "/xcomEntries/return_value",
            )
            xcom[task_id] = entry["value"]
        turns = {}  # each cell's hold on the host (flows/turn.py), from its result
        for key in tasks:
            if not key.startswith(("prefill[", "decode[")):
                continue
            task_id, _, index = key.rstrip("]").partition("[")
            try:
                value = dep.api(
                    "GET",
                    f"/dags/speed_matrix/dagRuns/{run_id}/taskInstances/{task_id}"
                    "/xcomEntries/return_value",
                    params={"map_index": int(index)},
                )["value"]
            except Exception as exc:  # a cell task that died left no result
                print(f"no result for {key}: {exc}", file=sys.stderr)
                continue
            value = json.loads(value) if isinstance(value, str) else value
            if isinstance(value, dict) and value.get("turn"):
                turns[key] = value["turn"]
    finally:
        left = dep.stop()
        if left:
            print(f"processes left after the deployment stopped: {left}", file=sys.stderr)
    return {
        "state": state,
        "tasks": tasks,
        "xcom": xcom,
        "turns": turns,
        "wall_s": outer_wall,
        "outer_wall_s": outer_wall,
        "work": str(work),
        "warm_deployment": not cold,
        "worker_concurrency": concurrency if celery else None,
        "scheduler_idle_sleep": scheduler_idle_sleep,
    }


def warmup_floor(cells: list[dict]) -> tuple[float | None, str]:
    """The least warm-up this matrix can have (issue #19): every distinct prompt prefilled
    once. A decode context's cells need C_max prompts; the prefill cell of that context
    prefills stream 0's (its measurement), so the warm-up must prefill the other C_max - 1,
    each at about that prefill cell's TTFT (prefill is compute-bound: batching C prompts
    does not make them cheaper). Without a prefill cell of the context, its C_max prompts
    count and their cost is unknown."""
    measured = [c for c in cells if c["status"] in ("valid", "invalid")]
    ttft = {
        c["context_tokens"]: (c["ttft_ms"] or 0.0) / 1000.0
        for c in measured
        if c["phase"] == "prefill"
    }
    top: dict[int, int] = {}
    for c in measured:
        if c["phase"] == "decode":
            top[c["context_tokens"]] = max(top.get(c["context_tokens"], 0), c["concurrency"])
    floor, missing = 0.0, []
    for ctx, c_max in sorted(top.items()):
        if ctx not in ttft:
            missing.append(ctx)
            continue
        floor += (c_max - 1) * ttft[ctx]
    if missing:
        return None, f"no prefill cell measured for contexts {missing}: floor unknown"
    return floor, "sum over decode contexts of (C_max - 1) x that context's prefill TTFT"


def lease_span(tasks: dict, busy_s: float, first: float, last: float) -> dict:
    """The host's part of the wall: from setup_server's start to stop_server's end, the span in
    which the run holds the host (the lease is taken just before and released by stop_server;
    resolve runs before it, validate ... site after it, with the host free for another run).
    `busy_s` is what the host did in the span (windows + warm-up + server start); `first` and
    `last` bound the issue's wall (the first task's start, the last task's end)."""
    setup, stop = tasks.get("setup_server") or {}, tasks.get("stop_server") or {}
    if not (setup.get("start") and stop.get("end")):
        return {}
    span = _ts(stop["end"]) - _ts(setup["start"])
    return {
        "lease_span_s": round(span, 1),
        "lease_idle_s": round(span - busy_s, 1),
        "lease_idle_pct": round(100 * (span - busy_s) / span, 2),
        # the rest of the wall: the tasks before the host is taken, after it is freed
        "before_setup_s": round(_ts(setup["start"]) - first, 1),
        "after_stop_s": round(last - _ts(stop["end"]), 1),
    }


def cell_split(tasks: dict, cells: list[dict]) -> dict:
    """Where a cell task's time outside its window goes: before the load generator started the
    cell (task start, DAG file, lease renewal, /health; to the record's started_at) and after
    (everything from started_at on that is neither warm-up nor the window: idle check, prompts,
    streams starting, the end of the window's requests, the task's return).

    Since the cell tasks start early (flows/turn.py), "before" also holds the wait for the
    previous cell, spent while that cell measures: turn_split gives the host's side.

    A task is paired with its cell by records' cell key: the map index label (`8K x 1`,
    `prefill 16K`, a bare `256K` under `prefill`) read back by `parse_cell`."""
    from speedmatrix.records import cell_key, parse_cell

    by_key = {
        cell_key(c): c
        for c in cells
        if c["status"] in ("valid", "invalid") and c.get("started_at") is not None
    }
    before = after = 0.0
    n = 0
    for k, t in tasks.items():
        if not k.startswith(("prefill[", "decode[")) or not t.get("start"):
            continue
        label = t.get("label") or ""
        try:
            c = by_key.get(parse_cell(f"prefill {label}" if k.startswith("prefill[") else label))
        except ValueError:  # a repeat pass (`8K x 1 #2`): it lands in cell_repeats
            continue
        if c is None:
            continue
        window = (c["measured_s"] or 0.0) if c["phase"] == "decode" else (c["ttft_ms"] or 0) / 1e3
        pre = c["started_at"].timestamp() - _ts(t["start"])
        before += pre
        after += (t["duration_s"] or 0.0) - pre - window - (c.get("warmup_s") or 0.0)
        n += 1
    return {
        "cells_split": n,
        "cell_before_loadgen_s": round(before, 1),
        "cell_loadgen_not_window_s": round(after, 1),
    }


def turn_split(turns: dict, windows_s: float, warmup_s: float) -> dict:
    """The host's view of the cells (issue #19's turn, flows/turn.py): each cell task holds the
    host from its turn's `began` to `ended`; between one cell's end and the next one's begin
    the host waits for nothing but the hand-off (the previous task's end reaching the API
    server, one poll of the next); inside the turns, what is neither window nor warm-up is the
    cell's own steps (lease renewal, /health, idle check, prompts, the window's end). With the
    cell tasks starting early, the tasks' own start-up no longer appears on the host's side."""
    spans = sorted(
        (_ts(t["began"]), _ts(t["ended"]), float(t.get("waited_s") or 0.0), label)
        for label, t in turns.items()
        if t.get("began") and t.get("ended")
    )
    if not spans:
        return {}
    held = sum(e - b for b, e, _, _ in spans)
    handoffs = [spans[k + 1][0] - spans[k][1] for k in range(len(spans) - 1)]
    # the three longest, named: where the host waited longest between two cells
    longest = sorted(range(len(handoffs)), key=lambda k: -handoffs[k])[:3]
    return {
        "turns": len(spans),
        "turns_held_s": round(held, 1),
        "turn_not_window_s": round(held - windows_s - warmup_s, 1),
        "handoffs_s": round(sum(handoffs), 1),
        "handoff_median_s": round(sorted(handoffs)[len(handoffs) // 2], 2) if handoffs else None,
        "handoff_max_s": round(max(handoffs), 2) if handoffs else None,
        # cells whose turn began before the previous one's ended (two cells on the host at
        # once: flows/turn.py exists to keep this at 0)
        "turn_overlaps": sum(1 for h in handoffs if h < 0),
        "handoffs_longest": [
            f"{spans[k][3]} -> {spans[k + 1][3]}: {handoffs[k]:.2f} s" for k in longest
        ],
        "cells_waited_s": round(sum(w for _, _, w, _ in spans), 1),
        # what let each cell go: its predecessor's word "released" (flows/turn.py) or state
        "turn_states": dict(
            Counter(str(t.get("state")) for t in turns.values() if t.get("after") is not None)
        ),
    }


def ramp_split(requests: list[dict]) -> dict:
    """The decode cells' ramps: from their first stream's request to the window opening, once
    every stream has its first token from its cached prompt (docs/measurement.md). The engine
    works then (a prefill step per stream on its cached prompt, then the first decode steps),
    yet the issue's formula counts it with the idle time, being neither window nor warm-up; this
    says how much of that time it is. From the request rows: a row's start_offset_s is its
    start relative to the window's (negative before it)."""
    first: dict[tuple, float] = {}
    for q in requests:
        if q["phase"] != "decode" or q.get("start_offset_s") is None:
            continue
        k = (q["context_tokens"], q["concurrency"])
        first[k] = min(first.get(k, 0.0), float(q["start_offset_s"]))
    return {"ramps": len(first), "ramps_s": round(-sum(first.values()), 1)}


def analyse(out: dict) -> dict:
    sys.path.insert(0, str(REPO / "plugins"))
    from speedmatrix.store.warehouse import Warehouse

    tasks = out["tasks"]
    resolved = out["xcom"]["resolve"]
    resolved = json.loads(resolved) if isinstance(resolved, str) else resolved
    _, cells, requests = Warehouse(str(Path(out["work"]) / "warehouse")).read_run(
        resolved["run_id"]
    )
    starts = [_ts(t["start"]) for t in tasks.values() if t["start"]]
    ends = [_ts(t["end"]) for t in tasks.values() if t["end"]]
    first, last = min(starts), max(ends)
    wall = last - first  # first task start to last task end
    windows = 0.0
    for c in cells:
        if c["status"] not in ("valid", "invalid"):
            continue
        if c["phase"] == "decode":
            windows += c["measured_s"] or 0.0
        else:
            windows += (c["ttft_ms"] or 0.0) / 1000.0
    warmup = sum(
        c.get("warmup_s") or 0.0
        for c in cells
        if c["phase"] == "decode" and c["status"] in ("valid", "invalid")
    )
    floor, floor_note = warmup_floor(cells)
    server = out["xcom"].get("setup_server") or {}
    server = json.loads(server) if isinstance(server, str) else server
    start_s = float(server.get("start_s") or 0.0) + float(server.get("provision_s") or 0.0)
    cell_s = sum(
        t["duration_s"] or 0 for k, t in tasks.items() if k.startswith(("prefill[", "decode["))
    )
    busy = sum(t["duration_s"] or 0 for t in tasks.values())
    groups: dict[str, float] = {}
    for k, t in tasks.items():
        name = k.split("[")[0]
        groups[name] = groups.get(name, 0.0) + (t["duration_s"] or 0.0)
    return {
        "state": out["state"],
        "cells": len(cells),
        "measured_cells": sum(c["status"] in ("valid", "invalid") for c in cells),
        "wall_s": round(wall, 1),
        "dag_test_wall_s": round(out["wall_s"], 1),
        "process_wall_s": round(out["outer_wall_s"], 1),
        "windows_s": round(windows, 1),
        "server_start_s": round(start_s, 1),
        "overhead_pct": round(100 * (wall - windows - start_s) / wall, 2),
        # issue #19: warm-up is measurement time; what is left is the host sitting idle
        "warmup_s": round(warmup, 1),
        "warmup_floor_s": None if floor is None else round(floor, 1),
        "warmup_floor_note": floor_note,
        "host_idle_s": round(wall - windows - warmup - start_s, 1),
        "host_idle_pct": round(100 * (wall - windows - warmup - start_s) / wall, 2),
        "warmup_by_cell_s": {
            f"{c['context_label']} x {c['concurrency']}": round(c.get("warmup_s") or 0.0, 2)
            for c in cells
            if c["phase"] == "decode" and c["status"] in ("valid", "invalid")
        },
        "cells_task_s": round(cell_s, 1),
        "in_cell_not_window_s": round(cell_s - windows, 1),
        "pipeline_only_s": round(wall - cell_s - start_s, 1),
        "pipeline_only_pct": round(100 * (wall - cell_s - start_s) / wall, 2),
        "gaps_between_tasks_s": round(wall - busy, 1),
        "by_task_s": {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        **lease_span(tasks, windows + warmup + start_s, first, last),
        **cell_split(tasks, cells),
        **turn_split(out.get("turns") or {}, windows, warmup),
        **ramp_split(requests),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--short", action="store_true", help="8K/16K only (a quick look)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument(
        "--runner",
        choices=("dag-test", "local", "celery"),
        default="dag-test",
        help="dag.test in one process, or a deployment: scheduler with the LocalExecutor, "
        "or the CeleryExecutor with one worker (deploy/'s production topology)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="for --runner local|celery: measure the first run of a freshly started "
        "deployment (cold api-server, no font cache), as every run before 2026-12-03 did; "
        "by default a warm-up run goes first, as on a deployment that has run before",
    )
    p.add_argument(
        "--scheduler-idle-sleep",
        type=float,
        default=None,
        help="[scheduler] scheduler_idle_sleep_time for --runner local|celery (default: "
        "deploy/airflow.env.example's, 0.25 s; Airflow's own is 1 s): how long an idle "
        "scheduler sleeps before it sees a finished task",
    )
    args = p.parse_args()
    conf = {**FULL, "window_s": args.duration}
    if args.short:
        conf.update(SHORT)
    from speedmatrix.cli.demo import free_port

    conf["port"] = free_port()
    if args.runner == "dag-test":
        out = run(conf)
    else:
        out = run_local_executor(
            conf,
            celery=args.runner == "celery",
            scheduler_idle_sleep=args.scheduler_idle_sleep,
            cold=args.cold,
        )
    figures = analyse(out)
    runner = {
        "dag-test": "dag.test in-process",
        "local": "scheduler, LocalExecutor",
        "celery": "scheduler, CeleryExecutor (1 worker)",
    }[args.runner]
    figures.update(
        conf=conf,
        runner=runner,
        scheduler_idle_sleep=out.get("scheduler_idle_sleep"),
        warm_deployment=out.get("warm_deployment"),
        worker_concurrency=out.get("worker_concurrency"),
    )
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    dest = REPO / "benchmarks" / "out" / f"pipeline_bench-{stamp}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"figures": figures, "tasks": out["tasks"]}, indent=1))
    print(json.dumps(figures, indent=1))
    print(
        f"host idle share {figures['host_idle_pct']:.2f}% of {figures['wall_s']:.0f} s wall; "
        f"warm-up measured {figures['warmup_s']:.1f} s, floor "
        f"{figures['warmup_floor_s']} s ({figures['warmup_floor_note']})"
    )
    print(f"written to {dest}")
    if not args.keep:
        shutil.rmtree(out["work"], ignore_errors=True)
    return 0 if out["state"] == "success" else 1


if __name__ == "__main__":
    raise SystemExit(main())
