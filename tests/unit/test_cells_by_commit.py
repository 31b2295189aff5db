"""A cell row answers "by commit" without a join (#44 item 3): every cells row carries the
run's engine_commit, host, trigger and model; a prefill row's figure has a name that says it
(prompt_tok_s), total_tok_s still read."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_run

from speedmatrix.store.warehouse import Warehouse


def test_cells_carry_the_runs_commit_host_trigger_and_model(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    run = make_run("r-1", engine_commit="a" * 40, host="gpu-1", model="org/m")
    wh.land_run(run, make_cells(), [])
    rows = wh.query(
        "SELECT engine_commit, host, trigger, model, count(*) AS n FROM cells GROUP BY ALL"
    )
    assert rows.to_dict("records") == [
        {"engine_commit": "a" * 40, "host": "gpu-1", "trigger": "nightly", "model": "org/m",
         "n": len(make_cells())}
    ]  # fmt: skip


def test_a_prefill_row_names_its_figure_prompt_tok_s(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    wh.land_run(make_run("r-1"), make_cells(), [])
    rows = wh.query("SELECT phase, prompt_tok_s, total_tok_s FROM cells ORDER BY phase DESC")
    prefill = rows[rows["phase"] == "prefill"].iloc[0]
    assert prefill["prompt_tok_s"] == prefill["total_tok_s"] == 6206.0
    assert rows[rows["phase"] == "decode"]["prompt_tok_s"].isna().all()


def test_landing_a_read_run_again_keeps_them(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    wh.land_run(make_run("r-1", host="gpu-1"), make_cells(), [])
    run, cells, requests = wh.read_run("r-1")
    wh.land_run(run, cells, requests)
    assert set(wh.query("SELECT host FROM cells")["host"]) == {"gpu-1"}
