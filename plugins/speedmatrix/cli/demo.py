"""`make demo`: the speed_matrix DAG end to end on this machine, against the simulated engine.

`python -m speedmatrix.cli.demo` runs the real DAG with `dag.test()` (every task through Airflow's
task runner, on the `local` host) against the simulator calibrated from the published reference
report (recipe sim/kimi-k2.7-nvfp4-rtxpro6k-x8), with short windows, then prints where the report
is and how to query the tables.

The simulated engine runs at the real hardware's speed, so prefill and each decode cell's cache
warm-up take their real time: the whole reference matrix takes about ten minutes (`--full`); the
default demo measures contexts 8K-64K (every concurrency, so the over-capacity cells show) and
takes a few minutes.

Also the entry point of the integration tests and the overhead benchmark (`--conf`,
`--result-json`): one code path for all three.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
SHORT = {
    "prefill_contexts": ["8K", "16K", "32K", "64K"],
    "contexts": ["8K", "16K", "32K", "64K"],
    "duration_s": 5,
}


def _airflow_env() -> None:
    """Make's exports, for when the demo is run without make (must precede Airflow's import)."""
    os.environ.setdefault("AIRFLOW_HOME", str(REPO / ".airflow"))
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(REPO / "dags"))
    os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", str(REPO / "plugins"))
    # The API key the simulated server demands and the cells send: per demo run, never shown.
    os.environ.setdefault("SPEEDMATRIX_API_KEY", "sk-demo-" + secrets.token_hex(12))


def migrate_once() -> None:
    """`airflow db migrate` when this AIRFLOW_HOME has not been migrated by this Airflow yet."""
    import airflow

    home = Path(os.environ["AIRFLOW_HOME"])
    marker = home / f".migrated-{airflow.__version__}"
    if marker.exists():
        return
    home.mkdir(parents=True, exist_ok=True)
    print(f"speedmatrix demo: preparing the Airflow metadata DB in {home} (once)", flush=True)
    out = subprocess.run(
        [sys.executable, "-m", "airflow", "db", "migrate"],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    if out.returncode != 0:
        raise SystemExit(f"airflow db migrate failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    marker.write_text("ok\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dag_callbacks_on_the_parsed_dag(parsed) -> None:
    """dag.test() (Airflow 3.3.2) builds a DAG callback's context from the serialized DAG's
    task, whose required Params (speed_matrix's `recipe`) fail validation there: a failed run
    with a failure callback (the alert notifier) would crash dag.test() itself. Build it from
    the parsed DAG, as the DAG processor does in a deployment; the callbacks are the same."""
    from airflow.models.dagrun import DagRun

    if getattr(DagRun.execute_dag_callbacks, "_speedmatrix", False):
        return
    original = DagRun.execute_dag_callbacks

    def execute(self, dag=None, success=True, relevant_ti=None, reason="success"):
        use = parsed if dag is not None and dag.dag_id == parsed.dag_id else dag
        return original(self, dag=use, success=success, relevant_ti=relevant_ti, reason=reason)

    execute._speedmatrix = True
    DagRun.execute_dag_callbacks = execute


def run_dag(conf: dict) -> dict:
    """Run speed_matrix once with dag.test(); return the run's outcome (JSON-able)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"]) / "speed_matrix.py"))
    if bag.import_errors:
        raise SystemExit(f"the speed_matrix DAG does not import: {bag.import_errors}")
    dag = bag.dags["speed_matrix"]
    _dag_callbacks_on_the_parsed_dag(dag)
    started = time.monotonic()
    dr = dag.test(run_conf=conf)
    wall = time.monotonic() - started
    tis = {}
    xcoms = {}
    turns = {}  # each cell task's hold on the host (flows/turn.py), by its task key
    labels = {}
    links: dict[str, dict] = {}
    for ti in dr.get_task_instances():
        key = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.rendered_map_index}]"
        labels[(ti.task_id, ti.map_index)] = key
        tis[key] = {
            "state": str(ti.state),
            "start": ti.start_date.isoformat() if ti.start_date else None,
            "end": ti.end_date.isoformat() if ti.end_date else None,
            "duration_s": ti.duration,
        }
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    from speedmatrix.flows.turn import RELEASED_KEY

    with create_session() as session:
        for row in session.query(XComModel).filter(
            XComModel.dag_id == dag.dag_id,
            XComModel.run_id == dr.run_id,
            XComModel.task_id.in_(
                ["resolve", "setup_server", "land", "report", "stop_server", "site"]
            ),
        ):
            if row.key == "return_value":
                xcoms[row.task_id] = row.value
            elif row.key.startswith("_link_"):  # operator extra links (the site's)
                value = row.value
                if isinstance(value, str) and value.startswith('"'):
                    value = json.loads(value)
                links.setdefault(row.task_id, {})[row.key] = value
        said = {}  # when each cell said it had left the host (flows/turn.py)
        for row in session.query(XComModel).filter(
            XComModel.dag_id == dag.dag_id,
            XComModel.run_id == dr.run_id,
            XComModel.task_id.in_(["prefill", "decode"]),
            XComModel.key.in_(["return_value", RELEASED_KEY]),
        ):
            value = row.value if isinstance(row.value, dict) else {}
            label = labels.get((row.task_id, row.map_index), row.task_id)
            if row.key == RELEASED_KEY:
                said[label] = value
            elif value.get("turn"):
                turns[label] = value["turn"]
        for label, value in said.items():
            if label in turns:
                turns[label]["released"] = value
        from airflow.models.asset import AssetEvent, AssetModel

        events = [
            {"uri": uri, "extra": extra}
            for uri, extra in session.query(AssetModel.uri, AssetEvent.extra)
            .join(AssetEvent, AssetEvent.asset_id == AssetModel.id)
            .filter(AssetEvent.source_dag_id == dag.dag_id, AssetEvent.source_run_id == dr.run_id)
        ]
    return {
        "dag_run_id": dr.run_id,
        "asset_events": json.loads(json.dumps(events, default=str)),
        "state": str(dr.state),
        "wall_s": wall,
        "tasks": tis,
        "xcom": json.loads(json.dumps(xcoms, default=str)),
        "turns": json.loads(json.dumps(turns, default=str)),
        "links": json.loads(json.dumps(links, default=str)),
    }


