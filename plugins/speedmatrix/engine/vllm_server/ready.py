"""Waiting for a started server to be ready: four checks run on the host.

One job: readiness (the checks and why some answers end the wait at once are in
:func:`wait_ready` and :func:`_not_ready`). The probe runs with the host's python on the host,
since GPU hosts' ports are not always reachable from the Airflow worker; a failure carries
the log's one-line diagnosis (:mod:`speedmatrix.engine.diagnose`) and its tail.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from collections.abc import Iterator

from speedmatrix.engine.diagnose import diagnose
from speedmatrix.engine.hosts import Host
from speedmatrix.engine.vllm_server.contract import ServerError, ServerHandle
from speedmatrix.engine.vllm_server.registry import is_alive

log = logging.getLogger("speedmatrix.server")

FIRST_POLL_S = 0.25
"""The first wait between readiness probes; each next one doubles, up to ``poll_s``. A server
up in a second (the simulator, a tiny model) is seen within a fraction of a second of it,
not up to ``poll_s`` later; a start of minutes is probed every ``poll_s`` after a few seconds."""


def poll_waits(poll_s: float) -> Iterator[float]:
    """The waits between readiness probes: ``FIRST_POLL_S``, doubling, at most ``poll_s``."""
    wait = min(FIRST_POLL_S, poll_s)
    while True:
        yield wait
        wait = min(2 * wait, poll_s)


_PROBE_PY = r"""
import json, os, sys, urllib.request, urllib.error
base, model = sys.argv[1], sys.argv[2]
key = os.environ.get("SPEEDMATRIX_PROBE_KEY")
def call(path, body=None, auth=False, timeout=10.0):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    if auth and key:
        req.add_header("Authorization", "Bearer " + key)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except Exception as e:
        return None, type(e).__name__ + ": " + str(e)
out = {}
out["health"] = call("/health")[0]
if out["health"] == 200:
    st, txt = call("/version")
    out["version"], out["version_status"], out["version_error"] = None, st, None
    try:
        data = json.loads(txt) if st == 200 else None
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("version"), str) and data["version"].strip():
        out["version"] = data["version"]
    elif st is not None:
        out["version_error"] = "HTTP %s: %s" % (st, " ".join(txt.split())[:200] or "(empty body)")
    st, txt = call("/sim/state")  # speedmatrix's simulated engine says so (vLLM: 404)
    try:
        sim = json.loads(txt) if st == 200 else None
    except ValueError:
        sim = None
    if isinstance(sim, dict) and "sim_time" in sim:
        out["sim_profile"] = str(sim.get("profile") or "unnamed")
    st, txt = call("/v1/models", auth=True)
    try:
        out["models"] = [m.get("id") for m in json.loads(txt).get("data", [])] if st == 200 else []
    except Exception:
        out["models"] = []
    out["models_status"] = st
    if model in out["models"]:
        st, txt = call(
            "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 1}, auth=True,
            timeout=float(sys.argv[3]),
        )
        out["completion"] = st
        out["completion_error"] = None if st == 200 else txt[-300:]
