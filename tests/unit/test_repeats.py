"""Repeated cells (issue 9, noise): the `repeats` / `repeat_cells` options from conf to plan,
the `cell_repeats` table, their validation, and the between-run noise they give one run."""

from __future__ import annotations

import datetime as dt
import json

import duckdb
import factories
import pytest

from speedmatrix.analysis.compare import judge_regressions
from speedmatrix.analysis.noise import NOISE_SCHEMA, NoiseModel, between_run_noise, noise_table
from speedmatrix.cli import main
from speedmatrix.flows import collect, matrix, resolution
from speedmatrix.flows.resolution import ResolveError
from speedmatrix.plan import (
    KvCapacity,
    MatrixSpec,
    PlanError,
    check_repeats,
    plan_matrix,
    repeat_keys,
)
from speedmatrix.quality import validate_run
from speedmatrix.records import empty_cell, parse_cell, to_wire
from speedmatrix.store.extra import cell_repeats_table, land_cell_repeats, land_extra, read_extra
from speedmatrix.store.schemas import CELL_REPEATS_SCHEMA, EXTRA_TABLES, view_schema
from speedmatrix.store.warehouse import Warehouse

K = 1024
SIM = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
WHEN = dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC)
BIG = KvCapacity(16640, 16)  # the simulator's KV cache: 8K x 32 does not fit


def spec(**over) -> MatrixSpec:
    values = dict(
        prefill_contexts=["8K", "16K"],
        contexts=["8K", "16K"],
        concurrencies=[1, 2, 32],
        max_output_tokens=512,
        window_s=2,
    )
    values.update(over)
    return MatrixSpec.build(**values)


def keys(cells):
    return [(c["label"], c["repeat"]) for c in cells]


# ------------------------------------------------------------------------------------- plan


def test_repeats_of_chosen_cells_come_as_later_passes_in_the_same_order():
    plan = plan_matrix(spec(), BIG, repeats=3, repeat_cells=["16Kx2", "8k X 1", "prefill 16K"])
    assert keys(plan.decode) == [
        ("8K x 1", 0),
        ("8K x 2", 0),
        ("16K x 1", 0),
        ("16K x 2", 0),
        ("8K x 1 #2", 1),
        ("16K x 2 #2", 1),
        ("8K x 1 #3", 2),
        ("16K x 2 #3", 2),
    ]
    assert keys(plan.prefill) == [("8K", 0), ("16K", 0), ("16K #2", 1), ("16K #3", 2)]
    # each pass runs in the run order: the prefill of a context before its decode cells
    assert keys(plan.order)[6:] == [
        ("8K x 1 #2", 1),
        ("16K #2", 1),
        ("16K x 2 #2", 1),
        ("8K x 1 #3", 2),
        ("16K #3", 2),
        ("16K x 2 #3", 2),
    ]
    # a repeat is the same cell: same context, concurrency, window, output length
    first, again = plan.decode[3], plan.decode[5]
    assert {k: v for k, v in again.items() if k not in ("label", "repeat")} == {
        k: v for k, v in first.items() if k not in ("label", "repeat")
    }
    assert len(plan.over_capacity) == 2  # never repeated, never run


def test_repeats_without_repeat_cells_repeat_whole_runs():
    plan = plan_matrix(spec(prefill_contexts=["8K"]), BIG, repeats=2)
    assert keys(plan.prefill) == [("8K", 0), ("8K #2", 1)]
    assert [c["repeat"] for c in plan.decode] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [c["label"] for c in plan.decode[4:]] == [
        "8K x 1 #2",
        "8K x 2 #2",
        "16K x 1 #2",
        "16K x 2 #2",
    ]
    assert keys(plan_matrix(spec(), BIG).decode)[-1] == ("16K x 2", 0)  # default: no repeats


