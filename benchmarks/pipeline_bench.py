"""Overhead of the pipeline itself: a whole speed_matrix run against the simulator.

    uv run python benchmarks/pipeline_bench.py [--duration 30] [--short]

Runs the DAG once through `python -m speedmatrix.demo` (dag.test: every task through Airflow's
task runner and execution API, one at a time, in one process; no scheduler heartbeat), with a
private HOME, Airflow home and warehouse, then reports

    overhead = (wall - sum of cell windows - server start) / wall          (the issue's figure)

and where the time goes: every task's duration, cache warm-up inside the cells (each decode
cell first puts its C prompts in the prefix cache; each prefill cell's window is its TTFT),
and the gaps between tasks (scheduling). Writes benchmarks/out/pipeline_bench-<stamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FULL = {"recipe": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"}
SHORT = {"prefill_contexts": ["8K", "16K"], "contexts": ["8K", "16K"]}


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
    cmd = [sys.executable, "-m", "speedmatrix.demo", "--conf", json.dumps(conf)]
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


def analyse(out: dict) -> dict:
    sys.path.insert(0, str(REPO / "plugins"))
    from speedmatrix.warehouse import Warehouse

    tasks = out["tasks"]
    resolved = out["xcom"]["resolve"]
    resolved = json.loads(resolved) if isinstance(resolved, str) else resolved
    _, cells, _ = Warehouse(str(Path(out["work"]) / "warehouse")).read_run(resolved["run_id"])
    starts = [_ts(t["start"]) for t in tasks.values() if t["start"]]
    ends = [_ts(t["end"]) for t in tasks.values() if t["end"]]
    wall = max(ends) - min(starts)  # first task start to last task end
    windows = 0.0
    for c in cells:
        if c["status"] not in ("valid", "invalid"):
            continue
        if c["phase"] == "decode":
            windows += c["measured_s"] or 0.0
        else:
            windows += (c["ttft_ms"] or 0.0) / 1000.0
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
        "cells_task_s": round(cell_s, 1),
        "in_cell_not_window_s": round(cell_s - windows, 1),
        "pipeline_only_s": round(wall - cell_s - start_s, 1),
        "pipeline_only_pct": round(100 * (wall - cell_s - start_s) / wall, 2),
        "gaps_between_tasks_s": round(wall - busy, 1),
        "by_task_s": {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--short", action="store_true", help="8K/16K only (a quick look)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    args = p.parse_args()
    conf = {**FULL, "duration_s": args.duration}
    if args.short:
        conf.update(SHORT)
    from speedmatrix.demo import free_port

    conf["port"] = free_port()
    out = run(conf)
    figures = analyse(out)
    figures.update(conf=conf, runner="dag.test in-process")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    dest = REPO / "benchmarks" / "out" / f"pipeline_bench-{stamp}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"figures": figures, "tasks": out["tasks"]}, indent=1))
    print(json.dumps(figures, indent=1))
    print(f"written to {dest}")
    if not args.keep:
        shutil.rmtree(out["work"], ignore_errors=True)
    return 0 if out["state"] == "success" else 1


if __name__ == "__main__":
    raise SystemExit(main())
