"""Task bodies without Airflow or a server: resolve, cell bookkeeping, run row, status."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from speedmatrix.flows import collect, matrix, resolution
from speedmatrix.flows.resolution import ResolveError
from speedmatrix.recipes import load_recipe_id

WHEN = dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC)
SIM = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
CPU = "cpu/tiny/llama-tiny"


def resolve(conf, run_id="manual__2026-11-29T20:30:05+00:00"):
    return resolution.resolve(conf, dag_run_id=run_id, run_after=WHEN)


def test_two_dag_runs_in_one_second_get_two_run_ids_and_one_run_keeps_its_own():
    """A fleet's script triggers one recipe on several hosts at once: runs that start in the
    same second are still apart (each landing would otherwise replace the one before), and
    the same DAG run (a retried task) gets its id again."""
    a = resolve({"recipe": SIM}, run_id="manual__2026-11-29T20:30:05.120+00:00")
    b = resolve({"recipe": SIM}, run_id="manual__2026-11-29T20:30:05.480+00:00")
    assert a["run_id"] != b["run_id"]
    assert a["run_id"].rsplit("__", 1)[0] == b["run_id"].rsplit("__", 1)[0]
    assert (
        resolve({"recipe": SIM}, run_id="manual__2026-11-29T20:30:05.120+00:00")["run_id"]
        == a["run_id"]
    )


def test_resolve_uses_recipe_defaults_and_makes_readable_stable_ids():
    r = resolve({"recipe": SIM})
    assert r["run_id"].startswith(
        "sim~kimi-k2.7-nvfp4-rtxpro6k-x8__9fedd24fa864__manual__20261129T203005Z__"
    )
    assert r == resolve({"recipe": SIM}) | {"started_at": r["started_at"]}  # stable
    assert r["trigger"] == "manual"
    assert r["host"] == "local"
    assert r["matrix"]["contexts"][0] == 8192
    assert r["matrix"]["concurrencies"] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert r["matrix"]["window_s"] == 30.0
    assert r["served_model"] == "Kimi-K2.7-Code-NVFP4"
    assert r["holder"] == "speed_matrix/manual__2026-11-29T20:30:05+00:00"


def test_resolve_applies_overrides_and_trigger_from_run_id():
    r = resolve(
        {
            "recipe": CPU,
            "engine_ref": "main",
            "contexts": ["1K", 256],
            "concurrencies": [2],
            "prefill_contexts": [512],
            "window_s": 2,
            "max_output_tokens": 16,
            "prompt_mode": "shared",
            "workload": "continuation",
            "ssh_conn_id": "gpu7",
            "warehouse": "/tmp/wh",
        },
        run_id="nightly__cpu~tiny~llama-tiny__2026-11-29",
    )
    assert r["trigger"] == "nightly"
    assert r["run_id"].startswith("cpu~tiny~llama-tiny__main__nightly__")
    assert r["matrix"] == {
        "prefill_contexts": [512],
        "contexts": [1024, 256],
        "concurrencies": [2],
        "max_output_tokens": 16,
        "window_s": 2.0,
        "prompt_mode": "shared",
        "workload": "continuation",
        "measurement_profile": "default",
        # the recipe's (none set): the server's own KV capacity, fixed windows
        "kv_budget": None,
        "burst": [],
        "adaptive": False,
        "adaptive_min_s": load_recipe_id(CPU).matrix.adaptive_min_s,
        "adaptive_target_pct": 1.0,
    }
    assert (r["host"], r["warehouse"]) == ("gpu7", "/tmp/wh")
    # the recipe's workload (article) unless the conf says otherwise
    assert resolve({"recipe": CPU}, run_id="manual__x")["matrix"]["workload"] == "article"
    assert resolution.trigger_of("commit__x__abc") == "commit"
    # the measurement profile (issue #35): the recipe's matrix.profile unless the conf says
    published = resolve({"recipe": CPU, "measurement_profile": "published"}, run_id="manual__y")
    assert published["matrix"]["measurement_profile"] == "published"


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({}, "must name a recipe"),
        ({"recipe": "no/such/recipe"}, "'no/such/recipe' cannot be used"),
        ({"recipe": SIM, "engine_ref": "banana"}, "engine ref 'banana'"),
        ({"recipe": CPU, "contexts": [4096]}, "exceed the model's max_model_len 2048"),
        ({"recipe": CPU, "concurrencies": [0]}, "concurrencies must be positive"),
        ({"recipe": CPU, "window_s": -1}, "window_s must be > 0"),
        ({"recipe": CPU, "contexts": ["64M"]}, "not a token count"),
        ({"recipe": CPU, "workload": "poetry"}, "workload must be one of"),
    ],
)
def test_bad_conf_fails_in_resolve_with_a_clear_message(conf, message):
    with pytest.raises(ResolveError, match=message):
        resolve(conf)


PLANNED = {
    "prefill": [
        {
            "phase": "prefill",
            "context_tokens": 512,
            "concurrency": 1,
            "label": "512",
            "max_output_tokens": 1,
            "window_s": None,
            "prompt_mode": None,
        },
    ],
    "decode": [
        {
            "phase": "decode",
            "context_tokens": 512,
            "concurrency": c,
            "label": f"512 x {c}",
            "max_output_tokens": 16,
            "window_s": 2.0,
            "prompt_mode": "distinct",
        }
        for c in (1, 2)
    ],
    "over_capacity": [
        collect.failed_cell({"phase": "decode", "context_tokens": 512, "concurrency": 64}, "x")
        | {"status": "over_capacity"}
    ],
}


def test_collect_cells_keeps_every_planned_cell_once_in_report_order():
    measured = collect.failed_cell(PLANNED["decode"][1], "stream disconnected")
    cells, requests = collect.collect_cells(
        PLANNED, [{"cell": measured, "requests": [{"phase": "decode", "x": 1}]}, None]
    )
    assert [(c["phase"], c["concurrency"], c["status"]) for c in cells] == [
        ("prefill", 1, "failed"),
        ("decode", 1, "failed"),
        ("decode", 2, "failed"),
        ("decode", 64, "over_capacity"),
    ]
    assert cells[0]["error"] == "the cell's task ended without a result"
    assert cells[2]["error"] == "stream disconnected"
    assert len(requests) == 1


def test_the_workload_reaches_every_cell_and_the_load_generator(monkeypatch):
    """conf -> resolved matrix -> planned cells -> loader config (local) and zipapp flag
    (remote) -> the run row; a failed cell still says which workload it was."""
    from speedmatrix.plan import KvCapacity, MatrixSpec, plan_matrix

    monkeypatch.delenv("SPEEDMATRIX_API_KEY", raising=False)
    r = resolve({"recipe": CPU, "workload": "continuation", "ssh_conn_id": "gpu7"})
    spec = MatrixSpec.build(
        prefill_contexts=r["matrix"]["prefill_contexts"],
        contexts=r["matrix"]["contexts"],
        concurrencies=r["matrix"]["concurrencies"],
        max_output_tokens=r["matrix"]["max_output_tokens"],
        window_s=r["matrix"]["window_s"],
        workload=r["matrix"]["workload"],
    )
    planned = plan_matrix(spec, KvCapacity(num_blocks=160, block_size=16)).as_dict()
    cells = planned["prefill"] + planned["decode"] + planned["over_capacity"]
    assert cells and {c["workload"] for c in cells} == {"continuation"}
    server = {"base_url": "http://127.0.0.1:9", "loadgen": "/x/loadgen.pyz"}
    cfg = matrix._loadgen_config(r, server, planned["decode"][0])
    assert cfg.workload == "continuation"
    assert collect.failed_cell(planned["decode"][0], "x")["workload"] == "continuation"
    sent: list[str] = []

    class FakeHost:
        def run(self, cmd, **kw):
            sent.append(cmd)
            raise RuntimeError("stop here")

    monkeypatch.setattr(matrix, "host_of", lambda resolved: FakeHost())
    with pytest.raises(RuntimeError, match="stop here"):
        matrix._measure_remote(r, server, planned["decode"][0], cfg)
    assert "--workload continuation" in sent[0]
    assert matrix.run_row(r, {}, {}, "success")["workload"] == "continuation"


def test_run_status():
    assert matrix.run_status([{"status": "valid"}, {"status": "over_capacity"}]) == "success"
    assert matrix.run_status([{"status": "valid"}], quarantined=1) == "partial"
    assert matrix.run_status([{"status": "invalid"}]) == "partial"
    assert matrix.run_status([{"status": "valid"}, {"status": "failed"}]) == "failed"


def test_run_row_has_every_field_and_no_secret(monkeypatch):
    monkeypatch.setenv("SPEEDMATRIX_API_KEY", "sk-secret-123")
    r = resolve({"recipe": SIM})
    info = {
        "version": "0.1.dev1+g9fedd24fa",
        "kv_num_blocks": 16640,
        "kv_block_size": 16,
        "kv_cache_tokens": 266240,
    }
    row = matrix.run_row(r, info, {"engine_commit": None}, "success")
    from speedmatrix.records import RUN_FIELDS

    assert set(row) == {f.name for f in RUN_FIELDS}
    assert row["launch_command"].count("<redacted>") == 1
    assert "sk-secret-123" not in str(row)
    assert (row["hardware_gpu_count"], row["kv_cache_tokens"]) == (8, 266240)
    assert row["source"].startswith("airflow:speed_matrix/")
    assert matrix.secrets_of(r) == ["sk-secret-123"]


def test_conclude_fails_a_failed_run_after_landing():
    with pytest.raises(RuntimeError, match="decode 8K x 4: server died"):
        matrix.conclude(
            {"run_id": "r", "status": "failed", "failed": ["decode 8K x 4: server died"]}
        )
    assert matrix.conclude({"run_id": "r", "status": "success"}) == "success"
    assert matrix.conclude({"run_id": "r", "status": "partial", "quarantined": [{}]}) == "partial"


def _request(c: int, i: int) -> dict:
    return {"phase": "decode", "context_tokens": 8192, "concurrency": c, "request_index": i,
            "stream": i, "prompt_tokens": 8192, "output_tokens": 100, "window_tokens": 100,
            "ttft_ms": 87.0, "tbt_ms": 18.2, "chunks": 100, "finished": False}  # fmt: skip


def test_a_cell_failing_validation_is_quarantined_with_its_requests_and_the_rest_lands(tmp_path):
    """validate -> land over a real warehouse (no Airflow, no server): the 8K x 2 cell whose
    server ran 0.4 requests of 2 goes to _quarantine/ with its requests and the GX result; the
    other cells and their requests land; the run says partial."""
    from test_repeats import decode, prefill, result

    r = resolve(
        {
            "recipe": SIM,
            "contexts": ["8K"],
            "concurrencies": [1, 2],
            "prefill_contexts": ["8K"],
            "warehouse": str(tmp_path / "wh"),
        }
    )
    info = {"kv_num_blocks": 16640, "kv_block_size": 16, "kv_cache_tokens": 266240}
    planned = matrix.plan(r, info)
    results = [
        result(prefill()),
        result(decode(c=1), requests=[_request(1, 0)]),
        result(decode(c=2, avg_active_requests=0.4), requests=[_request(2, 0), _request(2, 1)]),
    ]
    validated = matrix.validate(r, info, None, planned, results)
    assert validated["run"]["status"] == "partial"
    [q] = validated["quarantined"]
    assert (q["phase"], q["concurrency"]) == ("decode", 2)
    assert q["reasons"] == ["expect_column_values_to_be_between(active_ratio)"]
    landed = matrix.land(r, validated)
    assert (landed["status"], landed["cells"], landed["requests"]) == ("partial", 2, 1)

    wh = matrix.warehouse_of(r)
    run, cells, requests = wh.read_run(r["run_id"])
    assert run["status"] == "partial"
    assert [(c["phase"], c["concurrency"]) for c in cells] == [("prefill", 1), ("decode", 1)]
    assert [(q["concurrency"], q["request_index"]) for q in requests] == [(1, 0)]
    rows, doc = wh.read_quarantine(r["run_id"], "cells")
    assert [(c["phase"], c["concurrency"], c["avg_active_requests"]) for c in rows] == [
        ("decode", 2, 0.4)
    ]
    assert doc["result"]["expectations"] and doc["run_id"] == r["run_id"]
    rows, _ = wh.read_quarantine(r["run_id"], "requests")
    assert sorted(q["request_index"] for q in rows) == [0, 1]
    gx = Path(validated["gx_results"]).read_text()  # kept next to the run
    assert json.loads(gx) and "active_ratio" in gx
    assert matrix.conclude(landed) == "partial"
    wh.close()


def test_a_server_we_did_not_start_has_unknown_gpus_never_zero():
    """`speedmatrix run --base-url`: nothing says how many GPUs serve it or their memory. The
    runs row held 0 and 0 (a CPU's values, made up); unknown is NULL. What the inspection of
    the machine says still counts, and a recipe's own counts are kept as they are."""
    from speedmatrix.cli.run import existing_recipe

    recipe = existing_recipe("http://127.0.0.1:1", "m", "main", 65536, None)
    r = resolution.resolve(
        {"recipe": recipe.id, "contexts": ["8K"], "concurrencies": [1], "prefill_contexts": []},
        dag_run_id="manual__2026-11-29T20:30:05+00:00",
        run_after=dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC),
        recipe=recipe,
        base_url="http://127.0.0.1:1",
    )
    row = matrix.run_row(r, {"gpu_count": 0}, {}, "success")
    assert (row["hardware_gpu_count"], row["hardware_vram_gb"]) == (None, None)
    assert matrix.run_row(r, {"gpu_count": 2}, {}, "success")["hardware_gpu_count"] == 2
    cpu = matrix.run_row(resolve({"recipe": "cpu/tiny/llama-tiny"}), {}, {}, "success")
    assert (cpu["hardware_gpu_count"], cpu["hardware_vram_gb"]) == (0, 0)


def test_burst_sizes_come_from_the_conf_as_a_list_or_a_text_and_are_checked():
    """Issue #43 item 12: conf `burst` (the trigger form's text `2, 4` or a list) overrides the
    recipe's `matrix.burst`; a bad value fails in resolve, before a host is touched."""
    assert resolve({"recipe": CPU, "burst": "2, 4"}, run_id="manual__b")["matrix"]["burst"] == [
        2,
        4,
    ]
    assert resolve({"recipe": CPU, "burst": [3]}, run_id="manual__b")["matrix"]["burst"] == [3]
    with pytest.raises(ResolveError, match="burst"):
        resolve({"recipe": CPU, "burst": ["many"]}, run_id="manual__b")
    with pytest.raises(ResolveError, match="burst must be positive"):
        resolve({"recipe": CPU, "burst": [0]}, run_id="manual__b")
    with pytest.raises(ResolveError, match="burst cells are measured by our definitions"):
        resolve(
            {"recipe": CPU, "burst": [2], "measurement_profile": "published"}, run_id="manual__b"
        )