def test_each_pass_sends_its_own_run_tag_and_cache_salt():
    """A repeat that reused the run's tag would find its primary's prompt in the prefix
    cache: a repeated prefill would never be cold. Every pass has a tag (and salt) of its own,
    and every cell of one pass shares it (decode cells reuse their pass's warmed prompts)."""
    plan = plan_matrix(spec(prefill_contexts=["8K"]), BIG, repeats=3)
    resolved = {"served_model": "m", "run_tag": "0123456789", "api_key_env": None}
    server = {"base_url": "http://127.0.0.1:1"}
    sent = {}
    for cell in [*plan.prefill, *plan.decode]:
        cfg = matrix._loadgen_config(resolved, server, cell)
        cfg.validate()
        sent.setdefault(cell["repeat"], set()).add((cfg.run_tag, cfg.salt))
    assert sent[0] == {("0123456789", "speedmatrix-0123456789")}  # the primary: as before
    assert all(len(tags) == 1 for tags in sent.values())
    tags = [next(iter(sent[r])) for r in (0, 1, 2)]
    assert len({t for t, _ in tags}) == 3 and len({s for _, s in tags}) == 3


def test_a_named_cell_over_capacity_fails_the_plan_clearly():
    with pytest.raises(PlanError, match="8Kx32 is over capacity on this server"):
        plan_matrix(spec(), BIG, repeats=2, repeat_cells=["8Kx32", "8Kx1"])
    # with repeats = 1 nothing is repeated, so nothing to refuse
    plan_matrix(spec(), BIG, repeats=1, repeat_cells=["8Kx32"])


def test_repeat_cells_must_name_cells_of_the_matrix():
    s = spec()
    assert repeat_keys(s, None) is None
    assert repeat_keys(s, ["16Kx2", "prefill@8K", "16384x2", "8192 x 1"]) == [
        ("prefill", 8 * K, 1),
        ("decode", 8 * K, 1),
        ("decode", 16 * K, 2),
    ]
    with pytest.raises(PlanError) as err:
        repeat_keys(s, ["64Kx2", "8Kx4", "prefill 32K", "8K by 2"])
    text = str(err.value)
    for bad in ("'64Kx2' names no cell", "'8Kx4' names no cell", "'prefill 32K' names no"):
        assert bad in text
    assert "not a cell: '8K by 2'" in text and "decode ['8K', '16K'] x [1, 2, 32]" in text
    for empty in ([], "8Kx1"):
        with pytest.raises(PlanError, match="non-empty list"):
            repeat_keys(s, empty)
    assert parse_cell("64Kx16") == ("decode", "64K", 16)  # the trend --cell syntax


@pytest.mark.parametrize("bad", [0, 11, -1, 2.5, True, "3"])
def test_repeats_is_an_integer_from_1_to_10(bad):
    with pytest.raises(PlanError, match="repeats must be"):
        check_repeats(bad)
    assert check_repeats(None) == 1 and check_repeats(10) == 10


# ------------------------------------------------------------------------------------ resolve


def resolve(conf):
    return resolution.resolve(
        {"recipe": SIM, **conf}, dag_run_id="manual__2026-11-29T20:30:05+00:00", run_after=WHEN
    )


def test_resolve_keeps_repeats_and_canonical_cell_names():
    r = resolve({"contexts": ["8K"], "concurrencies": [1, 4], "repeats": 3})
    assert (r["repeats"], r["repeat_cells"]) == (3, None)
    r = resolve({"repeats": 2, "repeat_cells": ["8k x 4", "prefill 8192"]})
    assert r["repeat_cells"] == ["prefill 8K", "8Kx4"]
    assert resolve({})["repeats"] == 1 and resolve({})["repeat_cells"] is None
    assert "repeats" not in resolve({})["matrix"]  # the matrix dict is unchanged


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"repeats": 2, "repeat_cells": ["8Kx3"]}, "'8Kx3' names no cell of the matrix"),
        ({"repeats": 2, "repeat_cells": ["fast ones"]}, "not a cell: 'fast ones'"),
        ({"repeats": 2, "repeat_cells": []}, "non-empty list"),
        ({"repeat_cells": ["8Kx1"]}, "repeats is 1: set repeats to 2 or more"),
        ({"repeats": 11}, "repeats must be 1..10"),
    ],
)
def test_bad_repeat_conf_fails_in_resolve(conf, message):
    with pytest.raises(ResolveError, match=message):
        resolve(conf)


def test_recipe_may_default_repeats_and_checks_its_cells():
    from speedmatrix.recipes import Recipe, load_recipe

    base = load_recipe(SIM).model_dump()
    base["matrix"].update(repeats=2, repeat_cells=["8Kx1", "3Kx1"])
    problems = dict(Recipe.model_validate(base).problems())
    assert "'3Kx1' names no cell" in problems["matrix.repeat_cells"]
    base["matrix"].update(repeats=1, repeat_cells=["8Kx1"])
    assert "repeats is 1" in dict(Recipe.model_validate(base).problems())["matrix.repeat_cells"]


