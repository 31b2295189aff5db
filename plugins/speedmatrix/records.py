"""The cell, request and run records: the contract between the load generator, validation,
the warehouse and the report (design.md, "Cell record" and "Warehouse tables").

Standard library only: the load generator imports this on GPU hosts where only the vLLM
environment's Python (with aiohttp) is available. The warehouse turns these field lists into
explicit pyarrow schemas; everything else refers to the names defined here, so a renamed field
breaks loudly in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

METRIC_VERSION = 2
"""Bumped whenever the way a figure is measured changes, so trends never mix definitions.
2: decode prompts are the declared `workload` (default `article`, a chat conversation asking
for a new article) instead of a raw continuation of repeated prose (issue 15)."""

PHASES = ("prefill", "decode")
STATUSES = ("valid", "over_capacity", "failed", "invalid")
PROMPT_MODES = ("distinct", "shared")
# article: the published tool's chat conversation (a reference document, then a request for a
# long new article); continuation: raw continuation of repeated prose (servers without a chat
# template). The first is the default (measurement.md rule 11).
WORKLOADS = ("article", "continuation")
DEFAULT_WORKLOAD = "article"
TRIGGERS = ("nightly", "commit", "manual", "ingest")
# A valid decode cell's average running requests lie within this share of C: the load
# generator's own verdict and the cells suite's expectation are the one rule.
ACTIVE_TOLERANCE = 0.10


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # one of: str, int, float, bool, timestamp
    nullable: bool
    doc: str


# The contract fields, in the order design.md lists them; then what analysts need beyond them.
CELL_FIELDS: tuple[Field, ...] = (
    Field("phase", "str", False, "prefill or decode"),
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
    Field("measured_s", "float", True, "the window's length"),
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
    Field("chunk_gap_ms", "float", True, "median gap between chunks that carried tokens"),
    Field("tokens_per_chunk", "float", True, "mean output tokens per content chunk"),
    Field("requests_started", "int", True, "requests started in the cell (window and warm-up)"),
    Field("requests_failed", "int", True, "requests that failed in the cell"),
    Field("samples", "int", True, "requests contributing a time-between-tokens sample"),
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
)

CELL_CONTRACT_FIELDS = tuple(f.name for f in CELL_FIELDS[:14])

# One row per request of a measured cell (distributions); keyed by run_id + cell keys.
REQUEST_FIELDS: tuple[Field, ...] = (
    Field("phase", "str", False, "prefill or decode"),
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
    Field("engine_commit", "str", True, "commit (short or full hex)"),
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
    Field("decode_test", "str", True, "Fixed duration"),
    Field("prefill_mode", "str", True, "Measured during decode warm-up"),
    Field("measure_s", "float", True, "time per measurement, s"),
    Field("max_output_tokens", "int", True, "max output tokens per request"),
    Field("prompt_mode", "str", True, "distinct or shared"),
    Field("launch_command", "str", True, "the launch command, secrets as <redacted>"),
    Field("kv_cache_tokens", "int", True, "server KV capacity in tokens"),
    Field("kv_block_size", "int", True, "KV block size in tokens"),
    Field("kv_num_blocks", "int", True, "KV blocks"),
    Field("max_model_len", "int", True, "server max-model-len"),
    Field("host", "str", True, "Airflow connection id or local"),
    Field("source", "str", True, "where the run came from (report file name for ingest)"),
    Field("workload", "str", True, "article or continuation (decode prompts' content)"),
)


def context_label(tokens: int) -> str:
    """`8K`, `251K`: tokens / 1024 to the nearest whole K, as the published reports label them.

    Nearest, not floor: a prefill at max-model-len 262,144 sends 262,143 prompt tokens (one
    is left for the output token) and the published page still calls it `256K`.
    """
    if tokens >= 1024:
        return f"{round(tokens / 1024)}K"
    return str(tokens)


def parse_context(value: int | str) -> int:
    """`8K` -> 8192, `251K` -> 257024, `4096` / 4096 -> 4096 (labels as the reports write them)."""
    if isinstance(value, bool):
        raise ValueError(f"not a context length: {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip().upper().replace(",", "")
    try:
        if text.endswith("K"):
            return int(float(text[:-1]) * 1024)
        return int(text)
    except ValueError:
        raise ValueError(f"not a context length: {value!r} (write 8192 or 8K)") from None


def empty_cell(**values: object) -> dict[str, object]:
    """A cell record with every field present (None where unknown), overlaid with values."""
    record: dict[str, object] = {f.name: None for f in CELL_FIELDS}
    record["metric_version"] = METRIC_VERSION
    unknown = set(values) - set(record)
    if unknown:
        raise KeyError(f"not cell record fields: {sorted(unknown)}")
    record.update(values)
    return record
