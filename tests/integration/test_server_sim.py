"""Server lifecycle against the simulated engine through the local transport, and the parts
of start/stop that need a misbehaving server (one that ignores SIGTERM, one whose /version is
not vLLM's, GPUs that a fake nvidia-smi reports): small stand-ins launched as the recipe's
command, exactly as a real engine is launched."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import processes
import pytest
import requests
from processes import running

from speedmatrix.engine.hosts import get_host
from speedmatrix.engine.provision import ProvisionResult, provision
from speedmatrix.engine.vllm_server import (
    NO_TELEMETRY_ENV,
    PortInUse,
    ServerAlreadyRunning,
    ServerError,
    ServerHandle,
    alive_servers,
    group_pids,
    inspect_server,
    server_state,
    start_server,
    stop_server,
)
from speedmatrix.recipes import REPO_ROOT, load_recipe

pytestmark = pytest.mark.integration

SIM = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
KEY = "sim-key-$(touch /tmp/speedmatrix-pwned) 'q' \"d\""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def local(tmp_path):
    return get_host("local", env={"HOME": str(tmp_path)})


@pytest.fixture
def sim():
    recipe = load_recipe(SIM)
    return recipe, provision(recipe, host="local")


def _with_serve(recipe, **serve):
    return recipe.model_copy(update={"serve": recipe.serve.model_copy(update=serve)})


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        items = fh.read().decode("utf-8", "replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def test_start_inspect_stop_leaves_nothing(local, sim):
    recipe, prov = sim
    handle = start_server(recipe, prov, local, port=_free_port(), api_key="k1")
    try:
        assert handle.ready_s is not None
        pids = group_pids(local, handle.pid)
        assert handle.pid in pids
        facts = inspect_server(handle, host=local)
        assert facts["version"]
        assert facts["kv_cache_tokens_metrics"] and facts["kv_cache_tokens_metrics"] > 0
        assert facts["kv_cache_tokens"] == facts["kv_cache_tokens_metrics"]
        # what /v1/models reports: the sim profile's value, the recipe's (as the launch's)
        assert facts["max_model_len"] == recipe.model.max_model_len
        assert facts["hardware"]["cpu_count"] >= 1
        # Usage stats off: the server's own environment carries vLLM's opt-outs.
        env = _environ(handle.pid)
        assert "speedmatrix" in Path(f"/proc/{handle.pid}/cmdline").read_text()  # the sim
        assert env.get("VLLM_NO_USAGE_STATS") == "1" and env.get("DO_NOT_TRACK") == "1"
        assert {k: env.get(k) for k in NO_TELEMETRY_ENV} == NO_TELEMETRY_ENV
        cmd = local.run(f"cat {handle.run_dir}/command.txt", check=True).stdout.strip()
        assert cmd == handle.command and "<redacted>" in cmd and "k1" not in cmd
        with pytest.raises(ServerAlreadyRunning, match=f"PID {handle.pid}"):
            start_server(recipe, prov, local, port=_free_port(), api_key="k1")
    finally:
        out = stop_server(handle, host=local)
    assert out["was_running"] and out["left"] == []
    assert group_pids(local, handle.pid) == []
    assert running(pids) == []
    again = stop_server(handle, host=local)  # idempotent
    assert again["was_running"] is False and again["left"] == []


def test_recipe_value_with_shell_metacharacters_is_one_literal_argument(local, sim, tmp_path):
    """The profile path and the key both hold quotes, $(...), spaces and ';'."""
    recipe, prov = sim
    weird_dir = tmp_path / "we ird;$(touch PWNED)'\"`id`"
    weird_dir.mkdir()
    profile = weird_dir / "p.yaml"
    shutil.copy(REPO_ROOT / "include/sim-profiles/kimi-k2.7-nvfp4-rtxpro6k-x8.yaml", profile)
    command = tuple(str(profile) if "sim-profiles" in t else t for t in recipe.serve.command)
    weird = _with_serve(recipe, command=command)
    port = _free_port()
    handle = start_server(weird, prov, local, port=port, api_key=KEY)
    try:
        assert handle.ready_s is not None  # the key and the path arrived intact
        with open(f"/proc/{handle.pid}/cmdline", "rb") as fh:
            argv = [a.decode() for a in fh.read().split(b"\0")[:-1]]
        assert argv[argv.index("--profile") + 1] == str(profile)  # one argument, literal
        # the key reaches the simulator through its environment, as vLLM's does: in no
        # process's command line (issue #33 item 13), and it is enforced
        for pid in group_pids(local, handle.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                assert KEY.encode() not in fh.read(), pid
        assert "--api-key" not in argv
        url = f"http://127.0.0.1:{port}/v1/models"
        assert requests.get(url, timeout=5).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert requests.get(url, headers=auth, timeout=5).status_code == 200
    finally:
        stop_server(handle, host=local)
    assert not (tmp_path / "PWNED").exists()
    assert not list(tmp_path.rglob("PWNED"))


def test_bad_argument_is_diagnosed_with_the_log_tail(local, sim):
    recipe, prov = sim
    bad = _with_serve(recipe, args=(*recipe.serve.args, "--no-such-flag", "1"))
    with pytest.raises(ServerError) as exc:
        start_server(bad, prov, local, port=_free_port(), api_key="k")
    err = exc.value
    assert err.diagnosis.code == "unknown_argument"
    assert "--no-such-flag" in err.diagnosis.message
    assert "unrecognized arguments" in err.log_tail
    assert "last lines of" in str(err)


def _hang_up_on_each(s: socket.socket, stop: threading.Event) -> None:
    """Accept each connection to ``s`` and close it at once, until ``stop``: a port holder
    that is not an HTTP server, whose probes fail at once rather than time out."""
    s.settimeout(0.1)
    while not stop.is_set():
        try:
            conn, _ = s.accept()
        except TimeoutError:
            continue
        conn.close()


def test_port_taken_is_refused_or_diagnosed(local, sim):
    recipe, prov = sim
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        stop = threading.Event()
        holder = threading.Thread(target=_hang_up_on_each, args=(s, stop), daemon=True)
        holder.start()
        try:
            with pytest.raises(PortInUse, match=rf"port {port} .*in use"):
                start_server(recipe, prov, local, port=port, api_key="k")
            # Skipping our check, the engine itself fails: diagnosed from its log.
            with pytest.raises(ServerError) as exc:
                start_server(recipe, prov, local, port=port, api_key="k", check_port=False)
        finally:
            stop.set()
            holder.join()
    assert exc.value.diagnosis.code == "address_in_use"
    assert exc.value.log_tail


def test_a_recipe_cannot_switch_the_usage_stats_opt_out_back_on(local, sim, tmp_path):
    recipe, prov = sim
    noisy = _with_serve(recipe, env={"VLLM_NO_USAGE_STATS": "0"})
    servers = f"{tmp_path}/servers"
    with pytest.raises(ServerError, match=r"VLLM_NO_USAGE_STATS.*opt-outs"):
        start_server(noisy, prov, local, port=_free_port(), api_key="k", servers_dir=servers)
    assert not os.path.exists(servers)  # nothing launched


# ---------------------------------------------------------------- stand-in servers
def _standin_prov() -> ProvisionResult:
    """No env: the stand-ins are bash or this interpreter."""
    return ProvisionResult(
        env_dir=None, python=sys.executable, version=None, commit=None, reused=True
    )


def _launched(host, handle, text: str) -> None:
    """Wait until the server's log shows ``text`` (the stand-in is set up)."""
    for _ in range(300):
        if text in host.run(f"cat {handle.log_path}", stream=False).stdout:
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {handle.log_path}")


