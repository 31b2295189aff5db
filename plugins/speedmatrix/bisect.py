"""Bisection over an ordered commit list: which commit first made the regressed cells slower.

Pure logic, no Airflow and no engine: the caller supplies `measure(commit) -> verdict` (run only
the regressed cells at that commit and compare them with the known-good run) and, optionally,
`has_wheel(commit)`. Commits without a wheel cannot be measured cheaply, so they are never
measured; if the first bad measurable commit is preceded by unmeasurable ones, all of them are
named as suspects (like `git bisect skip`).

Convention: `commits` lists the commits AFTER the known-good one, oldest first, ending with
the known-bad one (which is not measured again). With N measurable commits the first bad one
is found in at most ceil(log2(N)) measurements, as long as no measurement says "skip".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

BAD_VERDICTS = frozenset({"bad", "regression"})
GOOD_VERDICTS = frozenset({"good", "noise", "improvement"})
SKIP_VERDICTS = frozenset({"skip", "not_comparable"})


@dataclass
class BisectResult:
    """The first bad commit, the commits that may share the blame, and what was measured."""

    first_bad: str
    suspects: list[str]
    measured: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def measurements(self) -> int:
        return len(self.measured)

    def describe(self) -> str:
        steps = ", ".join(f"{c[:12]}={v}" for c, v in self.measured) or "none"
        text = f"first bad commit: {self.first_bad} ({self.measurements} measurements: {steps})"
        if len(self.suspects) > 1:
            text += "; could also be (no wheel / unmeasurable): " + ", ".join(
                c for c in self.suspects if c != self.first_bad
            )
        return text


def max_measurements(n: int) -> int:
    """ceil(log2(n)): the bound this bisection keeps without skips."""
    return math.ceil(math.log2(n)) if n > 1 else 0


def bisect(
    commits: Sequence[str],
    measure: Callable[[str], str],
    *,
    has_wheel: Callable[[str], bool] | None = None,
) -> BisectResult:
    """Find the first bad commit in `commits` (oldest first; the last is known bad).

    `measure` returns a verdict: bad/regression, good/noise/improvement, or skip/not_comparable
    (could not measure: the commit is dropped and the search continues).
    """
    if not commits:
        raise ValueError("no commits to bisect: the list must end with the known-bad commit")
    bad = commits[-1]
    has_wheel = has_wheel or (lambda _c: True)
    no_wheel = [c for c in commits[:-1] if not has_wheel(c)]
    candidates = [c for c in commits[:-1] if has_wheel(c)] + [bad]
    measured: list[tuple[str, str]] = []
    skipped: list[str] = []
    lo, hi = 0, len(candidates) - 1  # candidates[hi] is known bad; all before lo are good
    while lo < hi:
        mid = (lo + hi) // 2
        commit = candidates[mid]
        verdict = measure(commit)
        measured.append((commit, verdict))
        if verdict in BAD_VERDICTS:
            hi = mid
        elif verdict in GOOD_VERDICTS:
            lo = mid + 1
        elif verdict in SKIP_VERDICTS:
            skipped.append(commit)
            del candidates[mid]
            hi -= 1
        else:
            raise ValueError(f"measure({commit}) returned {verdict!r}: not a verdict")
    first_bad = candidates[hi]
    # Everything between the last good measurable commit and first_bad is a suspect too.
    prev_good = candidates[hi - 1] if hi > 0 else None
    start = commits.index(prev_good) + 1 if prev_good is not None else 0
    stop = commits.index(first_bad)
    suspects = [c for c in commits[start:stop] if c in no_wheel or c in skipped] + [first_bad]
    return BisectResult(first_bad, suspects, measured, skipped)
