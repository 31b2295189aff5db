"""Simulator profiles: the performance parameters of one engine configuration.

A profile is a YAML or JSON file (format from the extension) under include/sim-profiles/. It is
plain data so that a calibrated profile can be read, diffed and reviewed; this module turns it
into fast callables (interpolation) for the engine. Times in a profile are simulated seconds
unless a key says ``_ms``.

Keys (all optional except where noted; defaults in ``Profile``):

- ``name``, ``description``, ``calibrated`` (bool: true only when fitted to a published report),
  ``source`` (the report it was fitted to).
- ``served_model_name``, ``model``, ``version``: what /v1/models and /version answer.
- ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens`` (chunked-prefill token budget
  per step), ``vocab_size``.
- ``kv``: ``block_size``, ``num_gpu_blocks`` (vLLM reserves one block, so ``num_gpu_blocks - 1``
  are usable, hence the "blocks - 1" in the capacity rule).
- ``prefill.points``: ``[[tokens, seconds], ...]``: cumulative time to prefill a cold prompt of
  that many tokens; piecewise linear through (0, 0), extended with the last slope. A chunk from
  token a to b costs P(b) - P(a), so chunking and prefix-cache hits are consistent.
- ``decode``: step time of a decode batch of B sequences holding T KV tokens in total:
  ``(base_s + per_seq_s * (B - 1) + per_kv_token_s * T) * correction(mean context, B)``;
  ``correction`` is a list of ``{context, batch, factor}`` (calibration residuals, context = the
  batch's mean prompt length), interpolated in log2 space and clamped outside; ``min_step_s`` is the floor of any step.
- ``frontend.first_token_delay_ms``: list of ``{context, requests, ms}``: the API server's
  latency before the engine sees a request, growing with the prompt and with the number of
  requests the server holds. A request waits ``delay(ctx, 1)``, then counts the requests held
  (n) and waits ``max(0, delay(ctx, n) - delay(ctx, 1))`` more. Interpolated in log2 space.
- ``frontend.first_token_output_ms``: list of ``{context, requests, ms}``: the latency between
  the engine computing a request's first token and the API server sending it (the request does
  not decode meanwhile), at (prompt length, requests held when the token is computed);
  interpolated like ``first_token_delay_ms``, so exact at each calibrated cell. Why: a first
  token waits for the step under way, so the delay before the engine moves a TTFT only in whole
  steps; a page whose steps are long next to its TTFT (speculative decoding: a step emits
  several tokens) is met by this continuous part. ``sim calibrate`` fits it for such pages.
- ``spec_decode``: null, or ``num_speculative_tokens`` (k), ``acceptance`` (per-position
  conditional acceptance probabilities, length k: the *shape* of one step's draw),
  ``cost_factor`` (step time multiplier), ``seed``, and ``acceptance_length`` (optional): the
  acceptance of each request, because on real hardware one prompt's content decides how often
  its drafts are accepted (so a C=1 cell scatters and many streams average out):
  ``mean`` (list of ``{context, length}``: the mean acceptance length, 1 + accepted per draft,
  of a request by its prompt length; interpolated in log2 space, clamped outside; absent =
  the shape's own mean), ``spread`` (standard deviation of a request's acceptance length around
  that mean; a Beta draw on [1, k + 1] seeded from the prompt's tokens, so the same prompt
  always gets the same acceptance), and ``cells`` (list of ``{context, concurrency, length,
  spread, label}``: a calibrated cell, which replaces the draw for every request whose prompt
  the cell reaches (within 1% of its context, the prompt its page implies, up to every count
  its ``label`` names: ``cell_span``) while the engine holds exactly that many requests; a
  prompt between two cells of that many requests takes the two interpolated: its streams,
  ranked by their prompts, take ``length`` but one, which is ``spread`` (signed) apart from the
  others (the cell's mean kept), so a cell's streams differ as on the page they were fitted to,
  whose total tok/s and median time between tokens disagree when they do; with ``streams:
  even`` all its streams are evenly spaced over ``spread`` end to end around ``length``
  instead, which a cell of many streams whose median is far faster than its mean needs: the
  fast streams restart more often and hold more of the requests). A step's draw
  scales the shape (p_i ** theta) so that its mean is the request's acceptance length.
- ``natural_stop_tokens``: null, or after how many output tokens a request without
  ``ignore_eos`` emits EOS (finish_reason "stop"), at the earliest token ``min_tokens + 1``
  (vLLM masks EOS until min_tokens are out); null means it always runs to max_tokens.
"""

