"""Writing a recipe from docs/recipes.md alone (#44 item 12): a generated field reference
(every field, type, default, example) from the recipe model, a template that validates,
"did you mean" on an unknown key, and shipped recipes whose names say what they are."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from speedmatrix.recipes import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
TEMPLATE = ROOT / "include" / "recipes" / "_template.yaml"


def test_the_field_reference_is_generated_and_current():
    from speedmatrix.recipe_reference import markdown

    start = DOC.index("<!-- recipe fields: generated -->")
    end = DOC.index("<!-- end of recipe fields -->")
    assert DOC[start:end] == markdown(), "regenerate: python -m speedmatrix.recipe_reference"


def test_the_reference_names_every_field_with_type_default_and_example():
    from speedmatrix.recipe_reference import fields

    rows = fields()
    names = {r.path for r in rows}
    for path in ("hardware.type", "hardware.vram_gb", "hardware.backend", "hardware.slug",
                 "model.slug", "matrix.window_s", "serve.host", "engine.install.kind"):  # fmt: skip
        assert path in names, path
    host = next(r for r in rows if r.path == "serve.host")
    assert host.default == "0.0.0.0" and "every interface" in host.doc
    window = next(r for r in rows if r.path == "matrix.window_s")
    assert window.type == "float" and window.default == "30.0" and window.example == "30"
    assert next(r for r in rows if r.path == "hardware.type").default == "required"


def test_the_template_validates_as_a_recipe(tmp_path):
    target = tmp_path / "include" / "recipes" / "my-gpu" / "org" / "my-model.yaml"
    target.parent.mkdir(parents=True)
    shutil.copy(TEMPLATE, target)
    recipe = load_recipe(target)
    assert recipe.matrix.window_s > 0 and recipe.serve.host == "0.0.0.0"
    assert "_template.yaml" in DOC


@pytest.mark.parametrize(
    ("where", "key", "suggestion"),
    [("matrix", "window", "window_s"), ("hardware", "vram", "vram_gb"), (None, "modle", "model")],
)
def test_an_unknown_key_says_did_you_mean(tmp_path, where, key, suggestion):
    data = yaml.safe_load(TEMPLATE.read_text(encoding="utf-8"))
    (data[where] if where else data)[key] = 1
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    shown = f"{where}.{key}" if where else key
    assert re.search(rf"{re.escape(shown)}: unknown key \(did you mean '?{suggestion}'?\?\)",
                     str(err.value)), str(err.value)  # fmt: skip


def test_shipped_kimi_recipes_name_their_own_model():
    """The RTX PRO Kimi recipe's model slug said `nvidia` (the org); the env name stays the
    published one (the rendered command must match the published page), named explicitly."""
    rtx = load_recipe("nvidia-rtxpro6k/moonshotai/kimi-k2.7-code-nvfp4")
    assert rtx.model.slug.startswith("kimi")
    assert rtx.env_name() == "env_rtxpro6k-nvidia-vllm-pr-9fedd24fa864"
    h200 = load_recipe("nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash")
    assert h200.model.slug.startswith("kimi")
    text = ROOT / "include/recipes/nvidia-h200/moonshotai/kimi-k2.7-code-int4-dflash.yaml"
    assert "published" in text.read_text(encoding="utf-8").split("env_name:")[0].lower()
