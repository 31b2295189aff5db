"""`resolved`, the run description the `resolve` task hands to every later task, typed.

Why a TypedDict and not a model: it crosses XCom as the plain JSON object it has always been
(its keys and values are XCom-visible and unchanged), and a TypedDict lets a type checker and
a reader see every key in one place; its values are checked where it crosses XCom
(`flows.contracts.RESOLVED`: pydantic over this TypedDict, with the ranges declared here). `started_at` stays
an ISO string here because this is the XCom form; `records.from_wire` reads it back as a
datetime where a row needs one (`flows.matrix.run_row`).
"""

from __future__ import annotations

from typing import Annotated, Literal, NotRequired

from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict

_CHECKED = ConfigDict(extra="forbid", strict=True)
Positive = Annotated[int, Field(ge=1)]


@with_config(_CHECKED)
class MatrixConf(TypedDict):
    """The matrix the run measures, as `plan.MatrixSpec.build` takes it (contexts in tokens)."""

    prefill_contexts: list[Positive]
    contexts: list[Positive]
    concurrencies: list[Positive]
    max_output_tokens: Positive
    window_s: Annotated[float, Field(gt=0)]
    prompt_mode: Literal["distinct", "shared"]  # records.PROMPT_MODES
    workload: Literal["article", "continuation"]  # records.WORKLOADS
    measurement_profile: Literal["default", "published"]  # records.MEASUREMENT_PROFILES
    # a manual KV cache size in tokens (plan.kv_capacity); None or absent: the server's own
    kv_budget: NotRequired[Positive | None]
    # burst sizes: N requests at once per decode context (loadgen/burst.py); absent: none
    burst: NotRequired[list[Positive]]
    # adaptive decode windows, window_s their cap (loadgen/adaptive.py); absent: fixed windows
    adaptive: NotRequired[bool]
    adaptive_min_s: NotRequired[Annotated[float, Field(gt=0)]]  # an adaptive window's least
    adaptive_target_pct: NotRequired[Annotated[float, Field(gt=0)]]  # plan.adaptive_target_pct


@with_config(_CHECKED)
class Resolved(TypedDict):
    """What a run is, fixed by `flows.resolution.resolve` before anything touches a host."""

    run_id: Annotated[
        str, Field(min_length=1)
    ]  # stable, readable: recipe__ref__trigger__UTC stamp__DAG run tag (make_run_id)
    dag_run_id: str
    recipe_id: str
    engine_ref: str  # the ref asked for (v0.29.0, 40-hex, pr/N, main)
    trigger: Literal["nightly", "commit", "manual"]  # records.TRIGGERS but ingest
    host: str  # an Airflow SSH connection id, or "local"
    warehouse: str | None  # the conf's warehouse root; None: the deployment's default
    host_home: str | None  # $HOME on the host for envs and server state; None: the host's
    holder: str  # the host lease's holder id (dag id + dag run id)
    run_tag: str  # starts every prompt and salts the prefix cache (cold prefills)
    served_model: str
    api_key_env: str | None  # the worker's env variable holding the server's API key
    port: Annotated[int, Field(ge=1, le=65535)] | None
    started_at: str  # ISO 8601 UTC (the XCom form; records.from_wire reads it back)
    matrix: MatrixConf
    repeats: Positive  # passes over the repeated cells (1: no repeats)
    repeat_cells: list[str] | None  # canonical names of the cells to repeat; None: all
    # the recipe as `resolve` read it (Recipe.model_dump): every later task uses this copy, so a
    # recipe edited mid-run changes nothing of the run; its content's hash lands in `runs`
    recipe: dict
    recipe_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    # `speedmatrix run` only (never from a conf): a server already running, and the run's
    # origin for the runs row; else None
    base_url: str | None
    source: str | None


RESOLVED_KEYS = tuple(Resolved.__annotations__)
"""The keys `resolve` returns, in order (a test holds resolve to them)."""
