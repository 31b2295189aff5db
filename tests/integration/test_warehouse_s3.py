"""The warehouse on a real S3-compatible server (moto's standalone server on loopback,
tests/s3server.py): landing, reading and querying through s3://, several writer processes at
once whose commits do overlap (issue #32: 8 of 80 landed on the older layout, the rest
refused), and a writer killed with SIGKILL at random moments of its landings. The full scale
(eight processes x ten landings, four kills) is benchmarks/warehouse_contention_bench.py's
``s3`` and ``kills`` (issue #41)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from contention import until_contended
from processes import run_scripts

from speedmatrix.store.warehouse import Warehouse

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parents[1]
UNIT = str(TESTS / "unit")
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
    sys.path[:0] = [{tests!r}, {unit!r}]
    from contention import counting_lost_commits
    from test_warehouse import make_run, make_cells, make_requests
    from speedmatrix.store.warehouse import Warehouse

    wh = Warehouse({root!r})
    lost = counting_lost_commits()
    start_together()
    report = {{"landed": [], "errors": [], "seconds": [], "lost": lost}}
    for i in range({landings}):
        # the last landing lands the worker's first run again (scale 2): replaced, not added
        run_id, scale = ("{prefix}-r" + str(i), 1.0) if i < {landings} - 1 else ("{prefix}-r0", 2.0)
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
    """Every run `runs` lists has all its cells and requests, of the landing `runs` lists
    (a cell carries its run's engine_commit: each landing of the killed writer its own), and
    no table holds a row twice; returns the listed run ids."""
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
    mixed = wh.query(
        "SELECT DISTINCT run_id, r.engine_commit AS listed, c.engine_commit AS cells FROM runs r "
        "JOIN cells c USING (run_id) WHERE c.engine_commit IS DISTINCT FROM r.engine_commit"
    )
    assert mixed.empty, f"runs listed with another landing's cells: {mixed.to_dict('records')}"
    return listed


def test_writer_processes_landing_together_all_land(s3_warehouse):
    """4 processes x 3 landings into one s3:// warehouse, started together: their commits
    overlap (retried by delta-rs or store/delta.py; another round if none did, at most three),
    every landing lands (none refused), every run whole, none lost, none duplicated; the
    re-landed run is the newer."""
    workers, landings = 4, 3

    def land_round(n: int) -> list[dict]:
        scripts = [
            WRITER.format(
                tests=str(TESTS),
                unit=UNIT,
                root=s3_warehouse,
                prefix=f"g{n}w{w}",
                landings=landings,
            )
            for w in range(workers)
        ]
        return run_scripts(scripts, timeout_s=600)

    reports, contended = until_contended(land_round, Warehouse(s3_warehouse))
    errors = [e for r in reports for e in r["errors"]]
    assert errors == [], f"{len(errors)} landings failed, first:\n{errors[0]}"
    assert contended > 0, "the writers' commits never overlapped: nothing was tested"
    assert sum(len(r["landed"]) for r in reports) == len(reports) * landings
    wh = Warehouse(s3_warehouse)
    listed = assert_whole(wh)
    rounds = len(reports) // workers
    prefixes = [f"g{n}w{w}" for n in range(rounds) for w in range(workers)]
    assert listed == {f"{p}-r{i}" for p in prefixes for i in range(landings - 1)}
    relanded = wh.query(
        "SELECT DISTINCT run_id, total_tok_s FROM cells WHERE phase = 'prefill' ORDER BY 1"
    )
    scale = {r: t / 6206.0 for r, t in relanded.values.tolist()}
    assert all(scale[r] == (2.0 if r.endswith("-r0") else 1.0) for r in scale)
    seconds = sorted(s for r in reports for s in r["seconds"])
    print(
        f"landing on s3: median {seconds[len(seconds) // 2]:.2f} s, max {seconds[-1]:.2f} s; "
        f"commits retried after overlapping another writer's: {contended}"
    )


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {unit!r})
    from test_warehouse import make_run, make_cells, make_requests
    from speedmatrix.store.warehouse import Warehouse

    wh = Warehouse({root!r})
    wh._fault = lambda step: print("at", step, flush=True)  # the landing's steps, as they pass
    for i in range(1000):
        run_id = "k-r" + str(i % 2)  # lands the same two runs again and again
        t0 = time.monotonic()
        run = make_run(run_id=run_id, day=1 + i % 28, engine_commit="c" + str(i))
        wh.land_run(run, make_cells(1.0 + i), make_requests(2))
        print("landed", run_id, time.monotonic() - t0, flush=True)
    """
)


KILL_AFTER = ("landed:cells", "landed:requests", "built", "unlisted")
"""The step of a re-landing after which round N's kill comes (N modulo 4), at a random moment
of the commit that follows it: the windows where a run would show half of two landings."""


def kill_mid_landing(root: str, round_: int, rng: random.Random) -> dict:
    """Start KILLED_WRITER and SIGKILL it at a random moment (0-0.25 s) after its third
    landing (a re-landing) passed the step KILL_AFTER names for ``round_``; check the
    warehouse is whole, then land a new run and the interrupted one at once and check again.
    Returns what happened, for benchmarks/warehouse_contention_bench.py's ``kills``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER.format(unit=UNIT, root=root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    step = KILL_AFTER[round_ % len(KILL_AFTER)]
    landed: list[str] = []
    while len(landed) < 2:  # both runs landed once: from now on every landing re-lands
        line = proc.stdout.readline().split()
        assert line, proc.stderr.read()
        landed += line[1:2] if line[0] == "landed" else []
    while (line := proc.stdout.readline().split()) != ["at", step]:
        assert line and line[0] == "at", f"the re-landing never passed {step}: {line}"
    moment = rng.uniform(0.0, 0.25)
    deadline = time.monotonic() + moment
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)  # the random moment itself is what this waits for
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    later = [line.split() for line in proc.stdout.read().splitlines() if line]
    finished = [x[1] for x in later if x[0] == "landed"]
    interrupted = "k-r1" if ([*landed, *finished][-1] == "k-r0") else "k-r0"
    wh = Warehouse(root)
    assert_whole(wh)
    # not stuck: another writer lands a new run whole right away, and the interrupted one
    t0 = time.monotonic()
    wh.land_run(make_run(run_id=f"after-{round_}", day=5), make_cells(), make_requests(2))
    wh.land_run(make_run(run_id=interrupted, day=7), make_cells(), make_requests(2))
    seconds = time.monotonic() - t0
    assert seconds < 120
    listed = assert_whole(wh)
    assert {f"after-{round_}", "k-r0", "k-r1"} <= listed
    return {"after": step, "moment_s": moment, "landed_after": len(finished), "next_two_s": seconds}


def test_a_writer_killed_at_random_moments_leaves_no_half_run_and_no_stuck_warehouse(
    s3_warehouse,
):
    """A writer landing (and re-landing) two runs is SIGKILLed at a random moment of a
    re-landing (the run leaves `runs`, its cells, requests and `runs` row are replaced),
    twice: once after its cells' commit, once after its requests' (KILL_AFTER; the
    benchmark's four kills also before any commit and after the run left `runs`): after each
    kill `runs` lists only whole runs of the landing it names, nothing is duplicated, and the
    next landings, of a new run and of the run the kill interrupted, land at once (nothing to
    wait for, nothing to clean first)."""
    rng = random.Random(32)
    for round_ in range(2):
        kill_mid_landing(s3_warehouse, round_, rng)