def _summary(result: dict) -> str:
    landed = _xcom(result, "land") or {}
    report = _xcom(result, "report") or {}
    resolved = _xcom(result, "resolve") or {}
    run_id = landed.get("run_id") or resolved.get("run_id")
    wh = landed.get("warehouse") or os.environ.get("SPEEDMATRIX_WAREHOUSE", "warehouse")
    lines = [
        "",
        f"speed_matrix finished: {result['state']} in {result['wall_s']:.0f} s "
        f"(run status: {landed.get('status', 'not landed')})",
        f"  run id:    {run_id}",
        f"  report:    {report.get('md', '(not written)')}",
        f"  html:      {report.get('html', '(not written)')}",
        f"  site:      {(_xcom(result, 'site') or {}).get('index', '(not written)')}",
        f"  warehouse: {wh}   (Delta Lake tables runs / cells / requests)",
        "",
        "Query the tables:",
        f'  uv run speedmatrix query "SELECT context_label, concurrency, status, total_tok_s, '
        f"ttft_ms FROM cells WHERE run_id = '{run_id}' ORDER BY phase, context_tokens, "
        'concurrency" --warehouse ' + wh,
        f"  uv run speedmatrix report --run-id '{run_id}' --warehouse {wh} --format md",
        f"  polars:    pl.scan_delta('{wh}/cells')   (DuckDB, pandas: warehouse/README.md)",
    ]
    failed = [k for k, v in result["tasks"].items() if v["state"] not in ("success", "skipped")]
    if failed:
        lines.insert(2, f"  tasks not successful: {', '.join(sorted(failed))}")
    return "\n".join(lines)


def _xcom(result: dict, task_id: str):
    value = result["xcom"].get(task_id)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speedmatrix.cli.demo", description=__doc__)
    parser.add_argument("--full", action="store_true", help="the whole reference matrix")
    parser.add_argument("--duration", type=float, default=None, help="decode window, s")
    parser.add_argument("--conf", help="JSON conf for speed_matrix (overrides the demo's)")
    parser.add_argument("--result-json", help="write the run's outcome (tasks, XComs) here")
    args = parser.parse_args(argv)
    _airflow_env()
    conf: dict = {"recipe": RECIPE, "ssh_conn_id": "local", "port": free_port()}
    if not args.full:
        conf.update(SHORT)
    if args.duration:
        conf["duration_s"] = args.duration
    if args.conf:
        conf.update(json.loads(args.conf))
    migrate_once()
    print(f"speedmatrix demo: speed_matrix with conf {json.dumps(conf)}", flush=True)
    result = run_dag(conf)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=1, default=str))
    print(_summary(result), flush=True)
    return 0 if result["state"] == "success" else 1


if __name__ == "__main__":
    raise SystemExit(main())
