"""How a speculating page's decode cells are read for the calibration (``sim.calibrate``).

A page shows each cell's total tok/s, per-request tok/s, median time between tokens and TTFT,
not its streams: these rules say what those figures imply about the streams (how many the
server runs, whether the median is one of C - 1 alike streams or of evenly spaced ones, the
spread the figures imply), where a cell's first-token delay starts, how the next spread of the
per-cell fit is chosen, and the smooth acceptance line for the cells a page does not have.
They are pure functions of the page's figures and the fit's history, kept apart from the fit's
loop so each can be read (and tested) alone.
"""

from __future__ import annotations

import math
from typing import Any


def smooth_acceptance(
    acc: dict[tuple[int, int], tuple[float, float]], k: int, even: list[tuple[int, int]]
) -> tuple[list[tuple[int, float]], float]:
    """The mean acceptance length as a line in log2(context), weighted by C, and the spread of
    a request around it: from the cells' means (a C-stream cell's mean scatters by
    spread / sqrt(C)) and from the spread within the cells of several streams, pooled."""
    xs = [math.log2(ctx) for ctx, _ in acc]
    ws = [float(c) for _, c in acc]
    ys = [v[0] for v in acc.values()]
    wsum = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / wsum
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / wsum
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True))
    slope = sxy / sxx if sxx > 0 else 0.0

    def line(x: float) -> float:
        return min(max(my + slope * (x - mx), 1.0), k + 1.0)

    var = [w * (y - line(x)) ** 2 for w, x, y in zip(ws, xs, ys, strict=True)]
    # a cell's C streams evenly spaced over sd end to end scatter by sd x sqrt((C+1) / 12(C-1))
    var += [
        sd**2 * ((c + 1) / (12 * (c - 1)) if key in even else 1.0)
        for key, (_, sd) in acc.items()
        if (c := key[1]) > 1
    ]
    spread = math.sqrt(sum(var) / len(var))
    ctxs = sorted({ctx for ctx, _ in acc})
    ends = [ctxs[0], ctxs[-1]] if len(ctxs) > 1 else ctxs
    return [(c, line(math.log2(c))) for c in ends], spread


def secant_step(
    tried: list[tuple[float, float]], x: float, err: float, k: int, first: float | None = None
) -> float:
    """Next signed outlier spread of a cell from the (spread, error) pairs tried so far: a
    secant step through the last two (at most 1 token, or |first| when larger: the median
    moves in jumps), a first step to `first` (else of 1 token), and the best so far when a
    step would not move; within [-k, k]."""
    tried.append((x, err))
    cap = max(1.0, abs(first)) if first is not None else 1.0
    if len(tried) == 1:
        nxt = first if first is not None and first != x else x + (-1.0 if err > 0 else 1.0)
    else:
        (x0, e0), (x1, e1) = tried[-2], tried[-1]
        if e1 == e0 or x1 == x0:
            nxt = min(tried, key=lambda t: abs(t[1]))[0]
        else:
            nxt = x1 + min(max(-e1 * (x1 - x0) / (e1 - e0), -cap), cap)
    return min(max(nxt, -float(k)), float(k))


def bracket_step(
    tried: list[tuple[float, float]], x: float, err: float, k: int, first: float
) -> float:
    """Next even spread of a cell of more than two streams from the (spread, error) pairs
    tried so far: the larger the spread the faster the median (the fast streams restart more),
    in jumps, so a bisection between the largest spread whose median was slow (err > 0) and
    the smallest whose median was fast; newest first, and a pair that contradicts newer ones
    is left out (it was tried while the cell's mean acceptance was elsewhere). With no fast
    pair yet, `first` (the spread the page implies) or 1 token more than the slow one; with
    no slow pair, half the fast one. Within [0, k]."""
    tried.append((x, err))
    slow: float | None = None
    fast: float | None = None
    for sd, e in reversed(tried):
        if e > 0 and (fast is None or sd < fast):
            slow = sd if slow is None else max(slow, sd)
        elif e < 0 and (slow is None or sd > slow):
            fast = sd if fast is None else min(fast, sd)
    if slow is not None and fast is not None:
        nxt = (slow + fast) / 2
    elif slow is not None:
        nxt = max(first, slow + 1.0)
    else:
        nxt = (fast or 0.0) / 2
    return min(max(nxt, 0.0), float(k))


