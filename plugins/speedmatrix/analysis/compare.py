"""A run's comparison with its baseline, end to end: the one owner of its life cycle.

One job: orchestration. :func:`comparison_for_run` makes a run's comparison out of the
warehouse: read the run and its baseline (analysis/baseline.py), judge every cell
(analysis/verdict.py's pure :func:`~speedmatrix.analysis.verdict.compare_runs`). Every maker
goes through it: `land` (:func:`comparison_for_run_or_none`, which the pipeline hands on to
`report` and `regressions` in flows/handoff.py), a page whose comparison was not handed on
(report/page.py), `speedmatrix compare`, and :func:`judge_regressions` when it is handed
none. :func:`judge_regressions` is the `regressions` task's work: land the `comparisons` and
`noise` tables (store/extra.py), write the markdown section (analysis/display.py), let the
caller's `charts` hook draw (report/charts.py: analysis does not draw), and raise
RegressionError for Airflow's alerting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from speedmatrix.analysis.baseline import (
    baseline_cells,
    read_history,
    recipe_threshold,
    select_baseline,
)
from speedmatrix.analysis.display import (
    comparison_markdown,
    verdict_counts,
)
from speedmatrix.analysis.noise import noise_rows, noise_table
from speedmatrix.analysis.verdict import (
    compare_runs,
    comparisons_table,
    fail_on_regressions,
    regression_rows,
)
from speedmatrix.errors import InputError
from speedmatrix.store.extra import land_extra
from speedmatrix.store.protocol import Warehouse, WarehouseReader
from speedmatrix.upstream import github_commits
from speedmatrix.upstream.github import github_repo

log = logging.getLogger("speedmatrix.compare")


@dataclass
class ComparisonResult:
    run: dict[str, Any]
    baseline: dict[str, Any] | None
    rows: list[dict[str, Any]]
    noise: list[dict[str, Any]]


def comparison_for_run(
    warehouse: WarehouseReader,
    run_id: str,
    *,
    baseline_ref: str | None = None,
    threshold: float | Mapping[str, float] | None = None,
    with_noise: bool = True,
) -> ComparisonResult:
    """Compare a landed run with its baseline (see select_baseline), using the requests for
    within-window intervals and the recipe/host history for the between-run noise.

    Raises KeyError when the run is not in the warehouse; `baseline` is None (and rows empty)
    when there is nothing to compare with, or ValueError when a named baseline is not found.
    The noise rows do not need a baseline: a first run (with repeats) has its noise too.
    `with_noise=False` skips them (their bootstraps) for a caller that only shows verdicts."""
    run, cells, requests = warehouse.read_run(run_id)
    runs_all = warehouse.query("SELECT * FROM runs")
    baseline = select_baseline(runs_all, run, baseline_ref)
    # the history strictly before the run: never the candidate itself, never a later run
    h_runs, h_cells, _, noise = read_history(
        warehouse, run.get("recipe_id"), run.get("host"), before=run
    )
    if baseline is None:
        if baseline_ref is not None:
            raise InputError(f"no baseline {baseline_ref!r} for run {run_id}")
        rows = noise_rows(run, cells, requests, noise) if with_noise else []
        return ComparisonResult(run, None, [], rows)
    b_run, b_cells, b_requests = warehouse.read_run(baseline["run_id"])
    b_runs: dict[str, dict[str, Any]] = {}
    if baseline_ref is None:
        # each cell against its latest earlier comparable cell (the latest run may lack it)
        b_cells, b_runs = baseline_cells(h_runs, h_cells, run, cells)
        others = {str(c["run_id"]) for c in b_cells} - {str(b_run["run_id"])}
        b_requests = [
            *b_requests,
            *(q for rid in sorted(others) for q in warehouse.read_run(rid)[2]),
        ]
        b_requests = _requests_of(b_requests, b_cells)
    if threshold is None:
        threshold = recipe_threshold(run.get("recipe_id"))
    rows = compare_runs(
        run,
        cells,
        b_run,
        b_cells,
        requests=requests,
        baseline_requests=b_requests,
        noise=noise,
        threshold=threshold,
        baseline_runs=b_runs,
    )
    noise_table_rows = noise_rows(run, cells, requests, noise) if with_noise else []
    return ComparisonResult(run, b_run, rows, noise_table_rows)


def _requests_of(
    requests: Sequence[Mapping[str, Any]], cells: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The request rows of exactly the chosen baseline cells (each from its own run)."""
    wanted = {
        (str(c["run_id"]), c["phase"], int(c["context_tokens"]), int(c["concurrency"]))
        for c in cells
    }
    return [
        q
        for q in requests
        if (
            str(q.get("run_id")),
            q.get("phase"),
            int(q.get("context_tokens") or 0),
            int(q.get("concurrency") or 0),
        )
        in wanted
    ]


