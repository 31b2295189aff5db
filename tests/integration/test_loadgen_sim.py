"""The load generator against the simulator: accuracy, injected faults, and the reference replay.

Ground truth is the simulator's own record of every token's emission time (`/sim/requests
?detail=1`), on its clock; the window the load generator used is mapped onto that clock through
`/sim/state` (perf_counter is CLOCK_MONOTONIC on Linux, shared by both processes). The simulator
runs in its own process so the two event loops never share a GIL.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from replay import (
    calibrated_page,
    problems,
    reference_replay,
    short_prompt_replay,
    spec_replay,
)

from speedmatrix.loadgen import DecodeConfig, PrefillConfig, run_decode, run_prefill
from speedmatrix.loadgen.runner import run_loop
from speedmatrix.records import CELL_FIELDS
from speedmatrix.sim.runner import run_in_process as sim

pytestmark = [pytest.mark.integration, pytest.mark.timing]

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "include" / "sim-profiles"
CELL_KEYS = sorted(f.name for f in CELL_FIELDS)


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.load(resp)


def _post(url: str, body: dict) -> object:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def sim_clock_origin(url: str) -> float:
    """perf_counter value at which the simulator's clock read 0 (time_scale 1)."""
    best = None
    for _ in range(5):
        t0 = time.perf_counter()
        state = _get(url + "/sim/state")
        t1 = time.perf_counter()
        cand = ((t0 + t1) / 2 - state["sim_time"], t1 - t0)  # type: ignore[index]
        if best is None or cand[1] < best[1]:
            best = cand
    assert best is not None
    return best[0]


