"""The speed_matrix DAG's task bodies, as plain functions of typed, JSON-able values.

One job, the steps of a run that use its server and those after it, in order: plan, the
cells, validate, land, report, regressions, conclude. What a step needs beyond that lives
beside it: `resolve` in flows/resolution.py; the host's lease and the server's start, inspection
and stop in flows/server.py (re-exported here, so that the DAG and `speedmatrix run` call every
step as `matrix.<step>`); a cell's turn on its host in flows/turn.py; pairing cell results with
the plan in flows/collect.py; the comparison carried from `land` to `report` and `regressions`
in flows/handoff.py (analysis/compare.py makes it); a cell's host side (the load generator run
on a remote host, the health probe) in engine/remote_cell.py and engine/health.py.

Why plain functions: the DAG file stays orchestration only, and every step is tested without
Airflow (tests/unit/test_pipeline*.py) and reused by scripts and the overhead benchmark.
What passes between steps is typed: `resolved` (flows/resolved.py: what the run is), then
(flows/contracts.py) the ServerHandoff (where the engine listens and how to stop it), the
ServerInfo (what the server reports), the Planned cells and the Landing, and one
`{"cell": record, "requests": rows}` per measured cell (records.CellRecord in its wire form).
Each is the plain JSON object XCom carries; the DAG's tasks check them as they read them
(contracts.SERVER.from_wire…), the steps here take them as they are.

The flow (docs/design.md): resolve -> take the host lease -> setup (provision + start) -> inspect ->
plan -> the cells, one at a time on the host (prefill and decode tasks side by side) -> teardown
(stop + release), and beside it validate -> land -> report and regressions side by side ->
conclude after report, verdicts after regressions. Rules kept here:

- a bad conf fails in `resolve`, before anything touches a host;
- a cell never raises for a measurement problem: it returns a `failed` record with the reason,
  so cells already measured still land; the run's status says `failed` and `conclude` fails
  the DAG run at the very end;
- each cell starts with a lease renewal and a health check, so a dead server is found before
  the next cell in seconds, not after one timeout per remaining cell;
- `land` is idempotent (the warehouse replaces a run landed again), `teardown` too.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from speedmatrix import __version__
from speedmatrix.engine.lease import LeaseLost
from speedmatrix.flows import progress
from speedmatrix.flows.collect import collect_cells, collect_repeats, failed_cell
from speedmatrix.flows.contracts import (
    CELL_RESULT,
    VALIDATED,
    Landing,
    Planned,
    ServerHandoff,
    ServerInfo,
)
from speedmatrix.flows.fresh_stack import on_fresh_stack
from speedmatrix.flows.handoff import hand_on_comparison, handed_on_comparison
from speedmatrix.flows.resolution import DAG_ID
from speedmatrix.flows.resolved import Resolved

# The host and server steps, called as matrix.<step> like every other (flows/server.py); the
# helpers the cells use are looked up here, so a test replaces them here.
from speedmatrix.flows.server import api_key as api_key
from speedmatrix.flows.server import host_lease as host_lease
from speedmatrix.flows.server import host_of as host_of
from speedmatrix.flows.server import inspect as inspect
from speedmatrix.flows.server import recipe_of as recipe_of
from speedmatrix.flows.server import secrets_of as secrets_of
from speedmatrix.flows.server import server_health as server_health
from speedmatrix.flows.server import setup as setup
from speedmatrix.flows.server import take_lease as take_lease
from speedmatrix.flows.server import teardown as teardown
from speedmatrix.flows.turn import NO_TURN, CellTurn, TurnUnknown
from speedmatrix.plan import KvCapacity, MatrixSpec, plan_matrix
from speedmatrix.quality import run_status
from speedmatrix.records import (
    REQUEST_FIELDS,
    RUN_FIELDS,
    WARM_PREFILL,
    CellRecord,
    context_label,
    from_wire,
    to_wire,
)

if TYPE_CHECKING:
    from speedmatrix.loadgen import CellConfig

log = logging.getLogger("speedmatrix.pipeline")


def _spec(resolved: Resolved) -> MatrixSpec:
    return MatrixSpec.build(**resolved["matrix"])


# -------------------------------------------------------------------------------------- plan


def plan(resolved: Resolved, info: ServerInfo) -> Planned:
    """Prefill cells, runnable decode cells and over-capacity records, from the real KV cache."""
    capacity = KvCapacity(int(info["kv_num_blocks"]), int(info["kv_block_size"]))
    max_len = info.get("max_model_len") or recipe_of(resolved).model.max_model_len
    planned: Planned = plan_matrix(  # type: ignore[assignment]  # Plan.as_dict: its keys
        _spec(resolved),
        capacity,
        max_model_len=max_len,
        repeats=int(resolved.get("repeats") or 1),
        repeat_cells=resolved.get("repeat_cells"),
    ).as_dict()
    progress.tell("planned", resolved, planned)
    repeated = sum(1 for c in [*planned["prefill"], *planned["decode"]] if c.get("repeat"))
    budget = resolved["matrix"].get("kv_budget")
    log.info(
        "plan: %d prefill cells, %d decode cells to run (%d of them repeats), %d over capacity "
        "(KV %d blocks x %d" + (f"; the manual budget of {budget} tokens used)" if budget else ")"),
        len(planned["prefill"]),
        len(planned["decode"]),
        repeated,
        len(planned["over_capacity"]),
        capacity.num_blocks,
        capacity.block_size,
    )
    return planned


# ------------------------------------------------------------------------------------- cells


def run_cell(
    resolved: Resolved,
    server: ServerHandoff,
    cell: Mapping[str, Any],
    turn: CellTurn = NO_TURN,
) -> dict[str, Any]:
    """Measure one planned cell on the run's host. Never raises for a measurement problem.

    `turn` (flows.turn) is this cell's turn on the host: the task starts and imports while the
    previous cell measures, takes the turn once that cell has left the host, and leaves it
    (saying so to the next cell) before its task ends. The result says
    which pass it was (`repeat`, 0 = the primary) beside the cell record, not in it: the
    record is the contract's, the pass is where it lands (cells or cell_repeats); and `turn`,
    when this cell held the host (began, ended) and how long it waited for it."""
    # Before the turn: import the load generator (in-process on `local`; 0.3-0.4 s measured
    # here, after Airflow's imports), so that the hand-off costs the host none of it.
    import speedmatrix.loadgen  # noqa: F401

    repeat = int(cell.get("repeat") or 0)
    try:
        held = turn.take()
    except TurnUnknown as exc:
        log.error("%s: %s", cell.get("label"), exc)
        record = failed_cell(cell, str(exc), started_at=dt.datetime.now(dt.UTC))
        return CELL_RESULT.to_wire({"cell": to_wire(record), "requests": [], "repeat": repeat})
    progress.tell("cell_started", resolved, server, cell)
    result = _run_cell(resolved, server, cell)
    turn.leave(held, cell.get("label") or "")
    progress.tell("cell_done", cell, result["cell"])
    return CELL_RESULT.to_wire({**result, "repeat": repeat, "turn": held})


def _run_cell(resolved: Resolved, server: ServerHandoff, cell: Mapping[str, Any]) -> dict[str, Any]:
    started_at = dt.datetime.now(dt.UTC)
    lease = host_lease(resolved)
    try:
        lease.renew()
    except LeaseLost as exc:
        return {
            "cell": to_wire(failed_cell(cell, str(exc), started_at=started_at)),
            "requests": [],
        }
    except Exception as exc:
        reason = f"host {resolved['host']} unreachable before the cell: {exc}"
        return {"cell": to_wire(failed_cell(cell, reason, started_at=started_at)), "requests": []}
    why = server_health(resolved, server)
    if why:
        reason = f"server not healthy before the cell: {why}"
        log.error("%s: %s", cell.get("label"), reason)
        return {"cell": to_wire(failed_cell(cell, reason, started_at=started_at)), "requests": []}
    with lease.renewing(renewed=True) as renewer:
        try:
            record, rows = measure(resolved, server, cell)
            if _warm_prefill(record):
                # A decode cell of this context ran first and left the prompt cached: the plan's
                # order (plan.run_order) was not kept (dag.test() runs mapped instances in no
                # set order). Measure again with a prompt of its own, cold: the cell stays
                # true, the order only costs this one prefill more.
                log.warning(
                    "cell %s: %s; measuring it again with a fresh prompt",
                    cell.get("label"),
                    record.get("error"),
                )
                record, rows = measure(resolved, server, {**cell, "cold_tag": COLD_TAG})
        except Exception as exc:
            log.exception("cell %s could not be measured", cell.get("label"))
            record, rows = failed_cell(cell, f"{type(exc).__name__}: {exc}"), []
    if renewer.lost is not None:
        record = {**record, "status": "failed", "error": str(renewer.lost)}
    if record.get("status") == "failed":
        why = server_health(resolved, server)
        if why:
            record = {**record, "error": f"{record.get('error')}; server not healthy after: {why}"}
    if record.get("started_at") is None:
        record = {**record, "started_at": started_at}
    # The record keeps the prompt tokens the server confirmed (context_tokens, measured);
    # which planned cell it is goes in its own field, the planned label (8K for a prompt of
    # 8,176 tokens): collect_cells matches the two by it when the counts differ.
    record = {**record, "context_label": context_label(int(cell["context_tokens"]))}
    log.info(
        "cell %s: %s%s",
        cell.get("label"),
        record.get("status"),
        f" ({record.get('error')})" if record.get("error") else "",
    )
    return {"cell": to_wire(record), "requests": [to_wire(r, REQUEST_FIELDS) for r in rows]}


COLD_TAG = "c"
"""Appended to a prefill cell's run tag when its prompt was found cached (see _run_cell)."""


