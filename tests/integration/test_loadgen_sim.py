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

from speedmatrix.loadgen import DecodeConfig, PrefillConfig, run_decode, run_prefill
from speedmatrix.loadgen.runner import run_loop
from speedmatrix.records import CELL_FIELDS
from speedmatrix.sim.runner import run_in_process as sim

pytestmark = [pytest.mark.integration, pytest.mark.timing]

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "include" / "sim-profiles"
REFERENCE_PROFILE = PROFILES / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"
REFERENCE_REPORT = ROOT / "include" / "reference" / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt"
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
            duration_s=8.0, max_output_tokens=max_out, repetition_check=True,
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
            base_url=url, model="sim-specdec", context=1024, concurrency=4, duration_s=3.0,
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
            base_url=url, model="sim-specdec", context=1024, concurrency=4, duration_s=5.0,
            max_output_tokens=20_000,
        )  # fmt: skip
        cell, _ = run_loop(run_decode(cfg))
        killer.join()
    assert errors == []
    assert cell["status"] == "failed"
    assert "connection closed by server" in cell["error"]


# Simulated seconds per decode window (the published 30 s took 16 x 6 s of wall time at 5x;
# 12 s holds the slowest cell's count, 8Kx1 at 55 tok/s, to 660 tokens, 0.3% per edge token).
REPLAY_WINDOW_S = 12.0


def _replay(url: str, profile: object, cells: list[dict], scale: float) -> list[str]:
    """Run the published cells against a simulator at `scale`; what differs by over 5%."""
    from speedmatrix.plan import sent_context
    from speedmatrix.sim.predict import over_capacity

    problems: list[str] = []
    for want in cells:
        # as a run sends it: the 256K prefill as 262,143 tokens on the 262,144-token server
        out = 1 if want["phase"] == "prefill" else 4096
        ctx = sent_context(want["context_tokens"], out, profile.max_model_len)  # type: ignore[attr-defined]
        conc = want["concurrency"]
        label = f"{want['phase']} {want['context_label']} x{conc}"
        common = {
            "base_url": url, "model": profile.served_model_name, "context": ctx,  # type: ignore[attr-defined]
            "time_scale": scale, "run_tag": "replay", "first_token_timeout_s": 120.0,
        }  # fmt: skip
        # the saturation guard and the counter cross-check watch wall-clock effects that
        # the time scale multiplies (a 10 ms stall of this shared box = 50 simulated ms);
        # here the figures themselves are held to the published ones instead
        guards = {"max_loop_lag_ms": 50.0, "max_client_cpu_pct": 100.0, "token_tolerance": 0.03}
        if want["phase"] == "prefill":
            # one cold prompt (not the default 3): the replay holds the figure to the page, and
            # three would triple the 256K prefills' minutes
            got, _ = run_loop(run_prefill(PrefillConfig(**common, samples=1)))
            keys = ["total_tok_s"]
        else:
            if over_capacity(profile, ctx, conc, 4096):
                if want["status"] != "over_capacity":
                    problems.append(f"{label}: over capacity here, {want['status']} there")
                continue
            got, _ = run_loop(
                run_decode(DecodeConfig(**common, **guards, concurrency=conc,
                                        duration_s=REPLAY_WINDOW_S, max_output_tokens=4096,
                                        prompt_mode="shared"))
            )  # fmt: skip
            # the published count is over its own 30 s window: compared per second of window
            want = {
                **want,
                "output_tokens": want["output_tokens"] * REPLAY_WINDOW_S / want["measured_s"],
            }
            keys = ["total_tok_s", "per_request_tok_s", "tbt_ms", "output_tokens"]
        if got["status"] != want["status"]:
            problems.append(f"{label}: status {got['status']} ({got['error']}) vs {want['status']}")
            continue
        for key in keys:
            if abs(got[key] - want[key]) > 0.05 * abs(want[key]):
                problems.append(f"{label}: {key} {got[key]:.1f} vs {want[key]:.1f}")
    return problems


