"""The cell, request and run records: the contract between the load generator, validation,
the warehouse and the report (docs/design.md, "Cell record" and "Warehouse tables").

Standard library only: the load generator imports this on GPU hosts where only the vLLM
environment's Python (with aiohttp) is available. The warehouse turns these field lists into
explicit pyarrow schemas; everything else refers to the names defined here, so a renamed field
breaks loudly in one place.
"""

from __future__ import annotations

import datetime as dt
import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from speedmatrix.errors import InputError

METRIC_VERSION = 2
"""Bumped whenever the way a figure is measured changes, so trends never mix definitions.
2: decode prompts are the declared `workload` (default `article`, a chat conversation asking
for a new article) instead of a raw continuation of repeated prose."""

INGEST_METRIC_VERSION = 0
"""metric_version of cells ingested from a published page: measured by another tool, by its
own definitions, never mixed into our trends (and held to the published tool's accounting by
the cells suite)."""

PHASES = ("prefill", "decode", "burst")
# burst: N requests sent at once and measured to completion (loadgen/burst.py; the published
# tool's request-count "Burst / E2E" mode): completed-request latency and per-user end-to-end
# tok/s, never compared with a sustained-decode cell (its `phase` is part of every cell key).
STATUSES = ("valid", "over_capacity", "failed", "invalid")
PROMPT_MODES = ("distinct", "shared")
# article: the published tool's chat conversation (a reference document, then a request for a
# long new article); continuation: raw continuation of repeated prose (servers without a chat
# template). The first is the default (docs/measurement.md rule 11).
WORKLOADS = ("article", "continuation")
DEFAULT_WORKLOAD = "article"
# How a run measured: `default`, our definitions (docs/measurement.md: exact token
# contexts, distinct prompts, TTFT from the last byte sent, min_tokens = max_tokens); or
# `published`, the published tool's (llm-inference-bench: one shared chat-text prompt sized by
# characters, TTFT from before the body is built, the window opening once running == C is
# stable, per-request tok/s = total / C). Never compared, trended or pooled across.
MEASUREMENT_PROFILES = ("default", "published")
DEFAULT_MEASUREMENT_PROFILE = "default"
# How a decode window's length is decided (loadgen/adaptive.py, docs/measurement.md "Adaptive
# windows"): fixed, window_s exactly; adaptive, until the cell's throughput interval is tight
# enough for its verdict, after a minimum, window_s the cap. And how it ended.
WINDOW_MODES = ("fixed", "adaptive")
WINDOW_STOPS = ("cap", "converged", "cap_not_steady", "cap_not_converged")
TRIGGERS = ("nightly", "commit", "manual", "ingest")
RUN_STATUSES = ("success", "failed", "partial")
# A valid decode cell's average running requests lie within this share of C: the load
# generator's own verdict and the cells suite's expectation are the one rule.
ACTIVE_TOLERANCE = 0.10


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # one of: str, int, float, bool, timestamp
    nullable: bool
    doc: str


