"""Fit a simulator profile to a published Speed test matrix report.

The report is parsed with the ingest code (``speedmatrix.published.parse``). Then:

- KV capacity: the statuses pin it down. A valid decode cell needs C x ceil((ctx+max_out)/block)
  <= blocks - 1, an over-capacity cell needs more; vLLM also refuses to start unless one
  max-model-len sequence fits. The profile takes the middle of the feasible interval (an error
  when the statuses contradict each other). The block size is not in the report: 16 (vLLM's
  default) unless told otherwise.
- Decode: a physical model, step = base + per_seq x (B - 1) + per_kv_token x (KV tokens held),
  fitted by least squares on relative error, then a correction factor per published cell
  (interpolated between cells in log2 space) so that every cell matches.
- First-token latency: the published TTFT of a decode cell (prompt cached) minus what the
  engine needs for the first step becomes the front end's delay at (context, requests held).
  Speculating, a step is several TBTs long and a first token waits for the step under way, so
  that delay moves a TTFT in whole steps only: it starts two steps short of the published TTFT
  and the first token's output latency (``frontend.first_token_output_ms``, continuous) takes
  the rest; the delay gives way only where the latency would go below zero. A cell of more
  than two streams starts its delay no higher than its context's next smaller cell's: its
  requests arrive one after another and see the delay between the two nodes; where its own
  levers reach zero and its TTFT is still high, the smaller cell's delay gives way by the rest
  (that cell's output latency takes it back).
- Running streams: a page whose average active requests sit at a ceiling below a cell's C
  shows the server's max_num_seqs (``fit_max_num_seqs``); the profile takes it.
- Prefill: the cumulative prefill time P(n) at each prefill context is the published TTFT minus
  the front end's delay at that context.

The corrections are refined by predicting every cell through ``predict`` (the engine model in
simulated time) until the predictions agree with the report; ``compare`` reports the residual
per cell and metric. numpy is imported here only, never on the serve path.

Speculative decoding (the launch command's ``num_speculative_tokens`` = k, or ``spec_tokens``):
a page's time between tokens is a step's time divided by the tokens a step emits (the mean
acceptance length), and a page does not say which is which. So the split is anchored by one
assumption, ``acceptance_length`` (default 1 + k / 2; the measured value of that server when
known). The page does bound it: the front end's levers only add to a first token, so the
engine's own part of a cell's TTFT (the step under way, then the first token's step) must fit
within the published TTFT; where the default's steps are too long for that (low acceptance:
ngram drafts or a weak draft model accept 1.2-2 of 7, and a step of 1 + k / 2 TBTs put C=2-8
TTFTs 36-144% over), the default is lowered to 0.9 x what fits (``FIRST_TOKEN_ROOM``). The
step-time model is fitted as if every cell accepted the anchor, and what each cell
needs beyond it is that cell's acceptance length (``spec_decode.acceptance_length.cells``), not
a step-time correction (which is used only where the acceptance would leave [1, k + 1]). The
cell's rate is read off its total tok/s (written to 4-5 digits) rather than its time between
tokens (0.1 ms, a few percent at 2 ms); the cell's spread is fitted only to a TBT outside what
its display rounding hides (``TBT_DEADBAND``): one outlier stream among alike ones, or, where
the median is faster than C - 1 alike streams allow within the total, C streams evenly spaced
(``streams_even``: the fast ones restart more often and hold more of the median's requests). On
real hardware one prompt decides a C=1 cell's acceptance, so the per-cell part is what
reproduces the page; the smooth part for cells the page does not have is the mean acceptance
length as a line in log2(context) (fitted to the cells weighted by C, since a cell of C streams
averages C draws) and the spread of a request's acceptance around it (sqrt of the C-weighted
mean squared residual: a C-stream cell's residual has variance spread^2 / C). ``fit_summary``
prints both fits.

Per-request tok/s is formed as the page's tool formed it (``page_accounting``): the
published tool's current code writes total / C ("derive per-request from aggregate"), its
older versions (the reference page) a per-stream median. The two part when streams are not
busy the whole window (a request restarting inside it waits for its first token: total tok/s
drops, the streams' time between tokens does not) and when speculating streams accept
differently: a twin reporting per stream put a C=2 cell of such a page 11-19% faster than its
total / 2. The accounting is read off the page (every C > 1 cell's per-request = total / C to
display rounding), so no cell is fudged.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from speedmatrix.errors import InputError
from speedmatrix.published.formats import ms_half_unit
from speedmatrix.records import parse_context
from speedmatrix.sim.predict import AGGREGATE, PER_STREAM, predict_decode, predict_prefill
from speedmatrix.sim.profile import Profile, SpecDecode
from speedmatrix.sim.spec_cells import (
    bracket_step,
    running_streams,
    secant_step,
    smooth_acceptance,
    spread_from_page,
    start_delays,
    streams_even,
)

SPEC_SHAPE = 0.8
"""Per-position conditional acceptance of a calibrated profile's shape (the page does not show
it; a step's draw scales it to the request's acceptance length, so only the per-step spread of
chunk sizes depends on it)."""

SPEC_TOLERANCE = 0.01
"""Worst error at which a speculative-decoding fit stops: a cell's median moves by about this
much as its streams' requests end in or out of the window, so iterating below it only wanders
(and each iteration predicts every cell)."""

METRICS = ("total_tok_s", "per_request_tok_s", "ttft_ms", "tbt_ms")

TBT_DEADBAND = 0.8
"""Share of a time between tokens' display rounding within which a speculating cell's streams
are left alike (no outlier stream is fitted to what the rounding may hide)."""


def _tbt_half(cell: dict[str, Any]) -> float:
    """Half a unit of a cell's time between tokens as a page writes it (0.1 ms), relative."""
    return ms_half_unit(cell["tbt_ms"], 1) / cell["tbt_ms"]