# ------------------------------------------------------------------- cells from the mapped tasks


def decode(ctx=8 * K, c=1, scale=1.0, **over):
    """A valid decode record (the published 8K x 1 cell scaled to C, then by `scale`)."""
    values = dict(
        phase="decode",
        context_tokens=ctx,
        context_label=f"{ctx // K}K",
        concurrency=c,
        status="valid",
        total_tok_s=54.9 * c * scale,
        per_request_tok_s=54.9 * scale,
        ttft_ms=87.0,
        tbt_ms=18.2 / scale,
        avg_active_requests=float(c),
        completed_requests=0,
        output_tokens=round(1647 * c * scale),
        measured_s=30.0,
        window_s=30.0,
        max_output_tokens=4096,
        prompt_mode="distinct",
    )
    values.update(over)
    return empty_cell(**values)


def prefill(ctx=8 * K, **over):
    values = dict(
        phase="prefill",
        context_tokens=ctx,
        context_label=f"{ctx // K}K",
        concurrency=1,
        status="valid",
        total_tok_s=6206.0,
        ttft_ms=ctx / 6.206,
        completed_requests=1,
        max_output_tokens=1,
    )
    values.update(over)
    return empty_cell(**values)


def result(record, repeat=0, requests=()):
    return {"cell": to_wire(record), "requests": list(requests), "repeat": repeat}


def test_collect_splits_primaries_from_repeats_and_fails_the_missing():
    planned = plan_matrix(
        spec(prefill_contexts=["8K"], contexts=["8K"], concurrencies=[1, 2]),
        BIG,
        repeats=3,
        repeat_cells=["8Kx2"],
    ).as_dict()
    results = [
        result(prefill()),
        result(decode(c=1)),
        result(decode(c=2), requests=[{"phase": "decode", "request_index": 0}]),
        result(decode(c=2, scale=1.01), 1, requests=[{"phase": "decode", "request_index": 0}]),
        None,  # the third pass's task died
    ]
    cells, requests = collect.collect_cells(planned, results)
    assert [(c["phase"], c["concurrency"], c["total_tok_s"]) for c in cells] == [
        ("prefill", 1, 6206.0),
        ("decode", 1, 54.9),
        ("decode", 2, 109.8),
    ]
    assert len(requests) == 1  # a repeat's requests are not kept
    repeats = collect.collect_repeats(planned, results)
    assert [(r["concurrency"], r["repeat"], r["status"]) for r in repeats] == [
        (2, 1, "valid"),
        (2, 2, "failed"),
    ]
    assert repeats[1]["error"] == "the cell's task ended without a result"


def run_row():
    return factories.run_row(
        "r1",
        recipe_id=SIM,
        started_at="2026-11-29T20:30:00Z",
        served_model="Kimi-K2.7-Code-NVFP4",
        launch_command="vllm serve m --port 8000",
    )


def test_a_repeat_is_validated_like_a_cell():
    cells = [decode(c=1), decode(c=2)]
    repeats = [
        {**decode(c=2, scale=1.01), "repeat": 1},
        {**decode(c=2, avg_active_requests=0.4), "repeat": 2},  # the server ran 0.4 of 2
    ]
    checked = validate_run(run_row(), cells, repeats=repeats)
    assert len(checked.good_cells) == 2 and not checked.bad_cells
    assert [r["repeat"] for r in checked.good_repeats] == [1]
    (bad,) = checked.bad_repeats
    assert bad["repeat"] == 2
    assert "expect_column_values_to_be_between(active_ratio)" in bad["quarantine_reasons"]
    # a repeat of the same pass and cell twice is refused like a duplicate cell
    twice = validate_run(run_row(), cells, repeats=[repeats[0], repeats[0]])
    assert len(twice.bad_repeats) == 2 and len(twice.good_cells) == 2


# ------------------------------------------------------------------------------------- noise


