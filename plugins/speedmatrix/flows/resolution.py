"""The `resolve` task: a run's conf and recipe become one fixed run description (`Resolved`).

One job, before anything touches a host: check the conf against the recipe (a bad conf fails
here, naming every problem), and fix the run's id, trigger, host, matrix, repeats and lease
holder. Plain values in, a JSON-able TypedDict out (flows/resolved.py), so `speedmatrix run`
and the DAG resolve a run the same way.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from speedmatrix.engine.lease import holder_id
from speedmatrix.errors import InputError
from speedmatrix.flows.contracts import RESOLVED
from speedmatrix.flows.resolved import Resolved
from speedmatrix.plan import MatrixSpec, adaptive_target_pct, check_matrix
from speedmatrix.records import cell_name, path_field_problems

DAG_ID = "speed_matrix"


class ResolveError(InputError):
    """The conf cannot become a run (unknown recipe, bad ref, impossible matrix)."""


def trigger_of(dag_run_id: str) -> str:
    """nightly / commit from the trigger DAGs' run ids (`nightly__…`, `commit__…`), else manual."""
    for trigger in ("nightly", "commit"):
        if dag_run_id.startswith(f"{trigger}__"):
            return trigger
    return "manual"


def make_run_id(recipe_id: str, ref: str, trigger: str, when: dt.datetime, dag_run: str) -> str:
    """Stable and readable: `<recipe with ~ for />__<ref slug>__<trigger>__<UTC stamp>__<tag>`.

    The tag (8 hex digits of the DAG run's own id, `dag_run`) keeps apart runs of one recipe and
    ref that start in the same second, as a fleet's script triggering one recipe on several
    hosts does: with the stamp alone they shared an id, and each landing replaced the one
    before. It is the DAG run's, so a retried task of one run lands under the same id again."""
    import hashlib

    from speedmatrix.refs import ref_slug

    stamp = when.astimezone(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    tag = hashlib.sha256(dag_run.encode()).hexdigest()[:8]
    return f"{recipe_id.replace('/', '~')}__{ref_slug(ref)}__{trigger}__{stamp}__{tag}"


def _override(conf: Mapping[str, Any], key: str, default: Any) -> Any:
    value = conf.get(key)
    return default if value is None or value == [] else value


def resolve(
    conf: Mapping[str, Any],
    *,
    dag_run_id: str,
    run_after: dt.datetime,
    dag_id: str = DAG_ID,
    recipe: Any = None,
    base_url: str | None = None,
    source: str | None = None,
) -> Resolved:
    """Check the conf against the recipe and fix everything the run needs, touching no host.

    Raises ResolveError naming every problem (unknown recipe, bad ref, impossible matrix).
    `recipe`, `base_url` and `source` are for `speedmatrix run` only (never a conf's: a URL
    is trusted from the command line, not from a run's conf): a recipe made in memory for a
    server already running at `base_url`, which `setup` then neither provisions nor starts
    and `teardown` never stops; `source` names the run's origin in the runs row.
    """
    from speedmatrix.flows.runconf import conf_problems, normalise_conf
    from speedmatrix.recipes import RecipeError, load_recipe_id
    from speedmatrix.refs import classify_ref

    recipe_name = conf.get("recipe")
    if not recipe_name:
        raise ResolveError("conf must name a recipe, e.g. {'recipe': 'cpu/tiny/llama-tiny'}")
    conf = normalise_conf(conf)  # `8K, 16K` as typed in the trigger form -> a list
    if problems := conf_problems(conf):
        raise ResolveError("bad conf: " + "; ".join(problems))
    given = recipe
    try:
        recipe = given or load_recipe_id(recipe_name)
    except (RecipeError, FileNotFoundError) as exc:
        raise ResolveError(f"recipe {recipe_name!r} cannot be used: {exc}") from exc
    ref = str(_override(conf, "engine_ref", recipe.engine.ref))
    try:
        classify_ref(ref)
    except ValueError as exc:
        raise ResolveError(str(exc)) from exc
    m = recipe.matrix
    try:
        spec = MatrixSpec.build(
            prefill_contexts=_override(conf, "prefill_contexts", m.prefill_contexts),
            contexts=_override(conf, "contexts", m.contexts),
            concurrencies=_override(conf, "concurrencies", m.concurrencies),
            max_output_tokens=_override(conf, "max_output_tokens", m.max_output_tokens),
            window_s=_override(conf, "window_s", m.window_s),
            prompt_mode=_override(conf, "prompt_mode", m.prompt_mode),
            workload=_override(conf, "workload", m.workload),
            measurement_profile=_override(conf, "measurement_profile", m.profile),
            adaptive=_override(conf, "adaptive", m.adaptive),
            adaptive_min_s=_override(conf, "adaptive_min_s", m.adaptive_min_s),
            adaptive_target_pct=adaptive_target_pct(recipe.schedule.regression_threshold_pct),
            kv_budget=_override(conf, "kv_budget", m.kv_budget),
            burst=_override(conf, "burst", m.burst),
        )
        check_matrix(spec, recipe.model.max_model_len)
    except ValueError as exc:
        raise ResolveError(f"recipe {recipe.id}: {exc}") from exc
    repeats, repeat_cells = _repeats(conf, m, spec)
    trigger = trigger_of(dag_run_id)
    run_id = make_run_id(recipe.id, ref, trigger, run_after, f"{dag_id}/{dag_run_id}")
    host = str(_override(conf, "ssh_conn_id", recipe.schedule.host or "local"))
    # every value that becomes part of a file name fits one, checked before anything runs
    # (a 185-character ref would be measured, then fail the landing)
    named = {
        "run_id": run_id,
        "recipe_id": recipe.id,
        "engine_ref": ref,
        "host": host,
        "served_model": recipe.model.served_name,
    }
    if problems := path_field_problems(named):
        raise ResolveError("; ".join(problems))
    # the recipe as it is now, pinned for the whole run: every later task reads this copy,
    # never the file again (an edit or a redeploy mid-run changes nothing of this run)
    pinned = recipe.model_dump(mode="json")
    return RESOLVED.to_wire(
        {
            "run_id": run_id,
            "dag_run_id": dag_run_id,
            "recipe_id": recipe.id,
            "engine_ref": ref,
            "trigger": trigger,
            "host": host,
            "warehouse": conf.get("warehouse") or None,
            "host_home": conf.get("host_home") or None,
            "holder": holder_id(dag_id, dag_run_id),
            "run_tag": hashlib.sha1(f"{run_id}|{dag_run_id}".encode()).hexdigest()[:10],
            "served_model": recipe.model.served_name,
            "api_key_env": recipe.serve.api_key_secret if recipe.has_api_key else None,
            "port": conf.get("port"),
            "started_at": dt.datetime.now(dt.UTC).isoformat(),
            "matrix": {
                "prefill_contexts": list(spec.prefill_contexts),
                "contexts": list(spec.contexts),
                "concurrencies": list(spec.concurrencies),
                "max_output_tokens": spec.max_output_tokens,
                "window_s": spec.window_s,
                "prompt_mode": spec.prompt_mode,
                "workload": spec.workload,
                "measurement_profile": spec.measurement_profile,
                "adaptive": spec.adaptive,
                "adaptive_min_s": spec.adaptive_min_s,
                "adaptive_target_pct": spec.adaptive_target_pct,
                "kv_budget": spec.kv_budget,
                "burst": list(spec.burst),
            },
            "repeats": repeats,
            "repeat_cells": repeat_cells,
            # the recipe pinned for the run (later tasks never read the file again), its hash
            "recipe": pinned,
            "recipe_sha256": recipe_hash(pinned),
            # speedmatrix run only: the server already running, the run's origin
            "base_url": base_url,
            "source": source,
        }
    )


def recipe_hash(recipe: Mapping[str, Any]) -> str:
    """The sha256 of a recipe's content (its validated model, keys sorted): the `runs` row's
    `recipe_sha256`, which tells two contents of one recipe id apart."""
    canonical = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _repeats(conf: Mapping[str, Any], m: Any, spec: MatrixSpec) -> tuple[int, list[str] | None]:
    """(repeats, the canonical names of the cells to repeat or None for all), checked against
    the matrix now so that a typo fails before a host is touched."""
    from speedmatrix.plan import PlanError, check_repeats, repeat_keys

    named = conf.get("repeat_cells")
    try:
        repeats = check_repeats(
            conf.get("repeats") if conf.get("repeats") is not None else m.repeats
        )
        if named is not None and repeats < 2:
            raise PlanError(
                "repeat_cells names cells to repeat but repeats is 1: set repeats to 2 or more"
            )
        keys = repeat_keys(spec, named if named is not None else m.repeat_cells)
    except PlanError as exc:
        raise ResolveError(str(exc)) from exc
    if repeats < 2:
        return 1, None
    return repeats, None if keys is None else [cell_name(*k) for k in keys]