def running_streams(cell: dict[str, Any]) -> int:
    """The streams of a cell the server runs at once: C, or its max_num_seqs when C is more
    (``fit_max_num_seqs``; the rest wait, neither decoding nor in the median)."""
    return min(cell["concurrency"], cell.get("max_num_seqs") or cell["concurrency"])


def median_against_mean(cell: dict[str, Any]) -> float:
    """r = total x TBT / C: the streams' mean rate against the median request's (below 1: the
    median is faster than the mean); C the streams running (``running_streams``)."""
    return cell["total_tok_s"] * cell["tbt_ms"] / 1000.0 / running_streams(cell)


def streams_even(cell: dict[str, Any]) -> bool:
    """Whether a cell's streams are fitted evenly spaced rather than alike but one outlier:
    when its median is faster than the outlier model can give. With one outlier the median is
    a non-outlier stream's, and C - 1 streams at the median's rate must not exceed the total:
    r >= (C - 1) / C. Below that (the seed-47 page's 2K x 8 cell: r = 0.85 < 7 / 8) the median
    is over more requests than streams, the fast streams, restarting more often inside the
    window, holding more of them: streams that scatter evenly do that in the twin too. Only
    a cell where requests finished inside the window (its completed requests, when the page
    has them) restarts streams at all: without restarts each stream is one request, evenly
    spaced streams have their median at the mean (r = 1 however wide the spread: a C=16 cell
    fitted so ran its spread to k and its TBT missed by 7%), and one slow outlier comes
    closest."""
    b = running_streams(cell)
    if cell.get("completed_requests") == 0:
        return False
    return b > 2 and median_against_mean(cell) < (b - 1) / b


def spread_from_page(cell: dict[str, Any], mean: float) -> float:
    """The spread a C-stream cell implies when every stream is busy and a stream's rate is in
    proportion to its acceptance, from r (``median_against_mean``).

    One outlier, the median a non-outlier stream's TBT: those streams run at 1 / TBT each, the
    outlier at the rest of the total, so the signed spread = mean x C x (1 - 1 / r). At C=2 a
    fast stream that restarts inside the window while a slow one does not has 2 of the 3
    requests, so the median is its TBT, below C / total (0.81 x on a 507K page's 1K x 2 cell,
    streams of 4.6 and 2.8 accepted): the fit's first step goes to this spread instead of 1
    token, which never left that median.

    Evenly spaced streams (``streams_even``): the fast half restarts more often inside the
    window and holds more of the requests, so the median is about the stream three quarters up
    the range, mean + spread / 4 = mean / r: spread = 4 x mean x (1 / r - 1). On the seed-47
    page's 2K x 8 cell (r = 0.85) that is about 4 tokens, where a hand check of even streams
    met its median."""
    r = median_against_mean(cell)
    if r <= 0:
        return 0.0
    if streams_even(cell):
        return max(4.0 * mean * (1.0 / r - 1.0), 0.0)
    return mean * running_streams(cell) * (1.0 - 1.0 / r)


def start_delays(decode: list[dict[str, Any]], anchor: float) -> dict[tuple[int, int], float]:
    """Each speculating cell's starting first-token delay: about two steps (anchor x TBT each)
    short of its published TTFT, so that the cell's first-token output latency takes the rest.
    A cell of more than two streams starts no higher than its context's next smaller cell: its
    requests arrive one after another, most while fewer are held, and see the delay between the
    two nodes (a node above the smaller cell's leaks into its ramp)."""
    delay_ms = {
        (c["context_tokens"], c["concurrency"]): max(c["ttft_ms"] - 2.0 * anchor * c["tbt_ms"], 0.0)
        for c in decode
    }
    for ctx, b in sorted(delay_ms):
        below = [n for c2, n in delay_ms if c2 == ctx and n < b]
        if b > 2 and below:
            delay_ms[(ctx, b)] = min(delay_ms[(ctx, b)], delay_ms[(ctx, max(below))])
    return delay_ms