def _warm_prefill(record: Mapping[str, Any]) -> bool:
    """A prefill cell measured on a prompt the prefix cache already held (loadgen.prefill's
    reason code records.WARM_PREFILL), which a fresh prompt would measure truly."""
    return (
        record.get("phase") == "prefill"
        and record.get("status") == "invalid"
        and any(
            reason.startswith(WARM_PREFILL) for reason in str(record.get("error") or "").split("; ")
        )
    )


def pass_run_tag(run_tag: str, repeat: int) -> str:
    """The run tag a cell of pass `repeat` sends (0: the run's own).

    The tag starts every prompt and salts the prefix cache, so with the run's tag a repeat
    finds its primary's prompt cached: a repeated prefill is never cold (vLLM reports it
    "not cold"; a server without prefix-cache counters gives an inflated prompt tok/s). Each
    pass gets its own tag, so a repeat is measured from the cache state its primary was: cold
    prefills, decode prompts warmed by its own pass."""
    return run_tag if not repeat else f"{run_tag}r{int(repeat)}"


def _loadgen_config(
    resolved: Resolved, server: ServerHandoff, cell: Mapping[str, Any]
) -> CellConfig:
    """The load generator's config for a planned cell: the same for a local cell (run
    in-process) and a remote one (engine.remote_cell writes it as the zipapp's flags)."""
    from speedmatrix.loadgen import BurstConfig, DecodeConfig, PrefillConfig

    common = {
        "base_url": server["base_url"],
        "model": resolved["served_model"],
        "context": int(cell["context_tokens"]),
        "api_key": api_key(resolved),
        "run_tag": pass_run_tag(resolved["run_tag"], int(cell.get("repeat") or 0))
        + str(cell.get("cold_tag") or ""),
        "progress": False,
    }
    if cell.get("workload"):  # planned before workloads were declared: the loader's default
        common["workload"] = str(cell["workload"])
    profile = str(cell.get("measurement_profile") or "default")
    common["measurement_profile"] = profile
    if cell.get("global_warmup_context"):  # the run's first cell (plan.plan_matrix)
        common["global_warmup_context"] = int(cell["global_warmup_context"])
    if profile == "published":  # its chars-per-token probe is min(8K, the run's largest)
        m = resolved["matrix"]
        common["largest_context"] = max([*m["contexts"], *m["prefill_contexts"]])
    if cell["phase"] == "prefill":
        return PrefillConfig(**common)
    if cell["phase"] == "burst":
        return BurstConfig(
            **common,
            concurrency=int(cell["concurrency"]),
            max_output_tokens=int(cell["max_output_tokens"]),
            prompt_mode=str(cell["prompt_mode"]),
        )
    return DecodeConfig(
        **common,
        concurrency=int(cell["concurrency"]),
        window_s=float(cell["window_s"]),
        max_output_tokens=int(cell["max_output_tokens"]),
        prompt_mode=str(cell["prompt_mode"]),
        **_adaptive_settings(cell),
    )