def test_replay_of_the_reference_matrix_within_5_percent() -> None:
    """Every runnable cell of the published matrix against its calibrated profile, 5x time.

    Compared within 5%: total tok/s, per-request tok/s, time between tokens and output
    tokens of every decode cell, prompt tok/s of every prefill cell; statuses identical
    (over-capacity cells by the KV rule, all others valid). Decode TTFT is not compared: at 5x
    time every millisecond the simulator's HTTP handler or this shared CPU adds becomes 5
    simulated ms, which the published report never had (TTFT accuracy is proven against the
    ideal server, whose clock is the client's own).
    """
    # both ship with the project: missing is a failure, never a skip
    assert REFERENCE_PROFILE.exists() and REFERENCE_REPORT.exists()
    from speedmatrix.published.parse import parse_report
    from speedmatrix.sim.profile import load_profile

    profile = load_profile(str(REFERENCE_PROFILE))
    ref = parse_report(REFERENCE_REPORT.read_text(), source=REFERENCE_REPORT.name)
    # 5x: a 30 s window takes 6 s. Faster amplifies every ms the simulator's HTTP handling
    # or a busy shared CPU adds (x scale, in simulated time) past the 5% budget. A prefill
    # cell is one request: at 5x the 8K prompt's 1.32 s is 264 ms of wall time, in which
    # 13 ms of tokenising and delivery on a loaded CI box was already 5% (5886 vs 6206 tok/s).
    # So prefills shorter than 8 s of simulated time run at 1x on a second simulator (~10 s
    # more in all), so that each cell's fixed wall-clock cost weighs the same few tenths of %.
    scale = 5.0
    problems: list[str] = []
    slow = [c for c in ref.cells if c["phase"] == "prefill" and c["ttft_ms"] < 8000]
    fast = [c for c in ref.cells if c not in slow]
    assert slow and fast
    for cells, cell_scale in ((slow, 1.0), (fast, scale)):
        with sim(REFERENCE_PROFILE, time_scale=cell_scale) as url:
            problems += _replay(url, profile, cells, cell_scale)
    assert problems == [], "\n".join(problems)


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
        base_url=url, model="sim-specdec", context=1024, concurrency=4, duration_s=3.0,
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


# Cells of the synthetic speculative-decoding page replayed over HTTP: every C=1 cell (one
# prompt decides each; the load generator's prompts are not the ones the page was made with)
# and cells of several streams whose total and median disagree (one stream apart).
SPEC_REPLAY = [(1024, 1), (2048, 1), (4096, 1), (8192, 1), (1024, 8), (2048, 4), (8192, 4)]


def test_replay_of_a_speculative_decoding_page_within_5_percent(tmp_path: Path) -> None:
    """A profile calibrated from a speculating server's page, served by the real simulator and
    measured by the real load generator: each replayed cell within 5% of the page (total tok/s,
    per-request tok/s, time between tokens, output tokens), status valid, and the acceptance
    length read from the simulator's vLLM counters equal to what the profile predicts.

    2x time (a 10 s window is 5 s of wall time): the synthetic server's steps are a few
    simulated ms, and at 5x the HTTP handling of 8 streams would weigh on them.
    """
    from specdec_page import calibrated, spec_page

    from speedmatrix.published.parse import parse_report
    from speedmatrix.records import parse_context
    from speedmatrix.sim.profile import save_profile

    page = spec_page()
    profile, _ = calibrated()  # the session's one calibration of this page (shared, cached)
    path = save_profile(profile, tmp_path / "spec.yaml")
    published = {  # by label: a cell's own tokens are what the page implies (issue #35)
        (parse_context(c["context_label"]), c["concurrency"]): c
        for c in parse_report(page).cells
        if c["phase"] == "decode"
    }
    scale = 2.0
    problems: list[str] = []
    with sim(path, time_scale=scale) as url:
        for ctx, conc in SPEC_REPLAY:
            want = published[(ctx, conc)]
            assert want["status"] == "valid"
            keys = ("total_tok_s", "per_request_tok_s", "tbt_ms", "output_tokens")
            label = f"{want['context_label']} x{conc}"
            problems += _replay_spec_cell(url, profile, ctx, conc, want, keys, label, scale)
    assert problems == [], "\n".join(problems)


