"""The speed_matrix DAG's task bodies, as plain functions of plain (JSON-able) values.

One job, the steps of a run in order (hence its length: one short function per task, the host
and server steps included). What a step needs beyond that lives beside it: `resolve` in
flows/resolution.py, a cell's turn on its host in flows/turn.py, pairing cell results with the
plan in flows/collect.py, the comparison carried from `land` to `report` and `regressions` in
flows/handoff.py (analysis/compare.py makes it); a cell's host side (the load
generator run on a remote host, the health probe) in engine/remote_cell.py and engine/health.py.

Why plain functions: the DAG file stays orchestration only, and every step is tested without
Airflow (tests/unit/test_pipeline*.py) and reused by scripts and the overhead benchmark.
Everything passed between steps is a small dict that survives XCom: `resolved` (what the run
is), `server` (where the engine listens and how to stop it), `info` (what the server reports),
`planned` (the cells), and one `{"cell": record, "requests": rows}` per measured cell.

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
import os
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from speedmatrix import __version__
from speedmatrix.engine.lease import HostLease, LeaseLost
from speedmatrix.flows import progress
from speedmatrix.flows.collect import collect_cells, collect_repeats, failed_cell
from speedmatrix.flows.fresh_stack import on_fresh_stack
from speedmatrix.flows.handoff import hand_on_comparison, handed_on_comparison
from speedmatrix.flows.resolution import DAG_ID
from speedmatrix.flows.resolved import Resolved
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
from speedmatrix.settings import settings

if TYPE_CHECKING:
    from speedmatrix.loadgen import CellConfig

log = logging.getLogger("speedmatrix.pipeline")


def _recipe(resolved: Resolved):
    from speedmatrix.recipes import Recipe, load_recipe_id

    if resolved.get("recipe"):  # made in memory by `speedmatrix run --base-url`
        return Recipe.model_validate(resolved["recipe"])
    return load_recipe_id(resolved["recipe_id"])


def _spec(resolved: Resolved) -> MatrixSpec:
    return MatrixSpec.build(**resolved["matrix"])


def api_key(resolved: Resolved) -> str | None:
    """The server's API key from the worker's environment (variable named by the recipe)."""
    name = resolved.get("api_key_env")
    return settings().secret_named(name) if name else None


def secrets_of(resolved: Resolved) -> list[str]:
    key = api_key(resolved)
    return [key] if key else []


# ------------------------------------------------------------------------------------- lease


def host_of(resolved: Resolved):
    """A fresh Host for the run (`host_home` becomes $HOME there: envs and server state; the
    lease is the machine's whatever the HOME)."""
    from speedmatrix.engine.hosts import get_host

    home = resolved.get("host_home")
    return get_host(resolved["host"], env={"HOME": home} if home else None)


def host_lease(
    resolved: Resolved, owner_pid: int | None = None, origin: str | None = None
) -> HostLease:
    """The run's lease on its host, on a connection of its own (see lease.Renewer). It covers
    the machine, whatever the run's host_home (lease.py: the machine-wide directory)."""
    return HostLease(
        host_of(resolved),
        resolved["holder"],
        ttl_s=settings().lease_ttl_s,  # the deployment's (SPEEDMATRIX_LEASE_TTL_S), never a conf's
        owner_pid=owner_pid,
        origin=origin,
    )


def take_lease(
    resolved: Resolved,
    *,
    one_process: bool = False,
    origin: str | None = None,
    gone_why: Callable[[str], str | None] | None = None,
) -> dict[str, Any] | None:
    """One attempt at the host lease: its state when taken, None when another run holds it.

    `one_process`: this process runs the whole run (`speedmatrix run`, dag.test); on the local
    host its PID is recorded with the lease, so that once it is gone (killed, its terminal
    closed) the next run takes the host over at once, saying so, instead of waiting out the
    lease. `origin` and `gone_why` (lease.HostLease.try_acquire): the deployment this run
    belongs to, and what says a holder of that deployment is gone (:func:`run_gone_why` over
    Airflow's DAG run states); such a holder is taken over at once too. The servers a gone
    holder left are stopped first: the host is measured alone."""
    pid = os.getpid() if one_process and resolved["host"] == "local" else None
    state = host_lease(resolved, owner_pid=pid, origin=origin).try_acquire(gone_why)
    if state.status != "ACQUIRED":
        progress.tell(  # said where the user looks (the demo's terminal), never waited silently
            "step",
            f"waiting for host {resolved['host']}: its lease is held by {state.holder} for "
            f"{state.seconds_left} s more (a holder whose process is gone is taken over)",
        )
        return None
    out = {"holder": state.holder, "expires_at": state.expires_at, "host": resolved["host"]}
    progress.tell("leased", resolved)
    if state.gone:
        out["taken_over_from"] = state.gone
        out["gone_because"] = state.why or "its process no longer runs"
        out["stopped_servers"] = _stop_servers_of(resolved, state.gone)
        progress.tell(
            "step",
            f"the lease on {resolved['host']} was held by {state.gone}: {state.why}; taken over"
            if state.why
            else f"the lease on {resolved['host']} was held by {state.gone}, whose process no "
            "longer runs: taken over",
        )
    return out


def _stop_servers_of(resolved: Resolved, holder: str) -> list[int]:
    """Stop the servers a gone holder started on the host (its records); their PIDs."""
    from speedmatrix.engine.vllm_server import run_servers, stop_server

    host = host_of(resolved)
    stopped = []
    for rec in run_servers(host, holder):
        log.warning("stopping server PID %d left by %s (gone)", rec.pid, holder)
        stop_server(rec.handle(host), host=host)
        stopped.append(rec.pid)
    return stopped


# ------------------------------------------------------------------------- server lifecycle


def setup(resolved: Resolved) -> dict[str, Any]:
    """Provision the engine env (idempotent) and start the server, holding the lease.

    Returns the JSON-able server handle every later step uses. Refuses to run when the lease
    is not this run's (a setup retried after its lease expired must not start a second server).
    `start_server` waits until the server is ready and stops it itself when it is not.
    """
    from speedmatrix.engine.provision import provision
    from speedmatrix.engine.vllm_server import start_server

    if resolved.get("base_url"):
        return _existing_server(resolved)
    progress.tell("step", f"starting the server on {resolved['host']}")
    lease = host_lease(resolved)
    lease.renew()  # raises LeaseLost when another run holds the host
    recipe = _recipe(resolved)
    host = host_of(resolved)
    started = time.monotonic()
    with lease.renewing(renewed=True):
        prov = provision(recipe, resolved["engine_ref"], host)
        provisioned_s = time.monotonic() - started
        handle = start_server(
            recipe,
            prov,
            host,
            ref=resolved["engine_ref"],
            port=int(resolved["port"]) if resolved.get("port") else None,
            api_key=api_key(resolved),
            wait=True,
            run=resolved["holder"],  # the teardown finds it by this, handle or not
        )
        # between tasks too, for as long as the server lives (the teardown releases it)
        lease.keep_while_group(int(handle.pid))
    out = {
        "handle": handle.to_dict(),
        "base_url": handle.base_url,
        "python": handle.python,
        "loadgen": prov.loadgen,
        "engine_version": prov.version,
        "engine_commit": prov.commit,
        "provision_s": round(provisioned_s, 3),
        "start_s": round(time.monotonic() - started - provisioned_s, 3),
    }
    progress.tell("server", resolved, out)
    log.info(
        "server ready at %s on %s (provision %.1f s, start %.1f s)",
        out["base_url"],
        resolved["host"],
        provisioned_s,
        out["start_s"],
    )
    return out


def _existing_server(resolved: Resolved) -> dict[str, Any]:
    """The handle of a server already running at `base_url` (`speedmatrix run --base-url`):
    nothing provisioned or started, so nothing to stop. Its run dir is a private temporary
    directory holding only the probes' key file (inspect reads it; teardown removes it)."""
    import sys
    import tempfile
    from urllib.parse import urlsplit

    from speedmatrix.engine.vllm_server import ServerHandle

    url = str(resolved["base_url"]).rstrip("/")
    why = server_health(resolved, {"base_url": url})
    if why:
        raise RuntimeError(f"no server ready at {url}: {why}")
    run_dir = tempfile.mkdtemp(prefix="speedmatrix-run-")
    key = api_key(resolved)
    if key:
        fd = os.open(f"{run_dir}/secrets.env", os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"SPEEDMATRIX_PROBE_KEY={shlex.quote(key)}\n")
    handle = ServerHandle(
        host=resolved["host"],
        host_env={},
        pid=0,
        run_dir=run_dir,
        log_path=f"{run_dir}/server.log",  # none: KV capacity comes from /metrics
        base_url=url,
        port=urlsplit(url).port or 0,
        served_name=resolved["served_model"],
        python=sys.executable,
        api_key_env=resolved.get("api_key_env"),
        command=f"(a server already running at {url})",
        started_at=time.time(),
        run=resolved["holder"],
    )
    return {"handle": handle.to_dict(), "base_url": url, "python": sys.executable,
            "loadgen": None, "engine_version": None, "engine_commit": None,
            "provision_s": 0.0, "start_s": 0.0, "existing": True}  # fmt: skip


def _handle(server: Mapping[str, Any]):
    from speedmatrix.engine.vllm_server import ServerHandle

    return ServerHandle.from_dict(dict(server["handle"]))


def inspect(resolved: Resolved, server: Mapping[str, Any]) -> dict[str, Any]:
    """What the server says about itself: version, KV capacity, hardware, max_model_len."""
    from speedmatrix.engine.vllm_server import inspect_server

    facts = inspect_server(_handle(server), host=host_of(resolved))
    if server.get("existing"):  # the commit and hardware probes read this machine, not the
        # server's: the commit is its /version's (engine_ref); hardware only when on loopback
        from urllib.parse import urlsplit

        loopback = urlsplit(server["base_url"]).hostname in ("127.0.0.1", "localhost", "::1")
        facts = {**facts, "commit": None, "hardware": facts.get("hardware") if loopback else {}}
    blocks, block = facts.get("num_gpu_blocks"), facts.get("block_size")
    if not blocks and facts.get("kv_cache_tokens"):
        block = block or 16
        blocks = int(facts["kv_cache_tokens"]) // block
        log.warning(
            "no num_gpu_blocks in /metrics: KV blocks derived from the start-up log's %s tokens "
            "with block size %d",
            facts["kv_cache_tokens"],
            block,
        )
    if not blocks or not block:
        raise RuntimeError(
            "the server did not report its KV capacity (vllm:cache_config_info num_gpu_blocks "
            f"and block_size, or the start-up log): cannot plan over-capacity cells; got {facts}"
        )
    hardware = facts.get("hardware") or {}
    gpus = hardware.get("gpus") or []
    info = {
        "version": facts.get("version"),
        "commit": facts.get("commit"),
        "kv_num_blocks": int(blocks),
        "kv_block_size": int(block),
        "kv_cache_tokens": facts.get("kv_cache_tokens") or int(blocks) * int(block),
        "max_model_len": facts.get("max_model_len"),
        "gpu": gpus[0]["name"] if gpus else None,
        "gpu_count": hardware.get("gpu_count"),
        "launch_command": _handle(server).command,
        "hardware": hardware,
        "sim_profile": facts.get("sim_profile"),
    }
    log.info("server facts: %s", info)
    return info


def teardown(resolved: Resolved, server: Mapping[str, Any] | None) -> dict[str, Any]:
    """Stop every server of this run, then release the lease. Idempotent; always runs.

    The servers are the one in the setup's handle and those the host recorded as started by
    this run (server.run_servers): a setup that failed after the launch (an SSH drop, a worker
    killed during setup) hands no handle over, yet its server holds the GPUs. The lease is
    released only once every stop is verified; when one failed (or the records could not be
    read) the lease is kept, so that no other run starts beside a server that may still
    hold the GPUs, and the task fails saying so (its retry tries again).
    """
    from speedmatrix.engine.vllm_server import run_servers, stop_server

    out: dict[str, Any] = {"stopped": None, "all_stopped": [], "from_records": [], "lease": None}
    errors = []
    host = host_of(resolved)
    handles = [_handle(server)] if server and server.get("handle") else []
    if server and server.get("existing"):  # not ours to stop: only our key file goes
        import shutil

        shutil.rmtree(_handle(server).run_dir, ignore_errors=True)
        handles = []
    try:
        recorded = run_servers(host, resolved["holder"])
    except Exception as exc:
        errors.append(f"the host's server records could not be read: {exc}")
        recorded = []
    known = {(h.run_dir, int(h.pid)) for h in handles}
    for rec in recorded:
        if (rec.run_dir, rec.pid) not in known:
            log.warning(
                "teardown: server PID %d (%s, %s) of this run found in the host's records, "
                "not in the setup's handle: stopping it",
                rec.pid,
                rec.run_dir,
                rec.state,
            )
            handles.append(rec.handle(host))
            out["from_records"].append(rec.run_dir)
    for handle in handles:
        try:
            stopped = stop_server(handle, host=host)
        except Exception as exc:
            errors.append(f"stop of server PID {handle.pid} failed: {exc}")
            continue
        out["all_stopped"].append(stopped)
        out["stopped"] = out["stopped"] or stopped
    if errors:
        out["lease"] = "kept"
        raise RuntimeError(
            "; ".join(errors) + f"; lease kept by {resolved['holder']} on {resolved['host']}: "
            "it is released once the stop is verified (a retry of this task, or stop the "
            "server by hand and clear the task)"
        )
    try:
        out["lease"] = host_lease(resolved).release().status
    except Exception as exc:
        raise RuntimeError(f"lease release failed: {exc}") from exc
    log.info("teardown: %s", out)
    return out


# -------------------------------------------------------------------------------------- plan


def plan(resolved: Resolved, info: Mapping[str, Any]) -> dict[str, list[dict]]:
    """Prefill cells, runnable decode cells and over-capacity records, from the real KV cache."""
    capacity = KvCapacity(int(info["kv_num_blocks"]), int(info["kv_block_size"]))
    max_len = info.get("max_model_len") or _recipe(resolved).model.max_model_len
    planned = plan_matrix(
        _spec(resolved),
        capacity,
        max_model_len=max_len,
        repeats=int(resolved.get("repeats") or 1),
        repeat_cells=resolved.get("repeat_cells"),
    ).as_dict()
    progress.tell("planned", resolved, planned)
    repeated = sum(1 for c in [*planned["prefill"], *planned["decode"]] if c.get("repeat"))
    log.info(
        "plan: %d prefill cells, %d decode cells to run (%d of them repeats), %d over capacity "
        "(KV %d blocks x %d)",
        len(planned["prefill"]),
        len(planned["decode"]),
        repeated,
        len(planned["over_capacity"]),
        capacity.num_blocks,
        capacity.block_size,
    )
    return planned


# ------------------------------------------------------------------------------------- cells


def server_health(resolved: Resolved, server: Mapping[str, Any]) -> str | None:
    """None when the server's /health answers 200, else why not (engine.health): asked from
    this process on `local`, on the host with the server's python elsewhere."""
    from speedmatrix.engine.health import server_health as probe

    if resolved["host"] == "local":
        return probe(server["base_url"])
    return probe(server["base_url"], host_of(resolved), server.get("python") or "python3")


def run_cell(
    resolved: Resolved,
    server: Mapping[str, Any],
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
        return {"cell": to_wire(record), "requests": [], "repeat": repeat}
    progress.tell("cell_started", resolved, server, cell)
    result = _run_cell(resolved, server, cell)
    turn.leave(held, cell.get("label") or "")
    progress.tell("cell_done", cell, result["cell"])
    return {**result, "repeat": repeat, "turn": held}


def _run_cell(
    resolved: Resolved, server: Mapping[str, Any], cell: Mapping[str, Any]
) -> dict[str, Any]:
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
    resolved: Resolved, server: Mapping[str, Any], cell: Mapping[str, Any]
) -> CellConfig:
    """The load generator's config for a planned cell: the same for a local cell (run
    in-process) and a remote one (engine.remote_cell writes it as the zipapp's flags)."""
    from speedmatrix.loadgen import DecodeConfig, PrefillConfig

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
    return DecodeConfig(
        **common,
        concurrency=int(cell["concurrency"]),
        duration_s=float(cell["window_s"]),
        max_output_tokens=int(cell["max_output_tokens"]),
        prompt_mode=str(cell["prompt_mode"]),
    )


def measure(
    resolved: Resolved, server: Mapping[str, Any], cell: Mapping[str, Any]
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
    resolved: Resolved, server: Mapping[str, Any], cell: Mapping[str, Any], cfg: CellConfig
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
    info: Mapping[str, Any] | None,
    server: Mapping[str, Any] | None,
    status: str,
) -> dict[str, Any]:
    """The `runs` row: recipe facts, what the server reported, and the redacted launch line."""
    from speedmatrix.recipes import classify_ref
    from speedmatrix.upstream.commits import engine_commit

    recipe = _recipe(resolved)
    info = info or {}
    server = server or {}
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
        hardware_gpu=info.get("gpu") or recipe.hardware.gpu,
        hardware_gpu_count=info.get("gpu_count") or recipe.hardware.gpu_count,
        hardware_vram_gb=recipe.hardware.vram_gb,
        hardware_os=recipe.hardware.os,
        engine=recipe.engine.name,
        engine_version=info.get("version") or server.get("engine_version"),
        # one value per commit whichever path measured it (speedmatrix.commits)
        engine_commit=engine_commit(
            recorded=info.get("commit") or server.get("engine_commit"),
            ref=ref,
            version=info.get("version") or server.get("engine_version"),
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
        decode_test="Fixed duration",
        prefill_mode="Measured during decode warm-up",
        measure_s=resolved["matrix"]["window_s"],
        max_output_tokens=resolved["matrix"]["max_output_tokens"],
        prompt_mode=resolved["matrix"]["prompt_mode"],
        workload=resolved["matrix"].get("workload"),
        sim_profile=info.get("sim_profile"),
        measurement_profile=resolved["matrix"].get("measurement_profile") or "default",
        launch_command=info.get("launch_command") or launch,
        kv_cache_tokens=info.get("kv_cache_tokens"),
        kv_block_size=info.get("kv_block_size"),
        kv_num_blocks=info.get("kv_num_blocks"),
        max_model_len=info.get("max_model_len") or recipe.model.max_model_len,
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
    info: Mapping[str, Any] | None,
    server: Mapping[str, Any] | None,
    planned: Mapping[str, Sequence[dict]] | None,
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
    return {
        **checked,
        "run": to_wire(checked["run"], RUN_FIELDS),
        "cells": [to_wire(c) for c in checked["cells"]],
        "requests": [to_wire(r, REQUEST_FIELDS) for r in checked["requests"]],
        "repeats": [to_wire(c) for c in checked["repeats"]],
    }


@on_fresh_stack  # the work after the host's stop, whatever executor runs it
def land(resolved: Resolved, validated: Mapping[str, Any]) -> dict[str, Any]:
    """Land the run atomically; landing it again replaces it (idempotent, safe to retry)."""
    from speedmatrix.store.extra import land_cell_repeats

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
    out = {
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
def report(resolved: Resolved, landed: Mapping[str, Any]) -> dict[str, str]:
    """Render the landed run (md + html) next to it in the warehouse; log where.

    The page shows the comparison `land` made and handed on, the one `regressions` judges;
    when none was handed on, the page's loader has analysis.compare make it."""
    from speedmatrix.report.page import keep_charts, load_run_page, render_page
    from speedmatrix.report.render import render_markdown

    wh = warehouse_of(resolved)
    data = load_run_page(
        wh, resolved["run_id"], result=handed_on_comparison(wh, resolved["run_id"])
    )
    md = render_markdown(data.run, data.cells, data.baseline) + (
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
def regressions(resolved: Resolved, landed: Mapping[str, Any]) -> dict[str, Any]:
    """The `regressions` task: judge the comparison `land` made (made again only when none
    was handed on), land the verdicts; RegressionError on a regression."""
    from speedmatrix.analysis.compare import judge_regressions
    from speedmatrix.report.charts import write_comparison_charts

    wh = warehouse_of(resolved)
    result = handed_on_comparison(wh, landed["run_id"])
    return judge_regressions(
        wh, landed["run_id"], fetch_commits=True, result=result, charts=write_comparison_charts
    )


def conclude(landed: Mapping[str, Any]) -> str:
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
