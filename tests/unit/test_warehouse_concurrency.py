"""Several processes landing into and reading one local warehouse at once (issue #16 item 13,
issue #32): every landing lands (none refused, none lost, none twice), readers only ever see
whole runs, and the writers' commits did overlap (tests/contention.py: a test of concurrent
writers that never contended proves nothing). The same on s3://:
tests/integration/test_warehouse_s3.py; the full scale (six processes x 40 landings) is
benchmarks/warehouse_contention_bench.py's ``local`` (issue #41)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from contention import until_contended
from processes import run_scripts

from speedmatrix.store.warehouse import Warehouse

TESTS = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent(
    """
    import json, sys, traceback
    sys.path[:0] = [{tests!r}, {unit!r}]
    from contention import counting_lost_commits
    from test_warehouse import make_run, make_cells, make_requests
    from speedmatrix.store.warehouse import Warehouse

    N_CELLS = len(make_cells())
    wh = Warehouse({root!r})
    errors, bad_views = [], []
    lost = counting_lost_commits()

    def check_whole():
        # every run a reader sees has all its cells, and no cell row without its whole run
        per_run = wh.query("SELECT run_id, count(*) AS n FROM cells GROUP BY run_id")
        bad = per_run[per_run["n"] != N_CELLS]
        if len(bad):
            bad_views.append(bad.to_dict("records"))
        orphans = wh.query(
            "SELECT r.run_id FROM runs r LEFT JOIN cells c USING (run_id) WHERE c.run_id IS NULL"
        )
        if len(orphans):
            bad_views.append(orphans["run_id"].tolist())

    start_together()  # tests/processes.py: once every worker is past its imports
    for i in range({runs}):
        run_id = "{prefix}-r" + str(i)
        try:
            wh.land_run(make_run(run_id=run_id, day=1 + i % 28), make_cells(), make_requests(2))
        except Exception:
            errors.append(traceback.format_exc())
        steps = [lambda: wh.read_run(run_id)]
        if i % {check_every} == {check_every} - 1:
            steps.append(check_whole)
        for step in steps:
            try:
                step()
            except Exception:
                errors.append(traceback.format_exc())
    print(json.dumps({{"errors": errors, "bad_views": bad_views, "lost": lost}}))
    """
)


def test_concurrent_landings_and_reads_from_several_processes(tmp_path):
    """Four processes started together each land 3 runs, reading after each landing (the run,
    and a query for runs not whole): no exception anywhere, every run landed exactly once,
    readers saw only whole runs, and commits did overlap (retried by delta-rs or by
    store/delta.py). Should a round pass without any overlap (likely, not certain), another
    round lands into the same warehouse, at most three."""
    workers, runs = 4, 3

    def land_round(n: int) -> list[dict]:
        scripts = [
            WORKER.format(
                tests=str(TESTS),
                unit=str(TESTS / "unit"),
                root=str(tmp_path),
                prefix=f"g{n}w{w}",
                runs=runs,
                check_every=1,
            )
            for w in range(workers)
        ]
        return run_scripts(scripts, timeout_s=600)

    reports, contended = until_contended(land_round, Warehouse(tmp_path))
    rounds = len(reports) // workers
    expected = {
        f"g{n}w{w}-r{i}" for n in range(rounds) for w in range(workers) for i in range(runs)
    }
    errors = [e for r in reports for e in r["errors"]]
    assert errors == [], f"{len(errors)} errors, first:\n{errors[0]}"
    assert [v for r in reports for v in r["bad_views"]] == []
    assert contended > 0, "the writers' commits never overlapped: nothing was tested"
    wh = Warehouse(tmp_path)
    counts = wh.query("SELECT run_id, count(*) AS n FROM runs GROUP BY run_id")
    assert set(counts["run_id"]) == expected
    assert set(counts["n"]) == {1}
    cells = wh.query("SELECT run_id, count(*) AS n FROM cells GROUP BY run_id")
    assert len(cells) == len(expected) and set(cells["n"]) == {5}
    print(f"commits retried after overlapping another writer's: {contended} ({rounds} rounds)")
