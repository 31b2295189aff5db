"""When a decode window has measured enough: the adaptive window's stopping rule.

A cell's figures are steady long before a fixed 30 s window ends on most hardware; the host
time that the rest of the window costs buys no verdict. An adaptive window stops once the
interval of its throughput is tighter than the verdict needs (the cell's minimum detectable
change, from the noise model), after a minimum time, and never later than the fixed window it
replaces (the cap). A window that is not steady (a trend inside it) runs to the cap.

Why throughput alone is judged: every decode figure but TTFT is a function of one token
stream. Total tok/s is the window's tokens over its seconds; time between tokens and
per-request tok/s are the same stream seen per request, and with C streams running (which the
cell's own checks hold to within 10%) a relative interval on the total is the relative interval
on C x (per-request tok/s) and on 1 / TBT. TTFT's samples are the requests started, which a
window's length does not choose (docs/measurement.md, "Adaptive windows").

The interval is a batch-means interval (the standard one for a steady-state mean of a
correlated series): the window's token counts, read at regular checkpoints, are cut into
`BATCHES` equal batches whose rates are close to independent; the 95% half-width is
t(0.975, k-1) x sd / sqrt(k). A trend is a least-squares slope over the batches that is both
significant (|t| over the same quantile) and larger over the window than the target: either
alone is noise or harmless. Standard library only: this runs in the zipapp on the GPU host.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from speedmatrix.records import WINDOW_STOPS

BATCHES = 10
"""Batches of the batch-means interval: 10 is the usual choice (enough degrees of freedom for
a t interval, batches long enough to be near independent at 0.25 s checkpoints)."""

# Two-sided 97.5% quantiles of Student's t for the degrees of freedom used here (k - 1 for the
# interval, k - 2 for the slope): stdlib has no t distribution, and k is fixed.
_T975 = {8: 2.306, 9: 2.262}

STOP_CAP = "cap"
STOP_CONVERGED = "converged"
STOP_NOT_STEADY = "cap_not_steady"
STOP_NOT_CONVERGED = "cap_not_converged"
assert (STOP_CAP, STOP_CONVERGED, STOP_NOT_STEADY, STOP_NOT_CONVERGED) == WINDOW_STOPS
"""How a decode window ended: `cap`, a fixed window ran its length; `converged`, an adaptive
window's interval was tight enough; `cap_not_steady`, an adaptive window saw a trend (or queueing)
and ran to its cap; `cap_not_converged`, it was steady but never tight enough."""


@dataclass(frozen=True)
class Interval:
    """The throughput's 95% batch-means interval over the window so far."""

    rate: float  # tokens per second over the whole window so far
    half_width_pct: float  # the interval's half-width, % of the batch-means mean
    trend_pct: float  # least-squares change over the window, % of the mean
    trend_t: float  # the slope's t statistic

    @property
    def trending(self) -> bool:
        return abs(self.trend_t) > _T975[BATCHES - 2]


def interval(times: list[float], tokens: list[int]) -> Interval | None:
    """The interval from checkpoints (`times[i]`, cumulative window tokens `tokens[i]`), the
    first at the window's start; None until there are enough checkpoints for the batches."""
    n = len(times) - 1  # intervals between checkpoints
    if n < BATCHES or times[-1] <= times[0]:
        return None
    per = n // BATCHES
    first = n - per * BATCHES  # the earliest leftover checkpoints go to no batch (rate uses all)
    rates, mids = [], []
    for b in range(BATCHES):
        i, j = first + b * per, first + (b + 1) * per
        span = times[j] - times[i]
        if span <= 0:
            return None
        rates.append((tokens[j] - tokens[i]) / span)
        mids.append((times[i] + times[j]) / 2)
    mean = statistics.fmean(rates)
    if mean <= 0:
        return None
    sd = statistics.stdev(rates)
    half = _T975[BATCHES - 1] * sd / math.sqrt(BATCHES)
    slope, se = _slope(mids, rates)
    span = times[-1] - times[0]
    t = slope / se if se > 0 else (0.0 if slope == 0 else math.inf)
    return Interval(
        rate=(tokens[-1] - tokens[0]) / span,
        half_width_pct=100.0 * half / mean,
        trend_pct=100.0 * slope * span / mean,
        trend_t=t,
    )


def _slope(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares slope of y on x and its standard error."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    if sxx <= 0:
        return 0.0, 0.0
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx
    resid = [b - (my + slope * (a - mx)) for a, b in zip(x, y, strict=True)]
    dof = len(x) - 2
    se = math.sqrt(sum(r * r for r in resid) / dof / sxx) if dof > 0 else 0.0
    return slope, se


@dataclass
class AdaptiveWindow:
    """Checkpoints of one window and the decision to stop it.

    `target_pct`: the throughput interval's half-width (95%, % of the rate) that is tight
    enough; `min_s` and `cap_s`: the window's least and greatest length (seconds on the
    caller's clock). The caller records a checkpoint every `check_s` and asks `decide`.
    """

    target_pct: float
    min_s: float
    cap_s: float
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    unsteady: str | None = None  # why the window cannot stop early (queueing, preemption)
    last: Interval | None = None

    def __post_init__(self) -> None:
        if not self.target_pct > 0:
            raise ValueError(f"adaptive target must be a positive %, got {self.target_pct}")
        if not 0 < self.min_s <= self.cap_s:
            raise ValueError(
                f"adaptive minimum ({self.min_s:g} s) must be positive and at most the "
                f"window's cap ({self.cap_s:g} s)"
            )

    def checkpoint(self, t: float, tokens: int) -> None:
        self.times.append(t)
        self.tokens.append(tokens)
        self.last = interval(self.times, self.tokens)

    def mark_unsteady(self, why: str) -> None:
        """A reason the figures are not those of a steady state: the window runs to its cap."""
        if self.unsteady is None:
            self.unsteady = why

    def converged(self) -> bool:
        """Stop now? Only past the minimum, steady, and tighter than the target."""
        if not self.times or self.times[-1] - self.times[0] < self.min_s:
            return False
        iv = self.last
        if iv is None or self.unsteady is not None or self._trending(iv):
            return False
        return iv.half_width_pct <= self.target_pct

    def _trending(self, iv: Interval) -> bool:
        return iv.trending and abs(iv.trend_pct) > self.target_pct

    def stop_reason(self, stopped_early: bool) -> str:
        """Why the window ended, for the record (STOP_REASONS)."""
        if stopped_early:
            return STOP_CONVERGED
        iv = self.last
        if self.unsteady is not None or (iv is not None and self._trending(iv)):
            return STOP_NOT_STEADY
        return STOP_NOT_CONVERGED

    def explain(self, stopped_early: bool) -> str:
        """One line for the cell: what the window saw when it ended."""
        iv = self.last
        if iv is None:
            return "too short for an interval"
        figures = (
            f"throughput ±{iv.half_width_pct:.2f}% (target ±{self.target_pct:.2f}%), "
            f"trend {iv.trend_pct:+.2f}% over the window"
        )
        if stopped_early:
            return f"converged: {figures}"
        if self.unsteady is not None:
            return f"ran to the cap: {self.unsteady}; {figures}"
        if self._trending(iv):
            return f"ran to the cap: not steady; {figures}"
        return f"ran to the cap: not tight enough; {figures}"
