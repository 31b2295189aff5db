"""Issue 17, "one typed contract per hand-off": the cell record type from the load generator to
the table builder, the typed run description, datetimes kept as datetimes until Parquet, the
measured context kept, the validity rules written once, the comparison made once per run.

No Airflow and no server: the task bodies of flows/matrix.py over a real temporary warehouse
and the real GX suites, fed the records the load generator returns."""

from __future__ import annotations

import datetime as dt
import json
import typing
from pathlib import Path

import pytest
from factories import run_row
from test_compare_warehouse import three_runs
from test_repeats import decode, prefill, result

from speedmatrix import records
from speedmatrix.analysis import compare
from speedmatrix.analysis.verdict import RegressionError
from speedmatrix.flows import collect, handoff, matrix, resolution, turn
from speedmatrix.flows.contracts import RESOLVED
from speedmatrix.flows.resolved import RESOLVED_KEYS, MatrixConf, Resolved
from speedmatrix.quality import validate_run
from speedmatrix.records import (
    CELL_FIELDS,
    REQUEST_FIELDS,
    RUN_FIELDS,
    WARM_PREFILL,
    CellRecord,
    empty_cell,
    from_wire,
    to_wire,
)
from speedmatrix.store.extra import read_extra
from speedmatrix.store.warehouse import WarehouseError, build_table

SIM = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
INFO = {"kv_num_blocks": 16640, "kv_block_size": 16, "kv_cache_tokens": 266240}
WHEN = dt.datetime(2026, 12, 2, 20, 30, 5, tzinfo=dt.UTC)


def resolve(tmp_path, **conf) -> Resolved:
    conf = {"recipe": SIM, "warehouse": str(tmp_path / "wh"), **conf}
    return resolution.resolve(conf, dag_run_id="manual__2026-12-02T20:30:05+00:00", run_after=WHEN)


# ------------------------------------------------------------------------------- the types


def test_the_cell_record_type_names_every_cell_field_with_its_type():
    hints = typing.get_type_hints(CellRecord)
    assert list(hints) == [f.name for f in CELL_FIELDS]
    py = {"str": str, "int": int, "float": float, "bool": bool, "timestamp": dt.datetime}
    for f in CELL_FIELDS:
        want = py[f.type] | None if f.nullable else py[f.type]
        assert hints[f.name] == want, f.name
    assert set(empty_cell()) == set(hints)


def test_resolve_returns_exactly_the_typed_run_description(tmp_path):
    r = resolve(tmp_path, contexts=["8K"], concurrencies=[1])
    assert tuple(r) == RESOLVED_KEYS
    assert set(r["matrix"]) == set(typing.get_type_hints(MatrixConf))
    assert RESOLVED.from_wire(r) == r  # every value of the type and range it declares
    json.dumps(r)  # still the plain JSON object XCom has always carried


# ----------------------------------------------------------- datetimes until Parquet only


def test_one_place_turns_timestamps_into_their_wire_form_and_back():
    cell = decode(started_at=WHEN)
    wire = to_wire(cell)
    assert wire["started_at"] == "2026-12-02T20:30:05+00:00"
    json.dumps(wire)
    back = from_wire(wire)
    assert back == cell and back["started_at"] == WHEN
    # the load generator's JSON (zipapp) and a naive or Z timestamp come back aware UTC
    assert from_wire({"started_at": "2026-12-02T20:30:05Z"})["started_at"] == WHEN
    assert from_wire({"started_at": "2026-12-02T20:30:05"})["started_at"] == WHEN
    with pytest.raises(ValueError, match="started_at"):
        from_wire({"started_at": "yesterday"})
    run = {"started_at": WHEN, "finished_at": WHEN, "run_id": "x"}
    assert from_wire(to_wire(run, RUN_FIELDS), RUN_FIELDS) == run


