"""`speedmatrix warehouse maintain` beside landing writers and with hostile input (issue #42,
items 3 to 5): every commit it makes is retried as a landing's is, a table that still fails
does not stop the others and the exit code says so; a dead writer's files are removed once
older than the longest landing, and the count is the files actually removed; the retention
has a floor (below it only with --force), keeps fractions and leaves delta-rs's check on."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from speedmatrix import cli
from speedmatrix.store.maintain import MIN_RETENTION_HOURS, maintain
from speedmatrix.store.schemas import EXTRA_TABLES
from speedmatrix.store.warehouse import Warehouse

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_requests, make_run


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "wh"
    wh = Warehouse(root)
    for i in range(3):
        wh.land_run(make_run(f"a{i}", day=1 + i), make_cells(), make_requests(1))
    return root


def _partition(root: Path, table: str) -> Path:
    first = DeltaTable(root / table).file_uris()[0].removeprefix("file://")
    return Path(first).parent


def _untracked_file(root: Path, table: str, name: str, age_hours: float) -> Path:
    """A data file a writer wrote and never committed (killed before its commit), as old as
    ``age_hours`` by its modification time (the clock vacuum reads)."""
    part = _partition(root, table)
    src = next(part.glob("*.parquet"))
    dead = part / f"part-00000-{name}-c000.snappy.parquet"
    pq.write_table(pq.read_table(src), dead)
    when = time.time() - age_hours * 3600
    os.utime(dead, (when, when))
    return dead


def removed_hours_ago(wh: Warehouse, run_id: str, age_hours: float) -> dict[str, str]:
    """Delete ``run_id`` (each table's commit removes the run's one data file) and date that
    removal ``age_hours`` back, as if committed then: the commit's time and the remove's
    ``deletionTimestamp`` in the table's log, rewritten through the warehouse's filesystem
    (a local path or S3). Returns, per table, where the removed file is (a filesystem path)."""
    tables = ("runs", "cells", "requests")
    before = {t: wh.delta_table(t).version() for t in tables}
    assert wh.delete_run(run_id)
    when = int((time.time() - age_hours * 3600) * 1000)
    removed = {}
    for table in tables:
        after = wh.delta_table(table).version()
        assert after == before[table] + 1, (table, before[table], after)
        entry = f"{wh.base}/{table}/_delta_log/{after:020d}.json"
        with wh.fs.open_input_stream(entry) as fh:
            actions = [json.loads(line) for line in fh.read().decode().splitlines() if line]
        for action in actions:
            if "commitInfo" in action:
                action["commitInfo"]["timestamp"] = when
            if "remove" in action:
                action["remove"]["deletionTimestamp"] = when
                removed[table] = f"{wh.base}/{table}/{unquote(action['remove']['path'])}"
        with wh.fs.open_output_stream(entry) as out:
            out.write(("\n".join(json.dumps(a) for a in actions) + "\n").encode())
        wh.forget(table)
    return removed


def exists(wh: Warehouse, path: str) -> bool:
    return wh.fs.get_file_info(path).type != pafs.FileType.NotFound


@contextlib.contextmanager
def relanding_writers(root: str, writers: int, runs_each: int) -> Iterator[set[str]]:
    """Threads landing and landing again runs ``w<writer>-<0..runs_each-1>`` into ``root``
    without pause (each landing removes the run's older files), under way when the body
    starts; yields the run ids landed so far, and on leaving stops them and checks that
    every landing landed."""
    stop = threading.Event()
    landed: set[str] = set()
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        wh = Warehouse(root)
        i = 0
        while not stop.is_set():
            run_id = f"w{w}-{i % runs_each}"
            try:
                wh.land_run(make_run(run_id, day=1 + i % 3), make_cells(), make_requests(1))
                landed.add(run_id)
            except BaseException as exc:
                errors.append(exc)
            i += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    try:
        while len(landed) < writers and not errors:  # writers under way
            time.sleep(0.01)
        yield landed
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]


def test_maintenance_beside_landing_writers_retries_every_commit(root):
    """Threads land and land again the same runs without pause (each landing removes the
    run's older files) while maintenance passes run, each pass with a dead writer's file to
    vacuum in every table: the vacuum's own commit races the landings (on today's code 63 of
    99 passes failed so, "a concurrent transaction deleted data this operation read"), and
    every pass maintains every table, every landing lands."""
    reports, dead = [], []
    with relanding_writers(str(root), writers=3, runs_each=3) as landed:
        for n in range(6):
            dead += [_untracked_file(root, t, f"dead{n}", 3) for t in ("runs", "cells")]
            reports.append(maintain(Warehouse(root), MIN_RETENTION_HOURS))
    for report in reports:
        # every table exists from the first landing (the extra ones empty)
        assert set(report) == {"runs", "cells", "requests", *EXTRA_TABLES}, report
        failed = {t: r["error"] for t, r in report.items() if r.get("error")}
        assert not failed, failed
        assert report["runs"]["files_vacuumed"] >= 1 and report["cells"]["files_vacuumed"] >= 1
    assert not [p for p in dead if p.exists()]
    wh = Warehouse(root)
    got = set(wh.query("SELECT run_id FROM runs")["run_id"])
    assert landed | {"a0", "a1", "a2"} == got
    assert wh.query("SELECT count(*) AS n FROM cells")["n"][0] == len(got) * len(make_cells())


def test_a_table_that_fails_does_not_stop_the_others_and_the_exit_code_says_so(root, capsys):
    log = root / "cells" / "_delta_log"
    last = sorted(log.glob("*.json"))[-1]
    last.write_bytes(last.read_bytes()[:40])  # a truncated log entry: cells cannot be read
    dead = _untracked_file(root, "requests", "dead", 30)
    rc = cli.main(["warehouse", "maintain", "--warehouse", str(root)])
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    assert "runs:" in out and "requests:" in out and not dead.exists()
    assert "cells" in err and f"1 of {3 + len(EXTRA_TABLES)} tables" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_dead_writers_files_go_once_older_than_the_longest_landing(root, capsys):
    dead = _untracked_file(root, "cells", "dead-writer", 25)
    live = _untracked_file(root, "cells", "live-writer", 0.1)  # a landing under way
    kept = set(DeltaTable(root / "cells").file_uris())
    assert cli.main(["warehouse", "maintain", "--warehouse", str(root)]) == 0
    out = capsys.readouterr().out
    assert not dead.exists() and live.exists()
    assert "cells: 3 -> 1 files" in out and ", 1 vacuumed" in out.split("cells:")[1], out
    # nothing left to remove: nothing counted
    assert cli.main(["warehouse", "maintain", "--warehouse", str(root)]) == 0
    out = capsys.readouterr().out
    assert all(", 0 vacuumed" in line for line in out.splitlines()), out
    assert live.exists() and kept  # the live writer's file stays until older than the floor


def test_the_vacuumed_count_is_the_files_removed(root, capsys):
    """Compacted files (3 per table) go at once with --force 0: the count is what went from
    disk, and a second pass counts none though the log still lists the tombstones."""

    def on_disk(table: str) -> int:
        return sum(1 for p in (root / table).rglob("*.parquet") if "_delta_log" not in p.parts)

    args = ["warehouse", "maintain", "--warehouse", str(root), "--retention-hours", "0"]
    assert cli.main([*args, "--force"]) == 0
    out = capsys.readouterr().out
    assert on_disk("cells") == 1 and "cells: 3 -> 1 files" in out, out
    assert ", 3 vacuumed" in out.split("cells:")[1].splitlines()[0], out
    assert cli.main([*args, "--force"]) == 0
    out = capsys.readouterr().out
    assert all(", 0 vacuumed" in line for line in out.splitlines()), out


def test_retention_below_the_floor_needs_force_and_fractions_are_not_truncated(root, capsys):
    dead = _untracked_file(root, "runs", "dead", 1.5)
    for hours in ("0", "0.5", "nan", "-1"):
        args = ["warehouse", "maintain", "--warehouse", str(root), "--retention-hours", hours]
        rc = cli.main(args)
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        if hours in ("0", "0.5"):
            assert "--force" in err and f"floor of {MIN_RETENTION_HOURS:g} h" in err, err
    assert dead.exists()
    # 1.9 h is not 1 h: a file 1.5 h old stays
    rc = cli.main(["warehouse", "maintain", "--warehouse", str(root), "--retention-hours", "1.9"])
    assert rc == 0 and dead.exists()
    assert capsys.readouterr().err == ""
    # delta-rs's own check stays on: each table says the floor is its minimum retention
    for table in ("runs", "cells", "requests"):
        conf = DeltaTable(root / table).metadata().configuration
        assert conf.get("delta.deletedFileRetentionDuration") == (
            f"interval {round(MIN_RETENTION_HOURS * 3600)} seconds"
        )
        with pytest.raises(Exception, match="minimum retention"):
            DeltaTable(root / table).vacuum(retention_hours=0, dry_run=True)
    rc = cli.main(["warehouse", "maintain", "--warehouse", str(root), "--retention-hours", "1"])
    assert rc == 0 and not dead.exists()
    capsys.readouterr()


def test_a_fraction_of_an_hour_is_kept_exactly(root, capsys):
    """--retention-hours 1.5 keeps what was removed 1.2 h ago and deletes what was removed
    1.7 h ago (today's code rounded 1.5 up to 2 h, and after its checkpoint judged the removed
    files by their age on disk: both went). The removed files are 30 h old on disk (written
    long before their removal), and a landing's checkpoint has since been written: delta-rs's
    checkpoint keeps no tombstone older than the table's retention property (the floor)."""
    wh = Warehouse(root)
    older = removed_hours_ago(wh, "a0", 1.7)
    newer = removed_hours_ago(wh, "a1", 1.2)
    long_ago = time.time() - 30 * 3600
    for path in (*older.values(), *newer.values()):
        os.utime(path, (long_ago, long_ago))
    for table in older:
        DeltaTable(root / table).create_checkpoint()
    args = ["warehouse", "maintain", "--warehouse", str(root), "--retention-hours"]
    assert cli.main([*args, "1.5"]) == 0
    out, err = capsys.readouterr()
    assert not [p for p in older.values() if exists(wh, p)], out
    assert all(exists(wh, p) for p in newer.values()), out
    for table in older:  # the count is the file that went (compaction's own are kept)
        line = next(x for x in out.splitlines() if x.startswith(f"{table}:"))
        assert ", 1 vacuumed" in line, out
    assert err == "", err
    # and 1.1 h, below the newer removal's age, takes it
    assert cli.main([*args, "1.1"]) == 0
    capsys.readouterr()
    assert not [p for p in newer.values() if exists(wh, p)]
    assert set(wh.query("SELECT run_id FROM runs")["run_id"]) == {"a2"}


def test_force_below_the_floor_is_said(root, capsys):
    dead = _untracked_file(root, "runs", "dead", 0.2)
    args = ["warehouse", "maintain", "--warehouse", str(root), "--retention-hours", "0"]
    assert cli.main([*args, "--force"]) == 0
    assert not dead.exists()
    assert "below the floor" in capsys.readouterr().err


def test_the_floor_covers_the_longest_landing():
    from speedmatrix.store.delta import MAX_WAIT_S

    assert MIN_RETENTION_HOURS * 3600 >= 2 * MAX_WAIT_S