# Ignores SIGTERM: bash with TERM ignored, and its `sleep` children inherit that.
_STUBBORN = ("bash", "-c", "trap '' TERM; echo trapped; while :; do sleep 1; done")
_OBEDIENT = ("bash", "-c", "echo started; while :; do sleep 1; done")


@pytest.fixture(params=["local", "ssh"])
def any_host(request, tmp_path):
    """The local transport and the test sshd, HOME in a temporary directory."""
    if request.param == "local":
        h = get_host("local", env={"HOME": str(tmp_path)})
    else:
        h = get_host(request.getfixturevalue("ssh_conn_id"), env={"HOME": str(tmp_path)})
    yield h
    h.close()


def test_a_server_that_ignores_sigterm_is_killed_and_nothing_is_left(any_host, log_messages):
    recipe = _with_serve(load_recipe(SIM), command=_STUBBORN)
    handle = start_server(
        recipe, _standin_prov(), any_host, port=_free_port(), api_key="k", wait=False
    )
    try:
        _launched(any_host, handle, "trapped")
        pids = group_pids(any_host, handle.pid)
        assert handle.pid in pids and len(pids) >= 2  # bash and its sleep
        with log_messages("speedmatrix.server") as msgs:
            out = stop_server(handle, host=any_host, grace_s=1)
    finally:
        stop_server(handle, host=any_host, grace_s=1)
    # It said it had to SIGKILL, and what it killed is gone.
    assert out["was_running"] and out["killed"] is True
    assert handle.pid in out["term_survivors"]
    assert any("SIGKILL" in m and str(handle.pid) in m for m in msgs), msgs
    assert out["left"] == [] and group_pids(any_host, handle.pid) == []
    assert running(pids) == []
    assert out["gpu_check"] == "skipped: no nvidia-smi on the host"


def test_a_server_that_obeys_sigterm_is_not_killed(local):
    recipe = _with_serve(load_recipe(SIM), command=_OBEDIENT)
    handle = start_server(
        recipe, _standin_prov(), local, port=_free_port(), api_key="k", wait=False
    )
    _launched(local, handle, "started")
    out = stop_server(handle, host=local)
    assert out["was_running"] and out["killed"] is False and out["term_survivors"] == []
    assert out["left"] == []


