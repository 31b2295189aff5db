"""vLLM's Prometheus `/metrics` text, reduced to the few figures the cross-checks need.

Hand-parsed (the text format is line based and stable) so that the load generator needs no
prometheus_client on the GPU host. Every series of a metric is summed over its labels: a server
with several engines (data parallel) reports one series per engine.
"""

from __future__ import annotations

from dataclasses import dataclass

# Names differ across vLLM versions; the first one present wins.
_ALIASES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "preemptions": ("vllm:num_preemptions_total",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "spec_drafts": ("vllm:spec_decode_num_drafts_total",),
    "spec_accepted": ("vllm:spec_decode_num_accepted_tokens_total",),
}


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels dropped); comments and blanks skipped."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            rest = line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


@dataclass(frozen=True)
class Snapshot:
    """One reading of the server counters at client time `at` (perf_counter seconds).

    `sent` is when the request left: the server read its counters somewhere between the two,
    so tokens generated in [sent, at] may be on either side of the reading.
    """

    at: float
    values: dict[str, float]
    sent: float | None = None

    def get(self, key: str) -> float | None:
        for name in _ALIASES[key]:
            if name in self.values:
                return self.values[name]
        return None


def snapshot(at: float, text: str, sent: float | None = None) -> Snapshot:
    return Snapshot(at, parse_metrics(text), sent)


def rise(start: Snapshot | None, end: Snapshot | None, key: str) -> float | None:
    """Counter increase between two readings, None when either reading lacks it."""
    if start is None or end is None:
        return None
    a, b = start.get(key), end.get(key)
    if a is None or b is None:
        return None
    return b - a
