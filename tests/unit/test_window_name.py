"""One name for the measurement window (#44 item 3): `window_s` in the recipe, the conf, the
tables and the Python config; `--window-s` on every command line. The old names still read,
each with a deprecation note: `--duration` / `--duration-s`, the conf's `duration_s`, a recipe's
`duration_s` / `measure_s`, and the runs table's `measure_s` column of a warehouse landed
before (schema 6)."""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
import views_fixture
import yaml
from deltalake import write_deltalake

from speedmatrix.flows import resolution
from speedmatrix.flows.resolution import ResolveError
from speedmatrix.store.schemas import RUNS_SCHEMA, SCHEMA_VERSION
from speedmatrix.store.warehouse import Warehouse

WHEN = dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC)
SIM = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"


def _resolve(conf):
    return resolution.resolve(conf, dag_run_id="manual__2026-11-29T20:30:05+00:00", run_after=WHEN)


# ------------------------------------------------------------------------------ command lines


def _parse(register, argv):
    parser = argparse.ArgumentParser(prog="speedmatrix")
    sub = parser.add_subparsers(dest="command")
    register(sub, argv[0])
    return parser.parse_args(argv)


def test_run_takes_window_s_and_still_reads_duration_s(capsys):
    from speedmatrix.cli.run import _conf, register

    args = _parse(register, ["run", SIM, "--window-s", "7"])
    assert _conf(args)[0]["window_s"] == 7.0
    assert "deprecated" not in capsys.readouterr().err
    args = _parse(register, ["run", SIM, "--duration-s", "9"])
    conf = _conf(args)[0]
    assert conf["window_s"] == 9.0 and "duration_s" not in conf
    err = capsys.readouterr().err
    assert "--duration-s is deprecated" in err and "--window-s" in err


def test_loadgen_decode_takes_window_s_and_still_reads_duration(capsys):
    from speedmatrix.loadgen.cli import build_config, config_to_argv, register

    base = ["loadgen", "decode", "--base-url", "http://127.0.0.1:9", "--model", "m"]
    cfg = build_config(_parse(register, [*base, "--context", "8K", "-c", "2", "--window-s", "7"]))
    assert cfg.window_s == 7.0
    assert "deprecated" not in capsys.readouterr().err
    cfg = build_config(_parse(register, [*base, "--context", "8K", "-c", "2", "--duration", "9"]))
    assert cfg.window_s == 9.0
    assert "--duration is deprecated" in capsys.readouterr().err
    argv = config_to_argv(cfg)  # what a remote host's cell is given: the new name
    assert float(argv[argv.index("--window-s") + 1]) == 9 and "--duration" not in argv


def test_demo_takes_window_s_and_still_reads_duration(capsys):
    from speedmatrix.cli.demo import demo_parser

    assert demo_parser().parse_args(["--window-s", "4"]).window_s == 4.0
    assert demo_parser().parse_args(["--duration", "6"]).window_s == 6.0
    assert "--duration is deprecated" in capsys.readouterr().err


def test_the_decode_config_still_takes_duration_s():
    from speedmatrix.loadgen.config import DecodeConfig

    new = DecodeConfig(base_url="http://x", model="m", context=8, concurrency=1, window_s=7)
    with pytest.warns(DeprecationWarning, match="window_s"):
        old = DecodeConfig(base_url="http://x", model="m", context=8, concurrency=1, duration_s=7)
    assert new.window_s == old.window_s == 7
    assert replace(new, window_s=9).window_s == 9  # the old name's InitVar does not undo it


# ---------------------------------------------------------------------------------------- conf


def test_the_conf_takes_window_s_and_still_reads_duration_s(caplog):
    assert _resolve({"recipe": SIM, "window_s": 12})["matrix"]["window_s"] == 12
    with caplog.at_level(logging.WARNING):
        resolved = _resolve({"recipe": SIM, "duration_s": 14})
    assert resolved["matrix"]["window_s"] == 14
    assert "duration_s is deprecated" in caplog.text and "window_s" in caplog.text
    # the form sends every Param: the old key given beside an empty new one is the old one's
    assert _resolve({"recipe": SIM, "window_s": None, "duration_s": 15})["matrix"]["window_s"] == 15
    with pytest.raises(ResolveError, match="window_s"):
        _resolve({"recipe": SIM, "window_s": 12, "duration_s": 14})
    with pytest.raises(ResolveError, match="window_s must be a number"):
        _resolve({"recipe": SIM, "duration_s": "long"})