_FAKE_NVIDIA_SMI = r"""#!/bin/bash
# Stand-in for nvidia-smi: answers the GPU query (name, memory, driver) from gpus.csv and the
# compute-apps query from apps.csv, or fails like a driver that is gone when the file `fail`
# exists. Every call is recorded in `calls`.
d="$(dirname "$0")"
echo "$*" >> "$d/calls"
case " $* " in
  *" --query-gpu=name,memory.total,driver_version "*)
    [ -e "$d/gpus.csv" ] || { echo "No devices were found"; exit 6; }
    case " $* " in *" --format=csv "*) echo "name, memory.total [MiB], driver_version" ;; esac
    cat "$d/gpus.csv" ;;
  *" --query-compute-apps="*)
    if [ -e "$d/fail" ]; then
      echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
      exit 9
    fi
    cat "$d/apps.csv" ;;
  *) echo "fake nvidia-smi: unexpected arguments: $*" >&2; exit 2 ;;
esac
"""


@pytest.mark.parametrize("mode", ["ours", "others", "fails", "absent"])
def test_gpu_check_after_stop(tmp_path, log_messages, mode):
    """After the group is gone, stop asks nvidia-smi for GPU compute processes: one of ours
    left is an error naming it; others' are fine; nvidia-smi failing is reported, not taken
    for "no process"; no nvidia-smi (a CPU host) skips the check."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    path = os.environ["PATH"]
    if mode == "absent":
        if shutil.which("nvidia-smi"):
            pytest.skip("this machine has a real nvidia-smi")
    else:
        (fake / "nvidia-smi").write_text(_FAKE_NVIDIA_SMI)
        (fake / "nvidia-smi").chmod(0o755)
        path = f"{fake}:{path}"
        if mode == "fails":
            (fake / "fail").touch()
    host = get_host("local", env={"HOME": str(tmp_path), "PATH": path})
    recipe = _with_serve(load_recipe(SIM), command=_OBEDIENT)
    handle = start_server(recipe, _standin_prov(), host, port=_free_port(), api_key="k", wait=False)
    _launched(host, handle, "started")
    pids = group_pids(host, handle.pid)
    apps = ["1, /usr/lib/xorg/Xorg, 12 MiB"]  # never ours
    if mode == "ours":
        apps.append(f"{handle.pid}, python3, 4000 MiB")
    (fake / "apps.csv").write_text("\n".join(apps) + "\n")

    with log_messages("speedmatrix.server") as msgs:
        if mode == "ours":
            with pytest.raises(ServerError) as exc:
                stop_server(handle, host=host, gpu_wait_s=0)
        else:
            out = stop_server(handle, host=host, gpu_wait_s=0)
    assert group_pids(host, handle.pid) == [] and running(pids) == []  # stopped in every case
    if mode != "absent":
        assert "--query-compute-apps=pid" in (fake / "calls").read_text()
    if mode == "ours":
        text = str(exc.value)
        assert "nvidia-smi still lists GPU compute processes of ours" in text
        assert f"PID {handle.pid} (python3, 4000 MiB)" in text and "Xorg" not in text
    elif mode == "others":
        assert out["gpu_check"] == "ok" and out["gpu_left"] == []
    elif mode == "fails":
        assert out["gpu_check"].startswith("failed: nvidia-smi exited with code 9")
        assert "couldn't communicate with the NVIDIA driver" in out["gpu_check"]
        assert any("could not check the GPUs" in m for m in msgs), msgs
    else:
        assert out["gpu_check"] == "skipped: no nvidia-smi on the host"


# A stand-in engine: /health, /v1/models and a completion as vLLM answers them, /version with
# whatever the test puts in a file (status and body), so only the /version check differs.
_STANDIN_SERVER = r"""
import argparse, json, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--served"); ap.add_argument("--version-file"); ap.add_argument("--version-status", type=int)
ap.add_argument("--host"); ap.add_argument("--port", type=int); ap.add_argument("--api-key")
ap.add_argument("--models", default=None); ap.add_argument("--completion-status", type=int, default=200)
ap.add_argument("--say", action="append", default=[]); ap.add_argument("--serve-after", type=float, default=0)
a = ap.parse_args()
for line in a.say:  # start-up log lines, before the port is served
    print(line, flush=True)
time.sleep(a.serve_after)
models = a.models.split(",") if a.models is not None else [a.served]


class H(BaseHTTPRequestHandler):
    def _send(self, code, body):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/version":
            self._send(a.version_status, open(a.version_file, "rb").read())
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": m} for m in models]}).encode())
        else:
            self._send(404, b'{"detail": "Not Found"}')

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if a.completion_status != 200:
            err = {"error": {"message": "stand-in refuses", "code": a.completion_status}}
            self._send(a.completion_status, json.dumps(err).encode())
            return
        self._send(200, json.dumps({"choices": [{"text": "x"}]}).encode())

    def log_message(self, *args):
        pass


