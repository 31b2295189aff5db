"""The speed_matrix_bisect DAG's steps: plain functions of JSON-able values (the DAG file only
wires them). They reach GitHub (the commit list), the wheel index (which commits can be
measured cheaply) and the warehouse (the good run, each step's landed run), so they live here
in flows/, above the pure bisection (analysis/bisection.py: `BisectState`) they drive.

A "job" carries the bisection state, the known-good run and the speed_matrix conf that runs
only the regressed cells; each step picks a commit, a speed_matrix run measures it, and the
judge compares the landed cells with the good run (compare.py's rule) to get the verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

from pydantic import Field, with_config
from typing_extensions import TypedDict

from speedmatrix.analysis.bisection import BisectState, step_verdict
from speedmatrix.commits import same_commit
from speedmatrix.flows.contracts import CHECKED, Contract
from speedmatrix.recipes import load_recipe_id, wheel_index_for
from speedmatrix.records import parse_cell, parse_context
from speedmatrix.renames import CONF_KEYS as RENAMED_KEYS
from speedmatrix.renames import renamed
from speedmatrix.settings import settings
from speedmatrix.store.protocol import WarehouseReader
from speedmatrix.upstream.github_commits import commits_between
from speedmatrix.upstream.wheels import wheel_published

Commit = Annotated[str, Field(pattern=r"^[0-9a-f]{7,40}$")]


@with_config(CHECKED)
class BisectStateDict(TypedDict):
    """`BisectState.to_dict()`: the search between the known-good and the known-bad commit."""

    commits: list[str]
    candidates: list[str]  # the commits with a wheel: the ones measured
    no_wheel: list[str]
    lo: int
    hi: int
    measured: list[list[str]]  # [commit, verdict] pairs
    skipped: list[str]


@with_config(CHECKED)
class BisectJob(TypedDict):
    """What `prepare` hands the steps and each `judge` the next: the search and its run."""

    recipe: str
    host: str
    good: str
    bad: str
    cells: list[str]
    good_run_id: str
    threshold: Annotated[float, Field(gt=0)]  # a fraction: 0.03 is 3 %
    warehouse: str | None
    conf: dict[str, Any]  # the speed_matrix conf of a step's run (regressed cells only)
    state: BisectStateDict


@with_config(CHECKED)
class BisectStep(TypedDict):
    """What `choose` hands the step's trigger and `judge`: the commit and its run."""

    job: BisectJob
    commit: Commit
    conf: dict[str, Any]
    trigger_run_id: str


BISECT_JOB: Contract[BisectJob] = Contract("bisection job (prepare/judge)", BisectJob)
BISECT_STEP: Contract[BisectStep] = Contract("bisection step (choose)", BisectStep)

MAX_STEPS = 10
"""Unrolled steps of the DAG: 2**10 = 1024 commits with wheels between good and bad."""


def poll_s() -> float:
    """How often the triggerer polls a step's speed_matrix run, in seconds (the
    ``bisect_poll_s`` setting). The DAG file asks when it is parsed, so it is set in the DAG
    processor's environment; a bad value fails the parse, naming the variable."""
    return settings().bisect_poll_s


def _decode_and_prefill(cells: Sequence[str]) -> tuple[list[tuple[str, str, int]], dict]:
    parsed = [parse_cell(c) for c in cells]
    if not parsed:
        raise ValueError("name at least one regressed cell, e.g. 64Kx16 or 'prefill 64K'")
    decode = [p for p in parsed if p[0] == "decode"]
    prefill = sorted({p[1] for p in parsed if p[0] == "prefill"}, key=parse_context)
    contexts = sorted({p[1] for p in decode}, key=parse_context)
    concurrencies = sorted({p[2] for p in decode})
    conf = {
        # The smallest context stands in when no prefill cell regressed: the parameter cannot
        # be empty (null would run the recipe's whole prefill sweep).
        "prefill_contexts": prefill or [contexts[0]],
        "contexts": contexts or [prefill[0]],
        "concurrencies": concurrencies or [1],
    }
    return parsed, conf


