"""The status verdicts of a decode cell (docs/measurement.md rules 6-8), decided on set inputs."""

from __future__ import annotations

import itertools
import random
from statistics import mean

import pytest

from speedmatrix.loadgen.config import DecodeConfig
from speedmatrix.loadgen.control import reading_times
from speedmatrix.loadgen.decode import _DecodeCell
from speedmatrix.loadgen.prometheus import Snapshot
from speedmatrix.loadgen.stream import Request


def cell(**cfg: object) -> _DecodeCell:
    cfg = {"concurrency": 4, **cfg}
    config = DecodeConfig(base_url="http://127.0.0.1:1", model="m", context=100,
                          **cfg)  # type: ignore[arg-type]  # fmt: skip
    c = _DecodeCell(config, None, None, None)  # type: ignore[arg-type]
    c.cell.update(output_tokens=10_000, server_generation_tokens=10_000, tokens_per_chunk=1.0)
    return c


def test_a_clean_cell_is_valid() -> None:
    assert cell()._judge(True) == ("valid", None)


def test_saturated_client_loop_makes_it_invalid() -> None:
    c = cell()
    c.monitor.lags = [0.001] * 80 + [0.030] * 20  # p90 above 10 ms
    status, reason = c._judge(True)
    assert status == "invalid" and "client saturated: event-loop lag p90" in reason
    c.monitor.lags = [0.001] * 95 + [0.200] * 5  # a few spikes: p90 still fine
    assert c._judge(True)[0] == "valid"


def test_saturated_client_cpu_makes_it_invalid() -> None:
    c = cell()
    c.monitor.cpu_s, c.monitor.wall_s = 0.95, 1.0
    c.cell["client_cpu_pct"] = c.monitor.cpu_pct
    status, reason = c._judge(True)
    assert status == "invalid" and "95% CPU" in reason


@pytest.mark.parametrize(("server", "verdict"), [(10_050, "valid"), (10_200, "invalid")])
def test_counter_cross_check(server: int, verdict: str) -> None:
    c = cell()
    c.cell["server_generation_tokens"] = server
    status, reason = c._judge(True)
    assert status == verdict
    if verdict == "invalid":
        assert "client counted 10000 output tokens, server 10200" in reason


def test_counter_cross_check_allows_the_metrics_round_trips() -> None:
    """Small counts on a slow /metrics: the server's extra tokens fall inside the readings'
    round trips (39 vs 42 seen on real vLLM under load), and only those are forgiven."""
    c = cell(concurrency=1)
    c.window.ws, c.window.we = 100.0, 105.0  # 5 s window, 39 tokens: 7.8 tok/s
    c.cell.update(output_tokens=39, server_generation_tokens=42)
    assert c._judge(True)[0] == "invalid"  # instant readings: 3 > 2 chunks, over 1%
    c.snap_start = Snapshot(at=100.0, values={}, sent=99.85)  # /metrics took 150 ms
    c.snap_end = Snapshot(at=105.2, values={}, sent=105.0)  # and 200 ms after the window
    assert c._judge(True) == ("valid", None)  # 2 + 7.8 x 0.35 = 4.7 tokens of slack
    c.cell["server_generation_tokens"] = 46  # 7 apart: more than the timing explains
    status, reason = c._judge(True)
    assert status == "invalid" and "client counted 39 output tokens, server 46" in reason


def test_queueing_preemption_and_prompt_mismatch_are_named() -> None:
    c = cell()
    c.cell.update(server_max_waiting=3.0, server_preemptions=2)
    status, reason = c._judge(False)
    assert status == "invalid"
    assert "queued" in reason and "2 preemptions" in reason and "prompt tokens" in reason


def test_repetition_loops_over_the_allowed_fraction() -> None:
    c = cell()
    for i in range(4):
        r = Request(i, i, 10, keep_text=True)
        r.text_parts = ["the same words " * 40] if i < 2 else [f"w{j} " for j in range(300)]
        c.requests.append(r)
    status, reason = c._judge(True)
    assert status == "invalid" and "repetition loop in 2 of 4 outputs" in reason
    assert cell(repetition_check=False)._judge(True)[0] == "valid"


def test_failure_wins_over_everything() -> None:
    c = cell()
    c.failed_requests = 3
    c._fail("HTTP 500: boom")
    assert c._judge(True) == ("failed", "HTTP 500: boom (3 failed requests)")


def test_a_long_client_stall_makes_it_invalid_even_with_a_fine_p90() -> None:
    """Real vLLM spinning on both cores froze the client's loop for 4.5 s of an 8 s window;
    its p90 lag was fine, and the cell passed as valid with tokens stamped in bursts."""
    c = cell()
    c.window.ws, c.window.we = 100.0, 108.0
    c.monitor.lags = [0.001] * 400 + [4.5]
    status, reason = c._judge(True)
    assert status == "invalid" and "client stalled for 4500 ms in a 8.0 s window" in reason
    c.monitor.lags = [0.001] * 400 + [0.6]  # one OS hiccup: 7.5% of the window
    assert c._judge(True) == ("valid", None)