def _adaptive_settings(cell: Mapping[str, Any]) -> dict[str, Any]:
    """An adaptive cell's window settings (plan._adaptive), its target where the plan set one
    from the cell's noise; {} for a fixed window."""
    if not cell.get("adaptive"):
        return {}
    out: dict[str, Any] = {"adaptive": True, "adaptive_min_s": float(cell["adaptive_min_s"])}
    if cell.get("adaptive_target_pct"):
        out["adaptive_target_pct"] = float(cell["adaptive_target_pct"])
    return out


def measure(
    resolved: Resolved, server: ServerHandoff, cell: Mapping[str, Any]
) -> tuple[CellRecord, list[dict[str, Any]]]:
    """Run the load generator next to the server: in-process on `local`, else the shipped
    zipapp over SSH (its JSON read back). A cell that cannot be attempted comes back failed."""
    from speedmatrix.loadgen import CellNotAttempted
    from speedmatrix.loadgen import run_cell as loadgen_run

    cfg = _loadgen_config(resolved, server, cell)
    cfg.validate()
    if resolved["host"] == "local":
        try:
            record, rows = loadgen_run(cfg)
        except CellNotAttempted as exc:
            return failed_cell(cell, f"not attempted: {exc}"), []
        return record, [dict(r) for r in rows]
    return _measure_remote(resolved, server, cell, cfg)


