"""The warehouse on a real S3-compatible server (moto's standalone server on loopback,
tests/s3server.py): landing, reading and querying through s3://, many writer processes at
once (issue #32: 8 of 80 landed on the older layout, the rest refused), and writers killed
with SIGKILL at random moments."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import run_scripts

from speedmatrix.store.warehouse import Warehouse

pytestmark = pytest.mark.integration

UNIT = str(Path(__file__).resolve().parents[1] / "unit")
sys.path.insert(0, UNIT)

from test_warehouse import make_cells, make_requests, make_run  # noqa: E402

N_CELLS, N_REQUESTS = len(make_cells()), 2


def test_land_read_and_query_on_s3(s3_warehouse):
    wh = Warehouse(s3_warehouse)
    assert not wh.is_local
    wh.land_run(make_run(), make_cells(), make_requests(3))
    wh.land_run(make_run(), make_cells(2.0), make_requests(2))  # landing again replaces
    wh.land_run(make_run("b", day=16), make_cells(), [])
    _run, cells, requests = wh.read_run("r-1")
    assert cells[0]["total_tok_s"] == 6206.0 * 2 and len(requests) == 2
    got = wh.query("SELECT run_id, count(*) AS n FROM cells GROUP BY 1 ORDER BY 1")
    assert got.values.tolist() == [["b", N_CELLS], ["r-1", N_CELLS]]
    assert wh.query("SELECT count(*) AS n FROM requests")["n"].tolist() == [2]
    wh.write_artifact("r-1", "report.html", "<html></html>")
    assert wh.read_artifact("r-1", "report.html") == b"<html></html>"
    assert wh.artifact_path("r-1", "report.html") == f"{s3_warehouse}/artifacts/r-1/report.html"
    wh.quarantine("r-1", "cells", [{"x": 1}], {"success": False})
    assert wh.read_quarantine("r-1", "cells")[0] == [{"x": 1}]
    assert wh.delete_run("b") and not wh.has_run("b")
    # another process, the same environment, sees it all
    fresh = Warehouse(s3_warehouse)
    assert fresh.query("SELECT run_id FROM runs")["run_id"].tolist() == ["r-1"]


WRITER = textwrap.dedent(
    """
    import json, sys, time, traceback
    sys.path.insert(0, {unit!r})
    from test_warehouse import make_run, make_cells, make_requests
    from speedmatrix.store.warehouse import Warehouse

    wh = Warehouse({root!r})
    start_together()
    report = {{"landed": [], "errors": [], "seconds": []}}
    for i in range({landings}):
        # the last landing lands the worker's first run again (scale 2): replaced, not added
        run_id, scale = ("w{worker}-r" + str(i), 1.0) if i < {landings} - 1 else ("w{worker}-r0", 2.0)
        t0 = time.monotonic()
        try:
            wh.land_run(make_run(run_id=run_id, day=1 + i % 28), make_cells(scale), make_requests(2))
            report["landed"].append(run_id)
        except Exception:
            report["errors"].append(traceback.format_exc())
        report["seconds"].append(time.monotonic() - t0)
    print(json.dumps(report))
    """
)


def assert_whole(wh: Warehouse) -> set[str]:
    """Every run `runs` lists has all its cells and requests, and no table holds a row
    twice; returns the listed run ids."""
    runs = wh.query("SELECT run_id, count(*) AS n FROM runs GROUP BY 1")
    assert set(runs["n"]) <= {1}, "a run listed twice"
    listed = set(runs["run_id"])
    for table, per_run, key in (
        ("cells", N_CELLS, "phase, context_tokens, concurrency"),
        ("requests", N_REQUESTS, "phase, context_tokens, concurrency, request_index"),
    ):
        dup = wh.query(
            f"SELECT run_id, {key}, count(*) AS n FROM {table} GROUP BY ALL HAVING count(*) > 1"
        )
        assert dup.empty, f"duplicate {table} rows: {dup.head().to_dict('records')}"
        counts = wh.query(
            f"SELECT r.run_id, count(t.run_id) AS n FROM runs r LEFT JOIN {table} t "
            "USING (run_id) GROUP BY 1"
        )
        half = counts[counts["n"] != per_run]
        assert half.empty, f"half runs in {table}: {half.to_dict('records')}"
    return listed


def test_eight_processes_ten_landings_each_all_land(s3_warehouse):
    """8 processes x 10 landings into one s3:// warehouse at once: every landing lands (none
    refused), every run whole, none lost, none duplicated; the re-landed run is the newer."""
    workers, landings = 8, 10
    reports = run_scripts(
        [
            WRITER.format(unit=UNIT, root=s3_warehouse, worker=w, landings=landings)
            for w in range(workers)
        ],
        timeout_s=1200,
    )
    errors = [e for r in reports for e in r["errors"]]
    assert errors == [], f"{len(errors)} landings failed, first:\n{errors[0]}"
    assert sum(len(r["landed"]) for r in reports) == workers * landings
    wh = Warehouse(s3_warehouse)
    listed = assert_whole(wh)
    assert listed == {f"w{w}-r{i}" for w in range(workers) for i in range(landings - 1)}
    relanded = wh.query(
        "SELECT DISTINCT run_id, total_tok_s FROM cells WHERE phase = 'prefill' ORDER BY 1"
    )
    scale = {r: t / 6206.0 for r, t in relanded.values.tolist()}
    assert all(scale[r] == (2.0 if r.endswith("-r0") else 1.0) for r in scale)
    seconds = sorted(s for r in reports for s in r["seconds"])
    print(f"landing on s3: median {seconds[len(seconds) // 2]:.2f} s, max {seconds[-1]:.2f} s")


KILLED_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {unit!r})
    from test_warehouse import make_run, make_cells, make_requests
    from speedmatrix.store.warehouse import Warehouse

    wh = Warehouse({root!r})
    print("ready", flush=True)
    for i in range(1000):
        run_id = "k-r" + str(i % 3)  # lands the same three runs again and again
        wh.land_run(make_run(run_id=run_id, day=1 + i % 28), make_cells(1.0 + i), make_requests(2))
        print("landed", run_id, flush=True)
    """
)


def test_a_writer_killed_at_random_moments_leaves_no_half_run_and_no_stuck_warehouse(
    s3_warehouse,
):
    """A writer landing (and re-landing) runs is SIGKILLed at a random moment, four times:
    after each kill `runs` lists only whole runs, nothing is duplicated, and the next writer
    lands at once (nothing to wait for, nothing to clean first)."""
    rng = random.Random(32)
    for _round in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_WRITER.format(unit=UNIT, root=s3_warehouse)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "ready"
        landed = proc.stdout.readline()  # its first landing is through: now it is mid-way
        assert landed.startswith("landed"), proc.stderr.read()
        deadline = time.monotonic() + rng.uniform(0.0, 2.0)
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)  # the random moment itself is what this waits for
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        wh = Warehouse(s3_warehouse)
        assert_whole(wh)
        # not stuck: another writer lands a run whole right away, and the killed runs too
        t0 = time.monotonic()
        wh.land_run(make_run(run_id=f"after-{_round}", day=5), make_cells(), make_requests(2))
        for i in range(3):
            wh.land_run(make_run(run_id=f"k-r{i}", day=7), make_cells(), make_requests(2))
        assert time.monotonic() - t0 < 120
        listed = assert_whole(wh)
        assert {f"after-{_round}", "k-r0", "k-r1", "k-r2"} <= listed