def _robust_sd(values):
    """#40's between-run scale of a sequence of measurements, written out: 1.4826 x the median
    absolute log ratio of consecutive ones, over sqrt(2)."""
    import itertools
    import math
    import statistics

    diffs = [abs(math.log(b / a)) for a, b in itertools.pairwise(values)]
    return 1.482602218505602 * statistics.median(diffs) / math.sqrt(2)


def test_between_run_noise_counts_a_runs_own_repeats():
    """#40 item 2: the between-run noise is the robust scale of consecutive differences of a
    cell's measurements, whatever their commits, and a run's repeats are measurements like its
    primary cell (in the order they were made). A failed run and an invalid repeat are none."""
    t0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)

    def run(run_id, commit, status, day):
        return {
            "run_id": run_id,
            "recipe_id": "r",
            "host": "h",
            "engine_commit": commit,
            "status": status,
            "started_at": t0 + dt.timedelta(days=day),
        }

    runs = [run("a", "c1", "success", 0), run("b", "c2", "success", 1), run("x", "c1", "failed", 2)]
    cells = [
        {"run_id": "a", **decode(c=2, scale=1.00)},
        {"run_id": "a", **decode(c=1)},
        {"run_id": "b", **decode(c=2, scale=0.90)},  # another engine: a measurement all the same
        {"run_id": "x", **decode(c=2, scale=0.50)},
    ]
    repeats = [
        {"run_id": "a", "repeat": 1, **decode(c=2, scale=1.02)},
        {"run_id": "a", "repeat": 2, **decode(c=2, scale=0.98)},
        {"run_id": "b", "repeat": 1, **decode(c=2, scale=0.90, status="invalid")},
        {"run_id": "x", "repeat": 1, **decode(c=2, scale=0.70)},  # a failed run's: ignored
    ]
    # without repeats: a and b, one difference, too few for a spread of the cell's own
    (alone,) = between_run_noise(runs, cells, columns=["total_tok_s"]).to_dict("records")
    assert (alone["dof"], alone["runs"]) == (1, 2)
    assert NoiseModel.from_history(runs, cells).lookup(
        "r", "h", "decode", 8 * K, 2, "total_tok_s"
    ) == (None, "none")
    table = between_run_noise(runs, cells, repeats, columns=["total_tok_s"])
    (row,) = table.to_dict("records")
    assert (row["concurrency"], row["dof"], row["runs"], row["engines"]) == (2, 3, 4, 2)
    assert row["rel_sd"] == pytest.approx(_robust_sd([1.00, 1.02, 0.98, 0.90]), rel=1e-6)
    model = NoiseModel.from_history(runs, cells, repeats)
    assert model.lookup("r", "h", "decode", 8 * K, 2, "total_tok_s") == (
        pytest.approx(_robust_sd([1.00, 1.02, 0.98, 0.90]), rel=1e-6),
        "cell",
    )
    assert model.lookup("r", "h", "decode", 8 * K, 1, "total_tok_s")[1] == "pooled"
    assert model.lookup("r", "other", "decode", 8 * K, 2, "total_tok_s")[1] == "none"
    # a verdict on run a reads no history before it, but a's own repeats are its noise
    first = NoiseModel.from_history(runs, cells, repeats, before=runs[0])
    assert first.lookup("r", "h", "decode", 8 * K, 2, "total_tok_s") == (
        pytest.approx(_robust_sd([1.00, 1.02, 0.98]), rel=1e-6),
        "pooled",  # two differences: the phase's pool, not yet the cell's own three
    )


# ----------------------------------------------------------------------------- warehouse


@pytest.fixture
def wh(tmp_path):
    w = Warehouse(str(tmp_path / "wh"))
    yield w
    w.close()


def undated_run(run_id="u1"):
    return {"run_id": run_id, "recipe_id": "sim/undated", "status": "success", "trigger": "manual"}


