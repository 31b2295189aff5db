"""speed_matrix end to end through Airflow (dag.test) on the `local` host, simulated engine.

Each run is `python -m speedmatrix.cli.demo --conf … --result-json …` in a subprocess (the code
path `make demo` uses) with a private HOME, so the host lease and the server state directory
belong to the test. The matrix is small and the windows short: what is checked is the pipeline
(plan, over capacity, mapped cells, validation, landing, report, teardown), not the numbers.
"""

from __future__ import annotations

import html
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import time
from pathlib import Path

import pytest
from alert_catchers import MAIL_TO, start_catchers
from speed_matrix_helpers import (
    KEY,
    finish,
    free_port,
    no_server_left,
    outcome,
    start_run,
    wait_for_line,
)

from speedmatrix.flows.contracts import INFO, LANDING, PLAN, SERVER
from speedmatrix.report.site import run_page
from speedmatrix.store.extra import read_extra
from speedmatrix.store.warehouse import Warehouse

# six DAG runs, an Airflow process each (~4 min of one worker): started first in its phase
pytestmark = [pytest.mark.integration, pytest.mark.long]

# 8K and 16K at C = 1, 2 fit the calibrated KV cache (16,498 blocks of 16); C = 32 does not.
CONF = {
    "recipe": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8",
    "prefill_contexts": ["8K"],
    "contexts": ["8K", "16K"],
    "concurrencies": [1, 2, 32],
    "window_s": 2,
    "max_output_tokens": 512,  # no stream finishes inside a 2 s window: C stays in flight
}


@pytest.fixture(scope="module")
def migrated(airflow_db: Path) -> Path:
    """The session's migrated Airflow home, marked so the demo does not migrate it again."""
    import airflow

    (airflow_db / f".migrated-{airflow.__version__}").write_text("ok\n")
    return airflow_db


@pytest.fixture(scope="module")
def catchers():
    """A real SMTP server and a chat-webhook catcher on loopback, for the whole module."""
    c, stop = start_catchers()
    yield c
    stop()


@pytest.fixture
def alerts(catchers, monkeypatch):
    """The deployment's alert settings point at the catchers (the run's subprocess inherits
    this environment: the settings are the deployment's, never the conf)."""
    for key, value in catchers.env().items():
        monkeypatch.setenv(key, value)
    catchers.clear()
    return catchers


def assert_one_alert(alerts, *needles: str) -> str:
    """One mail to the configured recipient and one webhook post, both saying `needles`."""
    assert len(alerts.inbox.messages) == 1, alerts.mail_bodies()
    assert len(alerts.posts) == 1, alerts.posts
    mail = alerts.inbox.messages[0]
    assert alerts.inbox.envelopes[0][1] == [MAIL_TO]
    body = html.unescape(alerts.mail_bodies()[0])  # the mail is HTML
    post = alerts.posts[0]
    assert post["content_type"].startswith("application/json")
    text = html.unescape(post["json"]["text"])  # Slack's mrkdwn escapes & < > (issue #33)
    for needle in needles:
        assert needle in body and needle in text, (needle, text)
    assert mail["Subject"].startswith("[speedmatrix]")
    return text


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


# A manual KV budget of 32K tokens (2,048 blocks of 16, 2,047 usable) in place of the
# server's 16,498 blocks: 16K x 2 needs 2 x ceil((16,384 + 512) / 16) = 2,112 blocks, so the
# budget, not the server, puts it over capacity; 8K x 2 (1,088) and 16K x 1 (1,056) still run.
KV_BUDGET = "32K"


