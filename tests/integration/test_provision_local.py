"""Provisioning failures and the simulator through the local transport (no vLLM install)."""

from __future__ import annotations

import sys

import pytest

from speedmatrix.hosts import get_host
from speedmatrix.provision import MARKER, ProvisionError, provision
from speedmatrix.recipes import load_recipe

pytestmark = pytest.mark.integration


def _with_install(recipe, **install):
    eng = recipe.engine.model_copy(
        update={"install": recipe.engine.install.model_copy(update=install)}
    )
    return recipe.model_copy(update={"engine": eng})


def test_failed_install_brings_back_the_log_tail_and_writes_no_marker(tmp_path):
    host = get_host("local", env={"HOME": str(tmp_path)})
    recipe = _with_install(
        load_recipe("cpu/tiny/llama-tiny"),
        pip_spec="./no-such-project-dir-speedmatrix",  # pip fails at once, without the network
    )
    with pytest.raises(ProvisionError) as exc:
        provision(recipe, host=host, poll_s=0.5, timeout_s=300)
    text = str(exc.value)
    assert "exit code" in text
    assert "last lines of" in text and "provision.log" in text
    assert "no-such-project-dir-speedmatrix" in exc.value.log_tail
    env_dir = host.resolve(recipe.env_dir())
    assert host.run(f"test -e {env_dir}/{MARKER}").rc == 1


def test_a_failing_post_install_step_fails_the_provisioning(tmp_path):
    host = get_host("local", env={"HOME": str(tmp_path)})
    recipe = _with_install(
        load_recipe("cpu/tiny/llama-tiny"),
        pip_spec="pip",  # already in the venv: a no-op install
        post_install=("echo about to fail; exit 7",),
    )
    with pytest.raises(ProvisionError, match="exit code 7") as exc:
        provision(recipe, host=host, poll_s=0.5, timeout_s=300)
    assert "about to fail" in exc.value.log_tail
    env_dir = host.resolve(recipe.env_dir())
    assert host.run(f"test -e {env_dir}/{MARKER}").rc == 1


def test_sim_provision_on_local_uses_this_python():
    recipe = load_recipe("sim/kimi-k2.7-nvfp4-rtxpro6k-x8")
    res = provision(recipe, host="local")
    assert res.env_dir is None
    assert res.python == sys.executable
    assert res.include_dir and res.include_dir.endswith("/include")
