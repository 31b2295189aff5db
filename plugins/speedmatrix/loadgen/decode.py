"""One sustained-decode cell: C streams kept busy over an exact window (docs/measurement.md).

Order of a cell: model check -> prompts as token ids -> server idle? -> C connections ->
warm the prefix cache (max_tokens=1 per distinct prompt) -> C streams, each restarted the
moment it ends -> the window opens when every stream has its first token -> exactly
`window_s` later the window closes: counters read, every stream cut -> server idle again.

Only tokens that arrive inside the window count; a cut stream's cut time is never a token
time. The status is decided from what was seen, never smoothed over (`_judge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from time import perf_counter

from speedmatrix.records import CellRecord, context_label, empty_cell

from .adaptive import STOP_CAP, AdaptiveWindow
from .common import (
    Progress,
    Watchdog,
    measure_with_prompts,
    progress_enabled,
    request_row,
    server_figures,
)
from .config import DecodeConfig
from .control import ControlClient, MetricsUnavailable, reading_times
from .monitor import ClientMonitor
from .prometheus import Snapshot, rise
from .prompts import BodyBuilder
from .stats import (
    COPY_NGRAM,
    CopyCheck,
    is_repetition_loop,
    median,
    ms,
    percentile,
    rate_median,
    scale_times,
)
from .stream import INF, Endpoint, Request, StreamConnection, Window, connect


async def run_decode(cfg: DecodeConfig) -> tuple[CellRecord, list[dict[str, object]]]:
    """Measure one decode cell; returns (cell record, request rows).

    Raises CellNotAttempted when the server is unreachable or cannot serve the cell at all;
    every other problem ends up in the record's status and error.
    """
    cfg.validate()
    if cfg.measurement_profile == "published":  # the published tool's definitions
        from .published import run_published_decode

        return await run_published_decode(cfg)
    return await measure_with_prompts(cfg, _DecodeCell)


class _DecodeCell:
    def __init__(
        self, cfg: DecodeConfig, endpoint: Endpoint, ctl: ControlClient, builder: BodyBuilder
    ) -> None:
        self.cfg = cfg
        self.endpoint = endpoint
        self.ctl = ctl
        self.builder = builder
        self.C = cfg.concurrency
        self.shared = cfg.prompt_mode == "shared"
        self.window = Window()
        self.requests: list[Request] = []
        self.active: dict[int, tuple[StreamConnection, Request, float]] = {}
        self.conns: list[StreamConnection | None] = [None] * self.C
        self.started_streams: set[int] = set()
        self.window_open = asyncio.Event()
        self.stop = asyncio.Event()
        self.stopping = False
        self.failure: str | None = None
        self.failed_requests = 0
        self.samples: list[Snapshot] = []
        self.snap_start: Snapshot | None = None
        self.snap_end: Snapshot | None = None
        self.missing_readings: list[str] = []  # window readings lost to failed /metrics reads
        self._snap_task: asyncio.Task[Snapshot | None] | None = None
        self.monitor = ClientMonitor()
        self.nonce = secrets.token_hex(3)
        self.notes: list[str] = []
        self.probes: list[Request] = []  # C=1: the TTFT samples after the window
        self.active_basis = ""
        # checkpoints of the window's tokens: the throughput's interval for every cell, and
        # for an adaptive window the decision to stop (loadgen/adaptive.py)
        self.meter = AdaptiveWindow(
            cfg.adaptive_target_pct, min(cfg.adaptive_min_s, cfg.window_s), cfg.window_s
        )
        self.stopped_early = False
        self.cell = empty_cell(
            phase="decode",
            context_tokens=cfg.context,
            context_label=context_label(cfg.context),
            concurrency=self.C,
            status="failed",
            prompt_mode=cfg.prompt_mode,
            workload=cfg.workload,
            max_output_tokens=cfg.max_output_tokens,
            window_s=cfg.window_s,
            started_at=datetime.now(UTC),
            measurement_profile="default",
        )

    # -- the cell -----------------------------------------------------------------------------
    async def run(self) -> tuple[CellRecord, list[dict[str, object]]]:
        cfg = self.cfg
        idle, snap = await self.ctl.wait_idle(cfg.idle_timeout_s)
        if not idle:
            return self._abandon(f"server not idle before the cell ({self.ctl.describe(snap)})")
        # Bodies are built now, before any clock starts.
        first_token_s = cfg.first_token_timeout(1)
        for p in range(1 if self.shared else self.C):
            self.builder.parts(p, 1)
            self.builder.parts(p, cfg.max_output_tokens)
        watchdog = Watchdog(self._active_items, cfg.stall_timeout_s)
        progress = Progress(
            f"decode {context_label(cfg.context)} x{self.C}",
            self._progress_line,
            progress_enabled(cfg.progress),
        )
        self.monitor.start()
        watchdog.start()
        progress.start()
        sampler = asyncio.get_running_loop().create_task(self._sample())
        tasks: list[asyncio.Task[None]] = []
        try:
            if not await self._open_connections():
                return self._finish_cell()
            warm_from = perf_counter()
            warmed = not cfg.warm_cache or await self._warm(cfg.first_token_timeout(self.C))
            # measurement time, recorded: the prefill this cell's prompts needed
            # beyond what the cache already held; scaled with the other times in _finish_cell
            self.cell["warmup_s"] = perf_counter() - warm_from
            if not warmed:
                return self._finish_cell()
            tasks = [
                asyncio.get_running_loop().create_task(self._stream(i, first_token_s))
                for i in range(self.C)
            ]
            await self._wait_window(cfg.first_token_timeout(self.C))
            if self.window_open.is_set():
                await self._hold_window()
        finally:
            self.stopping = True
            self._cut_all(perf_counter())
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            for t in (sampler,):
                t.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            await watchdog.stop()
            await self.monitor.stop()
            await progress.stop()
        idle_after, snap = await self.ctl.wait_idle(cfg.idle_timeout_s)
        if not idle_after:
            self.notes.append(
                f"server still busy {cfg.idle_timeout_s:.0f} s after the cell "
                f"({self.ctl.describe(snap)})"
            )
        elif self.C == 1 and self.window_open.is_set() and self.failure is None:
            await self._ttft_probes(first_token_s)
        return self._finish_cell()

    async def _ttft_probes(self, first_token_s: float) -> None:
        """C=1: `ttft_probes` more requests of the cell's prompt with max_tokens=1, one after
        the other on an idle server, each a TTFT sample as the window's request was (the
        prompt cached, one request running), so the cell's TTFT is a median of several: one
        long request fills a C=1 window, and one TTFT is one draw of the host's moment.
        They come after the window, so no window figure sees them."""
        parts = self.builder.parts(0, 1)
        for k in range(self.cfg.ttft_probes):
            try:
                conn = await connect(
                    self.endpoint, Window(), lambda r, t: None, self.cfg.connect_timeout_s
                )
            except (TimeoutError, OSError) as exc:
                self.notes.append(f"TTFT probe {k + 1}: could not connect: {exc!r}")
                return
            req = Request(-2 - k, 0, 1, False)
            self.active[0] = (conn, req, first_token_s)
            try:
                await conn.send(req, [self.endpoint.head(_size(parts)), *parts])
            finally:
                self.active.pop(0, None)
                conn.close()
            if req.error is not None:
                self.notes.append(f"TTFT probe {k + 1} failed: {req.error}")
                return
            self.probes.append(req)

    async def _open_connections(self) -> bool:
        async def one(i: int) -> None:
            self.conns[i] = await connect(
                self.endpoint, self.window, self._on_first_token, self.cfg.connect_timeout_s
            )

        results = await asyncio.gather(*(one(i) for i in range(self.C)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._fail(f"could not open {len(errors)} of {self.C} connections: {errors[0]!r}")
            return False
        return True

    async def _warm(self, first_token_s: float) -> bool:
        """Put every distinct prompt in the prefix cache so TTFT excludes prefill."""

        async def one(p: int) -> Request:
            conn = self.conns[p]
            assert conn is not None
            req = Request(-1, p, 1, False)
            parts = self.builder.parts(p, 1)
            self.active[p] = (conn, req, first_token_s)
            try:
                return await conn.send(req, [self.endpoint.head(_size(parts)), *parts])
            finally:
                self.active.pop(p, None)

        done = await asyncio.gather(*(one(p) for p in range(1 if self.shared else self.C)))
        for req in done:
            if req.error:
                self.failed_requests += 1
                self._fail(f"cache warm-up failed: {req.error}")
                return False
        for _i, conn in enumerate(self.conns):
            if conn is not None and not conn.keep_alive:
                conn.close()
        return True

    async def _stream(self, i: int, first_token_s: float) -> None:
        """Keep one request in flight on stream i until the window closes."""
        parts = self.builder.parts(0 if self.shared else i, self.cfg.max_output_tokens)
        size = _size(parts)
        # unique per cell attempt: a server refuses a request id it has already seen
        prefix = f"sm-{self.cfg.run_tag}-{self.cfg.context}-c{self.C}-{self.nonce}-"
        keep_text = self.cfg.repetition_check or self.cfg.copy_check
        while not self.stopping:
            conn = self.conns[i]
            if conn is None or conn.closed:
                try:
                    conn = await connect(
                        self.endpoint, self.window, self._on_first_token, self.cfg.connect_timeout_s
                    )
                except (TimeoutError, OSError) as exc:
                    if not self.stopping:
                        self._fail(f"reconnect failed: {exc!r}")
                    return
                self.conns[i] = conn
                if self.stopping:
                    conn.close()
                    return
            req = Request(len(self.requests), i, self.cfg.max_output_tokens, keep_text)
            self.requests.append(req)
            self.active[i] = (conn, req, first_token_s)
            head = self.endpoint.head(size, f"{prefix}{req.index}")
            await conn.send(req, [head, *parts])
            self.active.pop(i, None)
            if req.error is not None:
                if not self.stopping:
                    self.failed_requests += 1
                    self._fail(req.error)
                return
            if not conn.keep_alive:
                conn.close()

    def _on_first_token(self, req: Request, t: float) -> None:
        if self._snap_task is not None or req.index < 0:
            return
        self.started_streams.add(req.stream)
        if len(self.started_streams) == self.C and self._snap_task is None:
            self._snap_task = asyncio.get_running_loop().create_task(self._open_window(t))

    async def _open_window(self, t_all: float) -> Snapshot | None:
        """Open the window when the server's counters have been read, not before.

        The counter reading is what the client's count is checked against; opening the window
        on the arrival of that reading lines both up (tokens generated after the reading
        arrive after it), however long /metrics takes to answer under load.
        """
        snap = await self._reading("start")
        t = perf_counter() if snap is not None else t_all
        if self.stopping:
            return snap
        self.window.ws = t
        self.window.we = t + self.cfg.window_s / self.cfg.time_scale
        self.monitor.begin_window()
        self.window_open.set()
        return snap

    async def _wait_window(self, timeout_s: float) -> None:
        opened = asyncio.ensure_future(self.window_open.wait())
        stopped = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({opened, stopped}, timeout=timeout_s, return_when="FIRST_COMPLETED")
        for f in (opened, stopped):
            f.cancel()
        if not self.window_open.is_set() and self.failure is None:
            load = f" (server: {self.ctl.describe(self.samples[-1])})" if self.samples else ""
            self._fail(
                f"only {len(self.started_streams)} of {self.C} streams started within "
                f"{timeout_s:.0f} s{load}"
            )

    async def _hold_window(self) -> None:
        """Hold the window to its end, checkpointing its tokens; an adaptive window ends
        early, at a checkpoint, once its figures are tight enough (loadgen/adaptive.py).

        An early end moves the window's end to that checkpoint: tokens count when
        ws < t <= we, and every token stamped so far arrived before it."""
        w, cfg = self.window, self.cfg
        step = cfg.window_check_s / cfg.time_scale
        self.meter.checkpoint(0.0, 0)
        while not self.stop.is_set():
            remaining = w.we - perf_counter()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), min(step, remaining))
            now = perf_counter()
            self.meter.checkpoint(
                (min(now, w.we) - w.ws) * cfg.time_scale, sum(r.w_tokens for r in self.requests)
            )
            self._watch_steady(w.ws, now)
            if cfg.adaptive and now < w.we and self.meter.converged():
                w.we = now
                self.stopped_early = True
                break
        self.stopping = True
        if self.failure is None:
            self.snap_end = await self._reading("end")
        self.monitor.end_window()
        if self._snap_task is not None:
            self.snap_start = await self._snap_task

    def _watch_steady(self, ws: float, now: float) -> None:
        """Queueing or preemption inside the window: not a steady state, no early stop."""
        inside = [s for s in self.samples if ws <= s.at <= now]
        if any((s.get("waiting") or 0) > 0 for s in inside):
            self.meter.mark_unsteady("requests queued on the server")
        if len(inside) > 1 and (rise(inside[0], inside[-1], "preemptions") or 0) > 0:
            self.meter.mark_unsteady("preemptions on the server")

    def _cut_all(self, t: float) -> None:
        for conn in self.conns:
            if conn is not None:
                conn.cut(t)
        for conn, _req, _ in list(self.active.values()):
            conn.cut(t)

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        self.stopping = True
        self.stop.set()

    def _active_items(self) -> Iterator[tuple[StreamConnection, Request, float]]:
        return iter(list(self.active.values()))

    async def _reading(self, edge: str) -> Snapshot | None:
        """The counters at the window's start or end; None (and the reason kept) when the
        read failed, so the cell cannot pass its cross-checks unnoticed."""
        try:
            return await self.ctl.metrics()
        except MetricsUnavailable as exc:
            self.missing_readings.append(f"no /metrics reading at the window's {edge} ({exc})")
            return None

    async def _sample(self) -> None:
        """Server gauges through the cell, at `reading_times`; only readings inside the window
        are used. A reading whose moment passed while the last read was answered is skipped,
        not made up by a burst of reads (on a slow server those would all read one moment).

        A failed read is skipped, never the end of sampling: the next tick reads again (one
        timeout during warm-up must not end the readings of the whole window). Only a server without
        /metrics stops it."""
        for due in reading_times(perf_counter(), self._sample_interval(), random.Random()):
            wait = due - perf_counter()
            if wait < 0:
                continue
            await asyncio.sleep(wait)
            try:
                snap = await self.ctl.metrics()
            except MetricsUnavailable:
                snap = None
            else:
                if snap is None:
                    return
                self.samples.append(snap)

    def _sample_interval(self) -> float:
        """The configured interval, shortened so the window gets `min_window_readings`."""
        cfg = self.cfg
        # an adaptive window may end at its minimum: it gets its readings by then
        shortest = min(cfg.adaptive_min_s, cfg.window_s) if cfg.adaptive else cfg.window_s
        return min(cfg.metrics_interval_s, shortest / cfg.time_scale / cfg.min_window_readings)

    def _progress_line(self) -> str:
        w = self.window
        if w.ws == float("inf"):
            return f"starting: {len(self.started_streams)}/{self.C} streams"
        elapsed = min(perf_counter(), w.we) - w.ws
        tokens = sum(r.w_tokens for r in self.requests)
        rate = tokens / elapsed if elapsed > 0 else 0.0
        return (
            f"{elapsed:5.1f}/{self.cfg.window_s / self.cfg.time_scale:.0f} s  tokens {tokens:,}  "
            f"{rate:,.1f} tok/s  active {len(self.active)}"
        )

    # -- the record ---------------------------------------------------------------------------
    def _abandon(self, reason: str) -> tuple[CellRecord, list[dict[str, object]]]:
        self.cell["error"] = reason
        self.cell["status"] = "failed"
        return self.cell, []

    def _finish_cell(self) -> tuple[CellRecord, list[dict[str, object]]]:
        cfg, cell, w = self.cfg, self.cell, self.window
        reqs = self.requests
        opened = w.ws != float("inf")
        end = w.we
        if opened and self.failure is not None:
            end = min(w.we, max((r.ended_at or w.ws) for r in reqs) if reqs else w.ws)
        measured = (end - w.ws) if opened else None
        in_window = [r for r in reqs if opened and r.w_tokens > 0]
        tbts = [x for x in (r.window_tbt() for r in in_window) if x]
        ttfts = [r.first_at - r.sent_at for r in [*reqs, *self.probes] if r.first_at and r.sent_at]
        gaps = [
            (r.w_last - r.w_first) / (r.w_chunks - 1)
            for r in in_window
            if r.w_chunks > 1 and r.w_last is not None and r.w_first is not None
        ]
        out_tokens = sum(r.w_tokens for r in reqs)
        chunks = sum(r.w_chunks for r in in_window)
        cell.update(
            requests_started=len(reqs),
            requests_failed=self.failed_requests,
            samples=len(tbts),
            ttft_ms=ms(median(ttfts)),
            ttft_p90_ms=ms(percentile(ttfts, 90)),
            ttft_p99_ms=ms(percentile(ttfts, 99)),
            ttft_samples=len(ttfts),
            ttft_spread_pct=(
                (max(ttfts) - min(ttfts)) / median(ttfts) * 100  # type: ignore[operator]
                if len(ttfts) > 1 and median(ttfts)
                else None
            ),
            ttst_ms=ms(median([x for x in (r.ttst() for r in reqs) if x is not None])),
            client_cpu_pct=self.monitor.cpu_pct,
            loop_lag_p99_ms=self.monitor.lag_p99_ms,
        )
        prompt_counts = {r.prompt_tokens for r in reqs if r.prompt_tokens is not None}
        if len(prompt_counts) == 1:
            cell["context_tokens"] = prompt_counts.pop()
            cell["context_label"] = context_label(int(cell["context_tokens"]))  # type: ignore[arg-type]
        if opened and measured:
            completed = [r for r in reqs if r.finished and w.ws < (r.ended_at or 0) <= w.we]
            cell.update(
                measured_s=measured,
                output_tokens=out_tokens,
                total_tok_s=out_tokens / measured,
                tbt_ms=ms(median(tbts)),
                tbt_p90_ms=ms(percentile(tbts, 90)),
                tbt_p99_ms=ms(percentile(tbts, 99)),
                per_request_tok_s=rate_median(tbts),
                chunk_gap_ms=ms(median(gaps)),
                tokens_per_chunk=(out_tokens / chunks) if chunks else None,
                completed_requests=len(completed),
            )
            self._server_figures(w.ws, end)
            self._window_figures()
        outputs = ["".join(r.text_parts) for r in reqs if r.text_parts]
        if cfg.copy_check and outputs:
            cell["copy_share"] = CopyCheck(self.builder.prompts.text).share(outputs)
        cell["status"], cell["error"] = self._judge(prompt_counts_ok=self._prompts_exact())
        if opened and cfg.on_window is not None:
            cfg.on_window(w.ws, end)
        scale_times(cell, cfg.time_scale)
        rows = [
            request_row(r, "decode", cfg.context, self.C, w.ws if opened else None, cfg.workload)
            for r in reqs
        ]
        for row in rows:
            scale_times(row, cfg.time_scale, rows=True)
        return cell, rows if cfg.keep_requests else []

    def _window_figures(self) -> None:
        """How the window ended and how tight its throughput was (every decode cell)."""
        cell, iv = self.cell, self.meter.last
        cell["window_mode"] = "adaptive" if self.cfg.adaptive else "fixed"
        cell["window_halfwidth_pct"] = None if iv is None else iv.half_width_pct
        if self.cfg.adaptive:
            cell["window_stop"] = self.meter.stop_reason(self.stopped_early)
            cell["window_note"] = self.meter.explain(self.stopped_early)
            cell["adaptive_target_pct"] = self.cfg.adaptive_target_pct
        else:
            cell["window_stop"] = STOP_CAP

    def _server_figures(self, ws: float, we: float) -> None:
        cell = self.cell
        inside = [s for s in self.samples if ws <= s.at <= we + 0.05]
        running = [v for v in (s.get("running") for s in inside) if v is not None]
        if running:
            cell["avg_active_requests"] = sum(running) / len(running)
            cell["active_source"] = "server"
            self.active_basis = f"{len(running)} server readings"
        else:
            cell["avg_active_requests"] = self._client_active(ws, we)
            cell["active_source"] = "client"
            self.active_basis = "client in-flight time"
        a, b = self.snap_start, self.snap_end
        server_figures(cell, [*inside, *(s for s in (a, b) if s is not None)], a, b)

    def _client_active(self, ws: float, we: float) -> float:
        """Time-average of requests in flight from the client's side (no /metrics)."""
        busy = 0.0
        for r in self.requests:
            if r.sent_at is None:
                continue
            start = max(ws, r.sent_at)
            stop = min(we, r.ended_at if r.ended_at is not None else we)
            busy += max(0.0, stop - start)
        return busy / (we - ws) if we > ws else 0.0

    def _prompts_exact(self) -> bool:
        return all(
            r.prompt_tokens == self.cfg.context
            for r in self.requests
            if r.prompt_tokens is not None
        )

    def _count_slack(self, gen: int, out: int) -> float:
        """How far client and server token counts may differ and still agree.

        The two counts are read at different instants. At each edge of the window one chunk
        per stream may fall on different sides (several tokens with spec decoding). And the
        server reads its counter somewhere inside each /metrics round trip: tokens generated
        between the start reading's send and its arrival (when the window opens), and between
        the window's end and the end reading's arrival, are counted by the server only. On a
        busy host a /metrics answer takes tens of ms, which at small counts is more than 1%;
        the allowance is the client's own rate times those two spans, never a guess.
        """
        cell, w = self.cell, self.window
        per_chunk = cell["tokens_per_chunk"] if isinstance(cell["tokens_per_chunk"], float) else 1.0
        edges = 2.0 * self.C * per_chunk
        span = w.we - w.ws
        rate = out / span if span > 0 else 0.0
        return max(
            self.cfg.token_tolerance * max(gen, out), edges + rate * self._readings_ambiguity_s()
        )

    def _readings_ambiguity_s(self) -> float:
        """The spans in which the server may have read its counter but the client cannot know
        where: the start reading's round trip, and the end reading's arrival after the window."""
        a, b, ambiguous_s = self.snap_start, self.snap_end, 0.0
        if a is not None and a.sent is not None:
            ambiguous_s += max(0.0, a.at - a.sent)
        if b is not None:
            ambiguous_s += max(0.0, b.at - self.window.we)
        return ambiguous_s

    def _readings_missing(self, ws: float, we: float) -> list[str]:
        """Why the window lacks the server readings its checks need (empty: it has them).

        A server that has /metrics must give the window its start and end readings (the
        token cross-check, preemptions, prefix-cache and spec-decode figures are their
        differences) and at least half the gauge readings the sampler aims at (the average
        of running requests; half, because on a loaded host a /metrics answer may take as
        long as the interval between readings). Without them the cell's checks were off,
        so it cannot be called valid. A server without /metrics is the declared exception."""
        if not getattr(self.ctl, "has_metrics", False):  # none declared (or no client)
            return []
        out = list(self.missing_readings)
        inside = sum(1 for s in self.samples if ws <= s.at <= we + 0.05)
        need = (self.cfg.min_window_readings + 1) // 2
        if inside < need:
            out.append(
                f"only {inside} /metrics readings in the window, fewer than {need} "
                f"({self.ctl.metrics_failures} failed reads in the cell; last: "
                f"{self.ctl.metrics_error})"
            )
        return out

    def _blind_spots(self) -> list[str]:
        """Reasons the cell's own checks were blind for too long a share of the window.

        Seen on real vLLM sharing 2 cores with the client: a 4.5 s stall of the client's loop
        in an 8 s window (tokens stamped in bursts: 0.02 ms between tokens) and /metrics
        answers so late that the counter cross-check forgave a 2x disagreement; p90 lag and
        the slack alone called that cell valid.
        """
        span = self.window.we - self.window.ws
        if not (0 < span < INF):
            return []
        limit = self.cfg.max_blind_fraction * span
        out = []
        stall = self.monitor.longest_stall_s
        if stall > limit:
            out.append(
                f"client stalled for {stall * 1000:.0f} ms in a {span:.1f} s window "
                f"(over {self.cfg.max_blind_fraction:.0%})"
            )
        if isinstance(self.cell["server_generation_tokens"], int):
            ambiguous = self._readings_ambiguity_s()
            if ambiguous > limit:
                out.append(
                    f"server counters answered {ambiguous * 1000:.0f} ms late in a {span:.1f} s "
                    f"window: the token cross-check cannot be made"
                )
        return out

    def _judge(self, prompt_counts_ok: bool) -> tuple[str, str | None]:
        """failed: something broke; invalid: it ran, but the numbers cannot be trusted."""
        cfg, cell = self.cfg, self.cell
        if self.failure is not None:
            n = self.failed_requests
            extra = f" ({n} failed request{'s' if n != 1 else ''})" if n > 1 else ""
            return "failed", self.failure + extra
        reasons: list[str] = []
        if not prompt_counts_ok:
            seen = sorted({r.prompt_tokens for r in self.requests if r.prompt_tokens is not None})
            reasons.append(f"server counted prompt tokens {seen}, not {cfg.context}")
        waiting = cell["server_max_waiting"]
        if waiting:
            reasons.append(f"requests queued on the server during the window (waiting={waiting:g})")
        if cell["server_preemptions"]:
            reasons.append(f"{cell['server_preemptions']} preemptions during the window")
        gen, out = cell["server_generation_tokens"], cell["output_tokens"]
        if isinstance(gen, int) and isinstance(out, int):
            slack = self._count_slack(gen, out)
            if abs(gen - out) > slack:
                reasons.append(
                    f"client counted {out} output tokens, server {gen} "
                    f"(vllm:generation_tokens_total); over {cfg.token_tolerance:.0%} and the "
                    f"{slack:.1f} tokens the two readings' timing allows"
                )
        reasons += self.monitor.saturation(cfg.max_loop_lag_ms, cfg.max_client_cpu_pct)
        reasons += self._blind_spots()
        if self.window.ws != INF:
            reasons += self._readings_missing(self.window.ws, self.window.we)
        active = cell["avg_active_requests"]
        if isinstance(active, float) and abs(active - self.C) > cfg.max_active_deviation * self.C:
            reasons.append(
                f"average active requests {active:.2f} of C={self.C} ({self.active_basis}): "
                f"the server was not running {self.C} through the window"
            )
        if cfg.repetition_check:
            checked = [r for r in self.requests if r.text_parts]
            loops = sum(1 for r in checked if is_repetition_loop("".join(r.text_parts or [])))
            if checked and loops / len(checked) > cfg.max_loop_fraction:
                reasons.append(f"repetition loop in {loops} of {len(checked)} outputs")
        copied = cell["copy_share"]
        if isinstance(copied, float) and copied > cfg.max_copy_share:
            reasons.append(
                f"outputs copy their prompt: {copied:.0%} of their word {COPY_NGRAM}-grams are "
                f"in it (over {cfg.max_copy_share:.0%}); a speculative decoder accepts copied "
                "tokens almost for free, so the figures say nothing about real use"
            )
        if reasons:
            return "invalid", "; ".join(reasons + self.notes)
        return "valid", None


def _size(parts: list[bytes]) -> int:
    return sum(len(p) for p in parts)