print(json.dumps(out))
"""


def run_probe(host: Host, handle: ServerHandle, timeout_s: float = 120) -> dict:
    """The four readiness checks, run on the host; ``timeout_s`` bounds the completion (the
    first request on a cold server can be slow), 10 s each of the others."""
    res = host.run(
        f"set -a; . {shlex.quote(handle.run_dir + '/secrets.env')} 2>/dev/null; set +a; "
        f"{shlex.quote(handle.python)} -c {shlex.quote(_PROBE_PY)} {shlex.quote(handle.base_url)} "
        f"{shlex.quote(handle.served_name)} {timeout_s:g}",
        timeout_s=timeout_s + 60,
        idempotent=True,
        stream=False,
    )
    try:
        return json.loads(res.last_line)
    except (json.JSONDecodeError, IndexError):
        return {"probe_error": res.tail(5)}


def log_tail(host: Host, handle: ServerHandle, lines: int = 40) -> str:
    res = host.run(
        f"tail -n {lines} {shlex.quote(handle.log_path)}",
        timeout_s=60,
        idempotent=True,
        stream=False,
    )
    return res.stdout.rstrip()


def read_log(host: Host, handle: ServerHandle, max_bytes: int = 2_000_000) -> str:
    res = host.run(
        f"tail -c {max_bytes} {shlex.quote(handle.log_path)}",
        timeout_s=120,
        idempotent=True,
        stream=False,
    )
    return res.stdout


def _failure(host: Host, handle: ServerHandle, what: str) -> ServerError:
    text = read_log(host, handle)
    tail = "\n".join(text.rstrip().splitlines()[-40:])
    return ServerError(what, diagnose(text), tail, handle.log_path)


def wait_ready(
    handle: ServerHandle,
    timeout_s: float = 3600,
    *,
    host: Host | None = None,
    poll_s: float = 2.0,
) -> ServerHandle:
    """Block until the server passes all four readiness checks; raise ServerError otherwise.

    Probes soon after the start, then less often, every ``poll_s`` after a few seconds
    (:func:`poll_waits`). Ends early (with the diagnosis) as soon as the server's process group is gone, its log has
    a line that is fatal by itself (``diagnose(..., fatal_only=True)``: a hang is diagnosed at
    the timeout, not on sight), or an answer says waiting cannot help (:func:`_not_ready`).
    """
    host = host or handle.get_host()
    deadline = time.monotonic() + timeout_s
    last: dict = {}
    waits = poll_waits(poll_s)
    while True:
        if not is_alive(host, handle):
            raise _failure(host, handle, f"the server on {host.name} exited before it was ready")
        # A line that is fatal by itself ends the wait at once, even while the process
        # lingers. Only those: a hang-like line (NCCL) is the timeout's diagnosis, below.
        recent = host.run(
            f"tail -c 200000 {shlex.quote(handle.log_path)}",
            timeout_s=60,
            idempotent=True,
            stream=False,
        ).stdout
        if diagnose(recent, fatal_only=True).code != "unknown":
            raise _failure(host, handle, f"the server on {host.name} failed while starting")
        last = run_probe(host, handle)
        if last.get("health") == 200 and last.get("version_error"):
            # Up, yet /version is not vLLM's answer (a JSON object with a "version" string):
            # whatever serves the port is not the engine the recipe names. Waiting won't help.
            raise _failure(
                host,
                handle,
                f"the server on {host.name} answers /health but not /version as vLLM does "
                f'(a JSON object with a "version" string); it answered {last["version_error"]}',
            )
        missing, final = _not_ready(last, handle.served_name)
        if missing is None:
            handle.ready_s = round(time.time() - handle.started_at, 2)
            handle.facts["version"] = last["version"]
            log.info("%s: server ready after %.1f s", host.name, handle.ready_s)
            return handle
        if final:
            raise _failure(host, handle, f"the server on {host.name} is up but {missing}")
        if time.monotonic() > deadline:
            raise _failure(
                host,
                handle,
                f"the server on {host.name} was not ready within {timeout_s:g} s: {missing} "
                f"(last probe: {json.dumps(last)[:300]})",
            )
        time.sleep(next(waits))


def _not_ready(probe: dict, served: str) -> tuple[str | None, bool]:
    """What the probe says is still missing (None: ready), and whether waiting cannot help.

    Final (the start fails at once): ``/v1/models`` refusing the key, or listing models but not
    the served name (the engine serves under another name: the recipe's ``served_name`` and the
    engine's ``--served-model-name`` differ), or the one-token completion refused with a client
    error (4xx but 408/429: the request will not become acceptable). Not final, until the
    ready timeout: no answer yet, a 5xx, an empty model list (still loading).
    """
    if "probe_error" in probe:
        return f"the readiness probe failed on the host: {probe['probe_error']}", False
    if probe.get("health") != 200:
        return f"/health answered {probe.get('health') or 'nothing (no connection)'}", False
    if not probe.get("version"):
        return "/version did not answer", False
    models, st = probe.get("models") or [], probe.get("models_status")
    if served not in models:
        if st in (401, 403):
            return f"/v1/models refused the API key (HTTP {st})", True
        if st == 200 and models:
            return f"/v1/models does not list the served name {served!r} (it lists {models})", True
        return f"/v1/models does not list {served!r} yet (HTTP {st}, models {models})", False
    st = probe.get("completion")
    if st == 200:
        return None, False
    why = " ".join(str(probe.get("completion_error") or "").split())[:300] or "(empty body)"
    if st is not None and 400 <= st < 500 and st not in (408, 429):
        return f"the one-token completion was refused: HTTP {st}: {why}", True
    return f"the one-token completion failed: HTTP {st or 'no answer'}: {why}", False