print("stand-in listening", flush=True)
ThreadingHTTPServer((a.host, a.port), H).serve_forever()
"""


@pytest.mark.parametrize(
    ("status", "body", "shown"),
    [
        pytest.param(200, b'{"version": "0.32.0"}', None, id="vllm-like"),
        pytest.param(200, b"hello, I am not vLLM", "HTTP 200: hello, I am not vLLM", id="text"),
        pytest.param(200, b'["0.32.0"]', 'HTTP 200: ["0.32.0"]', id="list"),
        pytest.param(200, b'{"name": "x"}', 'HTTP 200: {"name": "x"}', id="no-version"),
        pytest.param(200, b'{"version": 3}', 'HTTP 200: {"version": 3}', id="number"),
        pytest.param(200, b'{"version": ""}', 'HTTP 200: {"version": ""}', id="empty"),
        pytest.param(404, b'{"detail": "Not Found"}', "HTTP 404", id="404"),
    ],
)
def test_readiness_requires_version_answered_as_vllm_does(local, tmp_path, status, body, shown):
    script = tmp_path / "standin_server.py"
    script.write_text(_STANDIN_SERVER)
    version_file = tmp_path / "version.body"
    version_file.write_bytes(body)
    recipe = load_recipe(SIM)
    command = (
        "{python}", str(script), "--served", recipe.model.served_name,
        "--version-file", str(version_file), "--version-status", str(status),
    )  # fmt: skip
    standin = _with_serve(recipe, command=command, ready_timeout_s=60)
    if shown is None:  # the control: everything as vLLM answers it -> ready
        handle = start_server(standin, _standin_prov(), local, port=_free_port(), api_key="k")
        assert handle.facts["version"] == "0.32.0"
        stop_server(handle, host=local)
        return
    with pytest.raises(ServerError) as exc:
        start_server(standin, _standin_prov(), local, port=_free_port(), api_key="k")
    text = str(exc.value)
    assert "answers /health but not /version as vLLM does" in text, text
    assert f"it answered {shown}" in text
    assert "not ready within" not in text  # failed at once, not by running out of time


def _standin_recipe(tmp_path, *extra: str, ready_timeout_s: float = 60):
    """The stand-in engine above as the recipe's command; ``extra`` are its options."""
    script = tmp_path / "standin_server.py"
    script.write_text(_STANDIN_SERVER)
    version_file = tmp_path / "version.body"
    version_file.write_bytes(b'{"version": "0.32.0"}')
    recipe = load_recipe(SIM)
    command = (
        "{python}", str(script), "--served", recipe.model.served_name,
        "--version-file", str(version_file), "--version-status", "200", *extra,
    )  # fmt: skip
    return _with_serve(recipe, command=command, ready_timeout_s=ready_timeout_s)


def _recorded_pids(tmp_path) -> list[int]:
    """PIDs recorded by every server started under the default servers dir of this HOME."""
    return [int(p.read_text()) for p in (tmp_path / ".speedmatrix/servers").glob("*/pid")]


def _assert_nothing_left(host, tmp_path) -> None:
    pids = _recorded_pids(tmp_path)
    assert pids, "no server was launched"
    for pid in pids:
        assert group_pids(host, pid) == []


def test_a_served_name_missing_from_v1_models_fails_at_once(local, tmp_path):
    recipe = _standin_recipe(tmp_path, "--models", "some/other-model")
    t0 = time.monotonic()
    with pytest.raises(ServerError) as exc:
        start_server(recipe, _standin_prov(), local, port=_free_port(), api_key="k")
    text = str(exc.value)
    assert f"/v1/models does not list the served name {recipe.model.served_name!r}" in text
    assert "it lists ['some/other-model']" in text
    assert "not ready within" not in text and time.monotonic() - t0 < 30
    _assert_nothing_left(local, tmp_path)


def test_a_refused_one_token_completion_fails_at_once(local, tmp_path):
    recipe = _standin_recipe(tmp_path, "--completion-status", "400")
    with pytest.raises(ServerError) as exc:
        start_server(recipe, _standin_prov(), local, port=_free_port(), api_key="k")
    text = str(exc.value)
    assert "the one-token completion was refused: HTTP 400" in text and "stand-in refuses" in text
    assert "not ready within" not in text
    _assert_nothing_left(local, tmp_path)


def test_a_failing_one_token_completion_is_not_ready(local, tmp_path):
    """A 5xx may be passing (a cold engine): retried until the ready timeout, then said."""
    recipe = _standin_recipe(tmp_path, "--completion-status", "500", ready_timeout_s=2)
    with pytest.raises(ServerError) as exc:
        start_server(recipe, _standin_prov(), local, port=_free_port(), api_key="k")
    text = str(exc.value)
    assert "was not ready within 2 s: the one-token completion failed: HTTP 500" in text
    _assert_nothing_left(local, tmp_path)