def test_speed_matrix_against_simulator_through_local(migrated, tmp_path, home, alerts):
    # and a burst of 2 requests at once at each context (issue #43 item 12): 8K's runs, 16K's
    # is over the budget as 16K x 2 is
    conf = {**CONF, "port": free_port(), "kv_budget": KV_BUDGET, "burst": [2]}
    proc, log, result = start_run(tmp_path, home, migrated, conf, "run")
    finish(proc)
    out = outcome(result)
    assert out["state"] == "success", log.read_text()[-4000:]
    tasks = out["tasks"]
    # readable map indexes, one mapped task per runnable cell; over-capacity cells not run
    assert {k for k in tasks if k.startswith("decode[")} == {
        "decode[8K x 1]",
        "decode[8K x 2]",
        "decode[16K x 1]",
        "decode[burst 8K x 2]",
    }
    assert "prefill[8K]" in tasks
    assert tasks["stop_server"]["state"] == "success"
    # Each cell task read the state of the one before it through the real execution API
    # (flows/turn.py): under dag.test, one at a time, that state is finished or not started,
    # never unknown (a key the API does not answer would read None and void the turn).
    turns = out["turns"]
    assert set(turns) == {k for k in tasks if k.startswith(("prefill[", "decode["))}
    firsts = [k for k, t in turns.items() if t["after"] is None]
    assert firsts == ["prefill[8K]"], turns
    # decode's first cell follows prefill's last one, another task's instance (#19)
    assert turns["decode[8K x 1]"]["after"] == "prefill[0]", turns
    for key, t in turns.items():
        if t["after"] is not None:
            assert t["state"] in ("scheduled", "success"), (key, t)
        assert t["began"] <= t["ended"]
        # ...and said it had left the host once its turn ended, through the real execution
        # API (an XCom of this run's clear_number; the next cell reads it while this one runs)
        assert t["released"]["clear_number"] == 0 and t["released"]["at"] >= t["ended"], t
    # landing emitted one Asset event per table, saying which run landed; `verdicts` one for
    # comparisons and noise once `regressions` had landed them
    events = {e["uri"]: e["extra"] for e in out["asset_events"]}
    tables = ("runs", "cells", "requests", "comparisons", "noise")
    assert set(events) == {f"speedmatrix://warehouse/{t}" for t in tables}
    assert {e["run_id"] for e in events.values()} == {out["xcom"]["resolve"]["run_id"]}

    run_id = out["xcom"]["resolve"]["run_id"]
    # the hand-offs crossed XCom as plain JSON and read back whole through their contracts
    xcom = out["xcom"]
    assert SERVER.from_wire(xcom["setup_server"])["base_url"].startswith("http://127.0.0.1:")
    assert INFO.from_wire(xcom["inspect"])["kv_block_size"] == 16
    assert len(PLAN.from_wire(xcom["plan"])["over_capacity"]) == 4
    assert LANDING.from_wire(xcom["land"])["run_id"] == run_id
    wh = Warehouse(os.environ["SPEEDMATRIX_WAREHOUSE"])
    run, cells, requests = wh.read_run(run_id)
    assert run["status"] == "success"
    assert "<redacted>" in run["launch_command"] and KEY not in run["launch_command"]
    # the manual budget is recorded with the run beside the server's own capacity...
    assert run["kv_budget_tokens"] == 32768
    assert (run["kv_num_blocks"], run["kv_block_size"]) == (16498, 16)
    by_cell = {(c["phase"], c["context_label"], c["concurrency"]): c for c in cells}
    assert by_cell[("prefill", "8K", 1)]["status"] == "valid"
    # ...and the over-capacity rule used it: 16K x 2 fits the server, not the budget
    over = by_cell[("decode", "16K", 2)]
    assert over["status"] == "over_capacity" and over["output_tokens"] is None
    assert "2112 KV blocks > 2047 available" in over["error"], over["error"]
    for ctx, c in (("8K", 1), ("8K", 2), ("16K", 1)):
        assert by_cell[("decode", ctx, c)]["status"] == "valid", by_cell[("decode", ctx, c)]
    # the burst: its own cell, measured to completion, landed through the cells suite
    burst = by_cell[("burst", "8K", 2)]
    assert burst["status"] == "valid", burst["error"]
    assert (burst["completed_requests"], burst["output_tokens"]) == (2, 2 * 512)
    assert burst["window_s"] is None
    assert burst["latency_ms"] > burst["ttft_ms"] > 0 and burst["e2e_per_request_tok_s"] > 0
    assert by_cell[("burst", "16K", 2)]["status"] == "over_capacity"
    assert sum(1 for r in requests if r["phase"] == "burst") == 2
    for ctx in ("8K", "16K"):
        assert by_cell[("decode", ctx, 32)]["status"] == "over_capacity"
        assert by_cell[("decode", ctx, 32)]["output_tokens"] is None
    assert len(cells) == 9
    assert requests and not any(r["concurrency"] == 32 for r in requests)
    assert not any((r["context_tokens"], r["concurrency"]) == (16384, 2) for r in requests)
    # the conf's window (window_s, its one name) reached both tables through Airflow's Params
    assert run["window_s"] == by_cell[("decode", "8K", 1)]["window_s"] == CONF["window_s"]

    gx = json.loads(wh.read_artifact(run_id, "validation/gx-results.json"))
    assert gx["cells"]["gx"]["success"] is True and gx["runs"]["gx"]["success"] is True
    report_md = Path(out["xcom"]["report"]["md"]).read_text()
    assert "Over capacity" in report_md and "## Sustained decode" in report_md
    assert "## Burst / E2E decode" in report_md
    assert Path(out["xcom"]["report"]["html"]).stat().st_size > 1000
    assert f"report: {out['xcom']['report']['md']}" in log.read_text()  # the log says where
    assert KEY not in log.read_text()
    # the site was refreshed after the run, and the task links to the run's page on it
    assert tasks["site"]["state"] == "success"
    site = out["xcom"]["site"]
    page = Path(site["site"]) / run_page(run_id)
    assert page.exists() and run_id in (Path(site["site"]) / "index.html").read_text()
    assert out["links"]["site"]["_link_SiteLink"] == page.resolve().as_uri() == site["url"]
    # a clean run: mail and webhook switched on, and nothing sent
    assert alerts.inbox.messages == [] and alerts.posts == []
    no_server_left(home)