def test_records_cross_xcom_as_strings_and_reach_the_table_builder_as_datetimes(
    tmp_path, monkeypatch
):
    """collect_cells reads the cell tasks' XCom back to datetimes; validate's XCom keeps the
    ISO strings it always had; land hands datetimes to the warehouse, which lands them."""
    r = resolve(tmp_path, contexts=["8K"], concurrencies=[1], prefill_contexts=["8K"])
    planned = matrix.plan(r, INFO)
    results = [result(prefill(started_at=WHEN)), result(decode(started_at=WHEN))]
    assert isinstance(results[0]["cell"]["started_at"], str)  # the cell task's XCom form
    cells, _ = collect.collect_cells(planned, results)
    assert [c["started_at"] for c in cells] == [WHEN, WHEN]

    built = []
    real_build = build_table

    def spy(table, rows, fixed):
        built.append((table, rows))
        return real_build(table, rows, fixed)

    monkeypatch.setattr("speedmatrix.store.warehouse.build_table", spy)
    validated = matrix.validate(r, INFO, None, planned, results)
    assert validated["cells"][0]["started_at"] == "2026-12-02T20:30:05+00:00"
    assert isinstance(validated["run"]["started_at"], str)
    json.dumps(validated)  # XCom-visible output: JSON, as before
    matrix.land(r, validated)
    got = dict(built)
    assert got["cells"][0]["started_at"] == WHEN  # never parsed back by the table builder
    assert isinstance(got["runs"][0]["started_at"], dt.datetime)
    wh = matrix.warehouse_of(r)
    run, landed, _ = wh.read_run(r["run_id"])
    assert [c["started_at"] for c in landed] == [WHEN, WHEN]
    assert run["started_at"] == dt.datetime.fromisoformat(r["started_at"])
    wh.close()


# -------------------------------------------------------------- the measured context stays


def test_a_cell_measured_at_8176_tokens_for_8k_keeps_8176_in_the_cells_table(tmp_path):
    """The server confirmed 8,176 prompt tokens for the planned 8K cell: the record lands
    with the measured count (its requests too, so they join it), under the planned label."""
    r = resolve(tmp_path, contexts=["8K"], concurrencies=[1, 2], prefill_contexts=["8K"])
    planned = matrix.plan(r, INFO)
    assert [c["context_tokens"] for c in planned["decode"]] == [8192, 8192]
    req = {"phase": "decode", "context_tokens": 8192, "concurrency": 1, "request_index": 0}
    results = [
        result(prefill(ctx=8176, context_label="8K")),
        result(decode(ctx=8176, c=1, context_label="8K"), requests=[req]),
        result(decode(c=2)),  # this one got exactly what was planned
    ]
    validated = matrix.validate(r, INFO, None, planned, results)
    assert validated["quarantined"] == []
    landed = matrix.land(r, validated)
    assert landed["status"] == "success" and landed["failed"] == []
    wh = matrix.warehouse_of(r)
    _, cells, requests = wh.read_run(r["run_id"])
    assert [(c["phase"], c["context_tokens"], c["context_label"], c["status"]) for c in cells] == [
        ("prefill", 8176, "8K", "valid"),
        ("decode", 8176, "8K", "valid"),
        ("decode", 8192, "8K", "valid"),
    ]
    assert [(q["context_tokens"], q["concurrency"]) for q in requests] == [(8176, 1)]
    # land compared this landing with its baseline (none: the recipe's first run) and handed
    # the comparison on to report and regressions
    handed = handoff.handed_on_comparison(wh, r["run_id"])
    assert handed is not None and handed.baseline is None
    wh.close()


def _quiet_host(monkeypatch):
    """run_cell without a host: a lease that always renews, a server always healthy."""
    import contextlib

    class Lease:
        def renew(self):
            pass

        def renewing(self, **kw):
            return contextlib.nullcontext(type("R", (), {"lost": None})())

    monkeypatch.setattr(matrix, "host_lease", lambda resolved: Lease())
    monkeypatch.setattr(matrix, "server_health", lambda resolved, server: None)


def test_run_cell_gives_the_record_the_planned_label_and_keeps_the_measured_tokens(
    tmp_path, monkeypatch
):
    """The cell task itself: what the load generator measured stays, the label is the plan's
    (8,000 tokens would be labelled 8K by count too; 7,000 would not)."""
    r = resolve(tmp_path, contexts=["8K"], concurrencies=[1])
    planned = matrix.plan(r, INFO)["decode"][0]
    measured = decode(ctx=7000, context_label="7K", started_at=WHEN)

    _quiet_host(monkeypatch)
    monkeypatch.setattr(matrix, "measure", lambda resolved, server, cell: (measured, []))
    out = matrix.run_cell(r, {"base_url": "http://127.0.0.1:1"}, planned)
    assert out["cell"]["context_tokens"] == 7000 and out["cell"]["context_label"] == "8K"
    assert out["cell"]["started_at"] == WHEN.isoformat() and set(out) == {
        "cell",
        "requests",
        "repeat",
        "turn",
    }
    cells, _ = collect.collect_cells(
        {"prefill": [], "decode": [planned], "over_capacity": []}, [out]
    )
    assert [(c["context_tokens"], c["status"]) for c in cells] == [(7000, "valid")]