def _measure_remote(
    resolved: Resolved, server: ServerHandoff, cell: Mapping[str, Any], cfg: CellConfig
) -> tuple[CellRecord, list[dict[str, Any]]]:
    """The cell on the run's remote host (engine.remote_cell); a load generator that left no
    record gives a failed cell with its reason."""
    from speedmatrix.engine.remote_cell import RemoteCellFailed, measure_remote

    zipapp = server.get("loadgen")
    if not zipapp:
        return failed_cell(cell, "no load generator zipapp was shipped to the host"), []
    try:
        return measure_remote(
            host_of(resolved),
            cfg,
            python=server.get("python") or "python3",
            zipapp=zipapp,
            key_name=resolved["run_tag"],
        )
    except RemoteCellFailed as exc:
        return failed_cell(cell, str(exc)), []


# ---------------------------------------------------------------------------- validate, land


def run_row(
    resolved: Resolved,
    info: ServerInfo | None,
    server: ServerHandoff | None,
    status: str,
) -> dict[str, Any]:
    """The `runs` row: recipe facts, what the server reported, and the redacted launch line."""
    from speedmatrix.refs import classify_ref
    from speedmatrix.upstream.github_commits import engine_commit

    recipe = recipe_of(resolved)
    # every fact may be missing: a run whose server never started or answered still lands
    said: Mapping[str, Any] = info or {}
    started: Mapping[str, Any] = server or {}
    ref = resolved["engine_ref"]
    kind, value = classify_ref(ref)
    launch = recipe.render_launch_command(ref, api_key="redact")
    row: dict[str, Any] = {f.name: None for f in RUN_FIELDS}
    row.update(
        run_id=resolved["run_id"],
        recipe_id=recipe.id,
        trigger=resolved["trigger"],
        started_at=from_wire(resolved, RUN_FIELDS)["started_at"],
        finished_at=dt.datetime.now(dt.UTC),
        status=status,
        hardware_type=recipe.hardware.type,
        hardware_gpu=said.get("gpu") or recipe.hardware.gpu,
        # a server we did not start: unknown (NULL) unless the machine's inspection says
        hardware_gpu_count=said.get("gpu_count")
        or (recipe.hardware.gpu_count if recipe.hardware.known else None),
        hardware_vram_gb=recipe.hardware.vram_gb if recipe.hardware.known else None,
        hardware_os=recipe.hardware.os,
        engine=recipe.engine.name,
        engine_version=said.get("version") or started.get("engine_version"),
        # one value per commit whichever path measured it (speedmatrix.commits)
        engine_commit=engine_commit(
            recorded=said.get("commit") or started.get("engine_commit"),
            ref=ref,
            version=said.get("version") or started.get("engine_version"),
            repository=recipe.engine.repository,
        ),
        engine_pr=int(value) if kind == "pr" else recipe.engine.pr,
        engine_ref=ref,
        engine_repository=recipe.engine.repository,
        quantization=recipe.model.quantization,
        backend=recipe.hardware.backend,
        build=recipe.hardware.build,
        served_model=recipe.model.served_name,
        model=recipe.model.id,
        model_revision=recipe.model.revision,
        bench_tool="speedmatrix",
        bench_tool_version=__version__,
        # adaptive: each window stopped when tight enough, window_s its cap; every cell's
        # "Measured" is the window it used and window_stop why it ended
        decode_test="Adaptive duration" if resolved["matrix"].get("adaptive") else "Fixed duration",
        prefill_mode="Measured during decode warm-up",
        window_s=resolved["matrix"]["window_s"],
        max_output_tokens=resolved["matrix"]["max_output_tokens"],
        prompt_mode=resolved["matrix"]["prompt_mode"],
        workload=resolved["matrix"].get("workload"),
        sim_profile=said.get("sim_profile"),
        measurement_profile=resolved["matrix"].get("measurement_profile") or "default",
        recipe_sha256=resolved["recipe_sha256"],
        launch_command=said.get("launch_command") or launch,
        kv_cache_tokens=said.get("kv_cache_tokens"),
        kv_block_size=said.get("kv_block_size"),
        kv_num_blocks=said.get("kv_num_blocks"),
        kv_budget_tokens=resolved["matrix"].get("kv_budget"),
        max_model_len=said.get("max_model_len") or recipe.model.max_model_len,
        host=resolved["host"],
        source=resolved.get("source") or f"airflow:{DAG_ID}/{resolved['dag_run_id']}",
    )
    return row