def test_repeated_cell_lands_in_cell_repeats_and_gives_its_own_noise(migrated, tmp_path, home):
    """repeats = 2 on one decode cell, in one DAG run: the primary in cells, the repeat (its
    own mapped decode task) in cell_repeats, and the noise table's between-run spread of that
    cell from this run alone. The first context has no prefill cell, so `prefill` (the prefill
    cells at the head of the run order) maps nothing and is skipped, and `decode` (its sibling:
    its first cell has no prefill cell to wait for) runs all the same, 16K's prefill cell among
    them."""
    wh_root = tmp_path / "wh"  # no baseline from the other tests' runs
    conf = {
        **CONF,
        "prefill_contexts": ["16K"],
        "contexts": ["8K", "16K"],
        "concurrencies": [1],
        "repeats": 4,
        "repeat_cells": ["8Kx1"],
        "warehouse": str(wh_root),
        "port": free_port(),
        # the DAG carries adaptive windows to every decode cell (issue #45); a minimum equal to
        # the 2 s cap keeps this test's windows, and so its figures, what they were
        "adaptive": True,
        "adaptive_min_s": 2,
    }
    proc, log, result = start_run(tmp_path, home, migrated, conf, "repeats")
    finish(proc)
    out = outcome(result)
    assert out["state"] == "success", log.read_text()[-4000:]
    tasks = out["tasks"]
    assert {k for k in tasks if k.startswith("decode[")} == {
        "decode[8K x 1]",
        "decode[prefill 16K]",
        "decode[16K x 1]",
        "decode[8K x 1 #2]",
        "decode[8K x 1 #3]",
        "decode[8K x 1 #4]",
    }
    assert not any(k.startswith("prefill[") for k in tasks), tasks
    assert tasks["prefill"]["state"] == "skipped", tasks
    # (the order of the mapped cells is the scheduler's, by map index: dag.test runs them
    # in set order, so when the repeat ran is not checked here; plan.py's tests check the order)
    assert tasks["regressions"]["state"] == "success"

    run_id = out["xcom"]["resolve"]["run_id"]
    wh = Warehouse(str(wh_root))
    _, landed, _ = wh.read_run(run_id)
    cells = [(c["phase"], c["context_label"], c["concurrency"], c["status"]) for c in landed]
    assert sorted(cells) == [
        ("decode", "16K", 1, "valid"),
        ("decode", "8K", 1, "valid"),
        ("prefill", "16K", 1, "valid"),
    ], [c["error"] for c in landed]
    run = wh.read_run(run_id)[0]
    assert run["decode_test"] == "Adaptive duration"
    decode_cells = [c for c in landed if c["phase"] == "decode"]
    assert {c["window_mode"] for c in decode_cells} == {"adaptive"}
    assert {c["window_stop"] for c in decode_cells} <= {"cap_not_converged", "cap_not_steady"}
    repeats = read_extra(wh, "cell_repeats", run_id=run_id)
    assert sorted(repeats[["phase", "concurrency", "repeat", "status"]].values.tolist()) == [
        ["decode", 1, k, "valid"] for k in (1, 2, 3)
    ]
    noise = read_extra(wh, "noise", run_id=run_id)
    decode = noise[(noise["phase"] == "decode") & (noise["metric"] == "total_tok_s")]
    row = decode[decode["context_tokens"] == 8192]
    assert row["between_source"].tolist() == ["cell"]
    # the robust spread of this cell's four measurements (the primary and its repeats, in
    # the order they were made), as the noise model defines it (issue #40): 1.4826 x the
    # median absolute log difference of consecutive measurements, over sqrt(2)
    primary = next(
        c["total_tok_s"]
        for c in landed
        if (c["phase"], c["context_tokens"], c["concurrency"]) == ("decode", 8192, 1)
    )
    series = [primary, *repeats.sort_values("repeat")["total_tok_s"].tolist()]
    diffs = [abs(math.log(b / a)) for a, b in itertools.pairwise(series)]
    expected = 1.482602218505602 * statistics.median(diffs) / math.sqrt(2)
    assert row["between_rel_sd"].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    no_server_left(home)


