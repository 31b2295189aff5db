"""Order statistics and the repetition-loop test, standard library only."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return data[lo]
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50.0)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def is_repetition_loop(text: str, min_chars: int = 256, max_period: int = 200) -> bool:
    """True when the second half of the output is one short piece repeated over and over.

    Why it matters for speed: a model stuck in a loop makes speculative decoding accept
    nearly every draft, so tok/s rises for a reason that has nothing to do with the engine.
    """
    if len(text) < min_chars:
        return False
    tail = text[len(text) // 2 :]
    for period in range(1, min(max_period, len(tail) // 3) + 1):
        if tail[period:] == tail[:-period]:
            return True
    return False


_TIMES = (
    "ttft_ms",
    "tbt_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tbt_p90_ms",
    "tbt_p99_ms",
    "chunk_gap_ms",
    "measured_s",
)
_RATES = ("total_tok_s", "per_request_tok_s")


def scale_times(record: dict[str, object], time_scale: float, rows: bool = False) -> None:
    """Wall-clock figures -> simulated ones for a simulator running time_scale x faster.

    Client-side figures (CPU, loop lag) stay in wall time: they describe this process.
    """
    if time_scale == 1.0:
        return
    keys = (
        ("ttft_ms", "tbt_ms", "max_chunk_gap_ms", "start_offset_s", "end_offset_s")
        if rows
        else _TIMES
    )
    for key in keys:
        value = record.get(key)
        if isinstance(value, float):
            record[key] = value * time_scale
    if not rows:
        for key in _RATES:
            value = record.get(key)
            if isinstance(value, float):
                record[key] = value / time_scale