def test_a_cell_measures_only_after_the_previous_cell_has_finished(tmp_path, monkeypatch):
    """Issue #19: the cell task starts while the previous cell measures; nothing of it touches
    the host (lease, health, load generator) until the previous cell's state says finished, and
    its result says when it held the host and how long it waited."""
    r = resolve(tmp_path, contexts=["8K"], concurrencies=[1])
    planned = matrix.plan(r, INFO)["decode"][0]
    events = []
    states = iter(["running", "running", "success"])

    def previous():
        events.append("asked")
        return next(states)

    _quiet_host(monkeypatch)
    monkeypatch.setattr(matrix, "server_health", lambda *a: events.append("health"))
    monkeypatch.setattr(turn, "POLL_S", 0.001)
    monkeypatch.setattr(
        matrix,
        "measure",
        lambda *a: (events.append("measure"), (decode(ctx=8176, started_at=WHEN), []))[1],
    )
    held = turn.CellTurn(previous, "decode[0]", lambda: events.append("released"))
    out = matrix.run_cell(r, {"base_url": "http://127.0.0.1:1"}, planned, held)
    # ...and it says it has left the host only after everything it did there
    assert events == ["asked", "asked", "asked", "health", "measure", "released"]
    t = out["turn"]
    assert t["after"] == "decode[0]" and t["state"] == "success" and t["waited_s"] >= 0
    assert t["began"] <= t["ended"] and out["cell"]["status"] == "valid"


def test_a_cell_whose_release_cannot_be_said_keeps_its_measurement(tmp_path, monkeypatch, caplog):
    """The next cell then goes on this task's end, as it would without the word."""
    r = resolve(tmp_path, contexts=["8K"], concurrencies=[1])
    planned = matrix.plan(r, INFO)["decode"][0]
    _quiet_host(monkeypatch)
    monkeypatch.setattr(matrix, "measure", lambda *a: (decode(ctx=8176, started_at=WHEN), []))

    def release():
        raise ConnectionError("API server gone")

    out = matrix.run_cell(
        r, {"base_url": "http://127.0.0.1:1"}, planned, turn.CellTurn(None, "", release)
    )
    assert out["cell"]["status"] == "valid" and out["turn"]["ended"]
    assert "could not say the host is released: API server gone" in caplog.text


def test_a_cell_that_cannot_learn_its_turn_fails_without_touching_the_host(tmp_path, monkeypatch):
    r = resolve(tmp_path, contexts=["8K"], concurrencies=[1])
    planned = matrix.plan(r, INFO)["decode"][0]

    def previous():
        raise ConnectionError("API server gone")

    def host_touched(*a):
        raise AssertionError("the host was touched")

    monkeypatch.setattr(matrix, "host_lease", host_touched)
    monkeypatch.setattr(matrix, "measure", host_touched)
    # nor does it say it released a host it never held
    held = turn.CellTurn(previous, "decode[0]", lambda: host_touched())
    out = matrix.run_cell(r, {"base_url": "http://127.0.0.1:1"}, planned, held)
    assert out["cell"]["status"] == "failed" and out["requests"] == []
    assert "could not learn whether decode[0] had finished" in out["cell"]["error"]
    assert "API server gone" in out["cell"]["error"]


