"""A long-lived Airflow process for the trigger tests: runs dag.test() on request.

Started by tests/integration/test_commit_watch.py with its own AIRFLOW_HOME (SQLite) and dags
folder in the environment. Reads one JSON command per line on stdin, answers one JSON line on
stdout. Paying Airflow's import and execution-API start-up once per test instead of once per
DagRun keeps these tests short on a busy 2-core machine; each DagRun still goes through the
real dag.test() loop, the task runner and the in-process execution API.

Commands: {"op": "run", "dag_id", "conf"?, "logical_date"?} -> {"run_id"};
{"op": "var_get", "key"} -> {"value"}; {"op": "var_delete", "key"} -> {}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> None:
    # Everything Airflow prints goes to stderr; stdout carries only the answers.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.variable import Variable
    from airflow.sdk import timezone

    bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    if bag.import_errors:
        raise SystemExit(f"import errors: {bag.import_errors}")
    answers.write(json.dumps({"ready": sorted(bag.dag_ids)}) + "\n")

    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "run":
                kw = {}
                if cmd.get("logical_date"):
                    kw["logical_date"] = timezone.parse(cmd["logical_date"])
                dr = bag.get_dag(cmd["dag_id"]).test(run_conf=cmd.get("conf"), **kw)
                out = {"run_id": dr.run_id, "state": str(dr.state)}
            elif cmd["op"] == "var_get":
                out = {"value": Variable.get(cmd["key"], default_var=None)}
            elif cmd["op"] == "var_delete":
                out = {"deleted": Variable.delete(cmd["key"])}
            else:
                out = {"error": f"unknown op {cmd['op']!r}"}
        except Exception as exc:
            traceback.print_exc()
            out = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(out) + "\n")
    answers.flush()
    sys.stderr.flush()
    # stdin closed: the test is done. Airflow's in-process API threads would keep a normal
    # exit waiting; nothing is left to write, so leave at once.
    os._exit(0)


if __name__ == "__main__":
    main()