from __future__ import annotations

import json
import math
import os
import random
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedmatrix.errors import InputError
from speedmatrix.records import context_label, label_span, parse_context

PROFILE_DIR = Path(__file__).resolve().parents[3] / "include" / "sim-profiles"


class ProfileError(InputError):
    """A profile file that cannot be used; the message names the file and key."""


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation, clamped to the end values outside [xs[0], xs[-1]]."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_right(xs, x) - 1
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


class LogGrid:
    """A value over (context tokens, count) known at scattered points.

    Interpolates in log2 of both axes: within each context row along the count (clamped at the
    row's ends), then across rows along the context. ``extrapolate_context`` extends beyond the
    outer rows with the log-log slope of the last two rows (a power law), used for latencies that
    grow with the prompt; otherwise the outer rows are clamped (correction factors).
    """

    def __init__(
        self, points: list[tuple[float, float, float]], *, extrapolate_context: bool = False
    ):
        rows: dict[float, list[tuple[float, float]]] = {}
        for ctx, n, value in points:
            rows.setdefault(math.log2(max(ctx, 1)), []).append((math.log2(max(n, 1)), value))
        self._rows = []
        for lx in sorted(rows):
            pts = sorted(rows[lx])
            self._rows.append((lx, [p[0] for p in pts], [p[1] for p in pts]))
        self._extrapolate = extrapolate_context
        self._cache: dict[tuple[int, int], float] = {}

    def __bool__(self) -> bool:
        return bool(self._rows)

    def __call__(self, ctx: float, n: float) -> float:
        key = (int(ctx), int(n))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        value = self._eval(ctx, n)
        if len(self._cache) < 100_000:
            self._cache[key] = value
        return value

    def _eval(self, ctx: float, n: float) -> float:
        if not self._rows:
            return 0.0
        lx, ln = math.log2(max(ctx, 1)), math.log2(max(n, 1))
        values = [(rx, _interp(ns, vs, ln)) for rx, ns, vs in self._rows]
        if len(values) == 1:
            return values[0][1]
        xs = [v[0] for v in values]
        ys = [v[1] for v in values]
        if self._extrapolate and (lx < xs[0] or lx > xs[-1]):
            (xa, ya), (xb, yb) = values[:2] if lx < xs[0] else values[-2:]
            if ya > 0 and yb > 0:
                slope = (math.log2(yb) - math.log2(ya)) / (xb - xa)
                x_ref, y_ref = (xa, ya) if lx < xs[0] else (xb, yb)
                return 2 ** (math.log2(y_ref) + slope * (lx - x_ref))
        return _interp(xs, ys, lx)


CELL_CONTEXT_TOLERANCE = 0.01
"""A prompt belongs to a calibrated cell when within 1% of its context (the prompt its page
implies), or anywhere its label reaches (``cell_span``)."""


def cell_span(context: int, label_tokens: int | None) -> tuple[float, float]:
    """The prompt lengths (lowest, highest) a calibrated cell answers for: from the prompt its
    page implies (``context``: the published tool's prompts fall 1-2.5% short of their labels,
    64,000 for 64K) up to the label's own tokens and every count the one labelling rule names
    so (``records.label_span``: a recipe measures 64K as 65,536, or shorter to fit
    max_model_len), each end with CELL_CONTEXT_TOLERANCE. A cell without a label (profiles
    written before labels were kept) reaches what its own context's label does."""
    lo, hi = label_span(context_label(label_tokens or context))
    tol = CELL_CONTEXT_TOLERANCE
    return min(context * (1 - tol), lo), max(context * (1 + tol), hi)