def test_the_dags_forms_name_the_window_window_s():
    from speedmatrix.flows.params import speed_matrix_params

    params = speed_matrix_params()
    assert "window_s" in params and "duration_s" not in params
    src = Path("dags/speed_matrix_bisect.py").read_text(encoding="utf-8")
    assert '"window_s": Param(' in src and '"duration_s": Param(' not in src


def test_a_bisection_passes_its_window_on_under_the_new_name():
    from speedmatrix.flows.bisect_steps import matrix_conf

    assert matrix_conf({"window_s": 8})["window_s"] == 8
    assert matrix_conf({"duration_s": 9})["window_s"] == 9


# -------------------------------------------------------------------------------------- recipe


@pytest.mark.parametrize("old", ["duration_s", "measure_s"])
def test_a_recipe_still_reads_the_old_names(tmp_path, old, caplog):
    from speedmatrix.recipes import RecipeError, load_recipe, recipe_path

    data = yaml.safe_load(recipe_path("cpu/tiny/llama-tiny").read_text())
    data["matrix"][old] = data["matrix"].pop("window_s") + 2
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    with caplog.at_level(logging.WARNING):
        assert load_recipe(path).matrix.window_s == 7
    assert f"matrix.{old} is deprecated" in caplog.text
    data["matrix"]["window_s"] = 3  # both: which one is meant is not guessed
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match="window_s"):
        load_recipe(path)


# -------------------------------------------------------------------------------------- tables


def _run(run_id, day, **extra):
    """A run of views_fixture's model, its window as given (`window_s=` or `measure_s=`)."""
    row = views_fixture.run_row(run_id, views_fixture.RTX, views_fixture.RTX_GPU, 8, day, "a" * 40)
    del row["window_s"]
    return {**row, **extra}


def _cells():
    return views_fixture.cells_for(60.0, 0.85)[:2]


def test_the_runs_table_names_the_window_window_s():
    assert "window_s" in RUNS_SCHEMA.names
    assert SCHEMA_VERSION >= 7


def test_the_old_column_name_is_still_written_for_readers_of_the_contract(tmp_path):
    """The design's table contract names runs' window `measure_s`: a reader of the Delta files
    (pandas, Polars, DuckDB without our views) still finds it, with window_s's value."""
    from deltalake import DeltaTable

    wh = Warehouse(tmp_path)
    wh.land_run(_run("r", 14, window_s=12.0), _cells(), [])
    data = DeltaTable(os.path.join(tmp_path, "runs")).to_pyarrow_table()
    assert data.column("window_s").to_pylist() == data.column("measure_s").to_pylist() == [12.0]
    assert wh.query("SELECT measure_s FROM runs")["measure_s"].tolist() == [12.0]


def test_a_warehouse_landed_with_measure_s_still_reads(tmp_path):
    """A runs table written by schema 6 (its window as `measure_s`): its rows read their window
    as `window_s` (query, read_run, the report) beside runs landed since, and the run's row
    of the old name is refused nowhere."""
    wh = Warehouse(tmp_path)
    built = wh.build_tables(_run("old", 14, window_s=30.0), _cells(), [])
    for table in ("cells", "requests", "runs"):
        data = built[table]
        if table == "runs":
            data = data.drop_columns(["measure_s"]).rename_columns(
                [
                    "measure_s" if n == "window_s" else n
                    for n in data.column_names
                    if n != "measure_s"
                ]
            )
        i = data.schema.get_field_index("schema_version")
        data = data.set_column(i, "schema_version", pa.array([6] * data.num_rows, pa.int32()))
        write_deltalake(
            os.path.join(tmp_path, table),
            data,
            mode="append",
            partition_by=["recipe_id", "run_month"],
        )
    wh = Warehouse(tmp_path)
    assert wh.query("SELECT window_s FROM runs")["window_s"].tolist() == [30.0]
    wh.land_run(_run("new", 20, window_s=12.0), _cells(), [])
    got = wh.query("SELECT run_id, window_s, schema_version FROM runs ORDER BY run_id")
    assert got.to_dict("records") == [
        {"run_id": "new", "window_s": 12.0, "schema_version": SCHEMA_VERSION},
        {"run_id": "old", "window_s": 30.0, "schema_version": 6},
    ]
    run, _cells_read, _ = wh.read_run("old")
    assert run["window_s"] == run["measure_s"] == 30.0
    from speedmatrix.report.render import render_markdown

    assert "Time per measurement: 30 s" in render_markdown(*wh.read_run("old")[:2])
    # a row given under the old name (a caller of the old API) lands under the new one
    wh.land_run(_run("again", 21, measure_s=45.0), _cells(), [])
    assert wh.read_run("again")[0]["window_s"] == 45.0
