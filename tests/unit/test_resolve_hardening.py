"""`resolve` checks every conf value itself (issue #16 items 4 and 15).

The trigger form's Params are not the only way in: the REST API, `airflow dags trigger --conf`
and the trigger DAGs all hand `resolve` a conf, and Airflow passes keys that are not declared
Params through. So `resolve` must refuse a bad value with a clear reason before anything
touches a host, and a recipe is an id inside include/recipes, never a path to any YAML on the
worker.
"""

from __future__ import annotations

import datetime as dt
import shutil

import pytest

from speedmatrix.flows import resolution
from speedmatrix.flows.resolution import ResolveError
from speedmatrix.recipes import RecipeError, load_recipe_id, recipes_dir

WHEN = dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC)
SIM = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
CPU = "cpu/tiny/llama-tiny"


def resolve(conf):
    return resolution.resolve(conf, dag_run_id="manual__2026-11-29T20:30:05+00:00", run_after=WHEN)


@pytest.fixture
def outside_recipe(tmp_path):
    """A valid recipe file outside include/recipes (what `..` or an absolute path reaches)."""
    path = tmp_path / "elsewhere" / "evil.yaml"
    path.parent.mkdir()
    shutil.copy(recipes_dir() / f"{CPU}.yaml", path)
    return path


def test_a_recipe_id_cannot_leave_the_recipes_tree(outside_recipe):
    import os

    up = os.path.relpath(outside_recipe.with_suffix(""), recipes_dir())
    assert up.startswith("..")
    for rid in (up, str(outside_recipe.with_suffix("")), str(outside_recipe)):
        with pytest.raises(RecipeError, match="recipe id"):
            load_recipe_id(rid)
    assert load_recipe_id(CPU).id == CPU


@pytest.mark.parametrize("how", ["dotdot", "absolute", "file"])
def test_resolve_takes_recipe_ids_only(outside_recipe, how):
    import os

    rid = {
        "dotdot": os.path.relpath(outside_recipe.with_suffix(""), recipes_dir()),
        "absolute": str(outside_recipe.with_suffix("")),
        "file": str(outside_recipe),
    }[how]
    with pytest.raises(ResolveError, match="recipe id"):
        resolve({"recipe": rid})


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"recipe": CPU, "port": 0}, "port"),
        ({"recipe": CPU, "port": 70000}, "port"),
        ({"recipe": CPU, "port": "8000; id"}, "port"),
        ({"recipe": CPU, "port": True}, "port"),
        ({"recipe": CPU, "port": 80.5}, "port"),
        ({"recipe": CPU, "host_home": "relative/home"}, "host_home"),
        ({"recipe": CPU, "host_home": "/home/x\ntouch /tmp/y"}, "host_home"),
        ({"recipe": CPU, "host_home": "/home/x\x00"}, "host_home"),
        ({"recipe": CPU, "host_home": ["/home/x"]}, "host_home"),
        ({"recipe": CPU, "engine_ref": "main\n"}, "engine_ref"),
        ({"recipe": CPU, "engine_ref": " v0.32.0"}, "engine_ref"),
        ({"recipe": CPU, "engine_ref": 123}, "engine_ref"),
        ({"recipe": CPU, "ssh_conn_id": "gpu\n1"}, "ssh_conn_id"),
        ({"recipe": CPU, "ssh_conn_id": 7}, "ssh_conn_id"),
        ({"recipe": CPU, "warehouse": "/wh\nx"}, "warehouse"),
        ({"recipe": CPU, "contexts": "1K; 2K"}, "contexts"),
        ({"recipe": CPU, "contexts": [True]}, "contexts"),
        ({"recipe": CPU, "contexts": [256.5]}, "contexts"),
        ({"recipe": CPU, "prefill_contexts": [{"a": 1}]}, "prefill_contexts"),
        ({"recipe": CPU, "concurrencies": ["2"]}, "concurrencies"),
        ({"recipe": CPU, "concurrencies": [1.5]}, "concurrencies"),
        ({"recipe": CPU, "concurrencies": [2, 2]}, "concurrencies"),
        ({"recipe": CPU, "window_s": "5"}, "window_s"),
        ({"recipe": CPU, "window_s": float("inf")}, "window_s"),
        ({"recipe": CPU, "window_s": float("nan")}, "window_s"),
        ({"recipe": CPU, "max_output_tokens": 1}, "max_output_tokens"),
        ({"recipe": CPU, "max_output_tokens": 2.5}, "max_output_tokens"),
        # absurd numbers (issue #33 item 2): refused here, not an overflow where they land
        ({"recipe": CPU, "max_output_tokens": 10**400}, "max_output_tokens"),
        ({"recipe": CPU, "contexts": [10**400]}, "contexts"),
        ({"recipe": CPU, "prefill_contexts": ["9" * 400 + "K"]}, "prefill_contexts"),
        ({"recipe": CPU, "concurrencies": [10**400]}, "concurrencies"),
        ({"recipe": CPU, "prompt_mode": "weird"}, "prompt_mode"),
        ({"recipe": CPU, "workload": "recite"}, "workload"),
        ({"recipe": CPU, "repeats": 11}, "repeats"),
        ({"recipe": CPU, "repeats": "3"}, "repeats"),
        ({"recipe": CPU, "recipe_typo": 1}, "recipe_typo"),
        ({"recipe": CPU, "lease_ttl_s": 1e12}, "lease_ttl_s"),
        ({"recipe": CPU, "lease_ttl_s": 60}, "lease_ttl_s"),
        ({"recipe": ["a"]}, "recipe"),
    ],
)
def test_resolve_rechecks_every_conf_value(conf, message):
    with pytest.raises(ResolveError, match=message):
        resolve(conf)


