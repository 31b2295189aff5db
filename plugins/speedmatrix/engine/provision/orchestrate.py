"""Provisioning an env: reuse it, wait for the provisioning that holds it, or build it.

One job: the decisions of one provisioning, in order (the why of each is in the package
docstring). Look at the lock and the marker; reuse a valid env (re-shipping what is stale);
else run an attempt (:mod:`.remote`, :mod:`.scripts`) and read its exit code: built, refused
by a peer holding the lock (look again), found valid under the lock, or failed (the error
carries the log's tail). The simulator needs no env: :func:`_provision_sim`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shlex
import sys
import time
from collections.abc import Callable

from speedmatrix.engine.hosts import Host, HostError, get_host
from speedmatrix.engine.provision.contract import (
    ATTEMPT_RECORD,
    MARKER,
    RC_ALREADY,
    RC_LOCKED,
    RC_NOT_OURS,
    RC_REASONS,
    ProvisionError,
    ProvisionResult,
)
from speedmatrix.engine.provision.plan import install_hash, plan_install
from speedmatrix.engine.provision.remote import (
    lock_held,
    log_tail,
    read_marker,
    start_attempt,
    wait_attempt,
    wait_lock_free,
)
from speedmatrix.engine.provision.scripts import Build, attempt_scripts
from speedmatrix.engine.provision.shipping import build_shipment, refresh_shipped, stage_shipment
from speedmatrix.recipes import REPO_ROOT, Recipe

log = logging.getLogger("speedmatrix.provision")


def _result(
    recipe: Recipe, ref: str, env_dir: str, marker: dict, reused: bool, started: float, **extra
) -> ProvisionResult:
    state_dir = env_dir + ".speedmatrix"
    return ProvisionResult(
        env_dir=env_dir,
        python=f"{env_dir}/bin/python",
        version=marker.get("version"),
        commit=marker.get("commit"),
        reused=reused,
        ref=ref,
        state_dir=state_dir,
        include_dir=marker.get("include_dir"),
        loadgen=marker.get("loadgen"),
        model_path=marker.get("model_path"),
        log_path=f"{state_dir}/provision.log",
        elapsed_s=time.monotonic() - started,
        marker=marker,
    )


def provision(
    recipe: Recipe,
    ref: str | None = None,
    host: Host | str = "local",
    *,
    wheel_index: str | None = None,
    repo_url: str | None = None,
    resolver: Callable[[str], str] | None = None,
    timeout_s: float = 3 * 3600,
    poll_s: float = 5.0,
    force: bool = False,
) -> ProvisionResult:
    """Create or reuse the engine env for ``recipe`` at ``ref`` on ``host``.

    Returns at once with ``reused=True`` when the marker matches. Everything that touches the
    env (moving a half-done one away, unpacking include/, installing, the marker) runs on the
    host under the env's lock (``<state>/lock``): when another provisioning of the same env
    holds it (a concurrent call, or a retried task's predecessor still installing), this one
    waits for it and then reuses what it left, or builds when it left no valid env. Rebuilds
    a half-done env; raises :class:`ProvisionError` (with the install log's tail) when a step
    fails. A reused env gets the zipapp and include/ again when they are not what this
    speedmatrix ships (:func:`refresh_shipped`). ``wheel_index`` and ``repo_url`` default as
    :func:`wheel_index_for` and :func:`repo_url_for` say (environment variables, read now).
    """
    started = time.monotonic()
    if isinstance(host, str):
        host = get_host(host)
    ref = ref or recipe.engine.ref
    if recipe.engine.install.kind == "sim":
        return _provision_sim(recipe, ref, host, started)

    env_dir = host.resolve(recipe.env_dir(ref))
    state_dir = env_dir + ".speedmatrix"
    python = f"{env_dir}/bin/python"
    model_path = host.resolve(recipe.model_location(ref)) if recipe.model.path else None
    plan = plan_install(recipe, ref, wheel_index=wheel_index, repo_url=repo_url, resolver=resolver)
    digest = install_hash(recipe, ref, plan.commit)
    ship = build_shipment()
    build = Build(recipe, ref, plan, digest, ship, env_dir, model_path, force)
    log_path = f"{state_dir}/provision.log"
    deadline = started + timeout_s

    def valid(m: dict | None) -> bool:
        return bool(m) and m.get("install_hash") == digest and m.get("ref") == ref

    host.run(f"mkdir -p {shlex.quote(state_dir)}", timeout_s=60, check=True, idempotent=True)
    for _attempt in range(3):
        if lock_held(host, state_dir):
            log.info("%s: a provisioning of %s is running: waiting for it", host.name, env_dir)
            wait_lock_free(host, state_dir, env_dir, deadline, timeout_s, poll_s)
        marker = None if force else read_marker(host, env_dir)
        if (
            valid(marker)
            and host.run(f"test -x {shlex.quote(python)}", 60, idempotent=True).rc == 0
        ):
            log.info("%s: env %s already provisioned for %s: reused", host.name, env_dir, ref)
            refresh_shipped(host, state_dir, ship)
            return _result(recipe, ref, env_dir, marker, True, started)
        why = "forced" if force else ("no valid marker" if not marker else "marker does not match")
        log.info("%s: building %s for %s (%s)", host.name, env_dir, ref, why)
        rc = run_attempt(host, build, deadline, timeout_s, poll_s)
        if rc == RC_LOCKED:
            # Another provisioning took the lock between our look and our start: wait for it.
            log.info("%s: another provisioning of %s took its lock first", host.name, env_dir)
            continue
        marker = read_marker(host, env_dir)
        if rc == RC_ALREADY and valid(marker):
            log.info("%s: env %s was provisioned meanwhile: reused", host.name, env_dir)
            refresh_shipped(host, state_dir, ship)
            return _result(recipe, ref, env_dir, marker, True, started)
        if rc == RC_NOT_OURS:
            raise ProvisionError(
                f"{env_dir} on {host.name} exists and was not made by speedmatrix (no marker "
                f"{MARKER} in it, no attempt record {state_dir}/{ATTEMPT_RECORD}): nothing was "
                "moved or removed. Move or delete it yourself, or give the recipe another "
                "env_name"
            )
        if rc != 0:
            reason = RC_REASONS.get(rc, "the install script failed")
            raise ProvisionError(
                f"provisioning {env_dir} for {ref} on {host.name}: {reason} (exit code {rc})",
                log_tail(host, log_path),
                log_path,
            )
        if not valid(marker):
            raise ProvisionError(
                f"provisioning {env_dir} on {host.name} ended without a valid marker",
                log_tail(host, log_path),
                log_path,
            )
        log.info(
            "%s: provisioned %s (%s %s)", host.name, env_dir, marker["dist"], marker["version"]
        )
        return _result(recipe, ref, env_dir, marker, False, started)
    raise ProvisionError(
        f"provisioning {env_dir} on {host.name}: other provisionings of this env kept taking "
        "its lock first (another provisioning of this env is running); try again"
    )


def run_attempt(host: Host, build: Build, deadline: float, timeout_s: float, poll_s: float) -> int:
    """Ship this attempt's files to its own directory (``<state>/attempts/<id>/``: nothing
    another provisioning uses), run it detached under the env's lock, return its exit code:
    0 built, RC_LOCKED refused (nothing touched), RC_ALREADY found valid under the lock."""
    state_dir = build.state_dir
    attempt = f"{state_dir}/attempts/{int(time.time())}-{os.getpid()}-{secrets.token_hex(4)}"
    host.run(f"mkdir -p {shlex.quote(attempt)}", timeout_s=60, check=True, idempotent=True)
    try:
        stage_shipment(host, build.ship, attempt, ("loadgen", "include"))
        wrapper, body = attempt_scripts(build, attempt)
        start_attempt(host, attempt, wrapper, body)
        deadline = max(deadline, time.monotonic() + 1.0)
        log_path = f"{state_dir}/provision.log"
        return wait_attempt(host, attempt, log_path, deadline, timeout_s, poll_s)
    finally:
        # Best effort: a lost connection here must not hide the attempt's own outcome.
        with contextlib.suppress(HostError):
            host.run(f"rm -rf {shlex.quote(attempt)}", timeout_s=60, idempotent=True, stream=False)


def _provision_sim(recipe: Recipe, ref: str, host: Host, started: float) -> ProvisionResult:
    """The simulator needs no env: check the host's python runs speedmatrix; ship include/
    and the zipapp when the host does not have this speedmatrix's already."""
    if host.is_local:
        python = sys.executable
        include_dir = str(REPO_ROOT / "include")
        state_dir = None
        loadgen = None
    else:
        python = "python3"
        state_dir = host.resolve("$HOME/.speedmatrix-sim")
        host.run(f"mkdir -p {shlex.quote(state_dir)}", timeout_s=60, check=True, idempotent=True)
        refresh_shipped(host, state_dir, build_shipment())
        include_dir = f"{state_dir}/include"
        loadgen = f"{state_dir}/loadgen.pyz"
    res = host.run(
        f"{shlex.quote(python)} -c 'import speedmatrix.sim'", timeout_s=120, idempotent=True
    )
    if res.rc != 0:
        raise ProvisionError(
            f"the simulator cannot run on {host.name}: {python} cannot import speedmatrix.sim",
            res.tail(),
        )
    return ProvisionResult(
        env_dir=None,
        python=python,
        version=recipe.engine.version,
        commit=None,
        reused=True,
        ref=ref,
        state_dir=state_dir,
        include_dir=include_dir,
        loadgen=loadgen,
        elapsed_s=time.monotonic() - started,
        marker={"kind": "sim"},
    )
