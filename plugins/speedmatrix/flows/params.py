"""The speed_matrix DAG's Params: the trigger form a person fills in, and the first check of a
conf.

Why here and not in the DAG file: the DAG file stays orchestration only, and the rules a form
checks are the library's (records: how a context or a list is written; runconf: the keys).

What the form shows, in Airflow 3.3's trigger form:
- sections (`section`): what to run, where, the matrix, the prompts, noise, where results go;
- a title per field and a description saying what an empty field means: the recipe's value;
- the recipes' own values: the form cannot change a field's default when another field
  changes (Airflow has no dependent defaults), so the recipe field's description lists every
  recipe with its matrix (read from include/recipes when the DAG is parsed), and each
  recipe-default field points there;
- contexts and concurrencies as JSON lists or as text, `8K, 16K` / `1, 2, 4`
  (records.CONTEXT_LIST_PATTERN / INTEGER_LIST_PATTERN; `resolve` reads the text with
  records.split_list_text and parse_context, the one reading of a context).

Validation stays in the Params: a conf that breaks a schema is refused before any task runs.
"""

from __future__ import annotations

import logging
from typing import Any

from speedmatrix.published.formats import fmt_tokens
from speedmatrix.records import (
    CONTEXT_LIST_PATTERN,
    INTEGER_LIST_PATTERN,
    context_label,
)

log = logging.getLogger("speedmatrix.params")

RUN, HOST, MATRIX, PROMPTS, NOISE, OUTPUT = (
    "What to run",
    "Where to run it",
    "Matrix (empty: the recipe's)",
    "Prompts (empty: the recipe's)",
    "Noise estimate: repeated cells",
    "Where results go",
)
FROM_RECIPE = "Empty: the recipe's value (listed under Recipe above)."


def _span(values: tuple[int, ...] | list[int], label: Any = str) -> str:
    if not values:
        return "none"
    if len(values) <= 3:
        return ", ".join(label(v) for v in values)
    return f"{label(values[0])}–{label(values[-1])} ({len(values)})"


def recipe_summary(recipe: Any) -> str:
    """One line of a recipe's matrix defaults, as the form's recipe list shows it."""
    m = recipe.matrix
    hw = recipe.hardware
    gpus = f"{hw.gpu} ×{hw.gpu_count}" if hw.gpu_count else hw.gpu
    return (
        f"{gpus}; decode {_span(m.contexts, context_label)} × "
        f"{_span(m.concurrencies)} requests; prefill {_span(m.prefill_contexts, context_label)}; "
        f"{m.window_s:g} s window; max output {fmt_tokens(m.max_output_tokens)}; "
        f"{m.prompt_mode}, {m.workload}; ref {recipe.engine.ref}; "
        f"host {recipe.schedule.host or 'local'}"
    )


def recipe_summaries() -> dict[str, str]:
    """Recipe id -> its summary line, for every recipe that loads (a broken recipe is left out
    and logged: the form must not cost the DAG; `resolve` names the recipe's problems)."""
    from speedmatrix.recipes import list_recipe_ids, load_recipe_id

    out: dict[str, str] = {}
    try:
        ids = list_recipe_ids()
    except OSError:
        return out
    for rid in ids:
        try:
            out[rid] = recipe_summary(load_recipe_id(rid))
        except Exception as exc:
            log.warning("recipe %s not listed in the trigger form: %s", rid, exc)
    return out


def _contexts(title: str, what: str) -> dict[str, Any]:
    return {
        "type": ["null", "array", "string"],
        "items": {"type": ["integer", "string"], "minimum": 2, "pattern": "^[0-9]+[kK]?$"},
        "minItems": 1,
        "uniqueItems": True,
        "pattern": CONTEXT_LIST_PATTERN,
        "title": title,
        "description": f"{what} Context lengths as 8K, 16K or a JSON list "
        f'(["8K", 16384]); tokens or K = 1024 tokens. {FROM_RECIPE}',
        "section": MATRIX,
    }