def test_good_values_still_resolve():
    r = resolve(
        {
            "recipe": CPU,
            "port": 8123,
            "host_home": "/tmp/some home",
            "engine_ref": "v0.32.0",
            "ssh_conn_id": "gpu_a",
            "contexts": ["1K", 256],
            "concurrencies": [1, 2],
            "window_s": 2,
            "max_output_tokens": 16,
            "repeats": None,
            "warehouse": None,
        }
    )
    assert (r["port"], r["host_home"], r["engine_ref"]) == (8123, "/tmp/some home", "v0.32.0")
    assert "lease_ttl_s" not in r


def test_the_declared_params_are_the_conf_keys_resolve_takes():
    """runconf.CONF_KEYS and the DAG's Params name the same keys (so a new Param is checked
    in resolve too, and resolve refuses only what the DAG does not declare)."""
    import importlib.util
    from pathlib import Path

    from speedmatrix.flows.runconf import CONF_KEYS

    path = Path(__file__).resolve().parents[2] / "dags" / "speed_matrix.py"
    spec = importlib.util.spec_from_file_location("speed_matrix_dag_for_keys", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert set(module.PARAMS) == set(CONF_KEYS)


LONG_REF = "v1.2.3-" + "a" * 178  # 185 characters: a valid release ref, too long for a name


@pytest.mark.parametrize(
    ("conf", "field"),
    [
        ({"recipe": SIM, "engine_ref": LONG_REF}, "engine_ref"),
        ({"recipe": SIM, "engine_ref": "v1.2.3-" + "a" * 233}, "engine_ref"),
        ({"recipe": SIM, "engine_ref": "pr/" + "9" * 200}, "engine_ref"),
        ({"recipe": SIM, "ssh_conn_id": "h" * 200}, "host"),
    ],
)
def test_every_value_that_becomes_a_name_is_bounded_before_anything_runs(conf, field):
    """Issue #33 item 1: a 185-character ref was measured, then poisoned the landing
    (ENAMETOOLONG); 240 lost the run in validate. resolve refuses it first, naming the field
    and the limit (records.path_field_problems, the one rule)."""
    from speedmatrix.records import MAX_PATH_VALUE

    with pytest.raises(ResolveError) as info:
        resolve(conf)
    assert f"{field} is too long" in str(info.value)
    assert f"the limit is {MAX_PATH_VALUE}" in str(info.value)


def test_a_long_but_fitting_ref_still_resolves():
    r = resolve({"recipe": SIM, "engine_ref": "v1.2.3-" + "a" * 60})
    assert r["engine_ref"].endswith("a" * 60)
