"""The time a run has left, from what its remaining cells will cost.

One job: the ETA of `speedmatrix run` and `make demo` (cli/run.py's Display). A mean time per
phase said about half the real time left (1:18 shown, 2:45 real at 3 of 18): the
cells run context by context, smallest first, and what a cell costs grows with its context.
So each cell is costed from its parts, as plan.run_order runs them:

- a prefill cell: an overhead and its prompt's prefill time, t(context);
- a decode cell: an overhead, its window, and its warm-up: the prefill of the prompts the
  cells before it in its context have not put in the cache yet (C minus the largest C run
  so far in that context, the prefill cell's prompt being stream 0's), each t(context).

t(context) is the prefill cells' own TTFT where measured, else extrapolated from the measured
ones (a power law fitted on them: prompt tok/s falls slowly with the context); the overheads
and the warm-up's share of t are fitted on the cells done (each decode record says its
`warmup_s`). Pure: the clock is the caller's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

PREFILL_GUESS_S = 5.0  # a prefill cell before any prefill was measured
DECODE_OVERHEAD_S = 5.0  # a decode cell's start and drain beyond its window, before measured
EXPONENT = 1.1  # t(context) ~ context^e before two prefill cells say better (published pages)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _key(cell: Mapping[str, Any]) -> tuple:
    """A cell as the plan and the tasks both name it (the task's copy is another dict)."""
    return tuple(cell.get(k) for k in ("phase", "context_tokens", "concurrency", "repeat"))


def _mean(xs: Sequence[float], default: float) -> float:
    return sum(xs) / len(xs) if xs else default


class CellCosts:
    """What each cell of a run will cost, learnt from the cells done."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.ttft: dict[int, float] = {}  # context -> a prefill's seconds (measured)
        self.prefill: list[tuple[float, float]] = []  # (t(context), seconds the cell took)
        self.overhead: list[float] = []  # decode: took - window - warm-up
        self.warm_share: list[float] = []  # decode: warm-up / (new prompts x t(context))
        self.new: dict[tuple, int] = {}  # cell key -> prompts its warm-up prefills
        self.burst: list[float] = []  # burst: took - warm-up (no window: to completion)

    def plan(self, cells: Sequence[Mapping[str, Any]]) -> None:
        """The prompts each decode cell's warm-up prefills, in run order (plan.run_order)."""
        widest: dict[int, int] = {}
        for cell in cells:
            ctx = int(cell.get("context_tokens") or 0)
            c = int(cell.get("concurrency") or 1)
            before = widest.get(ctx, 0)
            # a burst's request i sends the prompt of the decode streams' i (plan.run_order)
            self.new[_key(cell)] = max(0, c - before) if cell.get("phase") != "prefill" else 1
            widest[ctx] = max(before, c)

    def t(self, ctx: int) -> float | None:
        """A prefill's seconds at `ctx`: measured, else from the nearest measured context."""
        if ctx in self.ttft:
            return self.ttft[ctx]
        if not self.ttft:
            return None
        known = sorted(self.ttft)
        exponent = EXPONENT
        if len(known) >= 2:
            xs = [math.log(k) for k in known]
            ys = [math.log(self.ttft[k]) for k in known]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            if var > 0:
                slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
                exponent = min(2.0, max(0.8, slope))
        near = min(known, key=lambda k: abs(math.log(k / ctx)) if ctx > 0 else k)
        return self.ttft[near] * (ctx / near) ** exponent if ctx > 0 else self.ttft[near]

    def cost(self, cell: Mapping[str, Any]) -> float:
        ctx = int(cell.get("context_tokens") or 0)
        t = self.t(ctx)
        if cell.get("phase") == "prefill":
            if t is None or not self.prefill:
                return PREFILL_GUESS_S
            if len(self.prefill) >= 2 and len({round(x, 6) for x, _ in self.prefill}) >= 2:
                # took = a + b t, least squares over the prefill cells done
                xs, ys = zip(*self.prefill, strict=True)
                mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
                b = sum((x - mx) * (y - my) for x, y in self.prefill) / sum(
                    (x - mx) ** 2 for x in xs
                )
                b = max(0.0, b)
                a = max(0.0, my - b * mx)
                return a + b * t
            # one cell: it prefilled its prompt once at least; the rest is taken as overhead
            t0, took0 = self.prefill[0]
            return max(0.0, took0 - t0) + t
        over = _mean(self.overhead, DECODE_OVERHEAD_S)
        new = self.new.get(_key(cell), int(cell.get("concurrency") or 1))
        warm = new * (t or 0.0) * _mean(self.warm_share, 1.0)
        if cell.get("phase") == "burst":  # to completion: as long as the bursts done took
            return _mean(self.burst, over + self.window_s) + warm
        return over + self.window_s + warm

    def observe(self, cell: Mapping[str, Any], record: Mapping[str, Any], took: float) -> None:
        """A cell done: what it measured and how long it took."""
        ctx = int(cell.get("context_tokens") or 0)
        if cell.get("phase") == "prefill":
            ttft = _num(record.get("ttft_ms"))
            if ttft is not None and ttft > 0:
                self.ttft[ctx] = ttft / 1000
                self.prefill.append((ttft / 1000, took))
            return
        if record.get("status") != "valid":
            return
        warm = _num(record.get("warmup_s")) or 0.0
        if cell.get("phase") == "burst":
            self.burst.append(max(0.0, took - warm))
            return
        self.overhead.append(max(0.0, took - self.window_s - warm))
        new, t = self.new.get(_key(cell), 0), self.t(ctx)
        if new and t and warm > 0:
            self.warm_share.append(warm / (new * t))

    def left(self, cells: Sequence[Mapping[str, Any]], elapsed: float = 0.0) -> float:
        """Seconds the `cells` (the current one first, `elapsed` into it) will take."""
        if not cells:
            return 0.0
        first = max(0.0, self.cost(cells[0]) - elapsed)
        return first + sum(self.cost(c) for c in cells[1:])