def test_server_killed_mid_run_lands_measured_cells_and_fails_fast(
    migrated, tmp_path, home, alerts
):
    conf = {**CONF, "concurrencies": [1, 2], "port": free_port()}
    proc, log, result = start_run(tmp_path, home, migrated, conf, "killed")
    try:
        # dag.test() runs the mapped decode cells in no fixed order (seen: 8K x 1 last, so a
        # kill after it hit no cell): kill after the first decode cell that came out valid
        wait_for_line(log, r"cell \d+K x \d+: valid", proc)
        pid_file = home / ".speedmatrix" / "servers" / str(conf["port"]) / "pid"
        pgid = int(pid_file.read_text().split()[0])
        os.killpg(pgid, signal.SIGKILL)
        killed_at = time.monotonic()
        finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    after_kill_s = time.monotonic() - killed_at
    out = outcome(result)
    assert out["state"] == "failed"
    tasks = out["tasks"]
    assert tasks["conclude"]["state"] == "failed"
    assert tasks["land"]["state"] == "success" and tasks["stop_server"]["state"] == "success"

    run_id = out["xcom"]["resolve"]["run_id"]
    run, cells, _ = Warehouse(os.environ["SPEEDMATRIX_WAREHOUSE"]).read_run(run_id)
    assert run["status"] == "failed"
    by_cell = {(c["phase"], c["context_label"], c["concurrency"]): c for c in cells}
    assert by_cell[("prefill", "8K", 1)]["status"] == "valid"
    decode = {
        k: c for k, c in by_cell.items() if k[0] == "decode" and c["status"] != "over_capacity"
    }
    assert len(decode) == 4
    valid = [k for k, c in decode.items() if c["status"] == "valid"]
    refused = [k for k, c in decode.items() if c["status"] == "failed"]
    assert valid, decode  # the one measured before the kill (and any that raced it)
    assert len(valid) + len(refused) == 4
    # one cell at most raced the kill (it was running when the server died); every cell that
    # started after it was refused by the health check, in seconds, and says why
    healthy_refusals = [
        k for k in refused if "server not healthy before the cell" in decode[k]["error"]
    ]
    assert len(healthy_refusals) >= len(refused) - 1 and healthy_refusals, decode
    for _phase, label, conc in healthy_refusals:
        assert tasks[f"decode[{label} x {conc}]"]["duration_s"] < 20, tasks
    assert after_kill_s < 300
    # the failed run was announced by mail and webhook: its cells and the page's link
    bad = healthy_refusals[0]
    text = assert_one_alert(
        alerts,
        "run failed",
        run_id,
        "status failed",
        f"{bad[1]}x{bad[2]} failed: server not healthy before the cell",
        "https://perf.example.test/artifacts/",
    )
    assert "/report.html" in text
    no_server_left(home)


def test_two_runs_for_one_host_are_serialised_by_the_lease(migrated, tmp_path, home):
    # Two independent Airflow installations (own metadata DBs: as two workers would be), one
    # host (same HOME, so the same lease file), started together: whichever takes the lease
    # first, the other must wait until the first one's teardown released it.
    other = tmp_path / "airflow-b"
    shutil.copytree(migrated, other)
    small = {**CONF, "prefill_contexts": ["8K", "16K"], "contexts": ["8K"], "window_s": 5}
    small["concurrencies"] = [1, 2]
    a, log_a, res_a = start_run(tmp_path, home, migrated, {**small, "port": free_port()}, "a")
    b, log_b, res_b = start_run(tmp_path, home, other, {**small, "port": free_port()}, "b")
    try:
        finish(a, timeout=900)
        finish(b, timeout=900)
    finally:
        for p in (a, b):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    runs = [(outcome(res_a), log_a), (outcome(res_b), log_b)]
    for out, log in runs:
        assert out["state"] == "success", log.read_text()[-3000:]
    # order by who started its server first
    (first, _), (second, second_log) = sorted(
        runs, key=lambda r: r[0]["tasks"]["setup_server"]["start"]
    )
    holder_first = "speed_matrix/" + first["dag_run_id"]
    assert f"held by {holder_first}" in second_log.read_text()  # it found the host taken
    assert second["tasks"]["wait_for_host"]["state"] == "success"
    first_end = first["tasks"]["stop_server"]["end"]
    second_start = second["tasks"]["setup_server"]["start"]
    assert first_end <= second_start, (
        f"first held the host until {first_end}, second began {second_start}"
    )
    no_server_left(home)


