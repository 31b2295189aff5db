"""`resolved`, the run description the `resolve` task hands to every later task, typed.

Why a TypedDict and not a model: it crosses XCom as the plain JSON object it has always been
(its keys and values are XCom-visible and unchanged), and a TypedDict costs nothing at run
time while letting a type checker and a reader see every key in one place. `started_at` stays
an ISO string here because this is the XCom form; `records.from_wire` reads it back as a
datetime where a row needs one (`flows.matrix.run_row`).
"""

from __future__ import annotations

from typing import TypedDict


class MatrixConf(TypedDict):
    """The matrix the run measures, as `plan.MatrixSpec.build` takes it (contexts in tokens)."""

    prefill_contexts: list[int]
    contexts: list[int]
    concurrencies: list[int]
    max_output_tokens: int
    window_s: float
    prompt_mode: str
    workload: str
    measurement_profile: str  # default or published (records.MEASUREMENT_PROFILES)
    kv_budget: int | None  # a manual KV cache size in tokens (plan.kv_capacity); None: the server's


class Resolved(TypedDict):
    """What a run is, fixed by `flows.resolution.resolve` before anything touches a host."""

    run_id: str  # stable, readable: recipe__ref__trigger__UTC stamp__DAG run tag (make_run_id)
    dag_run_id: str
    recipe_id: str
    engine_ref: str  # the ref asked for (v0.29.0, 40-hex, pr/N, main)
    trigger: str  # nightly, commit or manual (records.TRIGGERS)
    host: str  # an Airflow SSH connection id, or "local"
    warehouse: str | None  # the conf's warehouse root; None: the deployment's default
    host_home: str | None  # $HOME on the host for envs and server state; None: the host's
    holder: str  # the host lease's holder id (dag id + dag run id)
    run_tag: str  # starts every prompt and salts the prefix cache (cold prefills)
    served_model: str
    api_key_env: str | None  # the worker's env variable holding the server's API key
    port: int | None
    started_at: str  # ISO 8601 UTC (the XCom form; records.from_wire reads it back)
    matrix: MatrixConf
    repeats: int  # passes over the repeated cells (1: no repeats)
    repeat_cells: list[str] | None  # canonical names of the cells to repeat; None: all
    # `speedmatrix run` only (never from a conf): a server already running, the recipe made in
    # memory for it (Recipe.model_dump), and the run's origin for the runs row; else None
    base_url: str | None
    recipe: dict | None
    source: str | None


RESOLVED_KEYS = tuple(Resolved.__annotations__)
"""The keys `resolve` returns, in order (a test holds resolve to them)."""