def wheel_check(recipe: Any) -> Callable[[str], bool]:
    """Whether a commit can be installed cheaply: a published wheel for wheel recipes, by the
    rule provisioning applies (upstream.wheels: the commit's page, variant included, lists a
    wheel), so a chosen commit is never one provisioning refuses; always for the others."""
    install = recipe.engine.install
    if install.kind != "wheel":
        return lambda _c: True
    index, variant = wheel_index_for(recipe), recipe.engine.variant
    return lambda commit: wheel_published(index, commit, variant)


def matrix_conf(params: Mapping[str, Any]) -> dict[str, Any]:
    """The matrix settings a bisection's every step runs with, under their conf names: the
    window (`window_s`; its old name `duration_s` still read, speedmatrix.renames) and the
    output tokens per request."""
    window = renamed({k: params.get(k) for k in ("window_s", *RENAMED_KEYS)}, RENAMED_KEYS)[0].get(
        "window_s"
    )
    return {"window_s": window, "max_output_tokens": params.get("max_output_tokens")}


def prepare_job(params: dict, has_wheel: Callable[[str], bool] | None = None) -> dict:
    """Check the params and build the job: commits, wheels, good run, conf of a step's run."""
    # pandas and pyarrow come with these: the bisect DAG file imports this module when it is
    # parsed, and parsing must stay light (tests/dags: no heavy imports)
    from speedmatrix.analysis.baseline import recipe_threshold, select_baseline
    from speedmatrix.store.warehouse import Warehouse

    if params.get("api_url") is not None:
        raise ValueError(
            "api_url is not taken from a conf: the GitHub API is the deployment's "
            "(SPEEDMATRIX_GITHUB_API_URL, or github.api_url in the schedule config)"
        )
    recipe = load_recipe_id(params["recipe"])
    good, bad = str(params["good"]), str(params["bad"])
    cells = list(params.get("cells") or [])
    _, conf = _decode_and_prefill(cells)
    commits = list(params.get("commits") or [])
    if not commits:
        repo = str(recipe.engine.repository)
        repo = repo.split("github.com/", 1)[-1] or "vllm-project/vllm"
        commits = commits_between(repo, good, bad)
    if not commits or (not commits[-1].startswith(bad) and not bad.startswith(commits[-1])):
        raise ValueError(f"the commit list must end with the bad commit {bad}")
    host = params.get("ssh_conn_id") or recipe.schedule.host or "local"
    wh = Warehouse(params.get("warehouse"))
    runs = wh.query("SELECT * FROM runs WHERE recipe_id = ? AND host = ?", [recipe.id, host])
    good_run = select_baseline(
        runs,
        {"run_id": None, "recipe_id": recipe.id, "host": host},
        params.get("good_run_id") or good,
    )
    if good_run is None:
        raise ValueError(f"no successful run of {recipe.id} on {host} at the good commit {good}")
    state = BisectState.start(commits, has_wheel or wheel_check(recipe))
    threshold = params.get("threshold_pct")
    return BISECT_JOB.to_wire(
        {
            "recipe": recipe.id,
            "host": host,
            "good": good,
            "bad": bad,
            "cells": cells,
            "good_run_id": good_run["run_id"],
            "threshold": threshold / 100 if threshold is not None else recipe_threshold(recipe.id),
            "warehouse": params.get("warehouse"),
            "conf": {
                "recipe": recipe.id,
                "ssh_conn_id": host,
                "warehouse": params.get("warehouse"),
                **matrix_conf(params),
                **conf,
            },
            "state": state.to_dict(),
        }
    )


