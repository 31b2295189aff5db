"""Starting the recipe's server on a host: the refusals first, then the launcher.

One job: the start. Refuses (nothing launched) while a server of ours lives on the machine,
a GPU is busy or the port is taken; writes the run dir (a 0600 ``secrets.env``, the redacted
``command.txt``, ``launch.sh`` with the usage-stats opt-outs) and launches it in a session of
its own that records its identity, PID and machine-wide registry entry itself.
"""

from __future__ import annotations

import logging
import re
import shlex
import time

from speedmatrix.engine.hosts import Host, get_host
from speedmatrix.engine.lease import LeaseError, machine_dir
from speedmatrix.engine.provision import ProvisionResult
from speedmatrix.engine.vllm_server.contract import (
    DEFAULT_API_KEY_ENV,
    DEFAULT_SERVERS_DIR,
    NO_TELEMETRY_ENV,
    PROBE_KEY_VAR,
    PortInUse,
    ServerAlreadyRunning,
    ServerError,
    ServerHandle,
)
from speedmatrix.engine.vllm_server.gpus import check_gpus_free
from speedmatrix.engine.vllm_server.ready import wait_ready
from speedmatrix.engine.vllm_server.registry import OURS, RECORD_IDENTITY, records_in
from speedmatrix.engine.vllm_server.stop import stop_server
from speedmatrix.recipes import Recipe
from speedmatrix.settings import settings

log = logging.getLogger("speedmatrix.server")


def _with_port(recipe: Recipe, port: int | None) -> Recipe:
    if port is None or port == recipe.serve.port:
        return recipe
    return recipe.model_copy(update={"serve": recipe.serve.model_copy(update={"port": port})})


def probe_host(bind: str) -> str:
    return "127.0.0.1" if bind in ("0.0.0.0", "", "::") else bind


def _api_key_value(recipe: Recipe, api_key: str | None) -> str | None:
    if not recipe.has_api_key:
        return None
    if api_key is not None:
        return api_key
    name = recipe.serve.api_key_secret or DEFAULT_API_KEY_ENV
    value = settings().secret_named(name)
    if not value:
        raise ServerError(
            f"recipe {recipe.id} needs an API key: set the environment variable {name}"
        )
    return value


def port_holder(host: Host, bind: str, port: int) -> str | None:
    """None when ``port`` is free on the host, else a description of who holds it."""
    probe = probe_host(bind)
    # bash opens /dev/tcp/HOST/PORT itself, also when the word is quoted: the recipe's
    # serve.host stays one word and is never run
    tcp = shlex.quote(f"/dev/tcp/{probe}/{int(port)}")
    res = host.run(
        f"(exec 3<>{tcp}) 2>/dev/null && echo taken || echo free",
        timeout_s=30,
        idempotent=True,
        stream=False,
    )
    if "taken" not in res.stdout:
        return None
    who = host.run(
        f"ss -Hltnp 'sport = :{int(port)}' 2>/dev/null | grep -o 'pid=[0-9]*' | head -1",
        timeout_s=30,
        idempotent=True,
        stream=False,
    ).stdout.strip()
    return f"held by PID {who[4:]}" if who.startswith("pid=") else "held by another process"