def test_ready_timeout_ends_with_the_log_tail_and_a_diagnosis(local, sim, tmp_path):
    """The simulator with a dead engine (/health 503) never gets ready: the wait ends at the
    recipe's ready timeout with the log's tail and a diagnosis, and nothing is left running."""
    recipe, prov = sim
    dead = _with_serve(
        recipe, args=(*recipe.serve.args, "--faults", '{"engine_dead": true}'), ready_timeout_s=2
    )
    t0 = time.monotonic()
    with pytest.raises(ServerError) as exc:
        start_server(dead, prov, local, port=_free_port(), api_key="k")
    assert time.monotonic() - t0 < 30
    err = exc.value
    assert "was not ready within 2 s: /health answered 503" in str(err)
    assert err.diagnosis is not None and err.diagnosis.code == "unknown"
    assert "KV cache size" in err.log_tail and "last lines of" in str(err)
    _assert_nothing_left(local, tmp_path)


# A harmless line every healthy multi-GPU start logs (torch's NCCL options, with a TIMEOUT), then
# a real watchdog timeout: neither stops the start early; at the ready timeout it is the cause.
_NCCL_STANDIN = (
    "bash", "-c",
    "echo '[PG ID 0 PG GUID 0 Rank 0] ProcessGroupNCCL initialization options: size: 8, "
    "global rank: 0, TIMEOUT(ms): 600000, USE_HIGH_PRIORITY_STREAM: 0'; "
    "echo '[rank3]:[E ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 600000 milliseconds'; "
    "while :; do sleep 1; done",
)  # fmt: skip


def test_an_nccl_hang_is_diagnosed_at_the_ready_timeout_not_on_sight(local, tmp_path):
    recipe = _with_serve(load_recipe(SIM), command=_NCCL_STANDIN, ready_timeout_s=3)
    t0 = time.monotonic()
    with pytest.raises(ServerError) as exc:
        start_server(recipe, _standin_prov(), local, port=_free_port(), api_key="k")
    assert time.monotonic() - t0 >= 3  # waited for the timeout: no early abort
    err = exc.value
    assert "was not ready within 3 s" in str(err) and "failed while starting" not in str(err)
    assert err.diagnosis.code == "nccl_hang"
    assert "Watchdog caught collective operation timeout" in err.diagnosis.message
    _assert_nothing_left(local, tmp_path)


# What vLLM 0.32.0 logs (platforms/interface.py, warning_once) when an optional compiled kernel
# module does not import: at warning level it goes on and serves; the same words at error level
# (or in the traceback of a process that died) are a failed start.
_UNDEFINED_SYMBOL = (
    "Failed to import from vllm._C: ImportError('/env/lib/python3.12/site-packages/vllm/"
    "_C.abi3.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')"
)
_VLLM_LINE = "(APIServer pid=4242) {level} 12-02 10:00:00 [interface.py:371] {text}"


def test_an_undefined_symbol_warning_does_not_stop_a_healthy_start(local, tmp_path):
    """The warning is in the log before the port is served (the stand-in waits 1 s), so the
    readiness wait reads it at least once; the server comes up and answers a completion."""
    warning = _VLLM_LINE.format(level="WARNING", text=_UNDEFINED_SYMBOL)
    recipe = _standin_recipe(tmp_path, "--say", warning, "--serve-after", "1")
    handle = start_server(recipe, _standin_prov(), local, port=_free_port(), api_key="k")
    try:
        assert handle.ready_s is not None and handle.ready_s >= 1
        assert "undefined symbol" in local.run(f"cat {handle.log_path}", stream=False).stdout
        res = local.run(
            f"curl -s -H 'Authorization: Bearer k' -d '{{}}' {handle.base_url}/v1/completions",
            timeout_s=30,
            stream=False,
        )
        assert '"choices"' in res.stdout  # served
    finally:
        stop_server(handle, host=local)
    _assert_nothing_left(local, tmp_path)


def test_an_undefined_symbol_error_ends_a_start_on_sight(local, tmp_path):
    """The same words at vLLM's ERROR level, from a process that lingers and never serves:
    the wait ends at once with the diagnosis, not at the ready timeout."""
    error = _VLLM_LINE.format(level="ERROR", text=_UNDEFINED_SYMBOL)
    recipe = _with_serve(
        load_recipe(SIM),
        command=("bash", "-c", f"echo {shlex.quote(error)}; while :; do sleep 1; done"),
        ready_timeout_s=120,
    )
    with pytest.raises(ServerError) as exc:
        start_server(recipe, _standin_prov(), local, port=_free_port(), api_key="k")
    err = exc.value
    assert "failed while starting" in str(err) and "not ready within" not in str(err)
    assert err.diagnosis.code == "undefined_symbol"
    assert "_ZN3c104cuda9SetDeviceEi" in err.diagnosis.message
    _assert_nothing_left(local, tmp_path)