def choose_step(job: dict, step: int, salt: str = "") -> dict | None:
    """The next commit and the speed_matrix conf and run id for it; None when finished.
    `salt` (the bisect DAG run's id) keeps two bisections of one range apart."""
    job = BISECT_JOB.from_wire(job)
    state = BisectState.from_dict(job["state"])
    commit = state.next_commit()
    if commit is None:
        return None
    conf = {k: v for k, v in {**job["conf"], "engine_ref": commit}.items() if v is not None}
    import hashlib

    tag = hashlib.sha1(salt.encode()).hexdigest()[:8]
    # good-bad, not git's good..bad: Airflow refuses a run id holding ".." (path traversal).
    run_id = f"bisect__{job['good'][:12]}-{job['bad'][:12]}__{tag}__{step:02d}__{commit[:12]}"
    return BISECT_STEP.to_wire(
        {"job": job, "commit": commit, "conf": conf, "trigger_run_id": run_id}
    )


def judge_step(chosen: dict, warehouse: WarehouseReader | None = None) -> dict:
    """Read the step's landed run, compare the regressed cells with the good run, record."""
    # pandas and pyarrow come with these: the bisect DAG file imports this module when it is
    # parsed, and parsing must stay light (tests/dags: no heavy imports)
    from speedmatrix.analysis.baseline import read_history
    from speedmatrix.analysis.verdict import compare_runs
    from speedmatrix.store.warehouse import Warehouse

    chosen = BISECT_STEP.from_wire(chosen)
    job, commit = chosen["job"], chosen["commit"]
    wh = warehouse or Warehouse(job["warehouse"])
    found = wh.query(
        "SELECT run_id FROM runs WHERE recipe_id = ? AND host = ? AND status = 'success' "
        "AND (engine_ref = ? OR starts_with(engine_commit, ?) OR starts_with(?, engine_commit)) "
        "ORDER BY started_at DESC LIMIT 1",
        [job["recipe"], job["host"], commit, commit, commit],
    )
    state = BisectState.from_dict(job["state"])
    if found.empty:
        verdict = "skip"  # the run failed or never landed: measure around it
    else:
        parsed, _ = _decode_and_prefill(job["cells"])
        wanted = {(p, label, c) for p, label, c in parsed}

        def keep(rows: list[dict]) -> list[dict]:
            return [r for r in rows if (r["phase"], r["context_label"], r["concurrency"]) in wanted]

        run, cells, requests = wh.read_run(found["run_id"].iloc[0])
        good, good_cells, good_requests = wh.read_run(job["good_run_id"])
        keys = {(r["phase"], r["context_tokens"], r["concurrency"]) for r in keep(cells)}

        def keep_req(rows: list[dict]) -> list[dict]:
            return [r for r in rows if (r["phase"], r["context_tokens"], r["concurrency"]) in keys]

        # The noise of the history strictly before the step's run (never the run itself),
        # without the runs at the commits being searched: the bisection's own steps sit on
        # either side of the change, and their differences would read as noise.
        searched = job["state"]["commits"][:-1]

        def in_search(r: Mapping[str, Any]) -> bool:
            names = (r.get("engine_commit"), r.get("engine_ref"))
            return any(same_commit(n, c) for n in names for c in searched)

        noise = read_history(wh, job["recipe"], job["host"], before=run, noise_excludes=in_search)[
            3
        ]
        rows = compare_runs(
            run,
            keep(cells),
            good,
            keep(good_cells),
            requests=keep_req(requests),
            baseline_requests=keep_req(good_requests),
            noise=noise,
            threshold=job["threshold"],
        )
        verdict = step_verdict(rows)
    state.record(commit, verdict)
    return BISECT_JOB.to_wire({**job, "state": state.to_dict()})


def conclude_job(jobs: Sequence[dict | None]) -> dict:
    """The first bad commit from the last job state; raises when the steps ran out."""
    job = next((j for j in reversed(list(jobs)) if j), None)
    if job is None:
        raise ValueError("no bisection state")
    job = BISECT_JOB.from_wire(job)
    state = BisectState.from_dict(job["state"])
    if not state.done:
        raise RuntimeError(
            f"bisection not finished after {len(state.measured)} steps; next: {state.next_commit()}"
        )
    result = state.result()
    return {
        "first_bad": result.first_bad,
        "suspects": result.suspects,
        "measured": [list(m) for m in result.measured],
        "skipped": result.skipped,
        "summary": result.describe(),
    }
