"""Why `validate` was slower under Celery than under the LocalExecutor (issue #19).

Starts the benchmark's deployment (pipeline_bench.deployment: the LocalExecutor with deploy/'s
forkserver preload, or the CeleryExecutor with one worker of deploy/'s concurrency), runs a
probe DAG whose two tasks validate the same 55-cell run (the published reference page,
ingested into a scratch warehouse) with speedmatrix.quality, one on the task's own thread and
one through speedmatrix.flows.fresh_stack, and prints for each: seconds, page faults, user and
system CPU, and the mmap/munmap calls strace counted during the validation.

    .venv/bin/python benchmarks/task_stack_probe.py celery
    .venv/bin/python benchmarks/task_stack_probe.py local

Needs strace (Debian's package) and ptrace rights over the worker's processes (root here).
What it showed is in benchmarks/README.md ("Celery's slow validation explained").
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

PROBE_DAG = r"""
import math, os, resource, signal, subprocess, time
import pendulum
from airflow.sdk import dag, task


@dag(dag_id="stack_probe", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False)
def stack_probe():
    @task
    def probe(fresh: bool) -> dict:
        import pandas as pd
        from speedmatrix import quality
        from speedmatrix.flows.fresh_stack import run_on_fresh_stack

        wh = os.environ["PROBE_WAREHOUSE"]
        from deltalake import DeltaTable

        cells = DeltaTable(f"{wh}/cells").to_pandas().to_dict("records")
        cells = [
            {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in c.items()}
            for c in cells
        ]
        run = DeltaTable(f"{wh}/runs").to_pandas().to_dict("records")[0]
        counts = f"{wh}/strace-{int(fresh)}.txt"
        tracer = subprocess.Popen(["strace", "-f", "-c", "-p", str(os.getpid()), "-o", counts])
        time.sleep(1.0)  # attached
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        if fresh:
            run_on_fresh_stack(quality.validate_run, run, cells)
        else:
            quality.validate_run(run, cells)
        seconds = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        tracer.send_signal(signal.SIGINT)
        tracer.wait()
        calls = {}
        for line in open(counts):
            parts = line.split()
            if parts and parts[-1] in ("mmap", "munmap"):
                calls[parts[-1]] = int(parts[3])
        return {
            "fresh_stack": fresh,
            "validate_s": round(seconds, 2),
            "page_faults": r1.ru_minflt - r0.ru_minflt,
            "user_s": round(r1.ru_utime - r0.ru_utime, 2),
            "sys_s": round(r1.ru_stime - r0.ru_stime, 2),
            "mmap": calls.get("mmap", 0),
            "munmap": calls.get("munmap", 0),
        }

    probe.expand(fresh=[False, True])


stack_probe()
"""


def main() -> int:
    from pipeline_bench import deployment

    celery = sys.argv[1:] == ["celery"]
    if sys.argv[1:] not in (["celery"], ["local"]):
        print(__doc__)
        return 2
    if not shutil.which("strace"):
        raise SystemExit("strace is needed (apt-get install strace)")
    work = Path(tempfile.mkdtemp(prefix="stack-probe-"))
    os.chmod(work, 0o755)
    dags = work / "dags"
    dags.mkdir()
    (dags / "stack_probe.py").write_text(PROBE_DAG)
    warehouse = work / "probe-warehouse"
    reference = next((REPO.parent / "shared" / "reference").glob("*.txt"))
    subprocess.run(
        [str(REPO / ".venv" / "bin" / "speedmatrix"), "ingest", str(reference),
         "--warehouse", str(warehouse)],
        check=True, capture_output=True,
    )  # fmt: skip
    os.chmod(warehouse, 0o777)
    env = {"HOME": str(work), "PROBE_WAREHOUSE": str(warehouse)}
    dep, _ = deployment(work, dags, celery=celery, env=env)
    dep.start()
    try:
        dep.wait_dag("stack_probe")
        run_id = dep.trigger("stack_probe", {}, "manual__stack-probe")
        state = dep.wait_runs("stack_probe", [run_id], timeout_s=900)[run_id]
        print(f"{'celery' if celery else 'local'}: run {state}")
        for index in (0, 1):
            value = dep.api(
                "GET",
                f"/dags/stack_probe/dagRuns/{run_id}/taskInstances/probe/xcomEntries/return_value",
                params={"map_index": index},
            )["value"]
            print(ast.literal_eval(value) if isinstance(value, str) else value)
    finally:
        dep.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
