"""One model, one identity (#44 item 4): a run against a server already running records the
model id the server loaded (/v1/models' root), as a recipe run does, the served name kept
apart; with no --model, the one model the server serves. Against the simulator, served on
loopback in this process (a test instrument: its profile names both)."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from speedmatrix.cli.run import existing_recipe, server_facts

PROFILE = "include/sim-profiles/kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"


@pytest.fixture(scope="module")
def sim_url():
    from aiohttp import web

    from speedmatrix.sim.profile import load_profile
    from speedmatrix.sim.server import SimServer

    server = SimServer(load_profile(PROFILE))
    loop = asyncio.new_event_loop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = web.AppRunner(server.app())
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(30)
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_the_model_id_is_read_from_the_server_and_the_served_name_kept_apart(sim_url):
    _version, _max_len, served, model_id = server_facts(sim_url, "Kimi-K2.7-Code-NVFP4", None)
    assert (served, model_id) == ("Kimi-K2.7-Code-NVFP4", "nvidia/Kimi-K2.7-Code-NVFP4")
    recipe = existing_recipe(sim_url, served, "main", 262144, None, model_id=model_id)
    assert recipe.model.id == "nvidia/Kimi-K2.7-Code-NVFP4"
    assert recipe.model.served_name == "Kimi-K2.7-Code-NVFP4"


def test_without_model_the_one_model_served_is_taken(sim_url):
    _version, _max_len, served, model_id = server_facts(sim_url, None, None)
    assert (served, model_id) == ("Kimi-K2.7-Code-NVFP4", "nvidia/Kimi-K2.7-Code-NVFP4")


def test_a_model_whose_view_would_be_empty_is_not_linked(tmp_path):
    """A server already running has no GPU count (tok/s per GPU would be made up): its
    model's Pareto view has no point, so the index does not link an empty table."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from views_fixture import cells_for, run_row

    from speedmatrix.report.site import build_site
    from speedmatrix.store.warehouse import Warehouse

    wh = Warehouse(tmp_path / "wh")
    for i, gpus in enumerate((0, 8)):
        model = "org/no-gpu-count" if gpus == 0 else "org/with-gpus"
        run = run_row(f"r{i}", f"external/x{i}", "unknown", gpus, 1 + i, "c" * 40, model=model)
        wh.land_run(run, cells_for(50.0, 0.8), [])
    build_site(wh, tmp_path / "site")
    index = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    row = index[index.index("org/no-gpu-count") :].split("</tr>")[0]
    assert "Pareto view</a>" not in row and "no GPU count" in row
    row = index[index.index("org/with-gpus") :].split("</tr>")[0]
    assert "Pareto view</a>" in row


# ------------------------------------------- runs landed before the fix, under the served name


@pytest.fixture(scope="module")
def both_kinds(tmp_path_factory):
    """A warehouse holding both kinds of run of one model: two recipe runs under the model id
    (`moonshotai/Kimi-K2.7`, served as `Kimi-K2.7`) and one `run --base-url` landed before the
    fix, under the served name as its model (model = served_model = `Kimi-K2.7`); and a served
    name two model ids share (`shared`), which no view may guess."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from views_fixture import H200, H200_GPU, MODEL, RTX, RTX_GPU, cells_for, run_row

    from speedmatrix.store.warehouse import Warehouse

    wh = Warehouse(tmp_path_factory.mktemp("both") / "wh")
    wh.land_run(run_row("rtx-1", RTX, RTX_GPU, 8, 10, "a" * 40), cells_for(60.0, 0.85), [])
    wh.land_run(run_row("h200-1", H200, H200_GPU, 4, 11, "a" * 40), cells_for(50.0, 0.9), [])
    old = run_row("old-1", "external/127.0.0.1-8000/kimi", RTX_GPU, 8, 12, "b" * 40)
    old["model"] = old["served_model"] = MODEL.split("/")[-1]
    wh.land_run(old, cells_for(55.0, 0.85), [])
    for i, model in enumerate(("org-a/shared", "org-b/shared", "shared")):
        row = run_row(f"shared-{i}", f"sim/shared-{i}", H200_GPU, 8, 13, "c" * 40, model=model)
        row["served_model"] = "shared"
        wh.land_run(row, cells_for(40.0, 0.9), [])
    yield wh, MODEL
    wh.close()


def test_views_group_a_served_name_run_under_its_model_id(both_kinds):
    from speedmatrix.analysis.pareto import choose_series
    from speedmatrix.report.pareto import build_view, models, warehouse_runs

    wh, model = both_kinds
    runs = warehouse_runs(wh)
    # one model, not two; a served name two ids share is left as it was recorded
    assert models(runs) == sorted([model, "org-a/shared", "org-b/shared", "shared"])
    assert {s.run["run_id"] for s in choose_series(runs, model)} == {"rtx-1", "h200-1", "old-1"}
    view = build_view(wh, model, runs=runs)
    assert {p.run_id for p in view.points} == {"rtx-1", "h200-1", "old-1"}


def test_report_versus_compares_a_served_name_run_with_a_model_id_run(both_kinds, capsys):
    from speedmatrix.cli import main

    wh, model = both_kinds
    assert main(["report", "--warehouse", wh.root, "--versus", "rtx-1", "old-1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# {model}: B against A") and "run old-1" in out
    assert main(["report", "--warehouse", wh.root, "--pareto", "Kimi-K2.7"]) == 0  # served name
    out = capsys.readouterr().out
    assert f"# Pareto view: {model}" in out and "external/127.0.0.1-8000/kimi" in out
    assert main(["report", "--warehouse", wh.root, "--versus", "old-1", "shared-2"]) == 2
    assert "a comparison is of one model" in capsys.readouterr().err


def test_the_site_lists_one_model_for_both_kinds(both_kinds, tmp_path):
    from speedmatrix.report.site import build_site
    from speedmatrix.report.site_views import model_page, versus_page

    wh, model = both_kinds
    build_site(wh, tmp_path / "site")
    index = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert f"<td>{model}</td>" in index and "<td>Kimi-K2.7</td>" not in index
    assert not (tmp_path / "site" / model_page("Kimi-K2.7")).exists()
    view = (tmp_path / "site" / model_page(model)).read_text(encoding="utf-8")
    assert "external/127.0.0.1-8000/kimi" in view
    pair = versus_page("external/127.0.0.1-8000/kimi|local", "sim/kimi-rtx-x8|local")
    assert (tmp_path / "site" / pair).exists()