def speed_matrix_params() -> dict[str, Any]:
    """The Params of speed_matrix, keyed by conf key (runconf.CONF_KEYS, the same keys)."""
    from airflow.sdk import Param

    recipes = recipe_summaries()
    listing = "\n".join(f"- **{rid}**: {line}" for rid, line in recipes.items())
    return {
        "recipe": Param(
            type="string",
            minLength=1,
            title="Recipe",
            # Markdown only: Airflow's form shows description_md only when there is no plain
            # description, and the recipe list is the point of this one.
            description_md="Recipe id under `include/recipes`; never a file path. **Required.** "
            "Every field left empty takes this recipe's value:\n\n" + listing,
            examples=list(recipes),
            section=RUN,
        ),
        "engine_ref": Param(
            None,
            type=["null", "string"],
            pattern=r"^(main|v\d+\.\d+\.\d+\S*|[0-9a-f]{7,40}|pr/\d+)$",
            title="vLLM engine ref",
            description="A release (v0.29.0), a 7-40 hex commit, pr/<N> or main. "
            "Empty: the recipe's (ref above).",
            section=RUN,
        ),
        "ssh_conn_id": Param(
            None,
            type=["null", "string"],
            title="Host (SSH connection)",
            description="Airflow SSH connection of the GPU host, or local (this worker). "
            "Empty: the recipe's schedule.host (host above).",
            section=HOST,
        ),
        "host_home": Param(
            None,
            type=["null", "string"],
            pattern="^/",
            title="HOME on the host",
            description="$HOME on the host for engine envs and server state (absolute path; "
            "the host lease is the machine's, whatever the HOME). Empty: the SSH user's home.",
            section=HOST,
        ),
        "port": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            maximum=65535,
            title="Server port",
            description="The server's port on the host. Empty: the recipe's.",
            section=HOST,
        ),
        "contexts": Param(None, **_contexts("Decode contexts", "Decode rows.")),
        "concurrencies": Param(
            None,
            type=["null", "array", "string"],
            items={"type": "integer", "minimum": 1},
            minItems=1,
            uniqueItems=True,
            pattern=INTEGER_LIST_PATTERN,
            title="Concurrencies",
            description="Simultaneous requests per decode cell (columns), as 1, 2, 4 or a "
            f"JSON list. {FROM_RECIPE}",
            section=MATRIX,
        ),
        "burst": Param(
            None,
            type=["null", "array", "string"],
            items={"type": "integer", "minimum": 1},
            uniqueItems=True,
            pattern=INTEGER_LIST_PATTERN,
            title="Burst sizes",
            description="Burst cells: at each decode context, N requests sent at once and "
            "measured to their completion (latency, per-user end-to-end tok/s), as 4, 16 or a "
            f"JSON list; their own cells, never compared with decode cells. {FROM_RECIPE}",
            section=MATRIX,
        ),
        "prefill_contexts": Param(None, **_contexts("Prefill contexts", "One prefill per length.")),
        "window_s": Param(
            None,
            type=["null", "number"],
            exclusiveMinimum=0,
            title="Window per decode cell (s)",
            description="Seconds measured per decode cell (the conf key duration_s, its old "
            f"name, is still read). {FROM_RECIPE}",
            section=MATRIX,
        ),
        "adaptive": Param(
            None,
            type=["null", "boolean"],
            title="Adaptive windows",
            description="Stop each decode window once its throughput's interval is tight "
            "enough for the cell's verdict (after the recipe's adaptive_min_s), the window "
            "above being the cap; a window that trends, queues or preempts runs to the cap. "
            f"{FROM_RECIPE}",
            section=MATRIX,
        ),
        "adaptive_min_s": Param(
            None,
            type=["null", "number"],
            exclusiveMinimum=0,
            title="Adaptive: least window (s)",
            description="An adaptive window's least length, at most the window above. "
            f"{FROM_RECIPE}",
            section=MATRIX,
        ),
        "max_output_tokens": Param(
            None,
            type=["null", "integer"],
            minimum=2,
            title="Output tokens per request",
            description=f"max_tokens of every request (ignore_eos). {FROM_RECIPE}",
            section=MATRIX,
        ),
        "kv_budget": Param(
            None,
            type=["null", "integer", "string"],
            minimum=1,
            pattern=r"^\s*[0-9]+[kK]?\s*$",
            title="KV budget (tokens)",
            description="A manual KV cache size in tokens (983040 or 960K), in place of what "
            "the server reports, for servers whose /metrics cannot tell their capacity "
            "(context parallelism, DCP); the over-capacity rule uses it and the run records "
            f"it. {FROM_RECIPE}",
            section=MATRIX,
        ),
        "prompt_mode": Param(
            None,
            type=["null", "string"],
            enum=[None, "distinct", "shared"],
            title="Prompt mode",
            description="distinct prompts per stream (the true KV footprint) or one shared "
            f"prompt. {FROM_RECIPE}",
            section=PROMPTS,
        ),
        "workload": Param(
            None,
            type=["null", "string"],
            enum=[None, "article", "continuation"],
            title="Workload",
            description="What the decode prompts say: article (a chat conversation asking for a "
            "long new article, rendered by the server's chat template: the published pages' "
            "workload) or continuation (raw repeated prose, for servers without a chat "
            f"template). {FROM_RECIPE}",
            section=PROMPTS,
        ),
        "measurement_profile": Param(
            None,
            type=["null", "string"],
            enum=[None, "default", "published"],
            title="Measurement profile",
            description="Whose definitions measure the run: default (ours: exact token contexts, "
            "distinct prompts, TTFT from the last byte sent) or published (the published tool's, "
            "to compare with its pages; never compared or trended with default runs). "
            f"{FROM_RECIPE}",
            section=PROMPTS,
        ),
        "repeats": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            maximum=10,
            title="Repeats",
            description="Measure the chosen cells (below) this many times in the run, "
            "interleaved (pass 2 starts after the whole matrix). The first measurement lands "
            "in cells, the others in cell_repeats; between-run noise counts them all. "
            "Empty: the recipe's (1: no repeats).",
            section=NOISE,
        ),
        "repeat_cells": Param(
            None,
            type=["null", "array"],
            items={"type": "string", "minLength": 1},
            minItems=1,
            uniqueItems=True,
            title="Cells to repeat",
            description="Cells named as speedmatrix trend --cell names them: 64Kx16 "
            "(decode), 'prefill 64K'. Each must be in the matrix. Empty: every cell, i.e. "
            "whole runs repeated.",
            section=NOISE,
        ),
        "warehouse": Param(
            None,
            type=["null", "string"],
            title="Warehouse",
            description="Warehouse root (path or s3:// URI). Empty: $SPEEDMATRIX_WAREHOUSE.",
            section=OUTPUT,
        ),
    }