# The contract fields, in the order docs/design.md lists them; then what analysts need beyond them.
CELL_FIELDS: tuple[Field, ...] = (
    Field("phase", "str", False, "prefill, decode or burst"),
    Field("context_tokens", "int", False, "exact prompt tokens sent (server usage.prompt_tokens)"),
    Field(
        "context_label", "str", False, "8K, 251K… (tokens / 1024, as published reports label them)"
    ),
    Field("concurrency", "int", False, "requests kept in flight (1 for prefill)"),
    Field("status", "str", False, "valid, over_capacity, failed, invalid"),
    Field(
        "total_tok_s",
        "float",
        True,
        "decode: window output tokens / window s; prefill: prompt tokens / TTFT",
    ),
    Field(
        "per_request_tok_s",
        "float",
        True,
        "median over requests of 1 / per-request time-between-tokens",
    ),
    Field("ttft_ms", "float", True, "median time to first output token"),
    Field("tbt_ms", "float", True, "median over requests of (t_last - t_first) / (tokens - 1)"),
    Field(
        "avg_active_requests",
        "float",
        True,
        "time-average of requests running on the server in the window",
    ),
    Field("completed_requests", "int", True, "requests that finished inside the window"),
    Field("output_tokens", "int", True, "output tokens inside the window"),
    Field(
        "measured_s",
        "float",
        True,
        "the window's length; the published profile's: to the window's last token",
    ),
    Field("error", "str", True, "why a cell is failed / invalid (null when valid)"),
    # --- beyond the contract ---
    Field("metric_version", "int", False, "METRIC_VERSION of the code that measured the cell"),
    Field("prompt_mode", "str", True, "distinct or shared (decode); null for prefill / ingested"),
    Field("max_output_tokens", "int", True, "max_tokens (= min_tokens) asked per request"),
    Field("window_s", "float", True, "the window asked for"),
    Field("ttft_p90_ms", "float", True, "p90 time to first token"),
    Field("ttft_p99_ms", "float", True, "p99 time to first token"),
    Field("tbt_p90_ms", "float", True, "p90 over requests of per-request time-between-tokens"),
    Field("tbt_p99_ms", "float", True, "p99 over requests of per-request time-between-tokens"),
    Field(
        "ttst_ms",
        "float",
        True,
        "median over requests of their second token arrival - their first (the first decode "
        "step apart from the prefill; the published tool's time to second token)",
    ),
    Field("chunk_gap_ms", "float", True, "median gap between chunks that carried tokens"),
    Field("tokens_per_chunk", "float", True, "mean output tokens per content chunk"),
    Field("requests_started", "int", True, "requests started in the cell (window and warm-up)"),
    Field("requests_failed", "int", True, "requests that failed in the cell"),
    Field(
        "samples",
        "int",
        True,
        "decode: requests contributing a time-between-tokens sample; prefill: cold prompts "
        "measured (docs/measurement.md, prefill)",
    ),
    Field(
        "active_source",
        "str",
        True,
        "server (vllm:num_requests_running) or client (in-flight count)",
    ),
    Field(
        "server_generation_tokens",
        "int",
        True,
        "rise of vllm:generation_tokens_total over the window",
    ),
    Field("server_max_waiting", "float", True, "max vllm:num_requests_waiting seen in the window"),
    Field("server_preemptions", "int", True, "rise of vllm:num_preemptions_total over the window"),
    Field(
        "kv_cache_usage_max", "float", True, "max vllm:kv_cache_usage_perc seen in the window (0-1)"
    ),
    Field("prefix_cache_hit_rate", "float", True, "prefix-cache hits / queries over the window"),
    Field(
        "spec_acceptance_length",
        "float",
        True,
        "1 + accepted / drafts over the window (spec decode)",
    ),
    Field(
        "client_cpu_pct",
        "float",
        True,
        "load generator CPU time / wall time in the window, percent",
    ),
    Field(
        "loop_lag_p99_ms", "float", True, "p99 event-loop lag of the load generator in the window"
    ),
    Field("started_at", "timestamp", True, "when the cell started (UTC)"),
    Field(
        "workload",
        "str",
        True,
        "article or continuation (the prompts' content); null: landed before it was recorded",
    ),
    Field(
        "copy_share",
        "float",
        True,
        "share of the outputs' word n-grams found in their own prompt (decode)",
    ),
    Field(
        "warmup_s",
        "float",
        True,
        "decode: seconds spent putting the cell's prompts in the prefix cache before its window "
        "(measurement time, not overhead); null for prefill (its one cold request is the "
        "measurement) and for cells that never warmed",
    ),
    Field(
        "measurement_profile",
        "str",
        True,
        "default or published (MEASUREMENT_PROFILES: whose definitions measured the cell); "
        "null: landed before it was recorded (default)",
    ),
    Field(
        "ttft_samples",
        "int",
        True,
        "requests whose TTFT the cell's ttft_ms is the median of (prefill: its cold prompts); "
        "null: landed before it was recorded",
    ),
    Field(
        "ttft_spread_pct",
        "float",
        True,
        "(max - min) / median of those TTFTs, percent: how far the samples of this one cell "
        "disagreed (null with fewer than 2)",
    ),
    Field(
        "window_mode",
        "str",
        True,
        "decode: fixed (the window ran window_s) or adaptive (it could stop once its figures "
        "were tight enough, window_s its cap); null for prefill and cells landed before it",
    ),
    Field(
        "window_stop",
        "str",
        True,
        "decode: how the window ended (WINDOW_STOPS): cap, converged, cap_not_steady, "
        "cap_not_converged",
    ),
    Field(
        "window_halfwidth_pct",
        "float",
        True,
        "decode: 95% batch-means half-width of total tok/s over the window, % of the rate",
    ),
    Field(
        "adaptive_target_pct",
        "float",
        True,
        "decode, adaptive: the half-width (%) that was tight enough for this cell's verdict",
    ),
    Field("window_note", "str", True, "decode, adaptive: what the window saw when it ended"),
    Field(
        "latency_ms",
        "float",
        True,
        "burst: median over its completed requests of (last token's arrival - request sent), "
        "the completed-request latency; null for prefill and decode cells",
    ),
    Field("latency_p90_ms", "float", True, "burst: p90 of the completed-request latency"),
    Field("latency_p99_ms", "float", True, "burst: p99 of the completed-request latency"),
    Field(
        "e2e_per_request_tok_s",
        "float",
        True,
        "burst: median over its completed requests of output tokens / latency, the per-user "
        "end-to-end tok/s (the wait for the first token included)",
    ),
)