class CalibrationError(InputError):
    """The report cannot be fitted (contradicting statuses, no valid cells...)."""


@dataclass
class Mismatch:
    phase: str
    context_tokens: int
    concurrency: int
    metric: str
    published: Any
    predicted: Any
    rel_error: float | None

    def __str__(self) -> str:
        err = "n/a" if self.rel_error is None else f"{self.rel_error:+.2%}"
        return (
            f"{self.phase} ctx={self.context_tokens} C={self.concurrency} {self.metric}: "
            f"published {self.published} predicted {self.predicted} ({err})"
        )


def _blocks_needed(cell: dict[str, Any], max_out: int, block_size: int) -> int:
    return cell["concurrency"] * -(-(cell["context_tokens"] + max_out) // block_size)


def fit_kv_blocks(
    cells: list[dict[str, Any]], max_out: int, block_size: int, max_model_len: int | None
) -> int:
    """num_gpu_blocks in the middle of the interval the statuses allow."""
    decode = [c for c in cells if c["phase"] == "decode"]
    valid = [_blocks_needed(c, max_out, block_size) for c in decode if c["status"] == "valid"]
    over = [
        _blocks_needed(c, max_out, block_size) for c in decode if c["status"] == "over_capacity"
    ]
    lo = (max(valid) + 1) if valid else 2
    if max_model_len:
        lo = max(lo, -(-max_model_len // block_size) + 1)
    hi = min(over) if over else 2 * lo
    if lo > hi:
        raise CalibrationError(
            f"KV capacity: valid cells need >= {lo} blocks of {block_size} tokens but "
            f"over-capacity cells say < {hi + 1}: the statuses contradict each other"
        )
    return (lo + hi) // 2


def _fit_decode(
    cells: list[dict[str, Any]], tokens_per_step: float = 1.0
) -> tuple[float, float, float]:
    """base, per_seq, per_kv of the step time; a step is `tokens_per_step` x the page's TBT."""
    import numpy as np

    rows, target = [], []
    for c in cells:
        tbt = c["tbt_ms"] / 1000.0 * tokens_per_step
        b = running_streams(c)
        kv = b * (c["context_tokens"] + (c["output_tokens"] or 0) / (2 * b))
        rows.append([1.0 / tbt, (b - 1) / tbt, kv / tbt])
        target.append(1.0)
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(target), rcond=None)
    base, per_seq, per_kv = (float(x) for x in coef)
    if per_seq < 0 or per_kv < 0:  # keep the model physical; the corrections do the rest
        per_seq, per_kv = max(per_seq, 0.0), max(per_kv, 0.0)
    return max(base, 1e-4), per_seq, per_kv


CAP_SHARE = 0.9
"""At most this share of a cell's C may be running for its active requests to show a cap."""


def fit_max_num_seqs(run: dict[str, Any], decode: list[dict[str, Any]]) -> int | None:
    """The server's max_num_seqs when the page shows it: the launch command's
    ``--max-num-seqs``, else the ceiling its busy cells' average active requests sit at. A cell
    of more streams than the server runs at once holds the rest waiting (each waits for a
    running request to finish: TTFTs of tens of seconds), its average active requests at that
    ceiling rather than at C; None when no cell shows one (the twin runs every stream)."""
    m = re.search(r"--max-num-seqs[ =](\d+)", run.get("launch_command") or "")
    if m:
        return int(m.group(1))
    active = [c["avg_active_requests"] for c in decode if c.get("avg_active_requests")]
    if not active:
        return None
    ceiling = max(active)
    # a cell at the ceiling must sit clearly under its C: an average of running requests falls
    # a little short of C anyway (a stream between its requests), and a page whose active
    # requests follow C (127.2 at C=128) shows no cap
    capped = [
        c
        for c in decode
        if c["concurrency"] > ceiling + 0.5
        and ceiling <= CAP_SHARE * c["concurrency"]
        and (c.get("avg_active_requests") or 0) > ceiling - 0.5
    ]
    return round(ceiling) if capped else None


def _max_model_len(run: dict[str, Any]) -> int | None:
    if run.get("max_model_len"):
        return int(run["max_model_len"])
    m = re.search(r"--max-model-len[ =](\d+)", run.get("launch_command") or "")
    return int(m.group(1)) if m else None


def spec_tokens_of(run: dict[str, Any]) -> int | None:
    """k from the launch command's speculative config (``num_speculative_tokens``), if any."""
    m = re.search(r"num_speculative_tokens\W{0,4}(\d+)", run.get("launch_command") or "")
    return int(m.group(1)) if m else None


ANCHOR_ROUNDS = 4
"""Rounds of lowering the assumed acceptance length until the page's first tokens fit."""

FIRST_TOKEN_ROOM = 0.9
"""Share of the room a lowered anchor leaves to a cell's first token: a TTFT median moves in
steps, so the engine's own part is kept a little under the page's, the front end's levers take
the rest."""


SETTLE_ROUNDS = 8
"""Rounds of the first-token settling after a speculative fit (each predicts every cell)."""


def _cell_error(pub: dict[str, Any], pred: dict[str, Any]) -> float:
    """Worst relative error of a decode cell's figures (those the page has)."""
    errs = [
        abs(pred[m] / pub[m] - 1)
        for m in METRICS
        if pub.get(m) is not None and pred.get(m) is not None and pub[m] != 0
    ]
    return max(errs, default=0.0)


def _settle_first_tokens(
    best: tuple[float, Profile, tuple[dict[Any, Any], ...]],
    build: Any,
    decode_by_key: dict[tuple[int, int], dict[str, Any]],
    delay_ms: dict[tuple[int, int], float],
    output_ms: dict[tuple[int, int], float],
    predict: Any,
) -> Profile:
    """The best iteration's profile with each cell's first-token latency searched alone.

    While acceptance and spreads move, a cell's TTFT median jumps by a step (a first token
    waits for the step under way, and which requests share a step shifts with them), so the
    full-step update swings around the page's value. With the rest held, one lever per cell
    (the output latency, then the delay below zero) is searched: a step of the error, and once
    two tries bracket the page's value, their midpoint; each cell keeps its best try. The
    result replaces the best iteration's only if every cell's worst figure is no worse."""
    delay0 = dict(delay_ms)

    def set_lever(key: tuple[int, int], x: float) -> None:
        output_ms[key] = max(x, 0.0)
        delay_ms[key] = max(delay0[key] + min(x, 0.0), 0.0)

    lever = dict(output_ms)
    tries: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    for _ in range(SETTLE_ROUNDS):
        profile = build()
        settled = True
        for key, pub in decode_by_key.items():
            pred = predict(profile, *key)
            err = pred["ttft_ms"] - pub["ttft_ms"]
            settled = settled and abs(err) <= ms_half_unit(pub["ttft_ms"])
            tries.setdefault(key, []).append((lever[key], err, _cell_error(pub, pred)))
            below = [x for x, e, _ in tries[key] if e < 0]
            above = [x for x, e, _ in tries[key] if e > 0]
            if below and above and max(below) < min(above):
                lever[key] = (max(below) + min(above)) / 2
            else:
                lever[key] -= err
            set_lever(key, lever[key])
        if settled:
            break
    before = {key: _cell_error(pub, predict(best[1], *key)) for key, pub in decode_by_key.items()}
    for key, tried in tries.items():
        x, _, _ = min(tried, key=lambda t: t[2])
        set_lever(key, x)
    settled = build()
    after = {key: _cell_error(pub, predict(settled, *key)) for key, pub in decode_by_key.items()}
    return settled if max(after.values()) <= max(before.values()) else best[1]


def calibrate(
    text: str,
    *,
    source: str | None = None,
    block_size: int = 16,
    name: str | None = None,
    iterations: int = 12,
    tolerance: float = 0.005,
    spec_tokens: int | None = None,
    acceptance_length: float | None = None,
) -> Profile:
    """A profile that reproduces the report's matrix (see the module docstring)."""
    # the report's parser, below which sim/ sits: a known layer exception (pyproject's
    # import-linter ignore), kept out of the module's imports until the parser moves down
    from speedmatrix.published.parse import parse_report

    parsed = parse_report(text, source)
    run, cells = parsed.run, parsed.cells
    accounting = page_accounting(cells)
    max_out = int(run.get("max_output_tokens") or 4096)
    window = float(run.get("window_s") or 30.0)
    prefill = [c for c in cells if c["phase"] == "prefill" and c["status"] == "valid"]
    decode = [c for c in cells if c["phase"] == "decode" and c["status"] == "valid"]
    if not prefill or not decode:
        raise CalibrationError("the report needs valid prefill and decode cells to calibrate")
    mml = _max_model_len(run)
    blocks = fit_kv_blocks(cells, max_out, block_size, mml)
    # The server's own max-model-len, as vLLM was launched (the plan sends the largest prefill
    # as max_model_len - 1, since vLLM refuses a prompt of max_model_len tokens); without a
    # launch command, the largest published context is the least the server admitted.
    sim_mml = mml or max(c["context_tokens"] for c in cells)
    k = spec_tokens or spec_tokens_of(run)
    anchor = 1.0
    if k:
        anchor = acceptance_length if acceptance_length is not None else 1.0 + k / 2.0
        if not 1.0 <= anchor <= k + 1:
            raise CalibrationError(f"acceptance length {anchor} is not in [1, {k + 1}] (k = {k})")
    elif acceptance_length is not None:
        raise CalibrationError("an acceptance length needs speculative decoding (k unknown)")
    max_seqs = fit_max_num_seqs(run, decode)
    if max_seqs:
        decode = [c | {"max_num_seqs": max_seqs} for c in decode]
    else:
        max_seqs = max(256, max(c["concurrency"] for c in cells))
    base, per_seq, per_kv = _fit_decode(decode, anchor)

    correction = {(c["context_tokens"], c["concurrency"]): 1.0 for c in decode}
    acc = {key: (anchor, 0.0) for key in correction} if k else {}
    # A step of a few prefill tokens costs about a one-sequence decode step (see build), but
    # never more than half the quickest published first token (a speculating server's decode
    # step, k drafts verified, can cost more than the first token's whole latency).
    min_step = min(base, 0.5 * min(c["ttft_ms"] for c in decode) / 1000.0)
    smooth: list[tuple[int, float]] = []
    spread = 0.0
    tried: dict[tuple[int, int], list[tuple[float, float]]] = {}
    delay_ms = {
        (c["context_tokens"], c["concurrency"]): max(c["ttft_ms"] - c["tbt_ms"], 0.0)
        for c in decode
    }
    pf = {c["context_tokens"]: c["ttft_ms"] / 1000.0 for c in prefill}
    # Speculating, a step is several TBTs long and the delay before the engine moves a TTFT in
    # whole steps only (a first token waits for the step under way): start the delay about two
    # steps short of the published TTFT and let each cell's first-token output latency (a
    # continuous part of the cell's own) take the rest; the delay gives way only where that
    # would go below zero.
    output_ms = {key: 0.0 for key in delay_ms}
    if k:
        delay_ms = start_delays(decode, anchor)
    decode_by_key = {(c["context_tokens"], c["concurrency"]): c for c in decode}
    # each cell's label, in tokens: a cell keyed on the prompt its page implies (64,000 for
    # 64K) answers up to the label's own tokens (profile.cell_span)
    labels = {c["context_tokens"]: parse_context(str(c["context_label"])) for c in decode}
    even = sorted(key for key, c in decode_by_key.items() if k and streams_even(c))
    # cells of more streams than the server runs: their first tokens wait for running requests
    # to finish (tens of seconds), which the engine forms; a first-token lever taking that wait
    # held slots idle (16 s of output latency on a C=128 cell: its TBT 21% fast)
    queued = {key for key, c in decode_by_key.items() if c["concurrency"] > running_streams(c)}
    desc = ""

    def build() -> Profile:
        points = sorted(pf.items())
        mono, last = [], 0.0
        for n, t in points:
            last = max(t, last + 1e-6)
            mono.append((n, last))
        return Profile(
            name=name or (run.get("served_model") or "calibrated"),
            description=desc,
            calibrated=True,
            source=source,
            served_model_name=run.get("served_model") or "sim-model",
            model=run.get("model") or run.get("served_model") or "sim/model",
            version=run.get("engine_version") or "0.0.0+sim",
            max_model_len=sim_mml,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=8192,
            vocab_size=163840,
            block_size=block_size,
            num_gpu_blocks=blocks,
            prefill_points=mono,
            decode_base_s=base,
            decode_per_seq_s=per_seq,
            decode_per_kv_token_s=per_kv,
            decode_correction=[(c, n, f) for (c, n), f in sorted(correction.items())],
            # Any forward pass reads all the weights: a step of a few prefill tokens costs about
            # what a one-sequence decode step does (this also keeps TTFT insensitive to how a
            # client spaces its first requests by a few milliseconds).
            min_step_s=min_step,
            first_token_delay_ms=[(c, n, ms) for (c, n), ms in sorted(delay_ms.items())],
            first_token_output_ms=[(c, n, ms) for (c, n), ms in sorted(output_ms.items())]
            if k
            else [],
            spec_decode=SpecDecode(
                k,
                [SPEC_SHAPE] * k,
                mean_length=smooth,
                spread=spread,
                cells=[(c, n, v, sd) for (c, n), (v, sd) in sorted(acc.items())],
                even_cells=list(even),
                labels=labels,
            )
            if k
            else None,
        )

    lowered = False
    if k and acceptance_length is None:
        # The front end's levers (delay, first-token output latency) only add to a first token:
        # the engine's own part of a cell's TTFT (the step under way, then the first token's
        # step) must fit within the published one. A step is the anchor x the page's TBT, so
        # where the default anchor makes a step longer than the page's first tokens allow (low
        # acceptance: ngram drafts or a weak draft model), it is lowered until they fit.
        for _ in range(ANCHOR_ROUNDS):
            levers = delay_ms, output_ms
            delay_ms, output_ms = dict.fromkeys(delay_ms, 0.0), dict.fromkeys(delay_ms, 0.0)
            bare = build()
            delay_ms, output_ms = levers
            fits = min(
                c["ttft_ms"]
                / predict_decode(
                    bare, *key, window_s=window, max_output=max_out, accounting=accounting
                )["ttft_ms"]
                for key, c in decode_by_key.items()
                if key not in queued  # a queued first token waits for a running request
            )
            if fits >= 1.0 or anchor <= 1.0:
                break
            anchor, lowered = max(anchor * fits * FIRST_TOKEN_ROOM, 1.0), True
            base, per_seq, per_kv = _fit_decode(decode, anchor)
            min_step = min(base, 0.5 * min(c["ttft_ms"] for c in decode) / 1000.0)
            acc = {key: (anchor, 0.0) for key in correction}
            delay_ms = start_delays(decode, anchor)

    desc = (
        f"Calibrated by `speedmatrix sim calibrate` from {source or 'a published report'}. "
        f"KV blocks fitted from the Over-capacity boundary (block size {block_size} assumed); "
        f"max_model_len {sim_mml} = "
        f"{'the launch command' if mml else 'the largest published context'}'s."
    )
    if k:
        desc += (
            f" Speculative decoding, k = {k}: the step-time model assumes a mean acceptance "
            f"length of {anchor:g}"
            f"{' (1 + k/2 lowered: its steps did not fit the TTFTs)' if lowered else ''} "
            f"(the page cannot tell step time from acceptance); each "
            f"published cell's acceptance length is in spec_decode.acceptance_length.cells."
        )

    profile = build()
    log: list[float] = []
    best: tuple[float, Profile, tuple[dict[Any, Any], ...]] | None = None
    state = (correction, acc, delay_ms, output_ms, pf)
    converged = False
    for _ in range(iterations * (3 if k else 1)):
        worst = raw = 0.0
        measured = profile
        measured_state = tuple(dict(d) for d in state)
        for (ctx, b), c in decode_by_key.items():
            pred = predict_decode(
                profile, ctx, b, window_s=window, max_output=max_out, accounting=accounting
            )
            ratio = c["tbt_ms"] / pred["tbt_ms"]
            if k:
                # The cell's rate is read off its total tok/s, which a page writes to 4-5
                # digits, not off its time between tokens, which it writes to 0.1 ms (a 2 ms
                # TBT is known to 2.5%): the acceptance takes the total's residual, the step
                # time only beyond [1, k + 1].
                ratio = pred["total_tok_s"] / c["total_tok_s"]
                mean, sd = acc[(ctx, b)]
                got = min(max(mean / ratio, 1.0), k + 1.0)
                correction[(ctx, b)] *= ratio * got / mean
                tbt_err = pred["tbt_ms"] / c["tbt_ms"] - 1
                if b > 1 and abs(tbt_err) > TBT_DEADBAND * _tbt_half(c):
                    # streams that differ move the median TBT against the total; only a TBT
                    # outside what its display rounding hides moves them (chasing the rounding
                    # set two streams 25% apart, and their restarts then jumped the median)
                    # one outlier: signed (a fast or a slow one); even streams: its size only
                    fit = bracket_step if (ctx, b) in even else secant_step
                    sd = fit(
                        tried.setdefault((ctx, b), []), sd, tbt_err, k, spread_from_page(c, got)
                    )
                acc[(ctx, b)] = (got, sd)
                worst = max(worst, abs(ratio - 1), max(abs(tbt_err) - _tbt_half(c), 0.0))
                raw = max(raw, abs(tbt_err))
            else:
                correction[(ctx, b)] *= ratio
            diff = c["ttft_ms"] - pred["ttft_ms"]
            if (ctx, b) in queued:
                pass  # its first tokens wait in the server's queue: the engine forms that TTFT
            elif k:  # the cell's own first-token latency takes it; the delay what it cannot
                held = output_ms[(ctx, b)] + diff
                output_ms[(ctx, b)] = max(held, 0.0)
                if held < 0:
                    rest = delay_ms[(ctx, b)] + held
                    delay_ms[(ctx, b)] = max(rest, 0.0)
                    below = [n for c2, n in delay_ms if c2 == ctx and n < b]
                    if rest < 0 and b > 2 and below and (ctx, max(below)) not in queued:
                        # its own levers at zero, its requests still see the smaller cell's
                        # delay (they arrive while fewer are held): that node gives way, and
                        # the smaller cell's output latency takes it back
                        low = (ctx, max(below))
                        delay_ms[low] = max(delay_ms[low] + rest, 0.0)
            else:
                delay_ms[(ctx, b)] = max(delay_ms[(ctx, b)] + diff, 0.0)
            if not k:
                worst = max(worst, abs(pred["tbt_ms"] / c["tbt_ms"] - 1))
            worst = max(worst, abs(pred["ttft_ms"] / c["ttft_ms"] - 1))
        profile = build()
        for c in prefill:
            pred = predict_prefill(profile, c["context_tokens"])
            pf[c["context_tokens"]] += (c["ttft_ms"] - pred["ttft_ms"]) / 1000.0
            worst = max(worst, abs(pred["ttft_ms"] / c["ttft_ms"] - 1))
        profile = build()
        raw = max(raw, worst)
        log.append(worst)
        if best is None or raw < best[0]:
            best = (raw, measured, measured_state)
        if worst < (max(tolerance, SPEC_TOLERANCE) if k else tolerance):
            converged = True
            break
    if k and best is not None:
        # With speculation a cell's median jumps as its streams' requests end in or out of the
        # window, so the iteration may wander: keep the profile whose predictions were best,
        # and when it did not settle, settle its first tokens alone (_settle_first_tokens).
        profile = best[1]
        if not converged:
            for d, saved in zip(state, best[2], strict=True):
                d.clear()
                d.update(saved)
            profile = _settle_first_tokens(
                best,
                build,
                {key: c for key, c in decode_by_key.items() if key not in queued},
                delay_ms,
                output_ms,
                lambda p, ctx, b: predict_decode(
                    p, ctx, b, window_s=window, max_output=max_out, accounting=accounting
                ),
            )
        profile.spec_decode.mean_length[:], profile.spec_decode.spread = smooth_acceptance(
            {(c, n): (v, sd) for c, n, v, sd in profile.spec_decode.cells}, k, even
        )
        profile = Profile.from_dict(profile.to_dict(), origin=profile.name)
    profile.raw = {"calibration_worst_error_by_iteration": log}
    return profile


def smooth_part(profile: Profile) -> Profile:
    """The profile without its per-cell parts (decode corrections, cells' acceptance): the
    model a cell the page does not have gets, held against the cells the page does have."""
    data = profile.to_dict()
    data["decode"]["correction"] = []
    spec = data.get("spec_decode")
    if spec and spec.get("acceptance_length"):
        spec["acceptance_length"]["cells"] = []
    return Profile.from_dict(data, origin=profile.name)


def fit_summary(profile: Profile, text: str, *, source: str | None = None) -> list[str]:
    """Lines: per figure (metric), max and median |error| of the smooth model alone and of
    the full profile (smooth + per-cell part), and whether the statuses are identical."""
    import statistics

    out = []
    for title, prof in (
        ("smooth model alone", smooth_part(profile)),
        ("with per-cell part", profile),
    ):
        rows, _ = compare(prof, text, source=source)
        statuses = all(r["ok"] for r in rows if r["metric"] == "status")
        parts = []
        for metric in METRICS:
            errs = [
                abs(r["rel_error"])
                for r in rows
                if r["metric"] == metric and r["rel_error"] is not None
            ]
            if errs:
                parts.append(f"{metric} max {max(errs):.2%} median {statistics.median(errs):.2%}")
        out.append(f"{title}: " + "; ".join(parts) + f"; statuses identical: {statuses}")
    return out


def page_accounting(cells: list[dict[str, Any]]) -> str:
    """How the page formed per-request tok/s (predict.ACCOUNTINGS), read from the page itself
    (published.implied): the twin reports a cell as the page's tool did."""
    # the published layer, below sim/ (as parse_report above)
    from speedmatrix.published.implied import per_request_is_aggregate

    return AGGREGATE if per_request_is_aggregate(cells) else PER_STREAM


def _rel(pub: Any, pred: Any) -> float | None:
    if pub is None or pred is None or pub == 0:
        return None
    return pred / pub - 1.0


def compare(
    profile: Profile, text: str, *, source: str | None = None
) -> tuple[list[dict[str, Any]], list[Mismatch]]:
    """Predict every cell of the report; return the rows (published, predicted, error)."""
    # the report's parser, below which sim/ sits: a known layer exception (pyproject's
    # import-linter ignore), kept out of the module's imports until the parser moves down
    from speedmatrix.published.parse import parse_report

    parsed = parse_report(text, source)
    max_out = int(parsed.run.get("max_output_tokens") or 4096)
    window = float(parsed.run.get("window_s") or 30.0)
    accounting = page_accounting(parsed.cells)
    rows: list[dict[str, Any]] = []
    for cell in parsed.cells:
        ctx, b = cell["context_tokens"], cell["concurrency"]
        if cell["phase"] == "prefill":
            pred = predict_prefill(profile, ctx)
        else:
            pred = predict_decode(
                profile, ctx, b, window_s=window, max_output=max_out, accounting=accounting
            )
        for metric in ("status", *METRICS):
            pub, got = cell.get(metric), pred.get(metric)
            err = None if metric == "status" else _rel(pub, got)
            rows.append(
                Mismatch(cell["phase"], ctx, b, metric, pub, got, err).__dict__
                | {"ok": (pub == got) if metric == "status" else _close(pub, got)}
            )
    bad = [Mismatch(**{k: v for k, v in r.items() if k != "ok"}) for r in rows if not r["ok"]]
    return rows, bad


def _close(pub: Any, pred: Any, tol: float = 0.05) -> bool:
    if pub is None:
        return True  # not published for this cell (e.g. per-request tok/s of a prefill)
    if pred is None:
        return False
    return math.isclose(pred, pub, rel_tol=tol)
