"""The run's server on its host: the host's lease taken, the engine provisioned and started,
what it reports inspected, and everything of the run stopped, the lease released.

One job: the host side of speed_matrix's `wait_for_host`, `setup_server`, `inspect` and
`stop_server` (and of `speedmatrix run`'s same steps). flows/matrix.py holds the steps that use
the server (plan, the cells) and those after it (validate, land, report), and re-exports these,
so that the DAG and the command call every step as `matrix.<step>`.
What a step hands on is typed in flows/contracts.py: `setup` returns a ServerHandoff, `inspect`
a ServerInfo. The engine's own parts live in engine/ (provision, vllm_server, lease, health);
this module decides, for one run, which to call in what order, and what to keep when one fails.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from collections.abc import Callable
from typing import Any

from speedmatrix.engine.lease import HostLease
from speedmatrix.flows import progress
from speedmatrix.flows.contracts import TEARDOWN, ServerHandoff, ServerInfo, TornDown
from speedmatrix.flows.resolved import Resolved
from speedmatrix.settings import settings

log = logging.getLogger("speedmatrix.pipeline")


def recipe_of(resolved: Resolved):
    """The run's recipe, as `resolve` pinned it (never the file again: a recipe edited or
    redeployed mid-run must not make the server run one recipe and the row record another)."""
    from speedmatrix.recipes import Recipe

    return Recipe.model_validate(resolved["recipe"])


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


def setup(resolved: Resolved) -> ServerHandoff:
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
    recipe = recipe_of(resolved)
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
    out: ServerHandoff = {
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


def _existing_server(resolved: Resolved) -> ServerHandoff:
    """The handle of a server already running at `base_url` (`speedmatrix run --base-url`):
    nothing provisioned or started, so nothing to stop. Its run dir is a private temporary
    directory holding only the probes' key file (inspect reads it; teardown removes it)."""
    import sys
    import tempfile
    from urllib.parse import urlsplit

    from speedmatrix.engine.vllm_server import ServerHandle

    url = str(resolved["base_url"]).rstrip("/")
    why = _health_at(resolved, url, None)
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


def server_handle(server: ServerHandoff):
    """The engine's handle of the server (engine.vllm_server.ServerHandle) from its hand-off."""
    from speedmatrix.engine.vllm_server import ServerHandle

    return ServerHandle.from_dict(dict(server["handle"]))


def inspect(resolved: Resolved, server: ServerHandoff) -> ServerInfo:
    """What the server says about itself: version, KV capacity, hardware, max_model_len."""
    from speedmatrix.engine.vllm_server import inspect_server

    facts = inspect_server(server_handle(server), host=host_of(resolved))
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
    info: ServerInfo = {
        "version": facts.get("version"),
        "commit": facts.get("commit"),
        "kv_num_blocks": int(blocks),
        "kv_block_size": int(block),
        "kv_cache_tokens": facts.get("kv_cache_tokens") or int(blocks) * int(block),
        "max_model_len": facts.get("max_model_len"),
        "gpu": gpus[0]["name"] if gpus else None,
        "gpu_count": hardware.get("gpu_count"),
        "launch_command": server_handle(server).command,
        "hardware": hardware,
        "sim_profile": facts.get("sim_profile"),
    }
    log.info("server facts: %s", info)
    return info


def teardown(resolved: Resolved, server: ServerHandoff | None) -> TornDown:
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
    handles = [server_handle(server)] if server and server.get("handle") else []
    if server and server.get("existing"):  # not ours to stop: only our key file goes
        import shutil

        shutil.rmtree(server_handle(server).run_dir, ignore_errors=True)
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
    return TEARDOWN.to_wire(out)


def server_health(resolved: Resolved, server: ServerHandoff) -> str | None:
    """None when the server's /health answers 200, else why not (engine.health): asked from
    this process on `local`, on the host with the server's python elsewhere."""
    return _health_at(resolved, server["base_url"], server.get("python"))


def _health_at(resolved: Resolved, base_url: str, python: str | None) -> str | None:
    from speedmatrix.engine.health import server_health as probe

    if resolved["host"] == "local":
        return probe(base_url)
    return probe(base_url, host_of(resolved), python or "python3")