def test_a_prefill_found_warm_is_measured_again_cold(tmp_path, monkeypatch):
    """dag.test() runs a mapped task's instances in no set order: a decode cell of the context
    can run before its prefill cell and leave the prompt cached. The prefill cell then measures
    again with a prompt of its own (another run tag) and records that cold measurement."""
    r = resolve(tmp_path, contexts=["8K"], concurrencies=[1])
    planned = matrix.plan(r, INFO)["prefill"][0]
    # the reason code loadgen writes (records.WARM_PREFILL), not English written here: the
    # simulator's own warm prefill is tests/integration/test_loadgen_sim.py's
    warm = prefill(status="invalid", error=f"{WARM_PREFILL}: 896 tokens came from the prefix cache")
    cold = prefill(started_at=WHEN)
    tags = []

    def measure(resolved, server, cell):
        tags.append(
            matrix._loadgen_config(resolved, {"base_url": "http://127.0.0.1:1"}, cell).run_tag
        )
        return (warm if len(tags) == 1 else cold), []

    _quiet_host(monkeypatch)
    monkeypatch.setattr(matrix, "measure", measure)
    out = matrix.run_cell(r, {"base_url": "http://127.0.0.1:1"}, planned)
    assert out["cell"]["status"] == "valid" and out["cell"]["error"] is None
    assert len(tags) == 2 and tags[0] == r["run_tag"] and tags[1] != tags[0]
    # a valid prefill, or a decode cell, is measured once
    tags.clear()
    warm.update(status="valid", error=None)
    assert (
        matrix.run_cell(r, {"base_url": "http://127.0.0.1:1"}, planned)["cell"]["status"] == "valid"
    )
    assert len(tags) == 1


# -------------------------------------------------------------- the validity rules, once


def _invalid_cell():
    return decode(status="invalid", error="server counted 8176 prompt tokens, not 8192")


def test_a_value_rule_changed_in_records_changes_gx_and_the_table_builder(monkeypatch):
    """records.ALLOWED_VALUES is the one definition: drop `invalid` from the cell statuses
    and both the cells suite and the table builder refuse an invalid cell; put it back and
    both take it."""
    fixed = {"run_id": "x", "recipe_id": "r", "run_date": WHEN.date(), "run_month": "2026-12"}
    fixed["schema_version"] = 1
    run = run_row("x")
    cell = _invalid_cell()
    assert validate_run(run, [cell]).bad_cells == []
    build_table("cells", [cell], fixed)

    statuses = tuple(s for s in records.STATUSES if s != "invalid")
    monkeypatch.setitem(records.ALLOWED_VALUES["cells"], "status", statuses)
    [bad] = validate_run(run, [cell]).bad_cells
    assert "expect_column_values_to_be_in_set(status)" in bad["quarantine_reasons"]
    with pytest.raises(WarehouseError, match="status 'invalid' is not one of"):
        build_table("cells", [cell], fixed)

    # a status the contract adds is taken by both at once
    monkeypatch.setitem(records.ALLOWED_VALUES["cells"], "status", (*records.STATUSES, "skipped"))
    skipped = {**cell, "status": "skipped"}
    assert validate_run(run, [skipped]).bad_cells == []
    build_table("cells", [skipped], fixed)


def test_the_unique_key_changed_in_records_changes_gx_and_the_table_builder(monkeypatch):
    fixed = {"run_id": "x", "recipe_id": "r", "run_date": WHEN.date(), "run_month": "2026-12"}
    fixed["schema_version"] = 1
    run = run_row("x")
    twins = [decode(workload="article"), decode(workload="continuation")]
    assert len(validate_run(run, twins).bad_cells) == 2
    with pytest.raises(WarehouseError, match="duplicate"):
        build_table("cells", twins, fixed)
    monkeypatch.setitem(records.UNIQUE_KEYS, "cells", (*records.UNIQUE_KEYS["cells"], "workload"))
    assert validate_run(run, twins).bad_cells == []
    assert build_table("cells", twins, fixed).num_rows == 2


def test_request_rows_keep_their_own_fields_on_the_wire():
    row = {f.name: None for f in REQUEST_FIELDS} | {"phase": "decode", "request_index": 0}
    assert from_wire(to_wire(row, REQUEST_FIELDS), REQUEST_FIELDS) == row


# -------------------------------------------------------------- the comparison, once per run


@pytest.fixture
def wh(tmp_path):
    yield from three_runs(tmp_path / "wh")


