"""Prometheus text for /metrics with vLLM's metric names and labels.

Names follow vLLM V1 (``vllm:`` prefix, counters exposed as ``<name>_total``), so that the load
generator's server cross-checks (generation tokens, running / waiting, KV usage, preemptions,
prefix-cache hit rate, spec-decode acceptance) and the server inspection (cache_config_info)
read the simulator exactly as they read vLLM. The spec-decode counters are vLLM's
``SpecDecodingProm`` (vllm/v1/spec_decode/metrics.py): drafts, draft tokens, accepted tokens,
and accepted tokens per draft position (label ``position``, 0 .. k - 1), only when the server
speculates; the mean acceptance length is 1 + accepted / drafts.
"""

from __future__ import annotations

from speedmatrix.sim.engine import Engine
from speedmatrix.sim.profile import Profile


def _esc(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(engine: Engine, profile: Profile, generation_tokens: int | None = None) -> str:
    """Prometheus text; `generation_tokens` overrides the engine's count (the server passes the
    tokens its API layer has handed to clients, see SimServer.tokens_out)."""
    # vLLM's PrometheusStatLogger declares labelnames ["model_name", "engine"], in that order
    labels = f'model_name="{_esc(profile.served_model_name)}",engine="0"'
    c = engine.counters
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for suffix_labels, value in samples:
            lines.append(f"{suffix_labels} {float(value)!r}")

    info = {
        "block_size": profile.block_size,
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "kv_cache_size_tokens": profile.kv_cache_tokens,
        "num_cpu_blocks": "None",
        "num_gpu_blocks": profile.num_gpu_blocks,
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
    }
    info_labels = ",".join(f'{k}="{_esc(v)}"' for k, v in info.items())
    metric(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        [(f'vllm:cache_config_info{{engine="0",{info_labels}}}', 1.0)],
    )
    gauges = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            len(engine.running),
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            len(engine.waiting),
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            engine.kv_usage(),
        ),
    ]
    for name, help_text, value in gauges:
        metric(name, "gauge", help_text, [(f"{name}{{{labels}}}", value)])
    counters = [
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens),
        (
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            c.generation_tokens if generation_tokens is None else generation_tokens,
        ),
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            c.prefix_queries,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            c.prefix_hits,
        ),
        ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", c.preemptions),
    ]
    for name, help_text, value in counters:
        metric(name, "counter", help_text, [(f"{name}_total{{{labels}}}", value)])
    metric(
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        [
            (f'vllm:request_success_total{{{labels},finished_reason="{r}"}}', c.finished.get(r, 0))
            for r in ("stop", "length", "abort")
        ],
    )
    if profile.spec_decode is not None:
        spec = [
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", c.spec_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", c.spec_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", c.spec_accepted),
        ]
        for name, help_text, value in spec:
            metric(name, "counter", help_text, [(f"{name}_total{{{labels}}}", value)])
        metric(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "counter",
            "Accepted tokens per draft position.",
            [
                (
                    f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}}',
                    v,
                )
                for i, v in enumerate(c.spec_accepted_per_pos)
            ],
        )
    return "\n".join(lines) + "\n"