def test_an_undefined_symbol_in_a_dead_process_is_its_diagnosis(local, tmp_path):
    """A traceback printed as the process dies is not in vLLM's log format: the dead process
    ends the wait, and the traceback's line is the cause."""
    traceback = (
        "echo 'Traceback (most recent call last):'; echo 'ImportError: /env/lib/python3.12/"
        "site-packages/vllm/_C.abi3.so: undefined symbol: _ZN3c104cuda9SetDeviceEi'; exit 1"
    )
    recipe = _with_serve(load_recipe(SIM), command=("bash", "-c", traceback), ready_timeout_s=120)
    with pytest.raises(ServerError) as exc:
        start_server(recipe, _standin_prov(), local, port=_free_port(), api_key="k")
    err = exc.value
    assert "exited before it was ready" in str(err) and "not ready within" not in str(err)
    assert err.diagnosis.code == "undefined_symbol"


def _path_without(tmp_path: Path, program: str) -> str:
    """$PATH with `program` hidden: a directory that holds it is replaced by a directory of
    links to everything else in it."""
    dirs = []
    for i, d in enumerate(os.environ["PATH"].split(os.pathsep)):
        if not os.path.exists(os.path.join(d, program)):
            dirs.append(d)
            continue
        mirror = tmp_path / f"path-without-{i}"
        mirror.mkdir()
        for entry in os.scandir(d):
            if entry.name != program:
                (mirror / entry.name).symlink_to(entry.path)
        dirs.append(str(mirror))
    hidden = os.pathsep.join(dirs)
    assert shutil.which(program, path=hidden) is None
    return hidden


def test_a_busy_gpu_refuses_the_start(tmp_path, log_messages):
    """Before a server starts, nvidia-smi is asked for the GPUs' compute processes: any (none
    of this run can exist yet) refuses the start, naming them, and nothing is launched. A host
    without nvidia-smi has no GPU to check: the log says so and the start goes on."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(_FAKE_NVIDIA_SMI)
    (fake / "nvidia-smi").chmod(0o755)
    (fake / "apps.csv").write_text("31337, /opt/other-team/bin/python3, 80211 MiB\n")
    host = get_host("local", env={"HOME": str(tmp_path), "PATH": f"{fake}:{os.environ['PATH']}"})
    recipe = _with_serve(load_recipe(SIM), command=_OBEDIENT)
    with pytest.raises(ServerError, match="GPU") as exc:
        start_server(recipe, _standin_prov(), host, port=_free_port(), api_key="k", wait=False)
    assert "PID 31337 (/opt/other-team/bin/python3, 80211 MiB)" in str(exc.value)
    assert not list(tmp_path.glob(".speedmatrix/servers/*/pid"))  # nothing launched

    # the absent case, on any host: a PATH without nvidia-smi (a GPU host's own is hidden, not
    # skipped: a bare `return` here dropped this half on a host with nvidia-smi, issue #33)
    bare = get_host(
        "local", env={"HOME": str(tmp_path), "PATH": _path_without(tmp_path, "nvidia-smi")}
    )
    with log_messages("speedmatrix.server") as msgs:
        handle = start_server(
            recipe, _standin_prov(), bare, port=_free_port(), api_key="k", wait=False
        )
    stop_server(handle, host=bare)
    assert any("no nvidia-smi" in m and "no GPU to check" in m for m in msgs), msgs


def test_a_server_of_another_home_on_the_machine_is_refused(tmp_path):
    """ "A server of ours is already running" covers the machine: a server started with one
    HOME (one host_home, one SSH user) refuses a start with another."""
    homes = [tmp_path / "home-a", tmp_path / "home-b"]
    a, b = (get_host("local", env={"HOME": str(h)}) for h in homes)
    recipe = _with_serve(load_recipe(SIM), command=_OBEDIENT)
    handle = start_server(recipe, _standin_prov(), a, port=_free_port(), api_key="k", wait=False)
    try:
        assert alive_servers(b) == {handle.run_dir: handle.pid}
        with pytest.raises(ServerAlreadyRunning, match=f"PID {handle.pid}"):
            start_server(recipe, _standin_prov(), b, port=_free_port(), api_key="k", wait=False)
    finally:
        stop_server(handle, host=a)
    assert alive_servers(b) == {}
    other = start_server(recipe, _standin_prov(), b, port=_free_port(), api_key="k", wait=False)
    stop_server(other, host=b)


# ---------------------------------------------------------------- inspect on a GPU host
_GPUS = "NVIDIA RTX PRO 6000 Blackwell Server Edition, 97887 MiB, 580.65.06\n" * 8


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_inspect_on_a_gpu_host_reports_gpus_kv_version_and_commit(tmp_path, sim):
    """nvidia-smi (a stand-in) answers the GPU query; the simulator's KV capacity in /metrics
    is the one its start-up log line says; the commit is None (below)."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(_FAKE_NVIDIA_SMI)
    (fake / "nvidia-smi").chmod(0o755)
    (fake / "gpus.csv").write_text(_GPUS)
    (fake / "apps.csv").write_text("")
    host = get_host("local", env={"HOME": str(tmp_path), "PATH": f"{fake}:{os.environ['PATH']}"})
    recipe, prov = sim
    handle = start_server(recipe, prov, host, port=_free_port(), api_key="k")
    try:
        # The leader's identity is recorded beside its PID and in the handle.
        assert handle.identity == f"{processes.start_ticks(handle.pid)} {_boot_id()}"
        assert Path(handle.run_dir, "pid.identity").read_text().strip() == handle.identity
        facts = inspect_server(handle, host=host)
        log_text = Path(handle.log_path).read_text()
    finally:
        out = stop_server(handle, host=host, gpu_wait_s=0)
    assert out["left"] == [] and out["gpu_check"] == "ok" and out["gone"] is None
    hw = facts["hardware"]
    assert hw["gpu_count"] == 8 and len(hw["gpus"]) == 8
    assert hw["gpus"][0] == {
        "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        "memory_total": "97887 MiB",
        "memory_total_mib": 97887,
        "driver": "580.65.06",
    }
    assert hw["cpu_count"] >= 1  # the CPU facts come along on a GPU host too
    assert "--query-gpu=name,memory.total,driver_version --format=csv" in (
        (fake / "calls").read_text()
    )
    # KV capacity: /metrics (vllm:cache_config_info) and the start-up log line agree.
    logged = re.findall(r"KV cache size: ([\d,]+) tokens", log_text)
    assert len(logged) == 1
    assert facts["kv_cache_tokens_metrics"] == int(logged[0].replace(",", ""))
    assert facts["kv_cache_tokens_log"] == facts["kv_cache_tokens_metrics"]
    assert facts["kv_cache_tokens"] == facts["kv_cache_tokens_metrics"]
    assert facts["block_size"] and facts["num_gpu_blocks"]
    assert facts["block_size"] * facts["num_gpu_blocks"] == facts["kv_cache_tokens"]
    # The version is what /version says (vLLM's own shape: {"version": ...}, no commit in
    # vLLM 0.32's /version, and /server_info is a dev-mode endpoint without one either). The
    # commit comes from vllm._version in the engine's python: the simulator's has no vllm, so
    # none, rather than a guess from the version string.
    assert facts["version"] == recipe.engine.version
    assert facts["commit"] is None