def _replay_spec_cell(
    url: str,
    profile,
    ctx: int,
    conc: int,
    want: dict,
    keys: tuple[str, ...],
    name: str,
    scale: float,
) -> list[str]:
    """One decode cell of a calibrated speculative profile measured over HTTP by the real load
    generator: what is off against the page (`keys` within 5%) and against the acceptance the
    profile itself predicts at that prompt length (within 5%)."""
    from specdec_page import WINDOW_S

    from speedmatrix.sim.predict import predict_decode

    got, _ = run_loop(
        run_decode(DecodeConfig(
            base_url=url, model=profile.served_model_name, context=ctx,
            concurrency=conc, duration_s=WINDOW_S, max_output_tokens=4096,
            time_scale=scale, run_tag="spec-replay", first_token_timeout_s=120.0,
            max_loop_lag_ms=50.0, max_client_cpu_pct=100.0, token_tolerance=0.03,
        ))
    )  # fmt: skip
    if got["status"] != "valid":
        return [f"{name}: {got['status']} ({got['error']})"]
    problems = [
        f"{name}: {key} {got[key]:.2f} vs {want[key]:.2f}"
        for key in keys
        if abs(got[key] - want[key]) > 0.05 * abs(want[key])
    ]
    expected = predict_decode(profile, ctx, conc, window_s=WINDOW_S)["spec_acceptance_length"]
    acceptance = got["spec_acceptance_length"]
    if acceptance is None or abs(acceptance / expected - 1) > 0.05:
        problems.append(f"{name}: acceptance {acceptance} vs {expected:.2f}")
    return problems


def test_a_calibrated_speculative_page_holds_at_its_labels_and_its_implied_prompts(
    tmp_path: Path,
) -> None:
    """Issue #43: a page whose tool sent prompts short of their labels (64K as about 64,000
    tokens, 16K as 16,236) calibrates cells keyed on those implied prompts; a recipe measures
    the label's own tokens. Over HTTP, the real load generator against the real simulator:
    64K x 2 and 16K x 4 at the implied length and at the nominal one, each valid, total tok/s
    and time between tokens within 5% of the page, the acceptance the simulator's counters
    give within 5% of the profile's own prediction at that length. Before, the nominal sizes
    missed the calibrated cell and took a random draw (64K x 2: -4.9% on this page in simulated
    time, -22% to +19% over HTTP on the issue's unseen page)."""
    from specdec_page import calibrated, spec_page

    from speedmatrix.published.parse import parse_report
    from speedmatrix.sim.profile import save_profile

    variant = "short-prompts"
    profile, _ = calibrated(variant)
    path = save_profile(profile, tmp_path / "short.yaml")
    published = {
        (c["context_label"], c["concurrency"]): c
        for c in parse_report(spec_page(variant)).cells
        if c["phase"] == "decode"
    }
    scale = 2.0
    problems: list[str] = []
    with sim(path, time_scale=scale) as url:
        for label, conc, nominal in (("64K", 2, 65536), ("16K", 4, 16384)):
            want = published[(label, conc)]
            assert want["status"] == "valid" and want["context_tokens"] < nominal
            for ctx in (want["context_tokens"], nominal):
                name = f"{label} x{conc} at {ctx}"
                keys = ("total_tok_s", "tbt_ms")
                problems += _replay_spec_cell(url, profile, ctx, conc, want, keys, name, scale)
    assert problems == [], "\n".join(problems)