@pytest.fixture(scope="module")
def wide_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic spec-decode profile (chunks of several tokens), widened to 512K contexts
    and 128 sequences so one profile covers the whole accuracy range."""
    data = yaml.safe_load((PROFILES / "synthetic-specdec-not-calibrated.yaml").read_text())
    data["name"] = "loadgen-accuracy-wide"
    data["max_model_len"] = 600_000
    data["max_num_seqs"] = 256
    data["max_num_batched_tokens"] = 8192
    data["kv"]["num_gpu_blocks"] = 80_000
    # 26K prompt tok/s (a 512K warm-up in 20 s) made the two long-context cells most of this
    # file's time; the decode figures checked here do not depend on it
    data["prefill"]["points"] = [[1024, 0.005], [8192, 0.04], [65536, 0.3], [524288, 2.5]]
    path = tmp_path_factory.mktemp("profiles") / "wide.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def truth_in_window(url: str, origin: float, ws: float, we: float, max_tokens: int) -> dict:
    """Total tok/s and median per-request per-token TBT from the sim's token times."""
    reqs = [
        r
        for r in _get(url + "/sim/requests?detail=1")  # type: ignore[union-attr]
        if r["max_tokens"] == max_tokens
    ]
    a, b = ws - origin, we - origin
    rates = []
    tbts = []
    ttfts = [r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
    for r in reqs:
        times = [t for t in r["token_times"] if a < t <= b]
        if len(times) > 1 and times[-1] > times[0]:
            after_first = sum(1 for t in times if t > times[0])
            tbts.append((times[-1] - times[0]) / after_first)
            if times[-1] - times[0] > 0.8 * (b - a):  # streams that ran the whole window
                rates.append(after_first / (times[-1] - times[0]))
    return {
        # the sum of the streams' steady rates: insensitive to a few ms of error in mapping
        # the window onto the simulator's clock (chunks carry ~5 tokens at once)
        "total_tok_s": sum(rates),
        "tbt_ms": 1000 * statistics.median(tbts),
        "ttft_ms": 1000 * statistics.median(ttfts),
        "spec": any(
            len(set(r["token_times"])) < len(r["token_times"]) for r in reqs if r["token_times"]
        ),
    }


@pytest.mark.parametrize(
    ("concurrency", "context"),
    [(1, 8192), (8, 65536), (32, 4096), (64, 2048), (128, 1024), (1, 524288)],
)
def test_accuracy_against_simulator_ground_truth(
    wide_profile: Path, concurrency: int, context: int
) -> None:
    window: dict[str, float] = {}
    max_out = 20_000
    with sim(wide_profile) as url:
        origin = sim_clock_origin(url)
        cfg = DecodeConfig(
            base_url=url, model="sim-specdec", context=context, concurrency=concurrency,
            window_s=8.0, max_output_tokens=max_out, repetition_check=True,
            # accuracy is checked against the truth directly here; the saturation guard is
            # loosened because this 2-core box is shared (the guard has its own tests)
            max_loop_lag_ms=50.0, max_client_cpu_pct=100.0,
            # at 512K the simulator's own loop stalls now and then (measured: max 440 ms),
            # delivering chunks behind its counters; 3% there, the 1% rule everywhere else
            token_tolerance=0.03 if context > 100_000 else 0.01,
            on_window=lambda a, b: window.update(ws=a, we=b),
        )  # fmt: skip
        cell, _rows = run_loop(run_decode(cfg))
        truth = truth_in_window(url, origin, window["ws"], window["we"], max_out)
    assert sorted(cell) == CELL_KEYS
    assert cell["status"] == "valid", cell["error"]
    assert truth["spec"], "the profile should produce multi-token steps"
    assert cell["tokens_per_chunk"] > 1.5  # speculative decoding: several tokens per chunk
    assert cell["total_tok_s"] == pytest.approx(truth["total_tok_s"], rel=0.01)
    assert cell["tbt_ms"] == pytest.approx(truth["tbt_ms"], rel=0.01)
    assert cell["context_tokens"] == context
    assert cell["server_generation_tokens"] == pytest.approx(cell["output_tokens"], rel=0.01)
    assert cell["spec_acceptance_length"] is None or cell["spec_acceptance_length"] > 1
    # TTFT: the simulator's truth starts when its HTTP handler has parsed the body, and its
    # clock can run ahead of delivery, so here the client's TTFT is only held to causality
    # (never below the truth); its stamping precision is proven against the ideal server,
    # whose clock is the client's own (tests/unit/test_loadgen_cells.py, benchmarks/).
    assert cell["ttft_ms"] >= truth["ttft_ms"] - 0.5


@pytest.mark.parametrize(
    ("faults", "status", "reason"),
    [
        ({"http_500_every": 7}, "failed", "HTTP 500: Internal server error (simulated fault)"),
        (
            {"disconnect_every": 7, "disconnect_after_tokens": 8},
            "failed",
            "connection closed by server after 8 tokens",
        ),
        (
            {"short_output_every": 7, "short_output_tokens": 4},
            "failed",
            "short output: 4 of 64 tokens",
        ),
        # 3 run, the 4th waits for a slot, starts, and from then on a restart always queues
        ({"max_running": 3}, "invalid", "requests queued on the server during the window"),
        ({"repetition_every": 1}, "invalid", "repetition loop"),
        # a server whose outputs echo their prompt: the copy check (docs/measurement.md rule 11)
        ({"echo_every": 1}, "invalid", "outputs copy their prompt"),
    ],
)
def test_simulator_faults_give_status_and_reason(
    wide_profile: Path, faults: dict, status: str, reason: str
) -> None:
    with sim(wide_profile) as url:
        _post(url + "/sim/faults", faults)
        cfg = DecodeConfig(
            base_url=url, model="sim-specdec", context=1024, concurrency=4, window_s=3.0,
            max_output_tokens=64, first_token_timeout_s=3.0, first_token_s_per_1k=0.1,
        )  # fmt: skip
        cell, _ = run_loop(run_decode(cfg))
    assert cell["status"] == status, cell
    assert reason in (cell["error"] or ""), cell["error"]


def test_engine_dead_mid_cell_fails_the_cell(wide_profile: Path) -> None:
    import threading

    errors: list[BaseException] = []

    def kill_when_busy(url: str) -> None:
        try:
            deadline = time.monotonic() + 30
            while _get(url + "/sim/state")["running"] < 4:  # type: ignore[index]
                assert time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(0.5)
            _post(url + "/sim/faults", {"engine_dead": True})
        except BaseException as exc:
            errors.append(exc)

    with sim(wide_profile) as url:
        killer = threading.Thread(target=kill_when_busy, args=(url,))
        killer.start()
        cfg = DecodeConfig(
            base_url=url, model="sim-specdec", context=1024, concurrency=4, window_s=5.0,
            max_output_tokens=20_000,
        )  # fmt: skip
        cell, _ = run_loop(run_decode(cfg))
        killer.join()
    assert errors == []
    assert cell["status"] == "failed"
    assert "connection closed by server" in cell["error"]


# The reference replay's sample (phase, label, concurrency): both prefill time scales (8K at
# 1x, 64K at 5x), decode at one stream, at 16 (the batch), at a long context with 2 streams
# (KV-dependent steps), and every over-capacity cell (by the KV rule, no request sent). Every
# cell of the page: benchmarks/replay_bench.py (it took 118 s of phase 2 as a test).
REFERENCE_SAMPLE = {
    ("prefill", "8K", 1), ("prefill", "64K", 1),
    ("decode", "8K", 1), ("decode", "8K", 16), ("decode", "64K", 2),
}  # fmt: skip


@pytest.mark.long
def test_replay_of_reference_cells_within_5_percent() -> None:
    """A sample of the published matrix against its calibrated profile (tests/replay.py
    says what is compared and at which time scale): each figure within 5% of the page and
    each status the page's."""
    rows = reference_replay(
        lambda c: (
            c["status"] == "over_capacity"
            or (c["phase"], c["context_label"], c["concurrency"]) in REFERENCE_SAMPLE
        )
    )
    compared = {r["cell"] for r in rows}
    assert len(compared) == len(REFERENCE_SAMPLE) + 32  # the page's 32 over-capacity cells
    assert problems(rows) == [], "\n".join(problems(rows))


def test_a_repeated_prefill_cell_is_cold(wide_profile: Path) -> None:
    """The repeat of a prefill cell, sent as the pipeline sends it, finds nothing of its
    primary's prompt in the prefix cache (each pass has its own run tag and cache salt)."""
    from speedmatrix.flows import matrix
    from speedmatrix.plan import KvCapacity, MatrixSpec, plan_matrix

    spec = MatrixSpec.build(
        prefill_contexts=[8192], contexts=[], concurrencies=[], max_output_tokens=64, window_s=1
    )
    planned = plan_matrix(spec, KvCapacity(80_000, 16), repeats=2).prefill
    assert [c["repeat"] for c in planned] == [0, 1]
    resolved = {"host": "local", "served_model": "sim-specdec", "run_tag": "cold0test"}
    with sim(wide_profile) as url:
        cells = [matrix.measure(resolved, {"base_url": url}, c)[0] for c in planned]
    for cell in cells:
        assert cell["status"] == "valid", cell["error"]
        assert cell["prefix_cache_hit_rate"] == 0.0, cell


def test_a_prefill_measured_on_a_cached_prompt_is_the_warm_prefill_the_pipeline_retries(
    wide_profile: Path,
) -> None:
    """A prefill cell measured twice with one run tag finds its prompt cached the second time:
    the load generator marks it with records.WARM_PREFILL, and that real record is what the
    pipeline measures again cold (matrix._warm_prefill); the first is not (issue #33)."""
    from speedmatrix.flows import matrix
    from speedmatrix.plan import KvCapacity, MatrixSpec, plan_matrix
    from speedmatrix.records import WARM_PREFILL

    spec = MatrixSpec.build(
        prefill_contexts=[8192], contexts=[], concurrencies=[], max_output_tokens=64, window_s=1
    )
    cell = plan_matrix(spec, KvCapacity(80_000, 16)).prefill[0]
    resolved = {"host": "local", "served_model": "sim-specdec", "run_tag": "warm1test"}
    with sim(wide_profile) as url:
        cold, warm = (matrix.measure(resolved, {"base_url": url}, cell)[0] for _ in range(2))
    assert cold["status"] == "valid" and not matrix._warm_prefill(cold), cold["error"]
    assert warm["status"] == "invalid" and warm["error"].startswith(WARM_PREFILL), warm["error"]
    assert matrix._warm_prefill(warm)


def test_decode_cells_of_a_context_reuse_its_prompts_so_warm_up_is_small(
    wide_profile: Path,
) -> None:
    """Issue #19: run in the plan's order (the DAG's map order), a context's prefill cell
    leaves stream 0's prompt cached and each decode cell reuses the earlier cells' prompts:
    the simulator prefills each distinct prompt once, and the first decode cell's recorded
    warm-up is a fraction of the prefill it no longer pays (the prefill cell's TTFT)."""
    from speedmatrix.flows import matrix
    from speedmatrix.plan import KvCapacity, MatrixSpec, plan_matrix, task_cells

    ctx = 131072
    spec = MatrixSpec.build(
        prefill_contexts=[ctx], contexts=[ctx], concurrencies=[1, 2], max_output_tokens=256,
        window_s=1.5,
    )  # fmt: skip
    planned = plan_matrix(spec, KvCapacity(80_000, 16)).as_dict()
    order = [*task_cells(planned, "prefill"), *task_cells(planned, "decode")]
    assert [c["label"] for c in order] == ["128K", "128K x 1", "128K x 2"]
    resolved = {"host": "local", "served_model": "sim-specdec", "run_tag": "warm0test"}
    with sim(wide_profile) as url:
        pre, one, two = (matrix.measure(resolved, {"base_url": url}, c)[0] for c in order)
        requests = _get(url + "/sim/requests")
    assert pre["status"] == "valid", pre["error"]
    assert pre["warmup_s"] is None  # a prefill cell's one cold request is its measurement
    for cell in (one, two):
        assert cell["status"] in ("valid", "invalid"), cell["error"]
        assert isinstance(cell["warmup_s"], float) and cell["warmup_s"] >= 0
    # prefilled from scratch: the prefill cell's cold samples (the last of them stream 0's
    # prompt, which the decode cells reuse) and stream 1 by 128K x 2's warm-up; nothing else
    cold = [r for r in requests if r["cached_tokens"] < r["prompt_tokens"] // 2]  # type: ignore[union-attr]
    assert pre["ttft_samples"] == 3
    assert len(cold) == pre["ttft_samples"] + 1, cold
    assert one["warmup_s"] < 0.5 * pre["ttft_ms"] / 1000, (one["warmup_s"], pre["ttft_ms"])


def _decode_cfg(url: str) -> DecodeConfig:
    return DecodeConfig(
        base_url=url, model="sim-specdec", context=1024, concurrency=4, window_s=3.0,
        first_token_timeout_s=3.0, first_token_s_per_1k=0.1, idle_timeout_s=10.0,
        # no request ends inside the window (C held), and the saturation guard loosened as in
        # the accuracy test: these cells are about the server readings, on a shared box
        max_output_tokens=4000, max_loop_lag_ms=50.0, max_client_cpu_pct=100.0,
    )  # fmt: skip


def test_a_transient_metrics_failure_is_retried_not_read_as_no_metrics(wide_profile: Path) -> None:
    """Two failed /metrics reads at the start of the cell (the idle check): retried, the cell
    keeps its server checks (server readings, the token cross-check) and is valid."""
    with sim(wide_profile) as url:
        _post(url + "/sim/faults", {"metrics_error": 500, "metrics_error_reads": 2})
        cell, _ = run_loop(run_decode(_decode_cfg(url)))
    assert cell["status"] == "valid", cell["error"]
    assert cell["active_source"] == "server"
    assert isinstance(cell["server_generation_tokens"], int)


def test_a_window_without_its_metrics_readings_is_invalid(wide_profile: Path) -> None:
    """/metrics fails from the moment the streams run: the window has neither its start or end
    reading nor its gauge readings, so the token cross-check and the preemption check cannot
    be made: the cell is invalid and says why (it used to pass with the checks skipped)."""
    import threading

    def fail_metrics_when_busy(url: str) -> None:
        deadline = time.monotonic() + 30
        while _get(url + "/sim/state")["running"] < 4 and time.monotonic() < deadline:  # type: ignore[index]
            time.sleep(0.02)
        _post(url + "/sim/faults", {"metrics_error": 500, "metrics_error_reads": 0})
        time.sleep(4.0)  # past the 3 s window
        _post(url + "/sim/faults", {})

    with sim(wide_profile) as url:
        t = threading.Thread(target=fail_metrics_when_busy, args=(url,))
        t.start()
        try:
            cell, _ = run_loop(run_decode(_decode_cfg(url)))
        finally:
            t.join()
    assert cell["status"] == "invalid", cell
    assert "/metrics" in cell["error"], cell["error"]
    assert "HTTP 500" in cell["error"], cell["error"]


def test_a_server_without_metrics_is_declared_client_measured(wide_profile: Path) -> None:
    """404 from the first read: the server has no /metrics, a declared case (active requests
    from the client's side), not a failure."""
    with sim(wide_profile) as url:
        _post(url + "/sim/faults", {"metrics_error": 404})
        cell, _ = run_loop(run_decode(_decode_cfg(url)))
        prefill, _ = run_loop(
            run_prefill(PrefillConfig(base_url=url, model="sim-specdec", context=2048))
        )
    assert cell["status"] == "valid", cell["error"]
    assert cell["active_source"] == "client" and cell["server_generation_tokens"] is None
    assert prefill["status"] == "valid", prefill["error"]


def test_a_failing_metrics_endpoint_is_not_an_idle_server(wide_profile: Path) -> None:
    """Every /metrics read fails (500): the idle check before the cell cannot pass, and says
    why; a failed read is neither "idle" nor "this server has no /metrics"."""
    with sim(wide_profile) as url:
        _post(url + "/sim/faults", {"metrics_error": 500})
        cfg = PrefillConfig(base_url=url, model="sim-specdec", context=2048, idle_timeout_s=1.0)
        cell, _ = run_loop(run_prefill(cfg))
    assert cell["status"] == "failed", cell
    assert "not idle" in cell["error"] and "/metrics unreadable: HTTP 500" in cell["error"]


@pytest.mark.long
def test_replay_of_a_speculative_decoding_page_within_5_percent(tmp_path: Path) -> None:
    """A profile calibrated from a speculating server's page, served by the real simulator and
    measured by the real load generator (tests/replay.py, `spec_replay`): a C=1 cell (one
    prompt decides it) and a cell of four streams whose total and median disagree, each within
    5% of the page, valid, with the acceptance the profile predicts. Every cell of
    SPEC_REPLAY: benchmarks/replay_bench.py."""
    rows = spec_replay([(1024, 1), (8192, 4)], tmp_path)
    assert len(rows) == 2 * 5  # four figures and the acceptance, per cell
    assert problems(rows) == [], "\n".join(problems(rows))


@pytest.mark.long
def test_a_calibrated_speculative_page_holds_at_its_labels_and_its_implied_prompts(
    tmp_path: Path,
) -> None:
    """Issue #43: a page whose tool sent prompts short of their labels (64K as about 64,000
    tokens) calibrates cells keyed on those implied prompts; a recipe measures the label's own
    tokens. Over HTTP, the real load generator against the real simulator: 64K x 2 at the
    implied length and at the nominal one, each valid, total tok/s and time between tokens
    within 5% of the page, the acceptance the simulator's counters give within 5% of the
    profile's own prediction at that length. Before, the nominal sizes missed the calibrated
    cell and took a random draw (64K x 2: -4.9% on this page in simulated time, -22% to +19%
    over HTTP on the issue's unseen page). 16K x 4 too: benchmarks/replay_bench.py."""
    rows = short_prompt_replay([("64K", 2, 65536)], tmp_path)
    assert len(rows) == 2 * 3  # two lengths: total tok/s, time between tokens, acceptance
    assert problems(rows) == [], "\n".join(problems(rows))


@pytest.mark.long
def test_a_dspark_like_pages_507k_x1_holds_over_http_by_the_published_tools_definitions(
    tmp_path: Path,
) -> None:
    """Issue #43 item 2: the DSpark-like page's 512K row (sent as 507K, C=1 only, a first token
    seconds long, 30 s windows: its request finishes inside the window and the restart waits
    its first token there), calibrated, served by the real simulator in real time and measured
    by the real load generator with the published tool's definitions (the page's): total,
    per-request (total / C), time between tokens and TTFT within 5% of the page. Before, the
    twin's prediction opened a published-tool window at the stream's first token where the
    tool opens it 3-4 s later at its readiness judgement: the page read 149.7 tok/s with the
    restart's wait cut off and the same twin measured 126.9 over HTTP (-15%: the restart's
    first token came inside the window); and the simulator's own tokenizing of 2 MB of chat
    text added to the modelled first-token delay, which already holds the real server's
    (TTFT 4,683 ms against 3,079: +52%).

    Real time: the published prompt is chat text the simulator tokenizes, and a faster clock
    would multiply that wall time into the model. The server's active-request check is ours,
    not the tool's: a restart's 3 s wait idles one stream a tenth of the window, so that bound
    is widened here; the figures are what is held."""
    profile, path, cells = calibrated_page("dspark-like", tmp_path)
    want = next(c for c in cells if c["context_label"] == "512K" and c["concurrency"] == 1)
    assert want["status"] == "valid" and want["context_tokens"] < 524288 - 4096
    with sim(path, time_scale=1.0) as url:
        got, _ = run_loop(
            run_decode(DecodeConfig(
                base_url=url, model=profile.served_model_name, context=want["context_tokens"],
                concurrency=1, window_s=30.0, max_output_tokens=4096, run_tag="dspark",
                measurement_profile="published", first_token_timeout_s=300.0,
                max_loop_lag_ms=200.0, max_client_cpu_pct=100.0, max_active_deviation=0.2,
            ))
        )  # fmt: skip
    assert got["status"] == "valid", (got["status"], got["error"])
    keys = ("total_tok_s", "per_request_tok_s", "tbt_ms", "ttft_ms")
    off = {k: f"{got[k]:.1f} vs {want[k]:.1f}" for k in keys if abs(got[k] / want[k] - 1) > 0.05}
    assert off == {}, off
