"""One recipe per run (issue #41): `resolve` pins the recipe's content and its hash, and every
later task (plan, setup's launch line, the `runs` row) uses the pinned one, so a recipe edited
or redeployed mid-run can never make the server run one recipe while the row records another."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil

import pytest

from speedmatrix.flows import resolution
from speedmatrix.flows.matrix import recipe_of, run_row
from speedmatrix.recipes import recipes_dir

WHEN = dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC)
CPU = "cpu/tiny/llama-tiny"


@pytest.fixture
def recipe_file(tmp_path, monkeypatch):
    """The CPU recipe copied into a recipes tree of this test's own, which it may edit."""
    path = tmp_path / "recipes" / f"{CPU}.yaml"
    path.parent.mkdir(parents=True)
    shutil.copy(recipes_dir() / f"{CPU}.yaml", path)
    monkeypatch.setenv("SPEEDMATRIX_RECIPES", str(tmp_path / "recipes"))
    return path


def resolve(conf):
    return resolution.resolve(conf, dag_run_id="manual__2026-11-29T20:30:05+00:00", run_after=WHEN)


def test_a_recipe_edited_after_resolve_changes_nothing_of_the_run(recipe_file):
    resolved = resolve({"recipe": CPU})
    before = recipe_of(resolved)
    launch = before.render_launch_command(resolved["engine_ref"], api_key="redact")
    # the recipe is edited (or redeployed) while the run is under way
    text = recipe_file.read_text()
    edited = text.replace("max_model_len: 2048", "max_model_len: 4096").replace(
        "gpu: CPU", "gpu: EDITED-GPU"
    )
    assert edited != text
    recipe_file.write_text(edited)

    after = recipe_of(resolved)
    assert after.model.max_model_len == 2048 and after.hardware.gpu == "CPU"
    assert after.render_launch_command(resolved["engine_ref"], api_key="redact") == launch
    row = run_row(resolved, None, None, "failed")
    assert row["max_model_len"] is None or row["max_model_len"] == 2048
    assert row["hardware_gpu"] == "CPU"
    # the row names the recipe it ran by its content's hash, the one resolve pinned
    pinned = hashlib.sha256(
        json.dumps(before.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    assert resolved["recipe_sha256"] == pinned
    assert row["recipe_sha256"] == pinned


def test_two_contents_of_one_recipe_id_have_two_hashes(recipe_file):
    first = resolve({"recipe": CPU})
    recipe_file.write_text(recipe_file.read_text().replace("gpu: CPU", "gpu: OTHER"))
    second = resolve({"recipe": CPU})
    assert first["recipe_id"] == second["recipe_id"]
    assert first["recipe_sha256"] != second["recipe_sha256"]
    assert recipe_of(second).hardware.gpu == "OTHER"