# One row per request of a measured cell (distributions); keyed by run_id + cell keys.
REQUEST_FIELDS: tuple[Field, ...] = (
    Field("phase", "str", False, "prefill, decode or burst"),
    Field("context_tokens", "int", False, "the cell's context"),
    Field("concurrency", "int", False, "the cell's concurrency"),
    Field("request_index", "int", False, "order in which the request was started within the cell"),
    Field("stream", "int", True, "which of the C streams sent it"),
    Field("prompt_tokens", "int", True, "usage.prompt_tokens confirmed by the server"),
    Field("output_tokens", "int", True, "output tokens received (all, not only in-window)"),
    Field("window_tokens", "int", True, "output tokens received inside the window"),
    Field("ttft_ms", "float", True, "time to first token from the request being written"),
    Field("tbt_ms", "float", True, "(t_last - t_first) / (tokens - 1)"),
    Field("chunks", "int", True, "chunks that carried tokens"),
    Field("max_chunk_gap_ms", "float", True, "largest gap between token-carrying chunks"),
    Field(
        "start_offset_s",
        "float",
        True,
        "start time relative to the window start (negative: before)",
    ),
    Field("end_offset_s", "float", True, "end time relative to the window start"),
    Field(
        "finished", "bool", True, "completed its max_tokens (false: cut at window end or failed)"
    ),
    Field("error", "str", True, "why it failed, null otherwise"),
    Field("workload", "str", True, "article or continuation (the cell's workload)"),
)

RUN_FIELDS: tuple[Field, ...] = (
    Field("run_id", "str", False, "stable id of the run"),
    Field("recipe_id", "str", True, "recipe path under include/recipes without extension"),
    Field("trigger", "str", False, "nightly, commit, manual or ingest"),
    Field("started_at", "timestamp", True, "UTC"),
    Field("finished_at", "timestamp", True, "UTC"),
    Field("status", "str", False, "success, failed, partial"),
    Field("hardware_type", "str", True, "e.g. Discrete GPU"),
    Field("hardware_gpu", "str", True, "GPU (or CPU) model"),
    Field("hardware_gpu_count", "int", True, "number of GPUs"),
    Field("hardware_vram_gb", "float", True, "VRAM per GPU, GB"),
    Field("hardware_os", "str", True, "linux…"),
    Field("engine", "str", True, "vllm"),
    Field("engine_version", "str", True, "vLLM version string as the server reports it"),
    Field(
        "engine_commit",
        "str",
        True,
        "the vLLM commit: its full 40-hex SHA when known, else the 9-hex prefix a dev build's "
        "version carries (an abbreviation, never padded: group it with its SHA by "
        "starts_with); shown everywhere as 12 hex, or the 9 known marked …",
    ),
    Field("engine_pr", "int", True, "pull request number when the build is a PR"),
    Field("engine_ref", "str", True, "the ref asked for (v0.29.0, 40-hex, pr/N, main)"),
    Field("engine_repository", "str", True, "e.g. github.com/vllm-project/vllm"),
    Field("quantization", "str", True, "NVFP4, INT4…"),
    Field("backend", "str", True, "cuda, cpu…"),
    Field("build", "str", True, "cuda-13.2…"),
    Field("served_model", "str", True, "served model name"),
    Field("model", "str", True, "model id"),
    Field("model_revision", "str", True, "model revision"),
    Field("bench_tool", "str", True, "speedmatrix, llm-inference-bench…"),
    Field("bench_tool_version", "str", True, "its version"),
    Field("decode_test", "str", True, "Fixed duration, or Adaptive duration (window_s the cap)"),
    Field("prefill_mode", "str", True, "Measured during decode warm-up"),
    Field(
        "window_s",
        "float",
        True,
        "the measurement window of each decode cell, as asked for (the page's \"Time per "
        'measurement"); named measure_s in tables landed before schema 7, which read here',
    ),
    Field(
        "measure_s",
        "float",
        True,
        "window_s under its old name (the same value, written beside it for readers of that "
        "name: speedmatrix.renames.MIRRORED); read window_s",
    ),
    Field("max_output_tokens", "int", True, "max output tokens per request"),
    Field("prompt_mode", "str", True, "distinct or shared"),
    Field("launch_command", "str", True, "the launch command, secrets as <redacted>"),
    Field("kv_cache_tokens", "int", True, "server KV capacity in tokens"),
    Field("kv_block_size", "int", True, "KV block size in tokens"),
    Field("kv_num_blocks", "int", True, "KV blocks"),
    Field(
        "kv_budget_tokens",
        "int",
        True,
        "the manual KV budget the over-capacity rule used (--kv-budget, recipe matrix.kv_budget "
        "or conf kv_budget); null: the server's own capacity",
    ),
    Field("max_model_len", "int", True, "server max-model-len"),
    Field("host", "str", True, "Airflow connection id or local"),
    Field("source", "str", True, "where the run came from (report file name for ingest)"),
    Field("workload", "str", True, "article or continuation (decode prompts' content)"),
    Field(
        "sim_profile",
        "str",
        True,
        "the simulator profile that served a simulated run (null: a real engine)",
    ),
    Field(
        "measurement_profile",
        "str",
        True,
        "default or published: whose definitions measured the run (null: default)",
    ),
    Field(
        "recipe_sha256",
        "str",
        True,
        "sha256 of the recipe's content as the run used it (null: ingested or landed before)",
    ),
)