OUTLIER = "outlier"
EVEN = "even"
CELL_STREAMS = (OUTLIER, EVEN)
"""How a calibrated cell's ``spread`` places its streams (a cell's ``streams`` key):
``outlier``, one stream apart from the others (a cell without the key), or ``even``, all evenly
spaced over the spread."""


@dataclass
class SpecDecode:
    """Speculative decoding: the shape of one step's draw and each request's acceptance."""

    num_speculative_tokens: int
    acceptance: list[float]
    cost_factor: float = 1.0
    seed: int = 0
    mean_length: list[tuple[int, float]] = field(default_factory=list)
    spread: float = 0.0
    cells: list[tuple[int, int, float, float]] = field(default_factory=list)
    even_cells: list[tuple[int, int]] = field(default_factory=list)
    """(context, concurrency) of the cells whose streams are evenly spaced (CELL_STREAMS)."""
    labels: dict[int, int] = field(default_factory=dict)
    """A cell context's label on its page, in tokens (65,536 for a 64K cell the page implies
    was 64,000 tokens): how far the cell reaches (``cell_span``)."""

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        for ctx, length in self.mean_length:
            if ctx <= 0 or not 1.0 <= length <= k + 1:
                raise ProfileError(f"spec_decode.acceptance_length.mean: length in [1, {k + 1}]")
        for ctx, conc, length, _ in self.cells:
            if ctx <= 0 or conc <= 0 or not 1.0 <= length <= k + 1:
                raise ProfileError(f"spec_decode.acceptance_length.cells: length in [1, {k + 1}]")
        if self.spread < 0:
            raise ProfileError("spec_decode.acceptance_length.spread must be >= 0")
        pts = sorted(self.mean_length)
        self._mxs = [math.log2(c) for c, _ in pts]
        self._mys = [v for _, v in pts]
        even = set(self.even_cells)
        self._cells = {(c, n): (v, sd, (c, n) in even) for c, n, v, sd in self.cells}
        self._cell_ctxs = sorted({c for c, _, _, _ in self.cells})
        self._spans = {c: cell_span(c, self.labels.get(c)) for c in self._cell_ctxs}
        self._rows: dict[int, list[int]] = {}  # concurrency -> its cells' contexts, ascending
        for c, n in sorted(self._cells):
            self._rows.setdefault(n, []).append(c)
        self._survival: dict[float, list[float]] = {}

    def shape_mean(self) -> float:
        """Mean acceptance length of the shape itself (theta = 1)."""
        return 1.0 + sum(math.prod(self.acceptance[: i + 1]) for i in range(len(self.acceptance)))

    def mean_at(self, context: int) -> float:
        """The mean acceptance length of a request with a prompt of `context` tokens."""
        if not self._mxs:
            return self.shape_mean()
        return _interp(self._mxs, self._mys, math.log2(max(context, 1)))

    def draw_length(self, context: int, key: int) -> float:
        """A request's acceptance length: Beta on [1, k + 1] around mean_at(context).

        `key` is a hash of the prompt's tokens: the same prompt draws the same acceptance (one
        prompt's content decides it), distinct prompts scatter.
        """
        mean = self.mean_at(context)
        if self.spread <= 0:
            return mean
        k = self.num_speculative_tokens
        mu = min(max((mean - 1.0) / k, 1e-6), 1 - 1e-6)
        var = min((self.spread / k) ** 2, 0.95 * mu * (1 - mu))
        nu = mu * (1 - mu) / var - 1.0
        rng = random.Random(self.seed * 1_000_003 + key)
        return 1.0 + k * rng.betavariate(mu * nu, (1 - mu) * nu)

    def cell_context(self, context: int) -> int | None:
        """The calibrated cell context a prompt of `context` tokens belongs to (``cell_span``:
        its label's own first, then any cell reaching it, the nearest), else `context` itself
        (``cell`` then reads between the calibrated cells); None without calibrated cells."""
        if not self._cell_ctxs:
            return None
        label = context_label(context)
        own = [c for c in self._cell_ctxs if context_label(self.labels.get(c) or c) == label]
        reach = own or [c for c, (lo, hi) in self._spans.items() if lo <= context <= hi]
        if not reach:
            return context
        return min(reach, key=lambda c: abs(math.log(context / c)))

    def cell(self, cell_context: int | None, concurrency: int) -> tuple[float, float, bool] | None:
        """A calibrated cell's (mean acceptance length, spread, streams evenly spaced); between
        two calibrated cells of that concurrency, the two interpolated in log2(context) from the
        end of one's span to the start of the other's (a prompt between labels reads smoothly
        between them, not a random draw; the streams placed as the nearer cell's); None beyond
        the row's ends or for a concurrency without cells (the smooth line's draw then)."""
        if cell_context is None:
            return None
        hit = self._cells.get((cell_context, concurrency))
        if hit is not None:
            return hit
        row = self._rows.get(concurrency, [])
        below = [c for c in row if self._spans[c][1] < cell_context]
        above = [c for c in row if self._spans[c][0] > cell_context]
        if not below or not above:
            return None
        a, b = below[-1], above[0]
        xa, xb = math.log2(self._spans[a][1]), math.log2(self._spans[b][0])
        w = (math.log2(cell_context) - xa) / (xb - xa)
        (va, sa, ea), (vb, sb, eb) = self._cells[(a, concurrency)], self._cells[(b, concurrency)]
        return va + w * (vb - va), sa + w * (sb - sa), ea if w < 0.5 else eb

    def cell_length(
        self, mean: float, spread: float, rank: int, streams: int, even: bool = False
    ) -> float:
        """The acceptance length of the stream ranked `rank` of `streams` in a calibrated cell."""
        if spread == 0 or streams <= 1:
            return mean
        if even:
            # every stream evenly spaced over `spread` (signed) end to end around the cell's
            # mean, as C prompts' acceptances scatter: the fast streams finish and restart more
            # often, so they hold more of the requests the median time between tokens is over
            place = spread * (rank / (streams - 1) - 0.5)
            return min(max(mean + place, 1.0), self.num_speculative_tokens + 1.0)
        # one stream (the last ranked) apart from the others, the cell's mean kept: a fast
        # outlier (spread > 0) or a slow one (< 0), which moves the median time between tokens
        # against the total either way, as one prompt unlike the others does on real hardware
        share = (streams - 1) / streams if rank == streams - 1 else -1.0 / streams
        return min(max(mean + spread * share, 1.0), self.num_speculative_tokens + 1.0)

    def survival(self, length: float) -> list[float]:
        """P(position i accepted) for a step whose mean acceptance length is `length`.

        The shape's conditional probabilities raised to theta, theta found by bisection so that
        1 + sum(survival) = length (clamped to what the shape can reach). Cached per 1e-4.
        """
        key = round(length, 4)
        hit = self._survival.get(key)
        if hit is not None:
            return hit

        def surv(log_theta: float) -> list[float]:
            theta = 2.0**log_theta
            out, s = [], 1.0
            for p in self.acceptance:
                s *= p**theta if p > 0 else 0.0
                out.append(s)
            return out

        lo, hi = -30.0, 30.0  # theta from ~0 (accept all) to huge (accept none)
        for _ in range(60):
            mid = (lo + hi) / 2
            if 1.0 + sum(surv(mid)) > key:
                lo = mid
            else:
                hi = mid
        result = surv((lo + hi) / 2)
        if len(self._survival) < 100_000:
            self._survival[key] = result
        return result

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "num_speculative_tokens": self.num_speculative_tokens,
            "acceptance": self.acceptance,
            "cost_factor": self.cost_factor,
            "seed": self.seed,
        }
        if self.mean_length or self.spread or self.cells:
            data["acceptance_length"] = {
                "mean": [{"context": c, "length": round(v, 6)} for c, v in self.mean_length],
                "spread": round(self.spread, 6),
                "cells": [
                    {"context": c, "concurrency": n, "length": round(v, 6), "spread": round(sd, 6)}
                    # the key only where not the default: a profile without even cells is
                    # written as before
                    | ({"streams": EVEN} if (c, n) in self.even_cells else {})
                    | ({"label": context_label(self.labels[c])} if c in self.labels else {})
                    for c, n, v, sd in self.cells
                ],
            }
        return data


