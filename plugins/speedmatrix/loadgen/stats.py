"""Order statistics, the repetition-loop test and the copy test, standard library only."""

from __future__ import annotations

import math
import re
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


def rate_median(intervals: Sequence[float]) -> float | None:
    """The median over requests of 1 / time-between-tokens, taken as 1 / the median interval.

    For an odd count the two are the same number. For an even count any value between the
    middle two is a median, and numpy's midpoint of the rates is not the reciprocal of the
    midpoint of the intervals: at C = 1 a window often holds one long request and a few tokens
    of the next, and two intervals 1.9x apart put the two columns 10% out of step (the cells
    suite's consistency bound). The reciprocal is also a median of the rates, keeps the
    published columns reciprocal (the reference's 48.6 tok/s at 20.6 ms) and matches the
    bootstrap interval noise.py puts around it.
    """
    mid = median(intervals)
    return None if mid is None or mid <= 0 else 1.0 / mid


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


COPY_NGRAM = 8
"""Words per n-gram in the copy check. Why 8: ordinary English shares its 3- to 5-word
phrases ("at the end of the") with any document, so shorter n-grams would call fresh prose a
copy; eight words in the same order (some ten tokens, longer than an n-gram drafter's lookup
of 3-5) almost never recur by chance in text written anew, whereas every n-gram of a passage
copied from the prompt does. Words, not token ids: the stream carries text on every server
(token ids only where asked for), and the prompt's words are known to the client."""

_WORD = re.compile(r"[a-z0-9]+")


def word_ngrams(text: str, n: int = COPY_NGRAM) -> list[tuple[str, ...]]:
    """The text's n-grams of lower-cased words (punctuation and spacing ignored)."""
    words = _WORD.findall(text.lower())
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


class CopyCheck:
    """Share of output n-grams found in the prompt: 0 for fresh prose, near 1 for an echo."""

    def __init__(self, prompt_text: str, n: int = COPY_NGRAM) -> None:
        self.n = n
        self.prompt = set(word_ngrams(prompt_text, n))

    def counts(self, output: str) -> tuple[int, int]:
        """(n-grams of the output found in the prompt, n-grams of the output)."""
        grams = word_ngrams(output, self.n)
        return sum(1 for g in grams if g in self.prompt), len(grams)

    def share(self, outputs: Sequence[str]) -> float | None:
        """Pooled over the outputs (long ones weigh more); None when none is long enough."""
        found = total = 0
        for text in outputs:
            f, t = self.counts(text)
            found += f
            total += t
        return found / total if total else None


_TIMES = (
    "ttft_ms",
    "tbt_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tbt_p90_ms",
    "tbt_p99_ms",
    "chunk_gap_ms",
    "measured_s",
    "warmup_s",
    "ttst_ms",
    "latency_ms",
    "latency_p90_ms",
    "latency_p99_ms",
)
_RATES = ("total_tok_s", "per_request_tok_s", "e2e_per_request_tok_s")


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
