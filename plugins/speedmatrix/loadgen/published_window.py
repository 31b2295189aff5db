"""When the published tool's decode window opens (llm_decode_bench.py 8546-8700).

The tool polls every 0.5 s but scrapes `/metrics` and judges readiness only when more than
``POLL_S`` has passed since its last scrape (``metrics_interval = 1.0``: about once a second),
never before ``MIN_WARMUP_S`` into the cell; ready is nothing waiting, every stream with its
first token and ``running >= C``, and the window opens at the first judgement ``STABLE_S``
after readiness was first seen and held. So a window opens some 3-4 s after the last stream's
first token, not at it: at C=1 with a long first-token wait (507K) that moves where a
restarted request's wait falls, inside the window or past its end.

One place for the rule: the ``published`` measurement profile polls by it over HTTP
(``loadgen/published.py``) and the simulator's prediction of a page made by that tool opens
its windows by it (``sim/predict.py``, ``aggregate`` accounting), which calibration fits.
"""

from __future__ import annotations

from collections.abc import Iterator

MIN_WARMUP_S = 2.0
"""No window before this much of the cell has passed (``min_warmup_seconds``)."""
STABLE_S = 3.0
"""Readiness held this long opens the window (``ready_stable_seconds``)."""
POLL_S = 1.0
"""Readiness is judged about this often (``metrics_interval``; the loop sleeps half of it)."""


def judgements(start: float) -> Iterator[float]:
    """The moments the tool judges readiness in a cell started at `start`, from
    ``MIN_WARMUP_S`` in: its first poll half a poll in, then one scrape a poll apart."""
    t = start + POLL_S / 2
    while True:
        if t - start >= MIN_WARMUP_S:
            yield t
        t += POLL_S