K = 1024

MAX_QUANTITY = 10**15
"""The largest number a page, a recipe or a record may hold (a token count, a rate, a time, a
size): exact in a float (below 2**53) and inside Parquet's int64. Unbounded, a 400-digit number on a
page is an OverflowError traceback, or lands as `inf` ("inf s" on the page); every
reading of a number checks this bound (`check_quantity`), so none of them can land."""


def check_quantity(value: float, text: object) -> float:
    """`value` (read from `text`) if it is finite and at most MAX_QUANTITY in size; else a
    ValueError saying which, quoting the start of the text."""
    shown = str(text).strip()
    shown = repr(shown if len(shown) <= 40 else shown[:40] + "…")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"not finite: {shown}")
    if abs(value) > MAX_QUANTITY:
        raise ValueError(f"too large: {shown} (at most {MAX_QUANTITY:.0e})")
    return value


"""Tokens per `K` in a context label: the published reports count in 1024s (8K = 8192)."""

# ASCII digits only (re.ASCII): `\d` alone also reads `١٢` (Arabic-Indic) or `１` (full-width)
# as numbers, which no page or recipe means.
_CONTEXT_RE = re.compile(r"([0-9]+)\s*([kK]?)", re.ASCII)
_COUNT_RE = re.compile(r"[0-9]+", re.ASCII)
_CELL_RE = re.compile(
    r"^\s*(?:(?P<prefill>prefill)[\s@:]*(?P<pctx>\d+\s*K?)"
    r"|(?:(?P<burst>burst)\s+)?(?P<ctx>\d+\s*K?)\s*[xX\u00d7]\s*(?P<conc>\d+))\s*$",
    re.IGNORECASE | re.ASCII,
)
_PHASE_RANK = {"prefill": 0, "decode": 1, "burst": 2}

CellKey = tuple[str, str, int]
"""(phase, context label, concurrency): what names the same cell in two runs."""


def context_label(tokens: int) -> str:
    """`8K`, `251K`: tokens / 1024 to the nearest whole K, as the published reports label them.

    Nearest, not floor: a prefill at max-model-len 262,144 sends 262,143 prompt tokens (one
    is left for the output token) and the published page still calls it `256K`. Below 1K the
    count itself (`512`), as the CPU recipes write it.
    """
    if tokens >= K:
        return f"{round(tokens / K)}K"
    return str(tokens)


def label_span(label: str | int) -> tuple[int, int]:
    """The token counts (first, last) that ``context_label`` names `label`: the inverse of the
    one labelling rule, read off it (`64K` -> 65,024..66,048; `1K` -> 1,024..1,535, below
    1,024 a count is its own label). Why: a cell measured anywhere its label reaches (a recipe's
    context shortened to fit max_model_len keeps its label: plan.sent_context) is that
    label's cell, wherever a rule asks which cell a token count belongs to."""
    tokens = parse_context(label)
    if tokens < K:
        return tokens, tokens
    label = context_label(tokens)  # `64k`, `65536`: written as the rule writes it
    n = round(tokens / K)
    lo, hi = n * K - K // 2, n * K + K // 2
    while context_label(lo) != label:
        lo += 1
    while context_label(hi) != label:
        hi -= 1
    return lo, hi