def _hand_on(wh, run_id):
    """`land` itself (matrix.land, not a copy of its last step: issue #33) on the run as
    `validate` hands it over: it lands the run again (replacing it) and hands its comparison
    on."""
    run, cells, requests = wh.read_run(run_id)
    validated = {
        "run": to_wire(run, RUN_FIELDS),
        "cells": [to_wire(c) for c in cells],
        "requests": [to_wire(r, REQUEST_FIELDS) for r in requests],
        "repeats": [],
        "quarantined": [],
        "gx_results": f"{wh.root}/artifacts/{run_id}/validation/gx-results.json",
    }
    out = matrix.land({"run_id": run_id, "warehouse": wh.root}, validated)
    assert out["run_id"] == run_id and out["cells"] == len(cells)


def test_the_comparison_is_made_once_by_land_and_shown_and_judged_after(wh, monkeypatch):
    """`land` compares the run with its baseline and hands the comparison on; `report` shows
    that one and `regressions` judges it (no second comparison, in either order: they run side
    by side), landing the same verdicts it would have made."""
    calls = []
    real = compare.comparison_for_run

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(compare, "comparison_for_run", counted)
    resolved = {"run_id": "r2", "warehouse": wh.root}
    _hand_on(wh, "r2")
    assert calls == ["r2"]
    with pytest.raises(RegressionError, match="64Kx2"):
        matrix.regressions(resolved, {"run_id": "r2"})
    paths = matrix.report(resolved, {"run_id": "r2"})
    assert "Change against baseline r1" in Path(paths["md"]).read_text()
    assert calls == ["r2"]  # both took the comparison land made
    handed = read_extra(wh, "comparisons", run_id="r2")
    noise = read_extra(wh, "noise", run_id="r2")

    # the same verdicts as a comparison made by regressions itself
    with pytest.raises(RegressionError):
        compare.judge_regressions(wh, "r2")
    made = read_extra(wh, "comparisons", run_id="r2")
    key = ["phase", "context_tokens", "concurrency", "metric"]
    assert (
        handed.sort_values(key)[[*key, "verdict", "value", "baseline_value"]]
        .reset_index(drop=True)
        .equals(
            made.sort_values(key)[[*key, "verdict", "value", "baseline_value"]].reset_index(
                drop=True
            )
        )
    )
    assert len(noise) == len(read_extra(wh, "noise", run_id="r2")) > 0


def test_a_comparison_of_an_earlier_landing_is_not_taken_for_this_one(wh, monkeypatch):
    resolved = {"run_id": "r1", "warehouse": wh.root}
    _hand_on(wh, "r1")
    assert handoff.handed_on_comparison(wh, "r1").baseline["run_id"] == "r0"
    run, cells, requests = wh.read_run("r1")
    wh.land_run(run, cells, requests)  # landed again (a retried or cleared land task)
    assert handoff.handed_on_comparison(wh, "r1") is None
    calls = []
    real = compare.comparison_for_run
    monkeypatch.setattr(
        compare, "comparison_for_run", lambda *a, **k: calls.append(a[1]) or real(*a, **k)
    )
    assert matrix.regressions(resolved, {"run_id": "r1"})["baseline_run_id"] == "r0"
    assert calls == ["r1"]  # made again, of the run as it is now
    paths = matrix.report(resolved, {"run_id": "r1"})
    assert "Change against baseline r0" in Path(paths["md"]).read_text()
    assert calls == ["r1", "r1"]  # the page too: never a comparison of another landing


def test_a_run_without_a_comparison_hands_on_that_there_is_none(wh):
    resolved = {"run_id": "r0", "warehouse": wh.root}
    _hand_on(wh, "r0")  # r0 is the first: no baseline
    handed = handoff.handed_on_comparison(wh, "r0")
    assert handed is not None and handed.baseline is None and handed.rows == []
    assert matrix.regressions(resolved, {"run_id": "r0"})["baseline_run_id"] is None


def test_a_run_land_handed_nothing_gets_its_page_from_the_one_maker(wh, monkeypatch):
    """A run landed before comparisons were handed on (or by another path): `report` finds
    nothing to take and its page is compared by analysis.compare, once."""
    calls = []
    real = compare.comparison_for_run
    monkeypatch.setattr(
        compare, "comparison_for_run", lambda *a, **k: calls.append(a[1]) or real(*a, **k)
    )
    assert handoff.handed_on_comparison(wh, "r2") is None
    paths = matrix.report({"run_id": "r2", "warehouse": wh.root}, {"run_id": "r2"})
    assert "Change against baseline r1" in Path(paths["md"]).read_text()
    assert calls == ["r2"]
