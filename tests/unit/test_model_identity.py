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