def start_server(
    recipe: Recipe,
    prov: ProvisionResult,
    host: Host | str = "local",
    *,
    ref: str | None = None,
    port: int | None = None,
    api_key: str | None = None,
    servers_dir: str = DEFAULT_SERVERS_DIR,
    check_port: bool = True,
    wait: bool = True,
    ready_timeout_s: float | None = None,
    run: str | None = None,
    lease_dir: str | None = None,
) -> ServerHandle:
    """Launch the recipe's server; by default also :func:`wait_ready` (stopping it on failure).

    Refuses (nothing launched) when a server of ours is alive on the machine, under
    ``servers_dir`` or in the machine-wide registry (:class:`ServerAlreadyRunning`), when
    nvidia-smi lists a GPU compute process (:class:`GpuBusy`), or when the port is taken
    (:class:`PortInUse`; skip with ``check_port=False``, e.g. to see the engine's own
    diagnosis). The key comes from ``api_key`` or the environment variable the recipe names
    (``serve.api_key_secret``). ``run`` (the run's lease holder) is recorded with the server,
    so that the run's teardown finds it from the host alone (:func:`run_servers`);
    ``lease_dir`` overrides the machine-wide directory (tests).
    """
    if isinstance(host, str):
        host = get_host(host)
    recipe = _with_port(recipe, port)
    ref = ref or prov.ref or recipe.engine.ref
    try:
        machine, uid = machine_dir(host, lease_dir)
    except LeaseError as exc:
        raise ServerError(f"cannot record a server on {host.name}: {exc}") from exc
    for rec in records_in(host, servers_dir, machine):
        if rec.state in OURS:
            by = f"started by {rec.owner}" + (f" for {rec.run}" if rec.run else "")
            raise ServerAlreadyRunning(
                f"a previous server of ours is still alive on {host.name}: PID {rec.pid} "
                f"({rec.run_dir}, {by}); stop it first"
            )
    check_gpus_free(host)
    s = recipe.serve
    if check_port and (who := port_holder(host, s.host, s.port)):
        raise PortInUse(f"port {s.port} on {host.name} is already in use ({who})")

    overridden = {
        k: v for k, v in s.env.items() if k in NO_TELEMETRY_ENV and v != NO_TELEMETRY_ENV[k]
    }
    if overridden:
        # The recipe's env is applied after the launcher's exports, so it could switch the
        # opt-outs back on: refused, nothing launched.
        raise ServerError(
            f"recipe {recipe.id} sets {overridden} in serve.env: the usage-stats opt-outs "
            f"{sorted(NO_TELEMETRY_ENV)} stay on for every server speedmatrix starts"
        )
    key = _api_key_value(recipe, api_key)
    key_var = s.api_key_secret or DEFAULT_API_KEY_ENV
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_var):
        # it is written unquoted after `export` (a name cannot be quoted): the loader refuses
        # such a recipe already; refused here too, so no path around the loader runs it
        raise ServerError(f"serve.api_key_secret {key_var!r} is not a variable name")
    python = prov.python
    include = prov.include_dir or "include"
    # vLLM and the simulator both read VLLM_API_KEY (exported from secrets.env below): the
    # `--api-key` pair is left out of the command, so no server we start has its key in argv
    line = recipe.render_launch_command(ref, api_key="omit", python=python, include=include)
    shown = recipe.render_launch_command(ref, api_key="redact", python=python, include=include)

    run_dir = f"{host.resolve(servers_dir)}/{s.port}"
    host.run(
        f"rm -rf {shlex.quote(run_dir)} && mkdir -p {shlex.quote(run_dir)}",
        60,
        check=True,
        idempotent=True,
    )
    secrets = ""
    if key is not None:
        secrets = (
            f"export {key_var}={shlex.quote(key)}\nexport {PROBE_KEY_VAR}={shlex.quote(key)}\n"
            + f"export VLLM_API_KEY={shlex.quote(key)}\n"
        )
    host.put_text(secrets, f"{run_dir}/secrets.env", mode=0o600)
    host.put_text(shown + "\n", f"{run_dir}/command.txt", mode=0o644)
    if run:
        host.put_text(run + "\n", f"{run_dir}/run", mode=0o644)
    host.put_text(
        "#!/bin/bash\n"
        "# Written by speedmatrix.engine.vllm_server: the recipe's launch command, secrets from secrets.env.\n"
        f"set -a; . {shlex.quote(run_dir + '/secrets.env')}; set +a\n"
        f"unset {PROBE_KEY_VAR}\n"
        "# No usage stats, no telemetry: the server contacts nothing but loopback.\n"
        + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in NO_TELEMETRY_ENV.items())
        + f"exec {line}\n",
        f"{run_dir}/launch.sh",
        mode=0o700,
    )
    log_path = f"{run_dir}/server.log"
    pid_path = f"{run_dir}/pid"
    # The registry entry, machine-wide and readable by every user (see the package docstring):
    # written by the launcher itself, so it exists as soon as the server does.
    entry = f"{machine}/server.{uid}.{s.port}"
    tmp = f"{machine}/.tmp.server.{uid}.{s.port}"
    register = (
        f'( umask 022; printf \'%s\\n\' "$$" "${{i:-}}" {shlex.quote(run_dir)} {shlex.quote(run or "")} '
        f"> {shlex.quote(tmp)} ) 2>/dev/null && mv -f {shlex.quote(tmp)} {shlex.quote(entry)} 2>/dev/null; "
    )
    launcher = (
        f"{RECORD_IDENTITY}echo $$ > {shlex.quote(pid_path)}; {register}exec bash ./launch.sh"
    )
    host.run(
        # The subshell's own output is redirected too: nothing keeps this command's pipes open.
        f"(cd {shlex.quote(run_dir)} && exec setsid bash -c {shlex.quote(launcher)}"
        f") > {shlex.quote(log_path)} 2>&1 < /dev/null &",
        timeout_s=60,
        check=True,
    )
    pid = 0
    identity = None
    for _ in range(50):
        res = host.run(
            f"cat {shlex.quote(pid_path)} 2>/dev/null && cat {shlex.quote(run_dir + '/pid.identity')} 2>/dev/null",
            30,
            idempotent=True,
            stream=False,
        )
        lines = res.stdout.splitlines()
        if lines and lines[0].strip().isdigit():
            pid = int(lines[0].strip())
            identity = lines[1].strip() if len(lines) > 1 and lines[1].strip() else None
            break
        time.sleep(0.1)
    if not pid:
        raise ServerError(f"the server on {host.name} did not record its PID in {pid_path}")
    handle = ServerHandle(
        host=host.name,
        host_env=dict(host.env),
        pid=pid,
        run_dir=run_dir,
        log_path=log_path,
        base_url=f"http://{probe_host(s.host)}:{s.port}",
        port=s.port,
        served_name=recipe.model.served_name,
        python=python,
        api_key_env=key_var if key is not None else None,
        command=shown,
        started_at=time.time(),
        identity=identity,
        run=run,
        record=entry,
    )
    log.info("%s: started server PID %d: %s", host.name, pid, shown)
    if wait:
        try:
            wait_ready(handle, ready_timeout_s or s.ready_timeout_s, host=host)
        except BaseException:
            stop_server(handle, host=host)
            raise
    return handle