def test_land_extra_without_a_run_date_goes_next_to_the_run(wh):
    run = undated_run()
    wh.land_run(run, [decode()], [])
    landed_day = str(wh.read_run("u1")[0]["run_date"])
    rows = [{"run_id": "u1", "recipe_id": "sim/undated", "phase": "decode", "context_tokens": 8192}]
    rows[0].update(concurrency=1, metric="total_tok_s", value=54.9, between_source="none")
    land_extra(wh, "noise", run, noise_table(rows))  # used to fail: run_date_of is None
    dated = "SELECT CAST(run_date AS VARCHAR) AS d, run_month FROM noise WHERE run_id = ?"
    assert wh.query(dated, ["u1"]).values.tolist() == [[landed_day, landed_day[:7]]]
    assert read_extra(wh, "noise", run_id="u1")["value"].tolist() == [54.9]
    # a run not (yet) in the warehouse and without dates: today's partition, as land_run
    land_extra(wh, "noise", undated_run("u2"), noise_table([{**rows[0], "run_id": "u2"}]))
    today = dt.datetime.now(dt.UTC).date().isoformat()
    assert wh.query(dated, ["u2"]).values.tolist() == [[today, today[:7]]]


def test_cell_repeats_land_replace_and_vanish(wh):
    run = {**undated_run(), "started_at": WHEN}
    wh.land_run(run, [decode(c=2)], [])
    rows = [
        {**decode(c=2, scale=1.01), "repeat": 1},
        {**decode(c=2, scale=0.99), "repeat": 2},
    ]
    land_cell_repeats(wh, run, rows)
    dated = wh.query("SELECT DISTINCT CAST(run_date AS VARCHAR), run_month FROM cell_repeats")
    assert dated.values.tolist() == [["2026-11-29", "2026-11"]]
    got = read_extra(wh, "cell_repeats", run_id="u1")
    assert got["repeat"].tolist() == [1, 2] and set(got["concurrency"]) == {2}
    land_cell_repeats(wh, run, rows[:1])  # landing again replaces
    assert read_extra(wh, "cell_repeats", run_id="u1")["repeat"].tolist() == [1]
    assert land_cell_repeats(wh, run, []) is None  # and with no repeats removes
    assert read_extra(wh, "cell_repeats", run_id="u1").empty
    with pytest.raises(ValueError, match="repeat must be an integer >= 1"):
        cell_repeats_table(run, [{**decode(), "repeat": 0}], WHEN.date())
    with pytest.raises(ValueError, match="status 'fine'"):
        cell_repeats_table(run, [{**decode(), "repeat": 1, "status": "fine"}], WHEN.date())


def test_query_views_of_the_extra_tables(tmp_path):
    wh = Warehouse(str(tmp_path / "wh"))
    try:
        for table in EXTRA_TABLES:  # no file yet: empty views with the right columns
            df = wh.query(f"SELECT * FROM {table}")
            assert df.empty and list(df.columns) == view_schema(table).names
        assert "repeat" in view_schema("cell_repeats").names
        assert {"run_date", "run_month"} <= set(view_schema("noise").names)
        run = {**undated_run(), "started_at": WHEN}
        wh.land_run(run, [decode(c=2)], [])
        land_cell_repeats(wh, run, [{**decode(c=2, scale=1.02), "repeat": 1}])
        noise = {"run_id": "u1", "recipe_id": "sim/undated", "phase": "decode"}
        noise.update(context_tokens=8192, concurrency=2, metric="total_tok_s", value=1.0)
        land_extra(wh, "noise", run, noise_table([noise]))
        joined = wh.query(
            "SELECT c.total_tok_s AS primary_tok_s, r.total_tok_s AS repeat_tok_s, r.repeat, "
            "r.run_month, CAST(n.run_date AS VARCHAR) AS run_date, n.recipe_id FROM cells c "
            "JOIN cell_repeats r USING (run_id, phase, context_tokens, concurrency) "
            "JOIN noise n USING (run_id, phase, context_tokens, concurrency)"
        ).to_dict("records")
        assert joined == [
            {
                "primary_tok_s": pytest.approx(109.8),
                "repeat_tok_s": pytest.approx(109.8 * 1.02),
                "repeat": 1,
                "run_month": "2026-11",
                "run_date": "2026-11-29",
                "recipe_id": "sim/undated",
            }
        ]
        assert wh.query("SELECT count(*) AS n FROM comparisons")["n"].tolist() == [0]
    finally:
        wh.close()


