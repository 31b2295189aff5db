"""Bisection over an ordered commit list: which commit first made the regressed cells slower.

Pure logic, no Airflow and no engine: the caller supplies `measure(commit) -> verdict` (run only
the regressed cells at that commit and compare them with the known-good run) and, optionally,
`has_wheel(commit)`. Commits without a wheel cannot be measured cheaply, so they are never
measured; if the first bad measurable commit is preceded by unmeasurable ones, all of them are
named as suspects (like `git bisect skip`).

Convention: `commits` lists the commits AFTER the known-good one, oldest first, ending with
the known-bad one (which is not measured again). With N measurable commits the first bad one
is found in at most ceil(log2(N)) measurements, as long as no measurement says "skip".

The speed_matrix_bisect DAG's steps (GitHub, wheel checks, the warehouse) are in
flows/bisect_steps.py, which drives this state one measurement at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

BAD_VERDICTS = frozenset({"bad", "regression"})
GOOD_VERDICTS = frozenset({"good", "noise", "improvement"})
SKIP_VERDICTS = frozenset({"skip", "not_comparable"})


def _slower(row: Mapping[str, Any]) -> bool:
    """Whether a comparison row's figure moved the slower way (its change against the good run)."""
    change = row.get("change_pct")
    if change is None or change != change or change == 0:
        return False
    return (change > 0) != bool(row.get("higher_is_better"))


def step_verdict(rows: Sequence[Mapping[str, Any]]) -> str:
    """A step's verdict from the comparison rows of its regressed cells with the known-good run
    (analysis/verdict.py's rule): bad, good, or skip (nothing comparable).

    A bisection is not a gate: its caller saw a change between the good and the bad commit and
    asks on which side each commit lies. A regression is bad. So is an "unverified" figure that
    moved the slower way: verdict.py calls it so when the change is beyond the threshold and
    every band that is known (within-window intervals, counting resolution, sample spread) but
    the host has no between-run noise history yet or the figure is one sample; reading it as
    good would walk every step to the bad end (the job's threshold is its caller's step size).
    """
    rows = [r for r in rows if r.get("phase") != "run"]
    if not rows or any(r.get("verdict") == "not_comparable" for r in rows):
        return "skip"
    if any(
        r.get("verdict") == "regression" or (r.get("verdict") == "unverified" and _slower(r))
        for r in rows
    ):
        return "bad"
    return "good"


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


@dataclass
class BisectState:
    """A bisection one measurement at a time, as JSON-able state (an Airflow DAG keeps it in
    XCom between a task that picks the next commit and one that judges its run)."""

    commits: list[str]
    candidates: list[str]
    no_wheel: list[str]
    lo: int
    hi: int
    measured: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls, commits: Sequence[str], has_wheel: Callable[[str], bool] | None = None
    ) -> BisectState:
        if not commits:
            raise ValueError("no commits to bisect: the list must end with the known-bad commit")
        if len(set(commits)) != len(commits):
            raise ValueError("commits must be distinct")
        has_wheel = has_wheel or (lambda _c: True)
        no_wheel = [c for c in commits[:-1] if not has_wheel(c)]
        candidates = [c for c in commits[:-1] if c not in no_wheel] + [commits[-1]]
        return cls(list(commits), candidates, no_wheel, 0, len(candidates) - 1)

    @property
    def done(self) -> bool:
        return self.lo >= self.hi

    def next_commit(self) -> str | None:
        """The commit to measure next; None when the first bad one is known."""
        return None if self.done else self.candidates[(self.lo + self.hi) // 2]

    def record(self, commit: str, verdict: str) -> None:
        """Take the verdict of measuring `commit` (which must be next_commit())."""
        mid = (self.lo + self.hi) // 2
        if self.done or self.candidates[mid] != commit:
            raise ValueError(f"{commit} is not the commit being measured")
        self.measured.append((commit, verdict))
        if verdict in BAD_VERDICTS:
            self.hi = mid
        elif verdict in GOOD_VERDICTS:
            self.lo = mid + 1
        elif verdict in SKIP_VERDICTS:
            self.skipped.append(commit)
            del self.candidates[mid]
            self.hi -= 1
        else:
            raise ValueError(f"measure({commit}) returned {verdict!r}: not a verdict")

    def result(self) -> BisectResult:
        if not self.done:
            raise ValueError("bisection not finished")
        first_bad = self.candidates[self.hi]
        # Everything between the last good measurable commit and first_bad is a suspect too.
        prev_good = self.candidates[self.hi - 1] if self.hi > 0 else None
        start = self.commits.index(prev_good) + 1 if prev_good is not None else 0
        stop = self.commits.index(first_bad)
        unmeasured = set(self.no_wheel) | set(self.skipped)
        suspects = [c for c in self.commits[start:stop] if c in unmeasured] + [first_bad]
        return BisectResult(first_bad, suspects, list(self.measured), list(self.skipped))

    def to_dict(self) -> dict:
        return {
            "commits": self.commits,
            "candidates": self.candidates,
            "no_wheel": self.no_wheel,
            "lo": self.lo,
            "hi": self.hi,
            "measured": [list(m) for m in self.measured],
            "skipped": self.skipped,
        }

    @classmethod
    def from_dict(cls, data: dict) -> BisectState:
        return cls(
            list(data["commits"]),
            list(data["candidates"]),
            list(data["no_wheel"]),
            int(data["lo"]),
            int(data["hi"]),
            [(str(c), str(v)) for c, v in data.get("measured", [])],
            list(data.get("skipped", [])),
        )


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
    state = BisectState.start(commits, has_wheel)
    while (commit := state.next_commit()) is not None:
        state.record(commit, measure(commit))
    return state.result()