def comparison_for_run_or_none(warehouse: WarehouseReader, run_id: str) -> ComparisonResult | None:
    """The run's comparison (:func:`comparison_for_run`), or None, logged, when it cannot be
    made: `land` lands the run anyway, `report` writes its page without one, and
    `regressions`, handed none, makes it again and fails where it belongs."""
    try:
        return comparison_for_run(warehouse, run_id)
    except Exception as exc:
        log.warning("no comparison of %s with its baseline: %s", run_id, exc)
        return None


def judge_regressions(
    warehouse: Warehouse,
    run_id: str,
    *,
    baseline_ref: str | None = None,
    commits: Sequence[str] | None = None,
    threshold: float | Mapping[str, float] | None = None,
    fetch_commits: bool = False,
    result: ComparisonResult | None = None,
    charts: Callable[[Any, ComparisonResult], None] | None = None,
) -> dict[str, Any]:
    """The `regressions` task: compare, land `comparisons` + `noise` and the markdown section
    as artifact comparison.md, then raise RegressionError (naming cells, baseline and
    commits) when any verdict is a regression. Returns counts for XCom otherwise.

    `fetch_commits`: when regressions were found and `commits` is not given, list the commits
    between the two engine commits from GitHub's compare API (best effort: on any error the
    summary keeps the compare URL only). `result`: the run's comparison already made (by the
    `land` task, handed on), so that a run's comparison is computed once.

    `charts(warehouse, result)` draws the comparison's charts next to the run (the caller
    passes speedmatrix.report.charts.write_comparison_charts: analysis does not draw); it
    runs before a regression raises, so the alert's reader finds them."""
    if result is None:
        result = comparison_for_run(
            warehouse, run_id, baseline_ref=baseline_ref, threshold=threshold
        )
    if result.noise:
        land_extra(warehouse, "noise", result.run, noise_table(result.noise))
    if result.baseline is None:
        return {"run_id": run_id, "baseline_run_id": None, "counts": {}, "regressions": 0}
    land_extra(warehouse, "comparisons", result.run, comparisons_table(result.rows))
    warehouse.write_artifact(
        run_id, "comparison.md", comparison_markdown(result.rows, result.run, result.baseline)
    )
    if charts is not None:
        charts(warehouse, result)
    if fetch_commits and commits is None and regression_rows(result.rows):
        commits = _fetch_commits(result.baseline, result.run)
    fail_on_regressions(result.rows, result.run, result.baseline, commits)
    return {
        "run_id": run_id,
        "baseline_run_id": result.baseline.get("run_id"),
        "counts": verdict_counts(result.rows),
        "regressions": 0,
    }


def _fetch_commits(baseline: Mapping[str, Any], run: Mapping[str, Any]) -> list[str] | None:
    """Commits after the baseline's engine commit up to the run's, or None when unknown.

    Through upstream.github_commits.commits_between, the one caller of the GitHub client's compare API (the
    deployment's API, never a conf's)."""
    a, b = baseline.get("engine_commit"), run.get("engine_commit")
    repo = github_repo(run.get("engine_repository") or baseline.get("engine_repository"))
    if not a or not b or a == b or repo is None:
        return None
    if run.get("sim_profile") or baseline.get("sim_profile"):
        return None  # a simulated engine's commits are made up: nobody upstream knows them
    try:
        return github_commits.commits_between(repo, str(a), str(b))
    except Exception as exc:  # network, rate limit, unknown commit: the URL still names them
        log.warning("could not list commits %s...%s: %s", a, b, exc)
        return None