def test_no_gpu_on_a_host_with_nvidia_smi_gives_cpu_facts_only(tmp_path):
    from speedmatrix.engine.vllm_server import hardware_facts

    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(_FAKE_NVIDIA_SMI)  # no gpus.csv: "No devices were found"
    (fake / "nvidia-smi").chmod(0o755)
    host = get_host("local", env={"PATH": f"{fake}:{os.environ['PATH']}"})
    hw = hardware_facts(host)
    assert "gpus" not in hw and hw["cpu_count"] >= 1 and hw["mem_total_gb"] > 0


# ---------------------------------------------------------------- PID reuse
class _Stranger:
    """A `sleep` in a session of its own, not our child (as an unrelated process is: our
    child would linger as a zombie once killed, and its group with it, until we reap it)."""

    def __init__(self) -> None:
        out = subprocess.run(
            ["bash", "-c", "setsid sleep 300 > /dev/null 2>&1 < /dev/null & echo $!"],
            capture_output=True,
            text=True,
            check=True,
        )
        self.pid = int(out.stdout)
        self.ticks = processes.start_ticks(self.pid)

    def alive(self) -> bool:
        return processes.alive(self.pid)

    def wait_gone(self, within_s: float = 5.0) -> bool:
        return processes.wait_gone(self.pid, within_s)

    def kill(self) -> None:
        """SIGKILL the sleep if it still runs, and never another process: once a test has
        stopped it its PID is free, and a neighbour test's process (a provisioning attempt
        beside this file under xdist) may hold it by now. The pidfd pins the process the PID
        names while its start time is checked, so the signal cannot reach a newcomer."""
        with contextlib.suppress(ProcessLookupError):
            fd = os.pidfd_open(self.pid)
            try:
                fields = processes.stat_fields(self.pid)
                if fields and fields[19] == self.ticks:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            finally:
                os.close(fd)


@pytest.fixture
def stranger():
    """An unrelated live process group, killed at the end."""
    proc = _Stranger()
    yield proc
    proc.kill()


def _record(run_dir: Path, pid: int, identity: str | None) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "pid").write_text(f"{pid}\n")
    (run_dir / "secrets.env").write_text("export X=1\n")
    if identity is not None:
        (run_dir / "pid.identity").write_text(identity + "\n")


