"""Server lifecycle against the simulated engine through the local transport."""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from speedmatrix.hosts import get_host
from speedmatrix.provision import provision
from speedmatrix.recipes import REPO_ROOT, load_recipe
from speedmatrix.server import (
    PortInUse,
    ServerAlreadyRunning,
    ServerError,
    group_pids,
    inspect_server,
    start_server,
    stop_server,
)

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


def _alive(pids: list[int]) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid="], capture_output=True, text=True).stdout.split()
    return [p for p in pids if str(p) in out]


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
        # what /v1/models reports (the sim profile's value; 262145 vs the recipe's 262144)
        assert isinstance(facts["max_model_len"], int) and facts["max_model_len"] > 0
        assert facts["hardware"]["cpu_count"] >= 1
        cmd = local.run(f"cat {handle.run_dir}/command.txt", check=True).stdout.strip()
        assert cmd == handle.command and "<redacted>" in cmd and "k1" not in cmd
        with pytest.raises(ServerAlreadyRunning, match=f"PID {handle.pid}"):
            start_server(recipe, prov, local, port=_free_port(), api_key="k1")
    finally:
        out = stop_server(handle, host=local)
    assert out["was_running"] and out["left"] == []
    assert group_pids(local, handle.pid) == []
    assert _alive(pids) == []
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
    handle = start_server(weird, prov, local, port=_free_port(), api_key=KEY)
    try:
        assert handle.ready_s is not None  # the key and the path arrived intact
        with open(f"/proc/{handle.pid}/cmdline", "rb") as fh:
            argv = [a.decode() for a in fh.read().split(b"\0")[:-1]]
        assert argv[argv.index("--profile") + 1] == str(profile)  # one argument, literal
        assert argv[argv.index("--api-key") + 1] == KEY
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


def test_port_taken_is_refused_or_diagnosed(local, sim):
    recipe, prov = sim
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"port {port} .*in use"):
            start_server(recipe, prov, local, port=port, api_key="k")
        # Skipping our check, the engine itself fails: diagnosed from its log.
        with pytest.raises(ServerError) as exc:
            start_server(recipe, prov, local, port=port, api_key="k", check_port=False)
    assert exc.value.diagnosis.code == "address_in_use"
    assert exc.value.log_tail