def test_unknown_recipe_fails_in_resolve_before_touching_the_host(migrated, tmp_path, home, alerts):
    conf = {"recipe": "no/such/recipe", "port": free_port()}
    proc, log, result = start_run(tmp_path, home, migrated, conf, "bad")
    finish(proc)
    out = outcome(result)
    assert out["state"] == "failed"
    tasks = out["tasks"]
    assert tasks["resolve"]["state"] == "failed"
    assert tasks["setup_server"]["state"] == "upstream_failed"
    assert "recipe 'no/such/recipe' cannot be used" in log.read_text()
    assert not (home / ".speedmatrix").exists()  # no lease taken, no server state written
    # a run that failed before it measured anything is announced too, with the reason
    assert_one_alert(alerts, "run failed", "recipe 'no/such/recipe' cannot be used")


def test_a_regression_alerts_by_mail_and_webhook_and_emits_the_verdict_assets(
    migrated, tmp_path, home, alerts
):
    """A planted regression (the baseline in the warehouse is far faster than the simulator):
    `regressions` fails the run, the alert names the regressed cell with its figures, the
    baseline and the page; the verdict Assets are emitted all the same."""
    from datetime import UTC, datetime, timedelta

    from speedmatrix.records import empty_cell

    wh_root = tmp_path / "wh"
    recipe = CONF["recipe"]
    wh = Warehouse(str(wh_root))
    baseline = {
        "run_id": "planted-baseline",
        "recipe_id": recipe,
        "trigger": "manual",
        "status": "success",
        "host": "local",
        "engine_commit": "0" * 40,
        "started_at": datetime.now(UTC) - timedelta(days=1),
    }
    fast = empty_cell(
        phase="decode",
        context_tokens=8192,
        context_label="8K",
        concurrency=1,
        status="valid",
        workload="article",  # cells of another workload are never compared
        total_tok_s=1.0e6,
        per_request_tok_s=1.0e6,
        tbt_ms=0.001,
        ttft_ms=1.0,
        measured_s=2.0,
    )
    # four planted runs (the last is the baseline): a history whose noise is known, else the
    # verdict is "unverified" and never gates (issue #40)
    for i, f in enumerate((1.01, 0.99, 1.005)):
        earlier = {
            **baseline,
            "run_id": f"planted-{i}",
            "started_at": baseline["started_at"] - timedelta(hours=3 - i),
        }
        wh.land_run(
            earlier,
            [
                {
                    **fast,
                    "total_tok_s": 1.0e6 * f,
                    "per_request_tok_s": 1.0e6 * f,
                    "tbt_ms": 0.001 / f,
                }
            ],
            [],
        )
    wh.land_run(baseline, [fast], [])
    wh.close()
    conf = {
        **CONF,
        "contexts": ["8K"],
        "concurrencies": [1],
        "warehouse": str(wh_root),
        "port": free_port(),
    }
    proc, log, result = start_run(tmp_path, home, migrated, conf, "regressed")
    finish(proc)
    out = outcome(result)
    assert out["state"] == "failed", log.read_text()[-4000:]
    tasks = out["tasks"]
    assert tasks["regressions"]["state"] == "failed"
    assert tasks["conclude"]["state"] == "success"
    assert tasks["verdicts"]["state"] == "success"
    run_id = out["xcom"]["resolve"]["run_id"]
    # the site runs after a regression too, and its run page shows it
    assert tasks["site"]["state"] == "success"
    site_page = Path(out["xcom"]["site"]["site"]) / run_page(run_id)
    assert "regression" in site_page.read_text()
    assert out["links"]["site"]["_link_SiteLink"] == out["xcom"]["site"]["url"]
    events = {e["uri"]: e["extra"] for e in out["asset_events"]}
    verdict = events["speedmatrix://warehouse/comparisons"]
    assert verdict["run_id"] == run_id and verdict["baseline_run_id"] == "planted-baseline"
    assert verdict["regressions"] >= 1
    assert events["speedmatrix://warehouse/noise"]["run_id"] == run_id

    text = assert_one_alert(
        alerts,
        " regression",  # "1 regression" or "N regressions"
        run_id,
        "Baseline: run planted-baseline",
        "8Kx1 total_tok_s: 1,000,000 -> ",
        "https://perf.example.test/artifacts/",
    )
    assert "Regressions (" in text and "%)" in text
    no_server_left(home)