def parse_context(value: int | str) -> int:
    """`8K` / `8k` / `8 K` -> 8192, `4096` / `4,096` / `4_096` / 4096 -> 4096.

    The one reading of a context (or token count) wherever a person or a page writes one:
    recipes, DAG conf, `repeat_cells` / `--cell` names, the load generator's flags, ingested
    reports. Whole K only: labels are whole (context_label never writes `1.5K`), so a
    fractional K is a typo rather than a context. Ranges (positive, fits the model) are the
    caller's to check, so a plan can name every problem at once. ValueError otherwise.
    """
    if isinstance(value, bool):
        raise InputError(f"not a token count: {value!r}")
    if isinstance(value, int):
        check_quantity(value, value)
        return value
    text = str(value).strip().replace(",", "").replace("_", "")
    match = _CONTEXT_RE.fullmatch(text)
    if match is None:
        raise InputError(f"not a token count: {value!r} (write 8192 or 8K)")
    tokens = int(match.group(1)) * (K if match.group(2) else 1)
    check_quantity(tokens, value)
    return tokens


def parse_concurrency(value: int | str) -> int:
    """`16` / 16 -> 16: the one reading of a concurrency (a number of requests in flight).

    Written in ASCII digits only: `int()` alone reads `+1`, ` 2 ` and Arabic-Indic `١` as
    numbers, and a `K` is a context's unit, not a count's. Ranges (positive, at most
    plan.MAX_CONCURRENCY) are the matrix's to check (plan.matrix_problems), so a plan names every
    problem at once. ValueError otherwise.
    """
    if isinstance(value, bool):
        raise InputError(f"not a number of requests: {value!r}")
    if isinstance(value, int):
        check_quantity(value, value)
        return value
    text = str(value).strip()
    if not isinstance(value, str) or _COUNT_RE.fullmatch(text) is None:
        raise InputError(f"not a number of requests: {value!r} (write ASCII digits: 16)")
    return int(check_quantity(int(text), value))


# A list written as text, where a form or a flag gives one field for many values:
# `8K, 16K`, `8K 16K`, `1,2,4`. Items are separated by commas and/or spaces, so an item is a
# whole count without separators (`4096`, `8K`; never `4,096`, which would read as 4 and 096).
# The patterns are what a Param's JSON schema checks; split_list_text is what resolve reads.
CONTEXT_LIST_PATTERN = r"^\s*[0-9]+[kK]?(\s*[,\s]\s*[0-9]+[kK]?)*\s*$"
INTEGER_LIST_PATTERN = r"^\s*[0-9]+(\s*[,\s]\s*[0-9]+)*\s*$"
_LIST_SEP = re.compile(r"\s*[,\s]\s*")


