"""Every value of a speed_matrix conf, checked by `resolve` itself.

Why not trust the DAG's Params: a conf also arrives through the REST API, `airflow dags
trigger --conf` and the trigger DAGs, and Airflow passes keys that are not declared Params
through to the task. Whatever reaches a host (a port, a home directory, an engine ref) is
quoted there anyway; this refuses nonsense with a reason, before a host is touched.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from speedmatrix.records import (
    MAX_QUANTITY,
    MEASUREMENT_PROFILES,
    PROMPT_MODES,
    WORKLOADS,
    parse_concurrency,
    parse_context,
    split_list_text,
)
from speedmatrix.renames import CONF_KEYS as RENAMED_KEYS
from speedmatrix.renames import RenameConflict, renamed

# The conf keys of speed_matrix (docs/design.md, contract); anything else is refused but the
# old names of renamed keys (speedmatrix.renames.CONF_KEYS: duration_s), read as the new ones.
CONF_KEYS = (
    "recipe",
    "engine_ref",
    "ssh_conn_id",
    "contexts",
    "concurrencies",
    "prefill_contexts",
    "window_s",
    "max_output_tokens",
    "prompt_mode",
    "workload",
    "measurement_profile",
    "kv_budget",
    "burst",
    "warehouse",
    "host_home",
    "port",
    "repeats",
    "repeat_cells",
    "adaptive",
    "adaptive_min_s",
)
_REMOVED = {
    "lease_ttl_s": "the lease's time to live is the deployment's, not a run's: "
    "SPEEDMATRIX_LEASE_TTL_S in the workers' environment",
}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,250}$")  # Airflow's connection id characters
MAX_WINDOW_S = 24 * 3600.0


def _is_int(v: Any) -> bool:
    """An integer (not a bool) within records.MAX_QUANTITY: a 400-digit count is refused here,
    naming its key, not an overflow where it lands."""
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_QUANTITY


def _is_token_count(v: Any) -> bool:
    """256 or a label like 64K, readable by records.parse_context (which bounds it)."""
    if isinstance(v, str) and _CONTROL.search(v):
        return False
    if not (_is_int(v) or isinstance(v, str)):
        return False
    try:
        parse_context(v)
    except ValueError:
        # not a count ("1.5K"): the matrix's check names it with its reason; a 400-digit
        # number is too long to be one and is refused here
        return len(str(v)) <= 40
    return True


def _is_number(v: Any) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


def _text_problem(key: str, v: Any) -> str | None:
    if not isinstance(v, str) or not v:
        return f"{key} must be a non-empty string, got {v!r}"
    if _CONTROL.search(v):
        return f"{key} must not hold control characters (newline, NUL…): {v!r}"
    return None


def _list_problems(key: str, v: Any, item_ok, what: str) -> list[str]:
    if not isinstance(v, list):
        return [f"{key} must be a list of {what}, got {v!r}"]
    bad = [x for x in v if not item_ok(x)]
    return [f"{key}: {bad!r} not {what}"] if bad else []


# The list keys a form may give as text (`8K, 16K`), and how each item is read.
LIST_TEXT_KEYS = {
    "contexts": parse_context,
    "prefill_contexts": parse_context,
    "concurrencies": parse_concurrency,
    "burst": parse_concurrency,
}


def normalise_conf(conf: Mapping[str, Any]) -> dict[str, Any]:
    """`conf` with the list keys written as text (`"8K, 16K"`, as the trigger form lets a
    person type them; records.split_list_text) made lists, each item read by its one rule
    (records.parse_context, records.parse_concurrency). A text that does not read stays as it is, for
    conf_problems to name; a list stays a list (its items are plan's to check)."""
    try:  # an old key (duration_s) under its name now, with a deprecation note
        out = renamed(conf, RENAMED_KEYS)[0]
    except RenameConflict:
        out = dict(conf)  # both given: conf_problems names them
    for key, read in LIST_TEXT_KEYS.items():
        value = out.get(key)
        if not isinstance(value, str):
            continue
        try:
            items = [read(x) for x in split_list_text(value)]
        except ValueError:
            continue
        if items:
            out[key] = items
    return out


def conf_problems(conf: Mapping[str, Any]) -> list[str]:
    """Every problem of `conf` (a key and its reason each); empty when every value is sane.

    Types here, and the ranges of what reaches a host (port, host_home, engine_ref); the
    matrix's ranges (positive, no duplicates, within max_model_len, repeats 1-10, repeat cells
    in the matrix) are plan's rules, checked next in `resolve` with their own messages."""
    problems: list[str] = []
    try:
        conf = renamed(conf, RENAMED_KEYS)[0]
    except RenameConflict as exc:
        problems.append(str(exc))
    for key in conf:
        if key in _REMOVED:
            problems.append(f"{key} is not a conf key: {_REMOVED[key]}")
        elif key not in CONF_KEYS and key not in RENAMED_KEYS:
            problems.append(f"unknown conf key {key!r} (known: {', '.join(CONF_KEYS)})")

    def given(key: str) -> bool:
        return conf.get(key) is not None

    if given("recipe") and (p := _text_problem("recipe", conf["recipe"])):
        problems.append(p)
    if given("engine_ref"):
        ref = conf["engine_ref"]
        if not isinstance(ref, str) or ref != ref.strip() or _CONTROL.search(ref):
            problems.append(f"engine_ref must be a ref without spaces or newlines, got {ref!r}")
    if given("ssh_conn_id") and (
        not isinstance(conf["ssh_conn_id"], str) or not _CONN_ID.match(conf["ssh_conn_id"])
    ):
        problems.append(
            f"ssh_conn_id must be an Airflow connection id (letters, digits, _ . -) or local, "
            f"got {conf['ssh_conn_id']!r}"
        )
    if given("warehouse") and (p := _text_problem("warehouse", conf["warehouse"])):
        problems.append(p)
    if given("host_home"):
        home = conf["host_home"]
        if p := _text_problem("host_home", home):
            problems.append(p)
        elif not home.startswith("/"):
            problems.append(f"host_home must be an absolute path, got {home!r}")
    if given("port") and not (_is_int(conf["port"]) and 1 <= conf["port"] <= 65535):
        problems.append(f"port must be an integer 1-65535, got {conf['port']!r}")
    for key in ("contexts", "prefill_contexts"):
        if given(key):
            problems += _list_problems(
                key,
                conf[key],
                _is_token_count,
                "token counts (256, 64K), or a text like `8K, 16K`",
            )
    for key in ("concurrencies", "burst"):
        if given(key):
            problems += _list_problems(
                key, conf[key], _is_int, "integers, or a text like `1, 2, 4`"
            )
    if given("window_s") and not (
        _is_number(conf["window_s"]) and conf["window_s"] <= MAX_WINDOW_S
    ):
        problems.append(
            f"window_s must be a number of seconds up to {MAX_WINDOW_S:g}, got {conf['window_s']!r}"
        )
    if given("max_output_tokens") and not (
        _is_int(conf["max_output_tokens"]) and conf["max_output_tokens"] >= 2
    ):
        problems.append(
            f"max_output_tokens must be an integer >= 2, got {conf['max_output_tokens']!r}"
        )
    if given("prompt_mode") and conf["prompt_mode"] not in PROMPT_MODES:
        problems.append(
            f"prompt_mode must be one of {list(PROMPT_MODES)}, got {conf['prompt_mode']!r}"
        )
    if given("workload") and conf["workload"] not in WORKLOADS:
        problems.append(f"workload must be one of {list(WORKLOADS)}, got {conf['workload']!r}")
    if given("measurement_profile") and conf["measurement_profile"] not in MEASUREMENT_PROFILES:
        problems.append(
            f"measurement_profile must be one of {list(MEASUREMENT_PROFILES)}, "
            f"got {conf['measurement_profile']!r}"
        )
    if given("adaptive") and not isinstance(conf["adaptive"], bool):
        problems.append(f"adaptive must be true or false, got {conf['adaptive']!r}")
    if given("adaptive_min_s") and not (
        _is_number(conf["adaptive_min_s"]) and 0 < conf["adaptive_min_s"] <= MAX_WINDOW_S
    ):
        problems.append(
            f"adaptive_min_s must be a positive number of seconds up to {MAX_WINDOW_S:g}, "
            f"got {conf['adaptive_min_s']!r}"
        )
    if given("kv_budget") and not _is_token_count(conf["kv_budget"]):
        problems.append(
            f"kv_budget must be a token count (983040 or 960K), got {conf['kv_budget']!r}"
        )
    if given("repeats") and not _is_int(conf["repeats"]):
        problems.append(f"repeats must be an integer, got {conf['repeats']!r}")
    if given("repeat_cells"):
        problems += _list_problems(
            "repeat_cells",
            conf["repeat_cells"],
            lambda x: isinstance(x, str) and x.strip() != "" and not _CONTROL.search(x),
            "cell names (64Kx16, 'prefill 64K')",
        )
    return problems
