"""Adaptive windows from the recipe, the conf and the command line down to the load generator's
config (issue #45 item 1): one setting, `adaptive`, carried by resolve -> plan -> the cell."""

from __future__ import annotations

import datetime as dt

import pytest

from speedmatrix.flows import resolution
from speedmatrix.flows.matrix import _loadgen_config, _spec
from speedmatrix.flows.resolution import ResolveError
from speedmatrix.flows.runconf import conf_problems
from speedmatrix.plan import KvCapacity, plan_matrix
from speedmatrix.recipes import load_recipe_id

WHEN = dt.datetime(2026, 12, 5, 15, 0, tzinfo=dt.UTC)
SIM = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
SERVER = {"base_url": "http://127.0.0.1:9", "pid": 1}


def _resolve(**conf):
    return resolution.resolve(
        {"recipe": SIM, **conf}, dag_run_id="manual__2026-12-05T15:00:00+00:00", run_after=WHEN
    )


def _decode_cells(resolved):
    plan = plan_matrix(_spec(resolved), KvCapacity(1_000_000, 16)).as_dict()
    return plan["decode"], plan["prefill"]


def test_the_recipe_default_is_a_fixed_window() -> None:
    r = _resolve(contexts=["8K"], concurrencies=[1, 2], prefill_contexts=["8K"])
    assert r["matrix"]["adaptive"] is False
    decode, _ = _decode_cells(r)
    cfg = _loadgen_config(r, SERVER, decode[0])
    assert cfg.adaptive is False  # type: ignore[attr-defined]


def test_conf_adaptive_reaches_every_decode_cell_with_its_minimum_under_its_cap() -> None:
    r = _resolve(contexts=["8K"], concurrencies=[1, 2], prefill_contexts=["8K"], adaptive=True,
                 window_s=4.0)  # fmt: skip
    assert r["matrix"]["adaptive"] is True
    decode, prefill = _decode_cells(r)
    assert decode and all(c["adaptive"] is True for c in decode)
    # the recipe's 5 s minimum, clamped to the 4 s cap: a window never exceeds its cap
    assert {c["adaptive_min_s"] for c in decode} == {4.0}
    assert all("adaptive" not in c for c in prefill)  # one cold request: no window
    cfg = _loadgen_config(r, SERVER, {**decode[0], "adaptive_target_pct": 0.4})  # as set
    assert (cfg.adaptive, cfg.adaptive_min_s, cfg.window_s) == (True, 4.0, 4.0)  # type: ignore[attr-defined]
    assert cfg.adaptive_target_pct == 0.4  # type: ignore[attr-defined]
    cfg.validate()


def test_a_bad_adaptive_value_is_named_before_anything_runs() -> None:
    assert any(
        "adaptive must be true or false" in p
        for p in conf_problems({"recipe": SIM, "adaptive": "yes"})
    )
    with pytest.raises(ResolveError, match="adaptive windows are not the published tool's"):
        _resolve(adaptive=True, measurement_profile="published")


def test_a_recipe_may_ask_for_adaptive_windows() -> None:
    recipe = load_recipe_id(SIM)
    m = recipe.matrix.model_copy(update={"adaptive": True, "adaptive_min_s": 4.0})
    r = resolution.resolve(
        {"recipe": SIM}, dag_run_id="manual__x", run_after=WHEN,
        recipe=recipe.model_copy(update={"matrix": m}),
    )  # fmt: skip
    assert (r["matrix"]["adaptive"], r["matrix"]["adaptive_min_s"]) == (True, 4.0)


def test_conf_sets_the_minimum_and_a_bad_one_is_named() -> None:
    r = _resolve(contexts=["8K"], concurrencies=[1], adaptive=True, window_s=30.0,
                 adaptive_min_s=3.5)  # fmt: skip
    assert r["matrix"]["adaptive_min_s"] == 3.5
    decode, _ = _decode_cells(r)
    assert {c["adaptive_min_s"] for c in decode} == {3.5}
    problems = conf_problems({"recipe": SIM, "adaptive_min_s": -1})
    assert any("adaptive_min_s must be a positive number of seconds" in p for p in problems)


def test_the_target_is_a_third_of_the_verdicts_threshold() -> None:
    """The sim recipe's regression threshold (3% unless it says otherwise) -> a 1% target;
    a stricter threshold asks a tighter window, never below 0.25%."""
    from speedmatrix.plan import adaptive_target_pct

    threshold = load_recipe_id(SIM).schedule.regression_threshold_pct
    r = _resolve(contexts=["8K"], concurrencies=[1], adaptive=True)
    assert r["matrix"]["adaptive_target_pct"] == pytest.approx(threshold / 3)
    decode, _ = _decode_cells(r)
    assert all(c["adaptive_target_pct"] == pytest.approx(threshold / 3) for c in decode)
    assert adaptive_target_pct(1.5) == pytest.approx(0.5)
    assert adaptive_target_pct(0.0) == 0.25
