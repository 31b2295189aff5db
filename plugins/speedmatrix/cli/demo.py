"""`make demo`: the speed_matrix DAG end to end on this machine, against the simulated engine.

`python -m speedmatrix.cli.demo` runs the real DAG with `dag.test()` (every task through Airflow's
task runner, on the `local` host) against the simulator calibrated from the published reference
report (recipe sim/kimi-k2.7-nvfp4-rtxpro6k-x8), with short windows, then prints where the report
is and how to query the tables.

The simulated engine runs at the real hardware's speed, so prefill and each decode cell's cache
warm-up take their real time: the whole reference matrix takes about ten minutes (`--full`, `make demo FULL=1`); the
default demo measures contexts 8K-64K (every concurrency, so the over-capacity cells show) and
takes a few minutes.

What it shows: the run as `speedmatrix run` does (the cells done, the current cell and its
tok/s, the time left; a live bar on a terminal), with Airflow's own log in a file the summary
names (`--airflow-log`, default `.airflow/logs/demo-<time>.log`; `-` keeps it on the terminal).
The cells run in the documented order (prefill then decode per context), and Ctrl-C stops the
server and releases the host's lease before it exits (speedmatrix.flows.dagtest).

Also the entry point of the integration tests and the overhead benchmark (`--conf`,
`--result-json`): one code path for all three.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from speedmatrix.renames import add_window_option
from speedmatrix.settings import settings

REPO = Path(__file__).resolve().parents[3]  # the checkout (plugins/speedmatrix/cli/demo.py)
RECIPE = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
SHORT = {
    "prefill_contexts": ["8K", "16K", "32K", "64K"],
    "contexts": ["8K", "16K", "32K", "64K"],
    "window_s": 5,
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


class DemoProgress:
    """The run on the terminal, told by the steps themselves (flows/progress.py): the same
    display as `speedmatrix run` (cli/run.py Display), and what the interrupt needs to clean
    up (the run's description and its server)."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.resolved: dict | None = None
        self.handle: dict | None = None  # the server's (setup_server's XCom)
        self.cells: list[dict] = []
        self.show: Any = None
        self.begun = False

    def note(self, text: str) -> None:
        if self.show is not None:
            self.show.note(text)
        else:
            print(f"speedmatrix demo: {text}", file=self.out, flush=True)

    step = note

    def leased(self, resolved: dict) -> None:
        from speedmatrix.cli.run import Display

        self.resolved = resolved
        self.show = Display.make(resolved, out=self.out, prog="speedmatrix demo")

    def server(self, resolved: dict, server: dict) -> None:
        self.handle = server

    def planned(self, resolved: dict, planned: dict) -> None:
        from speedmatrix.plan import task_cells

        self.resolved = resolved
        self.cells = [*task_cells(planned, "prefill"), *task_cells(planned, "decode")]

    def cell_started(self, resolved: dict, server: dict, cell: dict) -> None:
        self.handle = server
        if self.show is None:
            self.leased(resolved)
        if not self.begun:
            self.begun = True
            self.show.begin(self.cells, server["base_url"])
        self.show.cell_started(cell)

    def cell_done(self, cell: dict, record: dict) -> None:
        if self.show is not None:
            self.show.cell_done(cell, record)

    def end(self) -> None:
        if self.show is not None:
            self.show.end()


def cleanup(progress: DemoProgress) -> None:
    """After Ctrl-C: the run's teardown once more (idempotent: it stops this run's servers,
    found by the host's records, and releases the lease), whatever the DAG's teardown did."""
    from speedmatrix.cli.interrupts import finishing
    from speedmatrix.flows import matrix

    if progress.resolved is None:
        return  # interrupted before the lease: nothing was started
    with finishing(progress.note):
        matrix.teardown(progress.resolved, progress.handle)


@contextlib.contextmanager
def airflow_log_to(path: str | None, terminal: Any) -> Iterator[None]:
    """Airflow's log (every line dag.test writes to stdout and stderr) into `path`, the
    terminal kept for the progress display (`terminal`); None: leave both alone."""
    if path is None:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def run_dag(conf: dict, progress: DemoProgress | None = None) -> dict:
    """Run speed_matrix once with dag.test(); return the run's outcome (JSON-able)."""
    from airflow.dag_processing.dagbag import DagBag

    from speedmatrix.flows import progress as told
    from speedmatrix.flows.dagtest import Interrupt, driving

    bag = DagBag(dag_folder=str(Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"]) / "speed_matrix.py"))
    if bag.import_errors:
        raise SystemExit(f"the speed_matrix DAG does not import: {bag.import_errors}")
    dag = bag.dags["speed_matrix"]
    _dag_callbacks_on_the_parsed_dag(dag)
    started = time.monotonic()
    progress = progress or DemoProgress(sys.stderr)
    interrupt = Interrupt(progress.note)
    try:
        with told.listening(progress), driving(interrupt):
            dr = dag.test(run_conf=conf)
    except KeyboardInterrupt:
        interrupt.pressed = True
        dr = None
    finally:
        progress.end()
    if interrupt.pressed:
        cleanup(progress)
        host = (progress.resolved or {}).get("host", "local")
        raise Interrupted(
            f"interrupted: stopped what the run started, released the lease on {host}"
        )
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
                # the run's hand-offs too (flows/contracts.py), so a test reads them back
                [
                    "resolve",
                    "setup_server",
                    "inspect",
                    "plan",
                    "land",
                    "report",
                    "stop_server",
                    "site",
                ]
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


class Interrupted(Exception):
    """The demo was interrupted and cleaned up after itself; the message says what it did."""


def _summary(result: dict, airflow_log: str | None = None) -> str:
    landed = _xcom(result, "land") or {}
    report = _xcom(result, "report") or {}
    resolved = _xcom(result, "resolve") or {}
    run_id = landed.get("run_id") or resolved.get("run_id")
    wh = landed.get("warehouse") or settings().warehouse
    lines = [
        "",
        f"speed_matrix finished: {result['state']} in {result['wall_s']:.0f} s "
        f"(run status: {landed.get('status', 'not landed')})",
        f"  run id:    {run_id}",
        f"  report:    {report.get('md', '(not written)')}",
        f"  html:      {report.get('html', '(not written)')}",
        f"  site:      {(_xcom(result, 'site') or {}).get('index', '(not written)')}",
        f"  warehouse: {wh}   (Delta Lake tables runs / cells / requests)",
        f"  Airflow's log: {airflow_log or '(on the terminal above)'}",
        "",
        "Query the tables:",
        f'  uv run speedmatrix query "SELECT context_label, concurrency, status, total_tok_s, '
        f"ttft_ms FROM cells WHERE run_id = '{run_id}' ORDER BY phase, context_tokens, "
        'concurrency" --warehouse ' + wh,
        f"  uv run speedmatrix report --run-id '{run_id}' --warehouse {wh} --format md",
        f"  polars:    pl.scan_delta('{wh}/cells')   (DuckDB, pandas: warehouse/README.md)",
    ]
    lines[8:8] = _verdict(landed)  # after where everything is: the answer
    failed = [k for k, v in result["tasks"].items() if v["state"] not in ("success", "skipped")]
    if failed:
        lines.insert(2, f"  tasks not successful: {', '.join(sorted(failed))}")
    return "\n".join(lines)


def _verdict(landed: dict) -> list[str]:
    """The verdict `speedmatrix run` prints, of the landed run (none when it did not land)."""
    if not landed.get("run_id"):
        return []
    from speedmatrix.cli.verdict import run_verdict, verdict_text
    from speedmatrix.store.warehouse import Warehouse

    try:
        text = verdict_text(run_verdict(Warehouse(landed.get("warehouse")), landed["run_id"]))
    except Exception as exc:  # the summary must still say where everything is
        return [f"  verdict:   (not read: {exc})"]
    return ["  " + line for line in text.splitlines()]


def _xcom(result: dict, task_id: str):
    value = result["xcom"].get(task_id)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def demo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m speedmatrix.cli.demo", description=__doc__)
    parser.add_argument("--full", action="store_true", help="the whole reference matrix")
    add_window_option(parser, "--duration", help="decode window, s")
    parser.add_argument("--conf", help="JSON conf for speed_matrix (overrides the demo's)")
    parser.add_argument("--result-json", help="write the run's outcome (tasks, XComs) here")
    parser.add_argument(
        "--airflow-log",
        metavar="FILE",
        help="where Airflow's log goes (default .airflow/logs/demo-<time>.log; - : the terminal)",
    )
    return parser


def demo_conf(
    overrides: dict | None = None, *, full: bool = False, window_s: float | None = None
) -> dict:
    """The conf the demo runs speed_matrix with: the simulated recipe on the local host, a free
    port, the short matrix unless `full`, then `window_s` and `overrides` (``--conf``). The
    integration tests' long-lived Airflow process builds its runs' confs here too."""
    conf: dict = {"recipe": RECIPE, "ssh_conn_id": "local", "port": free_port()}
    if not full:
        conf.update(SHORT)
    if window_s:
        conf["window_s"] = window_s
    conf.update(overrides or {})
    return conf


def main(argv: list[str] | None = None) -> int:
    args = demo_parser().parse_args(argv)
    _airflow_env()
    conf = demo_conf(
        json.loads(args.conf) if args.conf else None, full=args.full, window_s=args.window_s
    )
    migrate_once()
    log = args.airflow_log or str(
        Path(os.environ["AIRFLOW_HOME"]) / "logs" / f"demo-{time.strftime('%Y%m%dT%H%M%S')}.log"
    )
    log = None if log == "-" else str(Path(log).resolve())
    print(f"speedmatrix demo: speed_matrix with conf {json.dumps(conf)}", flush=True)
    if log:
        print(f"speedmatrix demo: Airflow's log: {log}", flush=True)
    # the terminal, kept for the progress while Airflow's output goes to the log file
    terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8")
    try:
        with airflow_log_to(log, terminal):
            result = run_dag(conf, DemoProgress(terminal))
    except Interrupted as exc:
        print(f"speedmatrix demo: {exc}" + (f" (Airflow's log: {log})" if log else ""), flush=True)
        return 130
    finally:
        terminal.close()
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=1, default=str))
    print(_summary(result, log), flush=True)
    return 0 if result["state"] == "success" else 1


if __name__ == "__main__":
    raise SystemExit(main())
