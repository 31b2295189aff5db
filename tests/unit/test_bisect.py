"""Bisection names the first bad commit within ceil(log2(N)) measurements."""

from __future__ import annotations

import math

import pytest

from speedmatrix.analysis.bisection import bisect


def log2_bound(n: int) -> int:
    """ceil(log2(n)): the measurements a bisection of n candidates may take without skips."""
    return math.ceil(math.log2(n)) if n > 1 else 0


def _commits(n):
    return [f"{i:040x}" for i in range(1, n + 1)]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 16, 33, 100])
def test_every_planted_position_is_found_within_log2_n(n):
    commits = _commits(n)
    for planted in range(n):
        calls = []

        def measure(c, planted=planted, calls=calls):
            calls.append(c)
            return "regression" if commits.index(c) >= planted else "noise"

        result = bisect(commits, measure)
        assert result.first_bad == commits[planted]
        assert result.suspects == [commits[planted]]
        assert len(calls) == result.measurements <= log2_bound(n)
        assert commits[-1] not in calls  # the known-bad end is never re-measured


def test_commits_without_wheels_are_never_measured_and_become_suspects():
    commits = _commits(10)
    no_wheel = {commits[3], commits[4]}
    measured = []

    def measure(c):
        assert c not in no_wheel
        measured.append(c)
        return "bad" if commits.index(c) >= 4 else "good"

    result = bisect(commits, measure, has_wheel=lambda c: c not in no_wheel)
    # commit 4 (the true first bad) has no wheel: 5 is the first measurable bad one
    assert result.first_bad == commits[5]
    assert result.suspects == [commits[3], commits[4], commits[5]]
    assert result.measurements <= log2_bound(8)
    assert "could also be" in result.describe()


def test_a_skip_verdict_drops_the_commit_and_continues():
    commits = _commits(16)
    result = bisect(
        commits,
        lambda c: "skip" if c == commits[7] else ("bad" if commits.index(c) >= 9 else "good"),
    )
    assert result.first_bad == commits[9]
    assert commits[7] in result.skipped


def test_a_skipped_commit_right_before_the_first_bad_is_a_suspect():
    commits = _commits(8)
    result = bisect(
        commits,
        lambda c: (
            "not_comparable" if c == commits[3] else ("bad" if commits.index(c) >= 3 else "good")
        ),
    )
    assert result.first_bad == commits[4]
    assert result.suspects == [commits[3], commits[4]]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="no commits"):
        bisect([], lambda c: "bad")
    with pytest.raises(ValueError, match="not a verdict"):
        bisect(_commits(4), lambda c: "maybe")


def test_state_round_trips_through_json_between_steps():
    import json

    from speedmatrix.analysis.bisection import BisectState

    commits = _commits(20)
    state = BisectState.start(commits, has_wheel=lambda c: c != commits[2])
    steps = 0
    while (c := state.next_commit()) is not None:
        state = BisectState.from_dict(json.loads(json.dumps(state.to_dict())))
        state.record(c, "bad" if commits.index(c) >= 13 else "good")
        steps += 1
    assert state.result().first_bad == commits[13]
    assert steps <= log2_bound(19)
    with pytest.raises(ValueError, match="not the commit being measured"):
        fresh = BisectState.start(commits)
        fresh.record(commits[0], "bad")
    with pytest.raises(ValueError, match="not finished"):
        BisectState.start(commits).result()
    with pytest.raises(ValueError, match="distinct"):
        BisectState.start([commits[0], commits[0]])


def _row(metric, verdict, change_pct, higher_is_better=True, phase="decode"):
    return {
        "phase": phase,
        "metric": metric,
        "verdict": verdict,
        "change_pct": change_pct,
        "higher_is_better": higher_is_better,
    }


def test_a_step_reads_bad_only_from_a_slower_change_beyond_what_is_known():
    """A step's verdict from its rows against the known-good run. A figure without a noise
    history is "unverified" (never a gate), but a bisection must place the change its caller
    saw: one slower beyond the threshold and every known band is bad; faster or within is good."""
    from speedmatrix.analysis.bisection import step_verdict

    assert step_verdict([_row("total_tok_s", "regression", -10.0)]) == "bad"
    assert step_verdict([_row("total_tok_s", "unverified", -10.0)]) == "bad"
    assert step_verdict([_row("tbt_ms", "unverified", 11.0, higher_is_better=False)]) == "bad"
    assert step_verdict([_row("total_tok_s", "unverified", 10.0)]) == "good"
    assert step_verdict([_row("tbt_ms", "unverified", -9.0, higher_is_better=False)]) == "good"
    assert step_verdict([_row("total_tok_s", "noise", -2.0)]) == "good"
    # the run-level KV row is not a cell of the bisection
    assert step_verdict([_row("kv_cache_tokens", "regression", -50.0, phase="run")]) == "skip"
    assert step_verdict([]) == "skip"
    assert (
        step_verdict(
            [_row("total_tok_s", "regression", -10.0), _row("status", "not_comparable", None)]
        )
        == "skip"
    )