def warehouse_of(resolved: Resolved):
    from speedmatrix.store.warehouse import Warehouse

    return Warehouse(resolved.get("warehouse") or None)


@on_fresh_stack  # the work after the host's stop, whatever executor runs it
def validate(
    resolved: Resolved,
    info: ServerInfo | None,
    server: ServerHandoff | None,
    planned: Planned | None,
    results: Sequence[Mapping[str, Any] | None],
) -> dict[str, Any]:
    """Great Expectations over the run's rows; failing rows to quarantine, results kept next
    to the run (:func:`speedmatrix.quality.check_for_landing`, which ingest uses too). Returns
    what `land` lands."""
    from speedmatrix.quality import check_for_landing

    progress.tell("step", "validating, landing, comparing with the baseline, rendering the page")
    if planned is None:
        raise RuntimeError("nothing was planned (the server never became ready): nothing to land")
    cells, requests = collect_cells(planned, results)
    repeats = collect_repeats(planned, results)
    run = run_row(resolved, info, server, run_status(cells))
    checked = check_for_landing(
        warehouse_of(resolved),
        run,
        cells,
        requests,
        secrets=secrets_of(resolved),
        repeats=repeats,
    )
    # the XCom form `land` reads back (records.to_wire / from_wire: the one conversion)
    return VALIDATED.to_wire(
        {
            **checked,
            "run": to_wire(checked["run"], RUN_FIELDS),
            "cells": [to_wire(c) for c in checked["cells"]],
            "requests": [to_wire(r, REQUEST_FIELDS) for r in checked["requests"]],
            "repeats": [to_wire(c) for c in checked["repeats"]],
        }
    )


@on_fresh_stack  # the work after the host's stop, whatever executor runs it
def land(resolved: Resolved, validated: Mapping[str, Any]) -> Landing:
    """Land the run atomically; landing it again replaces it (idempotent, safe to retry)."""
    from speedmatrix.store.extra import land_cell_repeats

    validated = VALIDATED.from_wire(validated)
    wh = warehouse_of(resolved)
    run = from_wire(validated["run"], RUN_FIELDS)
    wh.land_run(
        run,
        [from_wire(c) for c in validated["cells"]],
        [from_wire(r, REQUEST_FIELDS) for r in validated["requests"]],
    )
    # after the run (the repeats file goes next to the run's files); with no repeats an older
    # landing's file is removed, so landing again replaces
    repeats = [from_wire(c) for c in validated.get("repeats") or []]
    land_cell_repeats(wh, run, repeats)
    cells = validated["cells"]
    failed = [
        f"{c['phase']} {c['context_label']} x {c['concurrency']}: {c.get('error')}"
        for c in cells
        if c.get("status") == "failed"
    ]
    failed_repeats = [
        f"{c['phase']} {c['context_label']} x {c['concurrency']} #{c['repeat'] + 1}: "
        f"{c.get('error')}"
        for c in repeats
        if c.get("status") == "failed"
    ]
    if failed_repeats:
        log.warning("failed repeats (landed in cell_repeats): %s", "; ".join(failed_repeats))
    out: Landing = {
        "run_id": resolved["run_id"],
        "status": validated["run"]["status"],
        "warehouse": wh.root,
        "cells": len(cells),
        "requests": len(validated["requests"]),
        "repeats": len(repeats),
        "quarantined": validated["quarantined"],
        "failed": failed,
        "failed_repeats": failed_repeats,
    }
    log.info("landed %s: %s", resolved["run_id"], out)
    # The run's comparison with its baseline, made once, of this landing: `report` shows it
    # and `regressions` judges it, side by side after this task (flows/handoff.py).
    from speedmatrix.analysis.compare import comparison_for_run_or_none

    hand_on_comparison(wh, resolved["run_id"], comparison_for_run_or_none(wh, resolved["run_id"]))
    return out


