"""The adaptive window's stopping rule (loadgen/adaptive.py) on token series with known truth.

Checkpoints are made as the decode cell makes them: every 0.25 s, the window's cumulative
tokens. A steady stream with independent noise must stop at the first checkpoint past the
minimum where its interval is within the target; a stream that slows inside the window, or a
window marked unsteady (queueing), must never stop early; a noisy one runs to the cap.
"""

from __future__ import annotations

import random

import pytest

from speedmatrix.loadgen.adaptive import (
    BATCHES,
    STOP_CONVERGED,
    STOP_NOT_CONVERGED,
    STOP_NOT_STEADY,
    AdaptiveWindow,
    interval,
)

STEP = 0.25


def _feed(meter: AdaptiveWindow, rates: list[float]) -> float | None:
    """Checkpoint a series of per-interval rates (whole tokens, as a stream delivers them);
    the time at which the rule said stop."""
    total, t = 0, 0.0
    meter.checkpoint(0.0, 0)
    for rate in rates:
        t += STEP
        total += max(0, round(rate * STEP))
        meter.checkpoint(t, total)
        if meter.converged():
            return t
    return None


def _noisy(rate: float, cv: float, n: int, seed: int = 7) -> list[float]:
    rng = random.Random(seed)
    return [rate * (1 + rng.gauss(0, cv)) for _ in range(n)]


def test_a_steady_stream_stops_at_its_minimum_and_its_rate_is_the_truth() -> None:
    meter = AdaptiveWindow(target_pct=1.0, min_s=10.0, cap_s=30.0)
    stopped = _feed(meter, _noisy(400.0, 0.02, 120))
    assert stopped == pytest.approx(10.0)
    assert meter.last is not None
    assert meter.last.rate == pytest.approx(400.0, rel=0.01)
    assert meter.last.half_width_pct <= 1.0
    assert meter.stop_reason(stopped_early=True) == STOP_CONVERGED
    assert meter.explain(True).startswith("converged: throughput ±")


def test_the_minimum_holds_however_tight_the_interval() -> None:
    meter = AdaptiveWindow(target_pct=5.0, min_s=6.0, cap_s=30.0)
    stopped = _feed(meter, [300.0] * 120)  # no noise at all: tight from the first batches
    assert stopped == pytest.approx(6.0)


def test_a_noisy_stream_is_not_stopped_before_its_interval_is_tight() -> None:
    meter = AdaptiveWindow(target_pct=1.0, min_s=5.0, cap_s=30.0)
    assert _feed(meter, _noisy(100.0, 0.25, 120)) is None  # ±25% per quarter second
    assert meter.last is not None and meter.last.half_width_pct > 1.0
    assert meter.stop_reason(stopped_early=False) == STOP_NOT_CONVERGED
    assert "not tight enough" in meter.explain(False)


def test_a_stream_that_slows_inside_the_window_runs_to_the_cap() -> None:
    # 1%/s of slowdown: every batch tight, the trend (~-10% over 10 s) is what matters
    rates = [400.0 * (1 - 0.01 * i * STEP) for i in range(120)]
    meter = AdaptiveWindow(target_pct=1.0, min_s=10.0, cap_s=30.0)
    assert _feed(meter, rates) is None
    assert meter.last is not None and meter.last.trending
    assert meter.last.trend_pct < -5
    assert meter.stop_reason(stopped_early=False) == STOP_NOT_STEADY
    assert "not steady" in meter.explain(False)


def test_a_trend_smaller_than_the_target_does_not_hold_the_window() -> None:
    # a significant but negligible drift (0.2% over the window) is no reason to run on
    rates = [400.0 * (1 - 0.0002 * i * STEP) for i in range(120)]
    meter = AdaptiveWindow(target_pct=1.0, min_s=10.0, cap_s=30.0)
    assert _feed(meter, rates) == pytest.approx(10.0)


def test_a_window_marked_unsteady_never_stops_early() -> None:
    meter = AdaptiveWindow(target_pct=1.0, min_s=5.0, cap_s=30.0)
    meter.mark_unsteady("requests queued on the server")
    meter.mark_unsteady("preemptions on the server")  # the first reason is kept
    assert _feed(meter, [400.0] * 120) is None
    assert meter.stop_reason(stopped_early=False) == STOP_NOT_STEADY
    assert "requests queued on the server" in meter.explain(False)


def test_too_few_checkpoints_give_no_interval() -> None:
    assert interval([0.0], [0]) is None
    times = [i * STEP for i in range(BATCHES)]  # BATCHES - 1 intervals
    assert interval(times, [100 * i for i in range(BATCHES)]) is None
    times.append(BATCHES * STEP)
    iv = interval(times, [100 * i for i in range(BATCHES + 1)])
    assert iv is not None and iv.rate == pytest.approx(400.0) and iv.half_width_pct == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_pct": 0.0, "min_s": 5.0, "cap_s": 30.0}, "positive %"),
        ({"target_pct": 1.0, "min_s": 40.0, "cap_s": 30.0}, "at most the window's cap"),
        ({"target_pct": 1.0, "min_s": 0.0, "cap_s": 30.0}, "must be positive"),
    ],
)
def test_bad_settings_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdaptiveWindow(**kwargs)
