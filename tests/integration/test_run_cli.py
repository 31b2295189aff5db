"""`speedmatrix run` (issue #18 item 5): a matrix measured without Airflow, landed, its page printed.

In process (`speedmatrix.cli.main`), so Great Expectations and the report's imports are paid once
for the module; against the simulator calibrated from the reference report (8K x 64 is over its
KV capacity, so the plan's over-capacity path is on the page too), with 1 s windows. What is
checked is the command (the DAG's steps in order, the server's lifecycle, landing, the page,
the progress lines and the errors), not the figures: the simulators these tests start
themselves run at ``SIM_SCALE`` times the wall clock (what a cell measures is then that many
times faster, as `run` does not know; a regression is still half the speed of its baseline).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from processes import group_running
from speed_matrix_helpers import no_server_left

from speedmatrix.cli import main
from speedmatrix.sim.runner import run_in_process
from speedmatrix.store.warehouse import Warehouse

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "include" / "sim-profiles" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"
RECIPE = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
MODEL = "Kimi-K2.7-Code-NVFP4"
TINY = ["--prefill-contexts", "8K", "--contexts", "8K", "--window-s", "1"]
TINY += ["--max-output-tokens", "256"]
SIM_SCALE = 4.0
# For a recipe's simulator (the recipe starts it, at the wall clock's pace): a 1K prefill takes
# a fraction of the 8K one's 1.25 s a request; the tests that use it are about the server's
# lifecycle, not the cells.
SHORT_PREFILL = ["--prefill-contexts", "1K"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    """A simulated server already running on loopback (no API key), for the module, at
    ``SIM_SCALE`` times the wall clock: what these tests check is the command, not figures."""
    with run_in_process(PROFILE, time_scale=SIM_SCALE) as url:
        yield url


def _landed(wh: Path, out: str) -> tuple[dict, list[dict], Path]:
    """The run the command printed (its page must exist) as the warehouse holds it."""
    page = next(line.split(":", 1)[1].strip() for line in out.splitlines() if "page:" in line)
    run_id = out.split()[1].rstrip(":")
    run, cells, _ = Warehouse(str(wh)).read_run(run_id)
    return run, list(cells), Path(page)


def test_run_against_a_server_already_running(sim_url, tmp_path, capsys) -> None:
    wh = tmp_path / "wh"
    rc = main(["run", "--base-url", sim_url, "--model", MODEL, *TINY,
               "--concurrencies", "1", "64", "--warehouse", str(wh)])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    run, cells, page = _landed(wh, out)
    assert page.is_file() and page.parent.parent == wh / "artifacts"
    assert "<html" in page.read_text()[:500].lower()
    assert run["source"] == f"cli:speedmatrix run {sim_url}"
    assert (
        run["recipe_id"] == f"external/127.0.0.1-{sim_url.rsplit(':', 1)[1]}/kimi-k2.7-code-nvfp4"
    )
    assert run["engine_version"] == "0.1.dev1+g9fedd24fa" and run["engine_ref"] == "9fedd24fa"
    assert run["engine_commit"] == "9fedd24fa"  # what the DAG lands for it (issue #34 item 3)
    # what inspect read from the server's /metrics: the calibrated profile's KV blocks
    assert run["kv_num_blocks"] == yaml.safe_load(PROFILE.read_text())["kv"]["num_gpu_blocks"]
    # a simulated engine says so, and where it ran is not known here (issue #34 item 4)
    assert run["sim_profile"] == "kimi-k2.7-nvfp4-rtxpro6k-x8"
    assert "simulated engine (profile kimi-k2.7-nvfp4-rtxpro6k-x8)" in page.read_text()
    got = {(c["phase"], c["context_label"], c["concurrency"]): c["status"] for c in cells}
    assert got[("decode", "8K", 64)] == "over_capacity"
    assert got[("prefill", "8K", 1)] in ("valid", "invalid")
    assert got[("decode", "8K", 1)] in ("valid", "invalid")
    # the progress: a line per measured cell, its figure and the ETA (not a terminal: plain)
    assert (
        "[1/2] prefill 8K: " in err and "[2/2] 8K x 1: " in err and "tok/s" in err and "ETA" in err
    )
    assert _healthy(sim_url), "a server already running is not ours to stop"


def test_an_adaptive_run_stops_windows_early_and_says_so(sim_url, tmp_path, capsys) -> None:
    """`run --adaptive` (issue #45): each decode window ends once tight (the simulator is
    steady), its cap being --window-s; the cell records the window it used and why it
    stopped, the run that its decode test was adaptive, and the page shows both."""
    wh = tmp_path / "wh"
    rc = main(["run", "--base-url", sim_url, "--model", MODEL, "--contexts", "8K",
               "--concurrencies", "4", "--prefill-contexts", "8K", "--window-s", "20",
               "--adaptive", "--adaptive-min-s", "3", "--max-output-tokens", "4096",
               "--warehouse", str(wh)])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    run, cells, page = _landed(wh, out)
    assert run["decode_test"] == "Adaptive duration" and run["window_s"] == 20.0
    decode = [c for c in cells if c["phase"] == "decode"]
    assert len(decode) == 1, (cells, err)
    cell = decode[0]
    assert cell["status"] == "valid", cell["error"]
    assert (cell["window_mode"], cell["window_stop"]) == ("adaptive", "converged")
    assert 3.0 <= cell["measured_s"] < 20.0, cell["window_note"]
    assert cell["window_halfwidth_pct"] <= cell["adaptive_target_pct"]
    html = page.read_text()
    assert "Adaptive duration" in html
    assert "Reason, window</th>" in html and "window early: ±" in html


def test_run_repeats_the_cells_it_names_as_the_dag_does(sim_url, tmp_path, capsys) -> None:
    """`--repeats 2 --repeat-cells 'prefill 8K'`: the prefill measured a second time, a whole
    pass later, landed in cell_repeats beside the run (the DAG's conf keys, the DAG's steps)."""
    from speedmatrix.store.extra import read_extra

    wh = tmp_path / "wh"
    rc = main(["run", "--base-url", sim_url, "--model", MODEL, *TINY, "--concurrencies", "1",
               "--repeats", "2", "--repeat-cells", "prefill 8K", "--warehouse", str(wh)])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    run, cells, _ = _landed(wh, out)
    assert sorted((c["phase"], c["concurrency"]) for c in cells) == [("decode", 1), ("prefill", 1)]
    repeats = read_extra(Warehouse(str(wh)), "cell_repeats", run_id=run["run_id"])
    assert [(r["phase"], r["context_label"]) for r in repeats.to_dict("records")] == [
        ("prefill", "8K")
    ]
    assert "[3/3]" in err  # the repeat is a cell of the run's progress too
    # the prefill's samples and their spread land with the cell (issue 40, item 3)
    pre = next(c for c in cells if c["phase"] == "prefill")
    assert pre["samples"] == pre["ttft_samples"] == 3 and pre["ttft_spread_pct"] is not None


def test_run_a_recipe_on_this_host(tmp_path, capsys, monkeypatch) -> None:
    home, wh = tmp_path / "home", tmp_path / "wh"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SPEEDMATRIX_API_KEY", raising=False)  # a sim run makes its own
    rc = main(["run", RECIPE, *TINY, *SHORT_PREFILL, "--concurrencies", "1",
               "--port", str(_free_port()), "--warehouse", str(wh)])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    run, cells, page = _landed(wh, out)
    assert page.is_file()
    assert run["recipe_id"] == RECIPE and run["source"] == "cli:speedmatrix run"
    assert run["trigger"] == "manual" and run["host"] == "local"
    assert sorted((c["phase"], c["concurrency"]) for c in cells) == [("decode", 1), ("prefill", 1)]
    assert "starting the server" in err
    no_server_left(home)  # the teardown stopped it and released the lease


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["run", "nope/never"], "no such recipe"),
        (["run", RECIPE, "--contexts", "8X"], "not a token count: '8X'"),
        (["run", RECIPE, "--contexts", "300K"], "max_model_len"),
        (["run", "--base-url", "http://127.0.0.1:9", "--model", "m"], "cannot reach a server"),
        (["run", "--base-url", "127.0.0.1:8000", "--model", "m"], "must be an http(s) URL"),
        (["run", "--model", "m"], "name a RECIPE"),
        (["run", RECIPE, "--base-url", "http://127.0.0.1:9"], "name a RECIPE"),
        # the DAG's conf keys repeats / repeat_cells, checked by the DAG's own rule
        (["run", RECIPE, "--repeats", "11"], "repeats must be 1..10"),
        (["run", RECIPE, "--repeat-cells", "prefill 8K"], "but repeats is 1"),
        (["run", RECIPE, *TINY, "--repeats", "2", "--repeat-cells", "64Kx9"], "repeat_cells"),
    ],
)
def test_bad_input_is_one_clear_line_and_non_zero(args, says, capsys) -> None:
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2
    assert says in err and err.startswith("speedmatrix run: "), err


def test_a_model_the_server_does_not_serve_is_refused(sim_url, capsys) -> None:
    rc = main(["run", "--base-url", sim_url, "--model", "other"])
    err = capsys.readouterr().err
    assert rc == 2 and f"does not serve 'other' (it serves: {MODEL})" in err


def _plant_history(wh: Warehouse, run_id: str) -> None:
    """Three earlier runs of the same engine on this host, each figure within 0.5% of the
    run's own: a history whose noise is known (issue #40: a figure without one is unverified,
    never a regression). Landed before the run in time, so the run stays the latest."""
    from datetime import timedelta

    run, cells, _ = wh.read_run(run_id)
    for i, f in enumerate((1.004, 0.996, 1.002)):
        earlier = {
            **run,
            "run_id": f"{run_id}-h{i}",
            "started_at": run["started_at"] - timedelta(hours=3 - i),
        }
        scaled = [
            {k: (v * f if k in ("total_tok_s", "per_request_tok_s") and v else
                 v / f if k in ("ttft_ms", "tbt_ms") and v else v) for k, v in c.items()
             if k not in ("run_id", "recipe_id", "run_date", "run_month", "schema_version")}
            for c in cells
        ]  # fmt: skip
        wh.land_run(earlier, scaled, [])
    wh.close()


def test_a_regression_is_landed_shown_on_the_terminal_and_fails_the_job(tmp_path) -> None:
    """Issue #34 items 1-2, on a real terminal: two runs of one server, the second slower
    (the simulator at half speed). The second lands its comparisons and noise as the DAG
    does, the site's copy says what its page says, the terminal shows the progress bar and
    the verdict, and `--fail-on-regression` exits 3."""
    from terminal import Terminal

    from speedmatrix.report.site import build_site
    from speedmatrix.sim.runner import run_in_thread
    from speedmatrix.store.extra import read_extra

    wh, port = tmp_path / "wh", _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    env.pop("SPEEDMATRIX_API_KEY", None)
    run_ids = []
    profile = yaml.safe_load(PROFILE.read_text())
    for speed, version in (
        (SIM_SCALE, "0.1.dev1+g9fedd24fa"),
        (SIM_SCALE / 2, "0.1.dev2+g1234abcde"),
    ):
        # the second run: a later commit of the engine, at half the speed (both faster than
        # the wall clock: the figures of both runs in the same unit, half apart)
        with run_in_thread({**profile, "version": version}, port=port, time_scale=speed) as url:
            term = Terminal(
                [sys.executable, "-m", "speedmatrix", "run", "--base-url", url,
                 "--model", MODEL, *TINY, "--concurrencies", "2", "--warehouse", str(wh),
                 "--fail-on-regression"], env=env, cwd=str(ROOT),
            )  # fmt: skip
            try:
                term.expect(r"ETA \d+:\d\d")  # the live bar, on a terminal
                rc = term.wait()
            finally:
                term.close()
        # (partial: a cell the loaded client marked invalid, which is not compared)
        run_ids.append(term.expect(r"run (\S+): (?:success|partial)").group(1))
        if speed == SIM_SCALE:
            assert rc == 0, term.text
            assert "verdict: not compared (no earlier successful run of external/" in term.text
            _plant_history(Warehouse(str(wh)), run_ids[0])
    assert rc == 3, term.text
    verdict = term.expect(r"verdict: (\d+) regressions?, \d+ improvements? beyond noise "
                          r"against run (\S+)")  # fmt: skip
    assert int(verdict.group(1)) >= 1 and verdict.group(2) == run_ids[0]
    # each regressed figure, baseline -> this run; half the speed: throughput halves (prefill
    # tok/s, or decode total tok/s when the loaded client left that cell valid)
    assert re.search(
        r"▼ (?:prefill 8K prefill_tok_s|8Kx2 total_tok_s): [\d,.]+ -> [\d,.]+ \(-\d", term.text
    ), term.text[-2000:]
    # landed as the DAG lands them: the site's copy of the run is compared, as its page is
    rows = read_extra(Warehouse(str(wh)), "comparisons", run_id=run_ids[1])
    assert set(rows["baseline_run_id"]) == {run_ids[0]} and "regression" in set(rows["verdict"])
    assert not read_extra(Warehouse(str(wh)), "noise", run_id=run_ids[1]).empty
    build_site(Warehouse(str(wh)), tmp_path / "site")
    index = (tmp_path / "site" / "index.html").read_text()
    assert "regressed" in index and "not compared (no baseline)" not in index.split("</table>")[0]


def test_a_killed_run_is_taken_over_and_ctrl_c_stops_what_it_started(tmp_path) -> None:
    """Issue #34 item 6, on a real terminal. A run killed outright (SIGKILL: no cleanup) leaves
    its server and its lease; the next run takes the host over at once, saying so, and stops
    that server. Ctrl-C on that run stops its own server and releases the lease."""
    from speed_matrix_helpers import no_server_left
    from terminal import Terminal

    home, wh = tmp_path / "home", tmp_path / "wh"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    env.pop("SPEEDMATRIX_API_KEY", None)
    argv = [sys.executable, "-m", "speedmatrix", "run", RECIPE, *SHORT_PREFILL,
            "--contexts", "8K", "--concurrencies", "1", "--window-s", "60",
            "--port", str(_free_port()), "--warehouse", str(wh)]  # fmt: skip
    first = Terminal(argv, env=env, cwd=str(ROOT))
    try:
        first.expect(r"8K x 1", timeout=180)  # measuring the decode cell
        os.killpg(first.proc.pid, signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
    finally:
        first.close()
    left = [int(p.read_text().split()[0]) for p in (home / ".speedmatrix/servers").glob("*/pid")]
    assert left and all(group_running(g) for g in left), "the killed run left its server"
    second = Terminal(argv, env=env, cwd=str(ROOT))
    try:
        # the takeover says what the host saw of the gone holder (its PID: no such process)
        second.expect(r"was held by \S+: no process \d+ on the host .*; taken over", timeout=120)
        assert not any(group_running(g) for g in left), "the gone run's server was stopped"
        second.expect(r"8K x 1", timeout=180)
        second.ctrl_c()
        assert second.wait(timeout=120) == 130
    finally:
        second.close()
    assert "interrupted: stopped the server, released the lease on local" in second.text
    no_server_left(home)


def test_a_manual_kv_budget_decides_over_capacity_and_is_recorded(sim_url, tmp_path, capsys):
    """Issue #43 item 11: a server whose /metrics cannot tell its capacity (context
    parallelism, DCP) is given one by hand, `--kv-budget` (recipe `matrix.kv_budget`, conf
    `kv_budget`): the over-capacity rule uses it instead of the server's blocks and the run
    records it. 12K tokens of budget: 8K x 1 fits, 8K x 2 does not (the simulator's own KV
    cache holds both)."""
    wh = tmp_path / "wh"
    rc = main(["run", "--base-url", sim_url, "--model", MODEL, *TINY,
               "--concurrencies", "1", "2", "--kv-budget", "12K", "--warehouse", str(wh)])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    run, cells, _ = _landed(wh, out)
    assert run["kv_budget_tokens"] == 12288
    assert run["kv_num_blocks"] == yaml.safe_load(PROFILE.read_text())["kv"]["num_gpu_blocks"]
    got = {(c["phase"], c["context_label"], c["concurrency"]): c["status"] for c in cells}
    assert got[("decode", "8K", 2)] == "over_capacity"
    assert got[("decode", "8K", 1)] in ("valid", "invalid")


def test_burst_cells_are_measured_landed_and_shown_beside_the_matrix(sim_url, tmp_path, capsys):
    """Issue #43 item 12: `--burst N…` adds burst cells (recipe `matrix.burst`, conf `burst`):
    at each decode context, N requests sent at once and measured to their completion. Their
    own cells (phase burst), over capacity by the same rule, landed with their latency and
    per-user end-to-end tok/s (the cells suite passed: they are in `cells`, not quarantined),
    their requests in `requests`, and a section of their own on the page."""
    wh = tmp_path / "wh"
    rc = main(["run", "--base-url", sim_url, "--model", MODEL, *TINY, "--concurrencies", "1",
               "--burst", "2", "64", "--warehouse", str(wh)])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    run, cells, page = _landed(wh, out)
    got = {(c["phase"], c["context_label"], c["concurrency"]): c for c in cells}
    assert set(got) == {
        ("prefill", "8K", 1),
        ("decode", "8K", 1),
        ("burst", "8K", 2),
        ("burst", "8K", 64),
    }
    burst = got[("burst", "8K", 2)]
    assert burst["status"] == "valid", burst["error"]
    assert burst["completed_requests"] == 2 and burst["output_tokens"] == 2 * 256
    assert burst["window_s"] is None and burst["max_output_tokens"] == 256
    assert burst["latency_ms"] > burst["ttft_ms"] > 0
    assert burst["latency_ms"] <= burst["latency_p90_ms"] <= burst["latency_p99_ms"]
    assert burst["e2e_per_request_tok_s"] == pytest.approx(
        256 / (burst["latency_ms"] / 1000), rel=0.02
    )
    assert burst["total_tok_s"] == pytest.approx(512 / burst["measured_s"], rel=1e-6)
    assert got[("burst", "8K", 64)]["status"] == "over_capacity"
    # the decode cell's figures are its own: it has no latency of a completed burst
    assert got[("decode", "8K", 1)]["latency_ms"] is None
    _, _, requests = Warehouse(str(wh)).read_run(run["run_id"])
    assert len([r for r in requests if r["phase"] == "burst"]) == 2
    # the progress names it, and the page has its section with its latency
    assert "burst 8K x 2: " in err
    html = page.read_text()
    assert "<h2>Burst / E2E decode</h2>" in html
    section = html[html.index("<h2>Burst / E2E decode</h2>") :]
    assert f"{burst['latency_ms']:,.0f} ms" in section