def _cell_streams(cell: dict[str, Any]) -> str:
    """A profile cell's ``streams`` (CELL_STREAMS; absent: ``outlier``)."""
    streams = str(cell.get("streams") or OUTLIER)
    if streams not in CELL_STREAMS:
        raise ProfileError(
            f"spec_decode.acceptance_length.cells: streams is one of {CELL_STREAMS}, "
            f"not {streams!r}"
        )
    return streams


@dataclass
class Profile:
    """A loaded profile; ``raw`` keeps the file's data for saving and /sim/profile."""

    name: str = "unnamed"
    description: str = ""
    calibrated: bool = False
    source: str | None = None
    served_model_name: str = "sim-model"
    model: str = "sim/model"
    version: str = "0.0.0+sim"
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    vocab_size: int = 32000
    block_size: int = 16
    num_gpu_blocks: int = 4096
    prefill_points: list[tuple[int, float]] = field(default_factory=lambda: [(1024, 0.1)])
    decode_base_s: float = 0.02
    decode_per_seq_s: float = 0.001
    decode_per_kv_token_s: float = 0.0
    decode_correction: list[tuple[int, int, float]] = field(default_factory=list)
    min_step_s: float = 0.001
    first_token_delay_ms: list[tuple[int, int, float]] = field(default_factory=list)
    first_token_output_ms: list[tuple[int, int, float]] = field(default_factory=list)
    spec_decode: SpecDecode | None = None
    natural_stop_tokens: int | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pts = sorted((int(n), float(t)) for n, t in self.prefill_points)
        if not pts or any(n <= 0 or t <= 0 for n, t in pts):
            raise ProfileError(f"profile {self.name}: prefill.points must be positive [tokens, s]")
        self._pxs = [0.0] + [float(n) for n, _ in pts]
        self._pys = [0.0] + [t for _, t in pts]
        if any(b < a for a, b in zip(self._pys, self._pys[1:], strict=False)):
            raise ProfileError(f"profile {self.name}: prefill.points must be non-decreasing")
        self._p_last_slope = (self._pys[-1] - self._pys[-2]) / (self._pxs[-1] - self._pxs[-2])
        self._correction = LogGrid([(c, b, f) for c, b, f in self.decode_correction])
        self._delay = LogGrid(
            [(c, n, ms / 1000.0) for c, n, ms in self.first_token_delay_ms],
            extrapolate_context=True,
        )
        self._output = LogGrid(
            [(c, n, ms / 1000.0) for c, n, ms in self.first_token_output_ms],
            extrapolate_context=True,
        )
        if self.num_gpu_blocks < 2 or self.block_size < 1:
            raise ProfileError(f"profile {self.name}: kv.num_gpu_blocks/block_size too small")

    # --- the model's functions -------------------------------------------------------------
    def prefill_time(self, tokens: float) -> float:
        """P(n): simulated seconds to prefill the first n tokens of a cold prompt."""
        if tokens <= self._pxs[-1]:
            return _interp(self._pxs, self._pys, tokens)
        return self._pys[-1] + self._p_last_slope * (tokens - self._pxs[-1])

    def decode_step_time(
        self, batch: int, kv_tokens: int, prompt_tokens: int | None = None
    ) -> float:
        """Step time of a decode batch of `batch` sequences holding `kv_tokens` in total.

        The correction is looked up at the batch's mean prompt length (the cell's context), so
        a calibrated cell hits its own correction point exactly as its outputs grow.
        """
        if batch <= 0:
            return 0.0
        t = (
            self.decode_base_s
            + self.decode_per_seq_s * (batch - 1)
            + self.decode_per_kv_token_s * kv_tokens
        )
        if self._correction:
            ctx = (kv_tokens if prompt_tokens is None else prompt_tokens) / batch
            t *= self._correction(ctx, batch)
        if self.spec_decode is not None:
            t *= self.spec_decode.cost_factor
        return max(t, self.min_step_s)

    def first_token_output(self, ctx: int, held: int) -> float:
        """Seconds between the engine computing a first token and the server sending it, for a
        prompt of ctx tokens with `held` requests held (0 when the profile has none)."""
        if not self._output:
            return 0.0
        return max(0.0, self._output(ctx, held))

    def frontend_delay(self, ctx: int, held: int) -> float:
        """Seconds of API-server latency for a prompt of ctx tokens with `held` requests."""
        if not self._delay:
            return 0.0
        return max(0.0, self._delay(ctx, held))

    @property
    def usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    # --- (de)serialisation ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, origin: str = "<dict>") -> Profile:
        def get(path: str, default: Any = None) -> Any:
            node: Any = data
            for part in path.split("."):
                if not isinstance(node, dict) or part not in node:
                    return default
                node = node[part]
            return node

        try:
            spec = get("spec_decode")
            spec_obj = None
            if spec:
                k = int(spec["num_speculative_tokens"])
                acc = [float(a) for a in spec.get("acceptance", [])]
                if len(acc) != k or not all(0.0 <= a <= 1.0 for a in acc):
                    raise ProfileError(
                        f"{origin}: spec_decode.acceptance needs {k} probabilities in [0, 1]"
                    )
                al = spec.get("acceptance_length") or {}
                try:
                    spec_obj = SpecDecode(
                        k,
                        acc,
                        float(spec.get("cost_factor", 1.0)),
                        int(spec.get("seed", 0)),
                        mean_length=[
                            (int(m["context"]), float(m["length"])) for m in al.get("mean") or []
                        ],
                        spread=float(al.get("spread") or 0.0),
                        cells=[
                            (
                                int(m["context"]),
                                int(m["concurrency"]),
                                float(m["length"]),
                                float(m.get("spread") or 0.0),
                            )
                            for m in al.get("cells") or []
                        ],
                        even_cells=[
                            (int(m["context"]), int(m["concurrency"]))
                            for m in al.get("cells") or []
                            if _cell_streams(m) == EVEN
                        ],
                        labels={
                            int(m["context"]): parse_context(str(m["label"]))
                            for m in al.get("cells") or []
                            if m.get("label")
                        },
                    )
                except ProfileError as exc:
                    raise ProfileError(f"{origin}: {exc}") from exc
            defaults = cls.__dataclass_fields__
            return cls(
                name=str(get("name", Path(origin).stem)),
                description=str(get("description", "")),
                calibrated=bool(get("calibrated", False)),
                source=get("source"),
                served_model_name=str(
                    get("served_model_name", defaults["served_model_name"].default)
                ),
                model=str(get("model", defaults["model"].default)),
                version=str(get("version", defaults["version"].default)),
                max_model_len=int(get("max_model_len", 8192)),
                max_num_seqs=int(get("max_num_seqs", 256)),
                max_num_batched_tokens=int(get("max_num_batched_tokens", 8192)),
                vocab_size=int(get("vocab_size", 32000)),
                block_size=int(get("kv.block_size", 16)),
                num_gpu_blocks=int(get("kv.num_gpu_blocks", 4096)),
                prefill_points=[
                    (int(n), float(t)) for n, t in get("prefill.points", [[1024, 0.1]])
                ],
                decode_base_s=float(get("decode.base_s", 0.02)),
                decode_per_seq_s=float(get("decode.per_seq_s", 0.001)),
                decode_per_kv_token_s=float(get("decode.per_kv_token_s", 0.0)),
                decode_correction=[
                    (int(c["context"]), int(c["batch"]), float(c["factor"]))
                    for c in get("decode.correction", []) or []
                ],
                min_step_s=float(get("decode.min_step_s", 0.001)),
                first_token_delay_ms=[
                    (int(c["context"]), int(c["requests"]), float(c["ms"]))
                    for c in get("frontend.first_token_delay_ms", []) or []
                ],
                first_token_output_ms=[
                    (int(c["context"]), int(c["requests"]), float(c["ms"]))
                    for c in get("frontend.first_token_output_ms", []) or []
                ],
                spec_decode=spec_obj,
                natural_stop_tokens=get("natural_stop_tokens"),
                raw=data,
            )
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{origin}: bad profile: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "calibrated": self.calibrated,
            "source": self.source,
            "served_model_name": self.served_model_name,
            "model": self.model,
            "version": self.version,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "vocab_size": self.vocab_size,
            "kv": {"block_size": self.block_size, "num_gpu_blocks": self.num_gpu_blocks},
            "prefill": {"points": [[n, round(t, 6)] for n, t in self.prefill_points]},
            "decode": {
                "base_s": self.decode_base_s,
                "per_seq_s": self.decode_per_seq_s,
                "per_kv_token_s": self.decode_per_kv_token_s,
                "min_step_s": self.min_step_s,
                "correction": [
                    {"context": c, "batch": b, "factor": round(f, 6)}
                    for c, b, f in self.decode_correction
                ],
            },
            "frontend": {
                "first_token_delay_ms": [
                    {"context": c, "requests": n, "ms": round(ms, 3)}
                    for c, n, ms in self.first_token_delay_ms
                ]
            },
            "spec_decode": None,
            "natural_stop_tokens": self.natural_stop_tokens,
        }
        if self.first_token_output_ms:  # only when fitted: the shipped profiles stay as they are
            data["frontend"]["first_token_output_ms"] = [
                {"context": c, "requests": n, "ms": round(ms, 3)}
                for c, n, ms in self.first_token_output_ms
            ]
        if self.spec_decode is not None:
            data["spec_decode"] = self.spec_decode.to_dict()
        return data


def resolve_profile_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A path as given, else a name under include/sim-profiles/ (with .yaml/.yml/.json)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for ext in ("", ".yaml", ".yml", ".json"):
        candidate = PROFILE_DIR / f"{name_or_path}{ext}"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no simulator profile {name_or_path!s} (looked in {PROFILE_DIR})")


def load_profile(source: str | os.PathLike[str] | dict[str, Any] | Profile) -> Profile:
    """A Profile from a Profile, a dict, a file path, or a name under include/sim-profiles/."""
    if isinstance(source, Profile):
        return source
    if isinstance(source, dict):
        return Profile.from_dict(source)
    path = resolve_profile_path(source)
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # yaml / json syntax errors carry the line
        raise ProfileError(f"{path}: cannot parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile must be a mapping")
    return Profile.from_dict(data, origin=str(path))


def save_profile(profile: Profile, path: str | os.PathLike[str], header: str = "") -> Path:
    """Write a profile; the format follows the extension (.json, else YAML)."""
    out = Path(path)
    data = profile.to_dict()
    if out.suffix == ".json":
        out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    else:
        import yaml

        body = yaml.safe_dump(data, sort_keys=False, width=100)
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        out.write_text(comment + body, encoding="utf-8")
    return out