def split_list_text(text: str) -> list[str]:
    """`8K, 16K` -> ["8K", "16K"]; `1 2,4` -> ["1", "2", "4"]; a JSON list written as text
    (`[8, 16]`, `["8K"]`) the same way, its brackets and quotes dropped. Each item is then read
    by its own rule (parse_context for contexts, int for concurrencies): this only splits."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1].replace('"', " ").replace("'", " ")
    return [item for item in _LIST_SEP.split(body.strip()) if item]


def cell_name(phase: str | None, context: int | str, concurrency: object) -> str:
    """`64Kx16` for a decode cell, `prefill 64K` for a prefill cell, `burst 64Kx16` for a burst
    cell, `run` for run-level rows.

    The one way a cell is written for people (`trend --cell`, `repeat_cells`, bisection,
    notifications); `parse_cell` reads it back. `context` is tokens or a label (canonicalised).
    """
    if phase == "run":
        return "run"
    label = context_label(parse_context(context))
    if phase == "prefill":
        return f"prefill {label}"
    name = f"{label}x{int(concurrency)}"  # type: ignore[call-overload]
    return f"burst {name}" if phase == "burst" else name


def parse_cell(spec: str) -> CellKey:
    """`64Kx16` -> (decode, 64K, 16); `prefill 64K` / `prefill@65536` -> (prefill, 64K, 1);
    `burst 64Kx16` -> (burst, 64K, 16).

    The label comes back canonical (`65536x16` names `64K`), so a name matches a stored
    cell's `context_label` whichever way it was written. ValueError when it names no cell.
    """
    m = _CELL_RE.match(spec) if isinstance(spec, str) else None
    if not m:
        raise InputError(
            f"not a cell: {spec!r} (use 64Kx16 for decode, 'prefill 64K' for prefill, "
            "'burst 64Kx16' for a burst)"
        )
    if m.group("prefill"):
        return "prefill", context_label(parse_context(m.group("pctx"))), 1
    return (
        "burst" if m.group("burst") else "decode",
        context_label(parse_context(m.group("ctx"))),
        parse_concurrency(m.group("conc")),
    )


def cell_key(cell: Mapping[str, object]) -> CellKey:
    """(phase, label, concurrency) of a cell record: what pairs a cell with a baseline's.

    By label, not token count: our 256K prefill is sent as 262,143 tokens while a published
    page ingested as 256K says 262,144; both are the page's `256K` cell. The stored label is
    used when present (an ingested page's own), else the label of `context_tokens`.
    """
    label = cell.get("context_label") or context_label(int(cell["context_tokens"]))  # type: ignore[call-overload]
    return str(cell["phase"]), str(label), int(cell.get("concurrency") or 1)  # type: ignore[call-overload]


def cell_sort_key(cell: Mapping[str, object] | Sequence[object]) -> tuple[int, int, int]:
    """The report's order: prefill, decode, burst, then by context, then by concurrency.

    Takes a cell record or a key tuple (phase, context tokens or label, concurrency).
    """
    if isinstance(cell, Mapping):
        tokens = cell.get("context_tokens")
        context = tokens if tokens is not None else cell.get("context_label")
        phase, conc = cell.get("phase"), cell.get("concurrency")
    else:
        phase, context, conc = cell
    if context is None:
        tokens = 0
    else:
        tokens = parse_context(context) if isinstance(context, str) else int(context)  # type: ignore[call-overload]
    return _PHASE_RANK.get(str(phase), 2), tokens, int(conc or 0)  # type: ignore[call-overload]


WARM_PREFILL = "prompt was not cold"
"""The reason code of a prefill cell measured on a prompt the prefix cache already held: the
start of its reason in the cell's error (loadgen.prefill writes it), which flows.matrix reads to
measure the cell again with a fresh prompt. One constant for both sides, so a rewording
changes both."""

PATH_FIELDS: tuple[str, ...] = ("run_id", "recipe_id", "engine_ref", "host", "served_model")
"""The values that become part of a file or directory name: the warehouse's partitions
(recipe_id=…), data files (<date>_<run_id>.parquet), a run's artifacts/<run_id>/, the env
directory (the ref's slug) and the lease and server records on a host, an ingested page's
recipe id (published/<gpu>/<served model>)."""

MAX_PATH_VALUE = 150
"""The longest a PATH_FIELDS value may be, counted as it is written into a name: UTF-8, with
every byte but letters, digits and `-_.~` percent-encoded (three bytes each), the most any of
our encodings takes. A name holds one value and at most ~45 bytes of its own (`recipe_id=`,
a date, `.parquet`, a temporary suffix), so it stays inside NAME_MAX (255 bytes). A value past
this fills the landing with ENAMETOOLONG after the whole matrix is measured, so
every entry point (resolve, so the DAG and `speedmatrix run`; `speedmatrix ingest`) checks it
first with :func:`path_field_problems`."""


RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.~:+@=-]*", re.ASCII)
"""What a run id is made of: ours (`<recipe with ~ for />__<ref>__<trigger>__<stamp>__<tag>`,
`ingest-<hex>`) and any a person would choose; never a path (no `/`), never hidden."""
_NAME_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def path_field_problems(values: Mapping[str, Any]) -> list[str]:
    """One line per PATH_FIELDS value in `values` that cannot be part of a file name: a control
    character, a part that is hidden or `..`, a run id that is not a name (RUN_ID_RE), or too
    long (naming its length and the limit); [] when every one fits (absent / None ones are
    skipped). The one check of names at every entry point: resolve, ingest, migrate."""
    out = []
    for name in PATH_FIELDS:
        value = values.get(name)
        if value is None:
            continue
        text = str(value)
        if _NAME_CONTROL.search(text):
            out.append(f"{name} must not hold control characters (newline, NUL…): {text[:60]!r}")
            continue
        if any(part.startswith(".") or not part for part in text.split("/")):
            out.append(
                f"{name} must not have a part that is empty or starts with '.' "
                f"(hidden, `..`): {text[:60]!r}"
            )
            continue
        if name == "run_id" and not RUN_ID_RE.fullmatch(text):
            out.append(
                f"run_id must be letters, digits and _ . ~ : + @ = - (no /), starting with a "
                f"letter or digit: {text[:60]!r}"
            )
            continue
        written = len(urllib.parse.quote(text, safe="-_.~"))
        if written > MAX_PATH_VALUE:
            out.append(
                f"{name} is too long to be part of a file name: {len(str(value))} characters "
                f"({written} once written into a name; the limit is {MAX_PATH_VALUE})"
            )
    return out


COMPARABILITY_FIELDS: tuple[str, ...] = (
    "phase",
    "metric_version",
    "workload",
    "measurement_profile",
    "prompt_mode",
    "max_output_tokens",
    "window_s",
)
"""What two cells must share for their figures to be compared, trended or pooled at all: the
phase (a burst's figures run to its requests' completion, a decode cell's over a sustained
window: a burst 8Kx4 is never a baseline of the decode 8Kx4, nor its noise), the metric's
definition, the decode workload (an article and a continuation measure different
things on a speculative decoder, docs/measurement.md rule 11), the measurement profile (our
definitions or the published tool's), the prompt mode (shared prompts hit the prefix cache),
the output tokens asked per request and the window's length (a shorter window counts a
larger share of ramp-up). The one rule of what may be compared, for verdicts, noise, trends,
the site and bisection alike (:func:`not_comparable_reason`); extend it here."""

WINDOW_LENGTH_FIGURES: tuple[str, ...] = ("completed_requests", "output_tokens")
"""Figures whose definition depends on how long the window was (counts that grow with it), so
never compared between two cells unless both measured the same seconds. Why the window's
*mode* is not in COMPARABILITY_FIELDS: an adaptive window (window_s its cap) stops only on a
steady stream, so its rates and per-token times (total and per-request tok/s, TTFT, TBT and
their percentiles) are the same quantities as a fixed window's of that length, measured over
fewer seconds (docs/measurement.md, "Adaptive windows"); the verdict judges only those."""

_READ_MISSING_AS = {"measurement_profile": DEFAULT_MEASUREMENT_PROFILE}
"""A field recorded only since some point: a cell landed before it was measured by what is
now its default (a cell without a measurement profile was measured by our definitions)."""


_UNRECORDED_IS_UNKNOWN = frozenset({"prompt_mode", "max_output_tokens", "window_s"})
"""Fields a cell may lack (a prefill cell has no prompt mode; an ingested page or a cell
landed by hand records none): a side that did not record one cannot be told apart by it."""


def _empty(v: object) -> bool:
    return v is None or (isinstance(v, float) and v != v)


def _same_value(a: object, b: object) -> bool:
    # a warehouse read gives NaN where a field is empty: two empties are the same
    def empty(v: object) -> bool:
        return v is None or (isinstance(v, float) and v != v)

    return (empty(a) and empty(b)) or a == b


def not_comparable_reason(cell: Mapping[str, Any], baseline: Mapping[str, Any]) -> str | None:
    """Why `cell`'s figures may not be judged against `baseline`'s ("metric_version 1 -> 2"),
    or None when they may (COMPARABILITY_FIELDS all equal)."""
    for name in COMPARABILITY_FIELDS:
        a, b = _comparable_value(cell, name), _comparable_value(baseline, name)
        if name in _UNRECORDED_IS_UNKNOWN and (_empty(a) or _empty(b)):
            continue
        if not _same_value(a, b):
            return f"{name} {b} -> {a}"
    return None


def _comparable_value(record: Mapping[str, Any], name: str) -> object:
    value = record.get(name)
    if name in _READ_MISSING_AS and (
        value is None or (isinstance(value, float) and value != value)
    ):
        return _READ_MISSING_AS[name]
    return value


def empty_cell(**values: object) -> CellRecord:
    """A cell record with every field present (None where unknown), overlaid with values."""
    record: dict[str, object] = {f.name: None for f in CELL_FIELDS}
    record["metric_version"] = METRIC_VERSION
    unknown = set(values) - set(record)
    if unknown:
        raise KeyError(f"not cell record fields: {sorted(unknown)}")
    record.update(values)
    return record  # type: ignore[return-value]  # every CellRecord key, checked above


class CellRecord(TypedDict):
    """One cell as it travels from the load generator to the table builder: exactly the
    CELL_FIELDS names (a test keeps the two in step), timestamps as datetimes. Its XCom / JSON
    form (timestamps as ISO strings) is made and read back by `to_wire` / `from_wire` only."""

    phase: str
    context_tokens: int  # the prompt tokens the server confirmed: measured, never the planned
    context_label: str  # the planned cell's label (8K), the cell's identity in the report
    concurrency: int
    status: str
    total_tok_s: float | None
    per_request_tok_s: float | None
    ttft_ms: float | None
    tbt_ms: float | None
    avg_active_requests: float | None
    completed_requests: int | None
    output_tokens: int | None
    measured_s: float | None
    error: str | None
    metric_version: int
    prompt_mode: str | None
    max_output_tokens: int | None
    window_s: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    tbt_p90_ms: float | None
    tbt_p99_ms: float | None
    ttst_ms: float | None
    chunk_gap_ms: float | None
    tokens_per_chunk: float | None
    requests_started: int | None
    requests_failed: int | None
    samples: int | None
    active_source: str | None
    server_generation_tokens: int | None
    server_max_waiting: float | None
    server_preemptions: int | None
    kv_cache_usage_max: float | None
    prefix_cache_hit_rate: float | None
    spec_acceptance_length: float | None
    client_cpu_pct: float | None
    loop_lag_p99_ms: float | None
    started_at: dt.datetime | None
    workload: str | None
    copy_share: float | None
    warmup_s: float | None
    measurement_profile: str | None
    ttft_samples: int | None
    ttft_spread_pct: float | None
    window_mode: str | None
    window_stop: str | None
    window_halfwidth_pct: float | None
    adaptive_target_pct: float | None
    window_note: str | None
    latency_ms: float | None
    latency_p90_ms: float | None
    latency_p99_ms: float | None
    e2e_per_request_tok_s: float | None


# ------------------------------------------------------------------- the one validity rule set
# What a row's values may be, read by both the GX cells / runs suites (quality.py) and the
# table builder (store/schemas.build_table): one definition, so the two cannot disagree.
# Looked up at call time (`allowed_values`, `unique_key`), never copied at import.
ALLOWED_VALUES: dict[str, dict[str, tuple[str, ...]]] = {
    "cells": {
        "status": STATUSES,
        "phase": PHASES,
        "workload": WORKLOADS,
        "measurement_profile": MEASUREMENT_PROFILES,
        "window_mode": WINDOW_MODES,
        "window_stop": WINDOW_STOPS,
    },
    "requests": {"phase": PHASES},
    "runs": {
        "trigger": TRIGGERS,
        "status": RUN_STATUSES,
        "measurement_profile": MEASUREMENT_PROFILES,
    },
}
"""table -> column -> the values it may hold (null is allowed where the field is nullable)."""

UNIQUE_KEYS: dict[str, tuple[str, ...]] = {
    "cells": ("phase", "context_tokens", "concurrency"),
    "requests": ("phase", "context_tokens", "concurrency", "request_index"),
}
"""table -> the columns no two rows of one run may share."""


def allowed_values(table: str) -> dict[str, tuple[str, ...]]:
    """The value sets of `table`'s enumerated columns (see ALLOWED_VALUES)."""
    return dict(ALLOWED_VALUES.get(table, {}))


_UNIT_SUFFIXES: tuple[tuple[str, str], ...] = (
    ("_tok_s", "tok/s"),
    ("_ms", "ms"),
    ("_s", "s"),
    ("_tokens", "tokens"),
    ("_pct", "%"),
    ("_gb", "GB"),
    ("_rate", "fraction 0-1"),
)


def unit_of(column: str) -> str | None:
    """A column's unit, read from its name (the naming rule every table keeps: `_ms`, `_s`,
    `_tok_s`, `_tokens`, `_pct`, `_gb`, `_rate`), so that a unit is said in one place and
    reaches the Parquet metadata, DuckDB's comments and the data dictionary alike. None for
    counts, labels and timestamps."""
    for suffix, unit in _UNIT_SUFFIXES:
        if column.endswith(suffix):
            return unit
    return None


def unique_key(table: str) -> tuple[str, ...] | None:
    """The columns that identify a row of `table` within a run (None: no such key)."""
    return UNIQUE_KEYS.get(table)


# ------------------------------------------------------------ the wire (XCom / JSON) form


def _timestamps(fields: Iterable[Field]) -> list[str]:
    return [f.name for f in fields if f.type == "timestamp"]


def to_wire(row: Mapping[str, object], fields: Iterable[Field] = CELL_FIELDS) -> dict:
    """A row as it crosses a task boundary (XCom) or a file: timestamps as ISO strings.

    The one place a record's datetimes become strings (`from_wire` is the way back); every
    other field is already JSON (keys outside `fields` pass through unchanged)."""
    out = dict(row)
    for name in _timestamps(fields):
        value = out.get(name)
        if isinstance(value, dt.datetime):
            out[name] = value.isoformat()
    return out


def from_wire(row: Mapping[str, object], fields: Iterable[Field] = CELL_FIELDS) -> dict:
    """A row read back from XCom or JSON: ISO strings of timestamp fields become aware UTC
    datetimes (a naive one is taken as UTC). Raises ValueError on a string that is no ISO
    timestamp: a malformed record fails where it is read, not in the table builder."""
    out = dict(row)
    for name in _timestamps(fields):
        value = out.get(name)
        if isinstance(value, str):
            try:
                value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise ValueError(f"{name}: not an ISO timestamp: {value!r}") from None
        if isinstance(value, dt.datetime):
            out[name] = (
                value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)
            )
    return out
