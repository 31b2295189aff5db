"""Several processes landing into and reading one local warehouse at once (issue #16 item 13,
issue #32): every landing lands (none refused, none lost, none twice) and readers only ever
see whole runs. The same on s3://: tests/integration/test_warehouse_s3.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

from processes import run_scripts

from speedmatrix.store.warehouse import Warehouse

WORKER = textwrap.dedent(
    """
    import json, sys, time, traceback
    sys.path.insert(0, {tests!r})
    from test_warehouse import make_run, make_cells, make_requests
    from speedmatrix.store.warehouse import Warehouse

    N_CELLS = len(make_cells())
    wh = Warehouse({root!r})
    errors, bad_views = [], []

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
        run_id = "w{worker}-r" + str(i)
        try:
            wh.land_run(make_run(run_id=run_id, day=1 + i % 28), make_cells(), make_requests(2))
        except Exception:
            errors.append(traceback.format_exc())
        steps = [lambda: wh.read_run(run_id)]
        if i % 8 == 7:
            steps.append(check_whole)
        for step in steps:
            try:
                step()
            except Exception:
                errors.append(traceback.format_exc())
    print(json.dumps({{"errors": errors, "bad_views": bad_views}}))
    """
)


def test_concurrent_landings_and_reads_from_several_processes(tmp_path):
    """Six processes each land 40 runs, reading after each landing (read_run, and every
    eighth time a query): no exception anywhere, every run landed exactly once, readers saw
    only whole runs."""
    workers, runs = 6, 40
    reports = run_scripts(
        [
            WORKER.format(
                tests=str(Path(__file__).parent),
                root=str(tmp_path),
                worker=w,
                runs=runs,
            )
            for w in range(workers)
        ],
        timeout_s=600,
    )
    errors = [e for r in reports for e in r["errors"]]
    assert errors == [], f"{len(errors)} errors, first:\n{errors[0]}"
    assert [v for r in reports for v in r["bad_views"]] == []
    wh = Warehouse(tmp_path)
    counts = wh.query("SELECT run_id, count(*) AS n FROM runs GROUP BY run_id")
    expected = {f"w{w}-r{i}" for w in range(workers) for i in range(runs)}
    assert set(counts["run_id"]) == expected
    assert set(counts["n"]) == {1}
    cells = wh.query("SELECT run_id, count(*) AS n FROM cells GROUP BY run_id")
    assert len(cells) == len(expected) and set(cells["n"]) == {5}