def _handle(run_dir: Path, pid: int, identity: str | None = None) -> ServerHandle:
    return ServerHandle(
        host="local", host_env={}, pid=pid, run_dir=str(run_dir),
        log_path=str(run_dir / "server.log"), base_url="http://127.0.0.1:9", port=9,
        served_name="x", python=sys.executable, api_key_env=None, command="x",
        started_at=time.time(), identity=identity,
    )  # fmt: skip


@pytest.mark.parametrize("why", ["start-time", "boot-id"])
@pytest.mark.parametrize("where", ["run-dir", "handle"])
def test_a_reused_pid_is_never_signalled(local, tmp_path, stranger, log_messages, why, where):
    """The pid file names a live process group that is not our server (its start time, or
    the boot, differ from what the launcher recorded): not alive, not killed, "gone"."""
    ticks, boot = processes.start_ticks(stranger.pid), _boot_id()
    identity = f"{int(ticks) - 1} {boot}" if why == "start-time" else f"{ticks} not-{boot}"
    servers = tmp_path / "servers"
    run_dir = servers / "8000"
    _record(run_dir, stranger.pid, identity if where == "run-dir" else None)
    handle = _handle(run_dir, stranger.pid, identity if where == "handle" else None)
    with log_messages("speedmatrix.server") as msgs:
        alive = alive_servers(local, str(servers))
        out = stop_server(handle, host=local, grace_s=1, gpu_wait_s=0)
    assert stranger.alive()  # never signalled
    assert out["was_running"] is False and out["killed"] is False
    expected = "another process now" if why == "start-time" else "the host rebooted"
    assert expected in out["gone"]
    assert any(f"server group {stranger.pid}" in m and "is gone" in m for m in msgs), msgs
    if where == "run-dir":
        assert alive == {}
        assert any(str(run_dir) in m and "is gone" in m for m in msgs), msgs
    assert (run_dir / "secrets.env").exists() is False  # the pid file is this handle's


def test_a_matching_identity_and_a_bare_pid_file_are_ours(local, tmp_path, stranger):
    """The control, and backward compatibility: with the right start time and boot id the
    group is ours; with only a pid file (a run dir from before identities) it is judged as
    before (a live group is ours). Either way stop_server stops it."""
    servers = tmp_path / "servers"
    _record(servers / "1", stranger.pid, f"{processes.start_ticks(stranger.pid)} {_boot_id()}")
    other = _Stranger()
    try:
        _record(servers / "2", other.pid, None)
        assert alive_servers(local, str(servers)) == {
            str(servers / "1"): stranger.pid,
            str(servers / "2"): other.pid,
        }
        for run_dir, proc in ((servers / "1", stranger), (servers / "2", other)):
            out = stop_server(_handle(run_dir, proc.pid), host=local, grace_s=5, gpu_wait_s=0)
            assert out["was_running"] and out["gone"] is None and out["left"] == []
            assert out["killed"] is False and proc.wait_gone()  # SIGTERM did it
    finally:
        other.kill()


def test_a_zombie_is_stopped_not_waited_for(local, tmp_path):
    """A server that exited on SIGTERM but is not yet reaped (a zombie: its parent, or the
    host's init, reaps late or never, as in a container without an init) holds nothing: the
    stop is verified at once, without a SIGKILL, and the group reads as dead. Here the test
    process is the parent and reaps only at the end; before, the stop waited out its grace,
    sent SIGKILL and failed with the zombie "left"."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)  # our child: not reaped
    try:
        servers = tmp_path / "servers"
        identity = f"{processes.start_ticks(proc.pid)} {_boot_id()}"
        _record(servers / "8000", proc.pid, identity)
        handle = _handle(servers / "8000", proc.pid, identity)
        assert alive_servers(local, str(servers)) == {str(servers / "8000"): proc.pid}
        out = stop_server(handle, host=local, grace_s=10, gpu_wait_s=0)
        assert processes.state(proc.pid) == "Z"  # exited, still in the process table
        assert out["was_running"] and out["killed"] is False and out["term_survivors"] == []
        assert out["left"] == [] and group_pids(local, proc.pid) == []
        assert server_state(local, handle) == "dead"
        assert alive_servers(local, str(servers)) == {}
    finally:
        proc.kill()
        proc.wait()


def test_a_stale_record_does_not_block_a_new_start(local, sim, tmp_path, stranger):
    """A previous server's pid file whose PID is another process now: start goes ahead."""
    recipe, prov = sim
    stale = tmp_path / ".speedmatrix/servers/1"
    _record(stale, stranger.pid, f"{int(processes.start_ticks(stranger.pid)) + 5} {_boot_id()}")
    handle = start_server(recipe, prov, local, port=_free_port(), api_key="k")
    stop_server(handle, host=local)
    assert stranger.alive()