def test_speedmatrix_query_reads_cell_repeats(wh, capsys):
    run = {**undated_run(), "started_at": WHEN}
    wh.land_run(run, [decode(c=2)], [])
    land_cell_repeats(wh, run, [{**decode(c=2, scale=1.02), "repeat": 1}])
    sql = "SELECT run_id, repeat, concurrency FROM cell_repeats"
    assert main(["query", sql, "--warehouse", wh.root, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"run_id": "u1", "repeat": 1, "concurrency": 2}]
    # readable without this package too
    from deltalake import DeltaTable

    con = duckdb.connect()
    con.register("t", DeltaTable(wh.table_uri("cell_repeats")).to_pyarrow_dataset())
    assert con.execute("SELECT count(*) FROM t").fetchall() == [(1,)]
    assert CELL_REPEATS_SCHEMA.names[-3:] == ["recipe_id", "run_date", "schema_version"]
    assert NOISE_SCHEMA.names[0] == "run_id"


# ------------------------------------------------------------------- one run, end to end


def test_one_run_with_repeats_lands_them_and_gives_its_cells_their_own_noise(tmp_path):
    """validate -> land -> regressions over a real warehouse (no Airflow, no server): the
    primary in cells, the repeats in cell_repeats, a bad repeat quarantined, and the noise
    table's between-run spread of the repeated cell from this one run (#40: its own repeats
    are its noise; a cell's own spread rests on three differences, so four measurements)."""
    r = resolve(
        {
            "contexts": ["8K"],
            "concurrencies": [1, 2],
            "prefill_contexts": ["8K"],
            "repeats": 5,
            "repeat_cells": ["8Kx2"],
            "warehouse": str(tmp_path / "wh"),
        }
    )
    info = {"kv_num_blocks": 16640, "kv_block_size": 16, "kv_cache_tokens": 266240}
    planned = matrix.plan(r, info)
    assert keys(planned["decode"])[2:] == [
        ("8K x 2 #2", 1),
        ("8K x 2 #3", 2),
        ("8K x 2 #4", 3),
        ("8K x 2 #5", 4),
    ]
    measured = {
        ("decode", 1, 0): decode(c=1),
        ("decode", 2, 0): decode(c=2),
        ("decode", 2, 1): decode(c=2, scale=1.03),
        ("decode", 2, 2): decode(c=2, avg_active_requests=0.4),  # fails validation
        ("decode", 2, 3): decode(c=2, scale=0.98),
        ("decode", 2, 4): decode(c=2, scale=1.01),
    }
    results = [result(prefill())] + [
        result(measured[(p["phase"], p["concurrency"], p["repeat"])], p["repeat"])
        for p in planned["decode"]
    ]
    validated = matrix.validate(r, info, None, planned, results)
    assert validated["run"]["status"] == "success"  # the matrix itself is whole
    assert [(q["concurrency"], q["repeat"]) for q in validated["quarantined"]] == [(2, 2)]
    landed = matrix.land(r, validated)
    assert (landed["cells"], landed["repeats"]) == (3, 3)

    wh = matrix.warehouse_of(r)
    run, cells, _ = wh.read_run(r["run_id"])
    assert run["status"] == "success"
    assert [c["total_tok_s"] for c in cells if c["concurrency"] == 2] == [pytest.approx(109.8)]
    repeats = read_extra(wh, "cell_repeats", run_id=r["run_id"])
    assert sorted(repeats[["concurrency", "repeat"]].values.tolist()) == [[2, 1], [2, 3], [2, 4]]
    rows, doc = wh.read_quarantine(r["run_id"], "cell_repeats")
    assert [(q["repeat"], q["concurrency"]) for q in rows] == [(2, 2)]
    assert doc["result"]["expectations"]

    assert judge_regressions(wh, r["run_id"])["baseline_run_id"] is None
    noise = read_extra(wh, "noise", run_id=r["run_id"])
    source = {
        (n["phase"], n["concurrency"], n["metric"]): n["between_source"]
        for n in noise.to_dict("records")
    }
    assert source[("decode", 2, "total_tok_s")] == "cell"
    assert source[("decode", 1, "total_tok_s")] == "pooled"
    assert source[("prefill", 1, "total_tok_s")] == "none"
    sd = noise[(noise["concurrency"] == 2) & (noise["metric"] == "total_tok_s")]
    # the primary and the valid repeats, in the order they ran (the quarantined one is none)
    assert sd["between_rel_sd"].item() == pytest.approx(
        _robust_sd([1.00, 1.03, 0.98, 1.01]), rel=1e-3
    )
    wh.close()