@on_fresh_stack  # the work after the host's stop, whatever executor runs it
def report(resolved: Resolved, landed: Landing) -> dict[str, str]:
    """Render the landed run (md + html) next to it in the warehouse; log where.

    The page shows the comparison `land` made and handed on, the one `regressions` judges;
    when none was handed on, the page's loader has analysis.compare make it."""
    from speedmatrix.report.page import keep_charts, load_run_page, render_page
    from speedmatrix.report.render import render_markdown

    wh = warehouse_of(resolved)
    data = load_run_page(
        wh, resolved["run_id"], result=handed_on_comparison(wh, resolved["run_id"])
    )
    md = render_markdown(data.run, data.cells, data.baseline, comparison=data.rows) + (
        "\n" + data.markdown if data.markdown else ""
    )
    keep_charts(wh, data)  # the site's page of the run shows the same charts, not drawn again
    page = render_page(data)
    paths = {
        "md": wh.write_artifact(resolved["run_id"], "report.md", md),
        "html": wh.write_artifact(resolved["run_id"], "report.html", page),
    }
    log.info("report: %s (html: %s)", paths["md"], paths["html"])
    return paths


@on_fresh_stack  # the work after the host's stop, whatever executor runs it
def regressions(resolved: Resolved, landed: Landing) -> dict[str, Any]:
    """The `regressions` task: judge the comparison `land` made (made again only when none
    was handed on), land the verdicts; RegressionError on a regression."""
    from speedmatrix.analysis.compare import judge_regressions
    from speedmatrix.report.charts import write_comparison_charts

    wh = warehouse_of(resolved)
    result = handed_on_comparison(wh, landed["run_id"])
    return judge_regressions(
        wh, landed["run_id"], fetch_commits=True, result=result, charts=write_comparison_charts
    )


def conclude(landed: Landing) -> str:
    """Fail the DAG run when the run failed (after everything measured has landed)."""
    status = landed["status"]
    if status == "failed":
        raise RuntimeError(
            f"run {landed['run_id']} failed: " + "; ".join(landed.get("failed") or ["see log"])
        )
    if landed.get("quarantined"):
        log.warning("run %s: %d cell(s) quarantined", landed["run_id"], len(landed["quarantined"]))
    return status


def verdicts_landed(resolved: Resolved) -> dict[str, Any] | None:
    """What the comparisons / noise Asset events say about this run (its id, baseline, how
    many regressions and improvements, the warehouse), read back from the landed files; None
    when neither table has a file of the run."""
    from speedmatrix.store.extra import read_extra

    wh = warehouse_of(resolved)
    run_id = resolved["run_id"]
    rows = read_extra(wh, "comparisons", run_id=run_id)
    noise = read_extra(wh, "noise", run_id=run_id)
    if rows.empty and noise.empty:
        return None
    verdicts = rows["verdict"].value_counts().to_dict() if not rows.empty else {}
    baseline = rows["baseline_run_id"].iloc[0] if not rows.empty else None
    return {
        "run_id": run_id,
        "baseline_run_id": baseline,
        "regressions": int(verdicts.get("regression", 0)),
        "improvements": int(verdicts.get("improvement", 0)),
        "comparisons": len(rows),
        "noise": len(noise),
        "warehouse": wh.root,
    }