def test_counters_read_too_late_make_the_cross_check_impossible() -> None:
    """The same run: /metrics answered seconds late, so the slack (rate x round trips)
    forgave 11,515 client tokens against 23,035 on the server."""
    c = cell()
    c.window.ws, c.window.we = 100.0, 108.0
    c.cell.update(output_tokens=11_515, server_generation_tokens=23_035)
    c.snap_start = Snapshot(at=100.0, values={}, sent=98.0)
    c.snap_end = Snapshot(at=112.0, values={}, sent=108.0)
    status, reason = c._judge(True)
    assert status == "invalid"
    assert "server counters answered 6000 ms late in a 8.0 s window" in reason
    c.cell.update(output_tokens=10_000, server_generation_tokens=10_000)
    c.snap_start = Snapshot(at=100.0, values={}, sent=99.85)  # 150 + 200 ms: 4.4%, allowed
    c.snap_end = Snapshot(at=108.2, values={}, sent=108.0)
    assert c._judge(True) == ("valid", None)


def _readings(c: _DecodeCell, running: list[float]) -> None:
    """`running` read at even steps through the window [100, 104]."""
    step = 4.0 / len(running)
    c.samples = [
        Snapshot(at=100.0 + step * (i + 0.5), values={"vllm:num_requests_running": v})
        for i, v in enumerate(running)
    ]
    c._server_figures(100.0, 104.0)


def test_too_few_running_requests_on_the_server_make_it_invalid() -> None:
    """One reading of 0 as a request turned over, among the 7 a 4 s window got at 0.5 s,
    put a real-vLLM C = 1 cell at 0.857: the loader called it valid, and the cells suite
    quarantined it (CI). The loader now says so itself, and samples a short window densely
    enough that one such reading is 5%."""
    c = cell(concurrency=1, window_s=4.0)
    _readings(c, [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    status, reason = c._judge(True)
    assert status == "invalid"
    assert "average active requests 0.86 of C=1 (7 server readings)" in reason
    _readings(c, [1.0] * 19 + [0.0])
    assert c.cell["avg_active_requests"] == 0.95 and c._judge(True) == ("valid", None)
    c = cell(concurrency=4)  # a cell that never held C: 3 running of 4
    _readings(c, [3.0] * 10)
    assert "average active requests 3.00 of C=4" in c._judge(True)[1]


def test_short_windows_are_sampled_often_enough() -> None:
    assert cell(window_s=4.0)._sample_interval() == pytest.approx(0.2)
    assert cell(window_s=30.0)._sample_interval() == 0.5  # the configured interval
    # a simulator at 5x: the window lasts 6 s on the wall clock
    assert cell(window_s=30.0, time_scale=5.0)._sample_interval() == pytest.approx(0.3)
    assert cell(window_s=4.0, min_window_readings=4)._sample_interval() == 0.5
    with pytest.raises(ValueError, match="min_window_readings"):
        DecodeConfig(base_url="http://h", model="m", context=8, min_window_readings=0).validate()


def test_gauge_readings_cannot_lock_onto_a_periodic_server() -> None:
    """Seen on real vLLM: 8-token requests at C = 1 repeat every ~51 ms and the running gauge
    reads 0 for about a third of each cycle. Readings a fixed step apart that is a multiple of
    the cycle read one phase only (here: always 1.0, a held cell). One reading at a random
    moment of each slot reads the true share, one per slot."""
    period, busy = 0.05, 2 / 3

    def running(t: float) -> float:
        return 1.0 if (t % period) < busy * period else 0.0

    interval = 0.15  # three cycles
    assert mean(running(0.01 + k * interval) for k in range(20)) == 1.0  # the fixed step
    rng = random.Random(7)
    averages = []
    for w in range(400):
        start = 3.0 * w + 0.01
        times = list(itertools.islice(reading_times(start, interval, rng), 20))
        assert [int((t - start) // interval) for t in times] == list(range(20))
        averages.append(mean(running(t) for t in times))
    assert mean(averages) == pytest.approx(busy, abs=0.01)
    assert sum(a >= 0.9 for a in averages) / len(averages) < 0.02  # not held, said so


def test_a_window_without_its_server_readings_is_invalid() -> None:
    """A server with /metrics must give the window its start and end readings and half the
    gauge readings aimed at; a server without /metrics (declared at its first read) need not."""
    from types import SimpleNamespace

    c = cell()
    c.window.ws, c.window.we = 100.0, 104.0
    c.ctl = SimpleNamespace(has_metrics=True, metrics_failures=6, metrics_error="HTTP 500 (x)")
    c.samples = [Snapshot(at=100.0 + 0.2 * i, values={"running": 4.0}) for i in range(20)]
    c.snap_start = Snapshot(at=100.0, values={})
    c.snap_end = Snapshot(at=104.01, values={})
    assert c._judge(True) == ("valid", None)
    c.missing_readings = ["no /metrics reading at the window's end (GET /metrics failed ...)"]
    status, reason = c._judge(True)
    assert status == "invalid" and "no /metrics reading at the window's end" in reason
    c.missing_readings = []
    c.samples = c.samples[:9]  # 9 of the 20 aimed at
    status, reason = c._judge(True)
    assert status == "invalid" and "only 9 /metrics readings in the window, fewer than 10" in reason
    assert "6 failed reads" in reason and "HTTP 500" in reason
    c.ctl = SimpleNamespace(has_metrics=False)  # no /metrics at all: declared, not a fault
    assert c._judge(True) == ("valid", None)
