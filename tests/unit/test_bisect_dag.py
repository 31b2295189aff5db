"""speed_matrix_bisect: its task bodies driven step by step against a warehouse (each step's
speed_matrix run stood in for by landing the regressed cells at that commit), and the DAG file
itself (imports, unrolled steps, params)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from factories import decode_cell, prefill_cell, run_row

from speedmatrix.flows.bisect_steps import (
    MAX_STEPS,
    choose_step,
    conclude_job,
    judge_step,
    prepare_job,
)
from speedmatrix.store.warehouse import Warehouse

RECIPE = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
COMMITS = [f"{i:040x}" for i in range(1, 34)]  # 33 commits: good is 0, bad is the last
GOOD = f"{0:040x}"
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def _land(wh, run_id, commit, when, slow):
    """What one speed_matrix run leaves in the warehouse: the run and the asked-for cells."""
    run = run_row(
        run_id, recipe_id=RECIPE, engine_commit=commit, engine_ref=commit, started_at=when
    )
    total = 81.0 * (0.9 if slow else 1.0)
    cells = [
        prefill_cell(65536, total_tok_s=5176.0, ttft_ms=12661.0),
        decode_cell(
            65536,
            2,
            total_tok_s=total,
            per_request_tok_s=total / 2,
            tbt_ms=2000.0 / total,
            ttft_ms=480.0,
            measured_s=30.0,
        ),
    ]
    wh.land_run(run, cells, [])


@pytest.mark.parametrize("planted", [0, 17, 32])
def test_bisection_job_finds_the_planted_commit_step_by_step(tmp_path, planted):
    from airflow.models.dagrun import DagRun

    wh = Warehouse(str(tmp_path / "wh"))
    _land(wh, "good", GOOD, T0, slow=False)
    no_wheel = {COMMITS[5]}
    job = prepare_job(
        {
            "recipe": RECIPE,
            "good": GOOD,
            "bad": COMMITS[-1],
            "cells": ["64Kx2"],
            "commits": COMMITS,
            "warehouse": wh.root,
            "window_s": 10,
        },
        has_wheel=lambda c: c not in no_wheel,
    )
    assert job["good_run_id"] == "good" and job["threshold"] == pytest.approx(0.03)
    jobs, steps = [job], 0
    while (chosen := choose_step(jobs[-1], steps, salt="run-1")) is not None:
        commit = chosen["commit"]
        assert commit not in no_wheel
        conf = chosen["conf"]
        assert conf["engine_ref"] == commit and conf["recipe"] == RECIPE
        assert conf["contexts"] == ["64K"] and conf["concurrencies"] == [2]
        assert conf["prefill_contexts"] == ["64K"] and conf["window_s"] == 10
        assert None not in conf.values()
        assert (
            chosen["trigger_run_id"].startswith("bisect__")
            and commit[:12] in chosen["trigger_run_id"]
        )
        # The id Airflow will be asked to create: its own check (no "..", allowed characters).
        assert DagRun(dag_id="speed_matrix", run_id=chosen["trigger_run_id"]).run_id
        _land(
            wh,
            f"step-{steps}",
            commit,
            T0 + timedelta(hours=steps + 1),
            slow=COMMITS.index(commit) >= planted,
        )
        jobs.append(judge_step(chosen, wh))
        steps += 1
    assert steps <= 5 <= MAX_STEPS  # ceil(log2(32 commits with wheels))
    result = conclude_job([*jobs, None])
    assert result["first_bad"] == COMMITS[planted]
    assert COMMITS[planted][:12] in result["summary"]
    wh.close()


def test_a_step_whose_run_did_not_land_is_skipped(tmp_path):
    wh = Warehouse(str(tmp_path / "wh"))
    _land(wh, "good", GOOD, T0, slow=False)
    job = prepare_job(
        {
            "recipe": RECIPE,
            "good": GOOD,
            "bad": COMMITS[3],
            "cells": ["64Kx2"],
            "commits": COMMITS[:4],
            "warehouse": wh.root,
        },
        has_wheel=lambda c: True,
    )
    chosen = choose_step(job, 0)
    job = judge_step(chosen, wh)  # nothing landed for it
    assert job["state"]["skipped"] == [chosen["commit"]]
    with pytest.raises(RuntimeError, match="not finished"):
        conclude_job([job])
    wh.close()


def test_prepare_refuses_bad_params(tmp_path):
    wh = Warehouse(str(tmp_path / "wh"))
    base = {
        "recipe": RECIPE,
        "good": GOOD,
        "bad": COMMITS[-1],
        "cells": ["64Kx2"],
        "commits": COMMITS,
        "warehouse": wh.root,
    }
    with pytest.raises(ValueError, match="no successful run"):
        prepare_job(base, has_wheel=lambda c: True)
    _land(wh, "good", GOOD, T0, slow=False)
    with pytest.raises(ValueError, match="end with the bad commit"):
        prepare_job({**base, "commits": COMMITS[:-1]}, has_wheel=lambda c: True)
    with pytest.raises(ValueError, match="not a cell"):
        prepare_job({**base, "cells": ["64K by 2"]}, has_wheel=lambda c: True)
    with pytest.raises(ValueError, match="at least one"):
        prepare_job({**base, "cells": []}, has_wheel=lambda c: True)
    wh.close()


def test_the_dag_file_imports_with_unrolled_steps():
    from airflow.dag_processing.dagbag import DagBag

    path = Path(__file__).resolve().parents[2] / "dags" / "speed_matrix_bisect.py"
    bag = DagBag(dag_folder=str(path))
    assert bag.import_errors == {}
    dag = bag.dags["speed_matrix_bisect"]
    ids = set(dag.task_ids)
    assert {"prepare", "conclude"} <= ids
    for i in range(MAX_STEPS):
        assert {f"choose_{i}", f"measure_{i}", f"judge_{i}"} <= ids
    measure = dag.get_task("measure_3")
    assert measure.trigger_dag_id == "speed_matrix" and measure.wait_for_completion
    # The triggerer waits out the run; a failed run ends the wait without failing the step.
    assert measure.deferrable
    assert set(measure.allowed_states) == {"success", "failed"} and measure.failed_states == []
    assert dag.get_task("judge_3").upstream_task_ids == {"choose_3", "measure_3"}
    assert dag.get_task("choose_4").upstream_task_ids == {"judge_3"}
    assert {"prepare", f"judge_{MAX_STEPS - 1}"} <= dag.get_task("conclude").upstream_task_ids
    assert set(dag.params) >= {"recipe", "good", "bad", "cells", "commits"}


def test_commits_between_reads_the_compare_api(monkeypatch):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from speedmatrix.upstream.github_commits import commits_between

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            body = json.dumps({"commits": [{"sha": c} for c in COMMITS[:3]]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        # the API is the deployment's setting, never an argument a conf could fill
        monkeypatch.setenv("SPEEDMATRIX_GITHUB_API_URL", f"http://127.0.0.1:{server.server_port}")
        assert commits_between("vllm-project/vllm", GOOD, COMMITS[2]) == COMMITS[:3]
        assert seen == [f"/repos/vllm-project/vllm/compare/{GOOD}...{COMMITS[2]}"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_sim_recipe_has_every_commit_without_asking_the_network(tmp_path, monkeypatch):
    """The simulator installs nothing, so no commit is skipped for want of a wheel, and
    bisecting it needs no wheel index (nor any network)."""
    import requests

    from speedmatrix.flows.bisect_steps import wheel_check
    from speedmatrix.recipes import load_recipe

    def no_network(*args, **kwargs):
        raise AssertionError(f"network asked: {args}")

    monkeypatch.setattr(requests, "head", no_network)
    monkeypatch.setattr(requests, "get", no_network)
    assert load_recipe(RECIPE).engine.install.kind == "sim"
    has_wheel = wheel_check(load_recipe(RECIPE))
    assert all(has_wheel(c) for c in COMMITS)
    wh = Warehouse(str(tmp_path / "wh"))
    _land(wh, "good", GOOD, T0, slow=False)
    job = prepare_job(
        {
            "recipe": RECIPE,
            "good": GOOD,
            "bad": COMMITS[-1],
            "cells": ["64Kx2"],
            "commits": COMMITS,
            "warehouse": wh.root,
        }
    )
    assert job["state"]["no_wheel"] == [] and job["state"]["candidates"] == COMMITS
    wh.close()


def test_a_bisect_conf_cannot_choose_the_github_api(monkeypatch):
    """prepare_job refuses an api_url (it used to take one): the compare API's answer picks
    the commits measured, so it comes from the deployment only (issue #16 item 1)."""
    import speedmatrix.flows.bisect_steps as bisection

    def no_network(*args, **kwargs):
        raise AssertionError("GitHub asked")

    monkeypatch.setattr(bisection, "commits_between", no_network)
    params = {"recipe": RECIPE, "good": GOOD, "bad": COMMITS[2], "cells": ["8Kx1"]}
    with pytest.raises(ValueError, match="api_url"):
        bisection.prepare_job({**params, "api_url": "http://127.0.0.1:9"})
