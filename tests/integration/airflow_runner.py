"""A long-lived Airflow process for the DAG tests: runs dag.test() on request.

Why: Airflow's import, the DAG parse and the in-process execution API's start-up cost several
CPU-seconds per process; a test module that runs many DagRuns pays them once here instead of
once per DagRun. Each DagRun still goes through the real dag.test() loop, the task runner and
the in-process execution API, in this process as under `airflow dags test` or `make demo`.

Started by a test module (:class:`Runner`) with its AIRFLOW_HOME (SQLite) and dags folder in the
environment. Reads one JSON command per line on stdin, answers one JSON line on stdout.

Commands:

- ``{"op": "run", "dag_id", "conf"?, "logical_date"?}`` -> ``{"run_id", "state"}``: any DAG of
  the dags folder (the trigger tests);
- ``{"op": "speed_matrix", "conf", "env", "log"}`` -> the run's outcome: speed_matrix through
  the demo's own code path (``speedmatrix.cli.demo.run_dag``: its dag.test rules, the tasks'
  states, XComs, turns, links and Asset events), with ``env`` as the whole process environment
  for that run (the test's own: its HOME, lease directory, warehouse, alert settings: what a
  subprocess of the test would have inherited) and Airflow's log of that run in the file
  ``log``;
- ``{"op": "var_get", "key"}`` -> ``{"value"}``; ``{"op": "var_delete", "key"}`` -> ``{}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path


def _airflow_config(name: str) -> bool:
    """Airflow's configuration, read when this process started: it stays this process's own
    whatever a run's environment says (its connections, AIRFLOW_CONN_*, come from the run)."""
    return name == "AIRFLOW_HOME" or name.startswith("AIRFLOW__")


def _speed_matrix(cmd: dict) -> dict:
    """One speed_matrix run as `make demo` runs it, in the environment the test gave."""
    from speedmatrix.cli import demo

    own = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in cmd["env"].items() if not _airflow_config(k)})
    os.environ.update({k: v for k, v in own.items() if _airflow_config(k)})
    try:
        with demo.airflow_log_to(cmd["log"], None):
            return demo.run_dag(demo.demo_conf(cmd["conf"]), demo.DemoProgress(sys.stderr))
    finally:
        os.environ.clear()
        os.environ.update(own)


def main() -> None:
    # Everything Airflow prints goes to stderr; stdout carries only the answers.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.variable import Variable
    from airflow.sdk import timezone

    bags: list[DagBag] = []  # the whole dags folder, parsed on the first "run"

    def bag() -> DagBag:
        if not bags:
            bags.append(DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"]))
            if bags[0].import_errors:
                raise RuntimeError(f"import errors: {bags[0].import_errors}")
        return bags[0]

    answers.write(json.dumps({"ready": True}) + "\n")

    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "run":
                kw = {}
                if cmd.get("logical_date"):
                    kw["logical_date"] = timezone.parse(cmd["logical_date"])
                dr = bag().get_dag(cmd["dag_id"]).test(run_conf=cmd.get("conf"), **kw)
                out = {"run_id": dr.run_id, "state": str(dr.state)}
            elif cmd["op"] == "speed_matrix":
                out = json.loads(json.dumps(_speed_matrix(cmd), default=str))
            elif cmd["op"] == "var_get":
                out = {"value": Variable.get(cmd["key"], default_var=None)}
            elif cmd["op"] == "var_delete":
                out = {"deleted": Variable.delete(cmd["key"])}
            else:
                out = {"error": f"unknown op {cmd['op']!r}"}
        except BaseException as exc:  # a KeyboardInterrupt of a run too: answer, go on
            traceback.print_exc()
            out = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(out) + "\n")
    answers.flush()
    sys.stderr.flush()
    # stdin closed: the test is done. Airflow's in-process API threads would keep a normal
    # exit waiting; nothing is left to write, so leave at once.
    os._exit(0)


class Runner:
    """The test's side of one runner process: send a command, read its answer (in between,
    the test may watch the run's log or the host)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        self._log = open(log, "a")  # noqa: SIM115 - closed in close()
        self.pending = 0  # commands sent, not answered yet
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        self.pending = 1
        self.ready = self.answer()

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"airflow runner died:\n{self.log.read_text()[-4000:]}"
        self.pending -= 1
        out = json.loads(line)
        assert "error" not in out, f"{out['error']}\n{self.log.read_text()[-4000:]}"
        return out

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        self.pending += 1

    def call(self, **cmd) -> dict:
        self.send(**cmd)
        return self.answer()

    def ended(self) -> bool:
        """Whether the command sent is over: its answer is there to read, or the process died."""
        import select

        return self.proc.poll() is not None or bool(select.select([self.proc.stdout], [], [], 0)[0])

    def close(self) -> None:
        """Stop the process: at once when a command is still running (a test that failed
        half-way leaves its run behind), else by closing its input."""
        if self.proc.poll() is None:
            if self.pending:
                self.proc.kill()
            else:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


if __name__ == "__main__":
    main()
