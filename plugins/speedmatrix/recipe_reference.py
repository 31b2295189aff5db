"""The recipe field reference: every field of a recipe, its type, default and an example.

One job: saying what a recipe may declare, generated from the recipe model itself
(speedmatrix.recipes: the pydantic classes are the one definition), so the reference in
docs/recipes.md cannot drift from what validation accepts (a test compares them;
``python -m speedmatrix.recipe_reference`` prints the section). Examples come from the shipped
recipe `make demo` runs, else the CPU recipe the tests run.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import PydanticUndefined

from speedmatrix.recipes import Recipe, recipe_path

EXAMPLES = ("sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "cpu/tiny/llama-tiny")
"""The shipped recipes whose values are the examples (the first that has the field)."""
_DERIVED = ("id", "path")  # filled from the file's place, never written
_DOCS = {  # what the model's own field descriptions do not say (those win where given)
    "description": "one line: what this recipe measures",
    "hardware.gpu_count": "GPUs the server uses (0 for a CPU)",
    "hardware.os": "the host's OS, as the report says",
    "engine.name": "the engine (vLLM only)",
    "engine.install.wheel_index": "the per-commit wheel index (kind wheel); "
    "$SPEEDMATRIX_WHEEL_INDEX beats it",
    "engine.install.full_build_when_compiled_changes": "kind pr: build from source when the "
    "PR changes compiled code (precompiled binaries otherwise)",
    "engine.python": "Python of the engine env",
    "engine.repository": "where the engine's commits are looked up",
    "model.id": "the model's id (Hugging Face), what the server is asked to load",
    "model.revision": "the model's revision",
    "model.served_name": "the name the server answers to ({served_name}, --served-model-name)",
    "model.quantization": "as the report says (NVFP4, INT4, none…)",
    "model.max_model_len": "the server's --max-model-len ({max_model_len}); the largest context",
    "serve.env": "environment of the server; a whole value $NAME is the host's variable",
    "serve.args": "arguments after the command; placeholders as below",
    "serve.ready_timeout_s": "how long the server may take to answer /health, seconds",
    "matrix.prefill_contexts": "contexts of the prefill sweep (8K, 251K or tokens)",
    "matrix.contexts": "contexts of the decode matrix",
    "matrix.concurrencies": "requests kept in flight, per decode column",
    "matrix.window_s": "the measurement window of each decode cell, seconds (the conf's "
    "window_s, the CLI's --window-s, the tables' window_s; old names duration_s and measure_s "
    "still read)",
    "matrix.max_output_tokens": "max_tokens of each request",
    "matrix.prompt_mode": "distinct: every request its own prompt; shared: one prompt",
    "matrix.workload": "what the decode prompts say (docs/recipes.md, Workload)",
    "matrix.profile": "whose definitions measure the run: ours or the published tool's",
    "matrix.repeats": "measure the cells (repeat_cells) this many times in one run",
    "matrix.repeat_cells": "cells to repeat (64Kx16…); null: all",
    "schedule.nightly": "run every night",
    "schedule.per_commit": "run for every new vLLM commit",
    "schedule.host": "the host scheduled runs use",
    "schedule.regression_threshold_pct": "smallest change that is a regression or an "
    "improvement, percent (3.0 = 3%)",
}


@dataclass(frozen=True)
class FieldRow:
    path: str
    type: str
    default: str
    example: str
    doc: str


def _type_text(ann: Any) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        text = " | ".join(_type_text(a) for a in inner)
        return f"{text} | null" if len(inner) < len(args) else text
    if origin is tuple:
        return f"list of {_type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping {_type_text(args[0])} -> {_type_text(args[1])}"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return getattr(ann, "__name__", str(ann))


def _yaml_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_yaml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _examples() -> list[dict[str, Any]]:
    return [yaml.safe_load(recipe_path(rid).read_text(encoding="utf-8")) for rid in EXAMPLES]


def _example(path: list[str], sources: list[dict[str, Any]]) -> str:
    for data in sources:
        node: Any = data
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and not isinstance(node, dict):
            return _yaml_text(node)
    return ""


def _walk(model: type[BaseModel], prefix: list[str], sources, out: list[FieldRow]) -> None:
    for name, info in model.model_fields.items():
        if not prefix and name in _DERIVED:
            continue
        path = [*prefix, name]
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            required = info.is_required()
            out.append(FieldRow(".".join(path), "section", "required" if required else "", "", ""))
            _walk(ann, path, sources, out)
            continue
        if info.is_required():
            default = "required"
        elif info.default_factory is not None:
            default = _yaml_text(info.default_factory())
        else:
            default = "" if info.default is PydanticUndefined else _yaml_text(info.default)
        doc = info.description or _DOCS.get(".".join(path), "")
        out.append(FieldRow(".".join(path), _type_text(ann), default, _example(path, sources), doc))


def fields() -> list[FieldRow]:
    """Every field of a recipe, sections first, in the model's order."""
    out: list[FieldRow] = []
    _walk(Recipe, [], _examples(), out)
    return out


def markdown() -> str:
    """The generated section of docs/recipes.md, from its opening marker to (not including)
    the closing one."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "<!-- recipe fields: generated -->",
        "Generated from the recipe model (`python -m speedmatrix.recipe_reference`; a test",
        "fails when it is out of date). *required* fields have no default; the example is the",
        f"value in `{EXAMPLES[0]}` (else `{EXAMPLES[1]}`).",
        "",
        "| field | type | default | example | what it is |",
        "|---|---|---|---|---|",
    ]
    for r in fields():
        if r.type == "section":
            lines.append(f"| **`{r.path}`** | section | {r.default} | | |")
            continue
        example = f"`{cell(r.example)}`" if r.example else ""
        default = f"`{cell(r.default)}`" if r.default not in ("", "required") else r.default
        default = "*required*" if r.default == "required" else default
        lines.append(f"| `{r.path}` | {cell(r.type)} | {default} | {example} | {cell(r.doc)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
