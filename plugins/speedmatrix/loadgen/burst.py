"""One burst cell: N requests sent at once and measured to their completion.

What the published tool's request-count mode ("Burst / E2E", llm_decode_bench.py
`--request-count` / `--run-burst`) measures, with as many requests as it keeps in flight: not a
steady state but what N users who ask at the same moment see, the batch's admission and its
completion included. Figures (docs/measurement.md, "Burst cells"):

- completed-request latency: a request's last token's arrival - its last byte sent; median,
  p90, p99 over the completed requests;
- per-user end-to-end tok/s: a request's output tokens / its latency (its first-token wait in);
- total tok/s: every completed request's output tokens / (the last token's arrival - the first
  request sent), the burst's own time (`measured_s`);
- and the decode figures of the same requests (TTFT, time between tokens, time to the second
  token, per-request tok/s as a decode cell forms it).

Order of a cell: model check -> prompts as token ids -> server idle? -> N connections -> warm
the prefix cache (max_tokens=1 per distinct prompt, as a decode cell does) -> counters read ->
the N requests written back to back -> every one to its end (or the burst's time limit) ->
counters read on an idle server. A burst is never compared with a decode cell (its phase is
part of every cell key and of the comparability rule, records.COMPARABILITY_FIELDS).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from time import perf_counter

from speedmatrix.records import CellRecord, context_label, empty_cell

from .common import (
    Progress,
    Watchdog,
    measure_with_prompts,
    progress_enabled,
    request_row,
    server_figures,
)
from .config import BurstConfig
from .control import ControlClient, MetricsUnavailable
from .monitor import ClientMonitor
from .prometheus import Snapshot
from .prompts import BodyBuilder
from .stats import median, ms, percentile, rate_median, scale_times
from .stream import Endpoint, Request, StreamConnection, Window, connect


async def run_burst(cfg: BurstConfig) -> tuple[CellRecord, list[dict[str, object]]]:
    """Measure one burst cell; returns (cell record, one row per request of the burst).

    Raises CellNotAttempted when the server is unreachable or does not serve the model;
    every other problem ends up in the record's status and error."""
    cfg.validate()
    return await measure_with_prompts(cfg, _Burst)


class _Burst:
    def __init__(
        self, cfg: BurstConfig, endpoint: Endpoint, ctl: ControlClient, builder: BodyBuilder
    ) -> None:
        self.cfg = cfg
        self.endpoint = endpoint
        self.ctl = ctl
        self.builder = builder
        self.N = cfg.concurrency
        self.prompts = 1 if cfg.prompt_mode == "shared" else self.N
        self.conns: list[StreamConnection] = []
        self.active: dict[int, tuple[StreamConnection, Request, float]] = {}
        self.requests: list[Request] = []
        self.failure: str | None = None
        self.notes: list[str] = []
        self.samples: list[Snapshot] = []
        self.before: Snapshot | None = None
        self.after: Snapshot | None = None
        self.monitor = ClientMonitor()
        self.cell = empty_cell(
            phase="burst",
            context_tokens=cfg.context,
            context_label=context_label(cfg.context),
            concurrency=self.N,
            status="failed",
            prompt_mode=cfg.prompt_mode,
            workload=cfg.workload,
            max_output_tokens=cfg.max_output_tokens,
            started_at=datetime.now(UTC),
            measurement_profile="default",
            requests_started=0,
            requests_failed=0,
        )

    async def run(self) -> tuple[CellRecord, list[dict[str, object]]]:
        cfg = self.cfg
        idle, snap = await self.ctl.wait_idle(cfg.idle_timeout_s)
        if not idle:
            self.cell["error"] = f"server not idle before the cell ({self.ctl.describe(snap)})"
            return self.cell, []
        for p in range(self.prompts):  # bodies built before any clock starts
            self.builder.parts(p, 1)
            self.builder.parts(p, cfg.max_output_tokens)
        watchdog = Watchdog(lambda: list(self.active.values()), cfg.stall_timeout_s)
        progress = Progress(
            f"burst {context_label(cfg.context)} x{self.N}",
            self._progress_line,
            progress_enabled(cfg.progress),
        )
        self.monitor.start()
        watchdog.start()
        progress.start()
        try:
            if await self._open() and await self._warm():
                await self._burst()
        finally:
            for conn in self.conns:
                conn.close()
            await watchdog.stop()
            await self.monitor.stop()
            await progress.stop()
        idle_after, snap = await self.ctl.wait_idle(cfg.idle_timeout_s)
        if not idle_after:
            self.notes.append(
                f"server still busy {cfg.idle_timeout_s:.0f} s after the cell "
                f"({self.ctl.describe(snap)})"
            )
        elif self.requests and self.failure is None:
            self.after = await self._reading("after the burst")
        return self._finish()

    # -- the steps ------------------------------------------------------------------------------
    async def _connect(self) -> StreamConnection:
        return await connect(self.endpoint, Window(), lambda r, t: None, self.cfg.connect_timeout_s)

    async def _open(self) -> bool:
        results = await asyncio.gather(
            *(self._connect() for _ in range(self.N)), return_exceptions=True
        )
        self.conns = [r for r in results if isinstance(r, StreamConnection)]
        if len(self.conns) < self.N:
            error = next(r for r in results if isinstance(r, BaseException))
            self.failure = f"could not open {self.N - len(self.conns)} of {self.N} connections: "
            self.failure += repr(error)
            return False
        return True

    async def _warm(self) -> bool:
        """Every distinct prompt in the prefix cache first (max_tokens=1), as a decode cell's:
        the burst then measures admission and decoding, not N cold prefills."""
        if not self.cfg.warm_cache:
            return True
        first_token_s = self.cfg.first_token_timeout(self.prompts)
        started = perf_counter()

        async def one(p: int) -> Request:
            req = Request(-1 - p, p, 1, False)
            parts = self.builder.parts(p, 1)
            self.active[p] = (self.conns[p], req, first_token_s)
            try:
                return await self.conns[p].send(req, [self.endpoint.head(_size(parts)), *parts])
            finally:
                self.active.pop(p, None)

        done = await asyncio.gather(*(one(p) for p in range(self.prompts)))
        self.cell["warmup_s"] = perf_counter() - started  # scaled with the other times
        failed = [r for r in done if r.error]
        if failed:
            self.failure = f"cache warm-up failed: {failed[0].error}"
            return False
        for i, conn in enumerate(self.conns):
            if conn.closed or not conn.keep_alive:
                conn.close()
                try:
                    self.conns[i] = await self._connect()
                except (TimeoutError, OSError) as exc:
                    self.failure = f"reconnect after the warm-up failed: {exc!r}"
                    return False
        return True

    async def _burst(self) -> None:
        cfg = self.cfg
        self.before = await self._reading("before the burst")
        first_token_s = cfg.first_token_timeout(self.N)
        prefix = f"sm-{cfg.run_tag}-{cfg.context}-b{self.N}-{perf_counter():.6f}-"
        sends = []
        for i in range(self.N):
            parts = self.builder.parts(i % self.prompts, cfg.max_output_tokens)
            head = self.endpoint.head(_size(parts), f"{prefix}{i}")
            req = Request(i, i, cfg.max_output_tokens, False)
            self.requests.append(req)
            self.active[i] = (self.conns[i], req, first_token_s)
            sends.append((self.conns[i], req, [head, *parts]))
        self.monitor.begin_window()
        # written back to back in one turn of the loop: "at once" as a client can
        futures = [conn.send(req, message) for conn, req, message in sends]
        sampler = asyncio.get_running_loop().create_task(self._sample())
        _, pending = await asyncio.wait(futures, timeout=cfg.max_burst_s / cfg.time_scale)
        self.monitor.end_window()
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        if pending:
            now = perf_counter()
            for conn, _req, _ in list(self.active.values()):
                conn.cut(now)
            self.failure = (
                f"burst not complete within {cfg.max_burst_s:g} s: "
                f"{len(pending)} of {self.N} requests still running"
            )
        self.active.clear()

    async def _sample(self) -> None:
        """The server's gauges through the burst (running, waiting, KV usage)."""
        while True:
            await asyncio.sleep(0.5 / self.cfg.time_scale)
            try:
                snap = await self.ctl.metrics()
            except MetricsUnavailable:
                continue
            if snap is None:
                return
            self.samples.append(snap)

    async def _reading(self, when: str) -> Snapshot | None:
        try:
            return await self.ctl.metrics()
        except MetricsUnavailable as exc:
            self.notes.append(f"no /metrics reading {when} ({exc})")
            return None

    def _progress_line(self) -> str:
        done = sum(1 for r in self.requests if r.ended_at is not None)
        tokens = sum(r.tokens for r in self.requests)
        return f"{done}/{self.N} requests complete, {tokens:,} tokens"

    # -- the record -----------------------------------------------------------------------------
    def _finish(self) -> tuple[CellRecord, list[dict[str, object]]]:
        cfg, cell, reqs = self.cfg, self.cell, self.requests
        completed = [r for r in reqs if r.finished and r.sent_at and r.last_at]
        failed = [r for r in reqs if r.error is not None]
        latencies = [r.last_at - r.sent_at for r in completed]  # type: ignore[operator]
        ttfts = [r.first_at - r.sent_at for r in reqs if r.first_at and r.sent_at]
        tbts = [x for x in (r.tbt() for r in reqs) if x]
        chunks = sum(r.chunks for r in completed)
        tokens = sum(r.tokens for r in completed)
        cell.update(
            requests_started=len(reqs),
            requests_failed=len(failed),
            completed_requests=len(completed),
            output_tokens=tokens,
            samples=len(tbts),
            ttft_ms=ms(median(ttfts)),
            ttft_p90_ms=ms(percentile(ttfts, 90)),
            ttft_p99_ms=ms(percentile(ttfts, 99)),
            ttft_samples=len(ttfts),
            ttst_ms=ms(median([x for x in (r.ttst() for r in reqs) if x is not None])),
            tbt_ms=ms(median(tbts)),
            tbt_p90_ms=ms(percentile(tbts, 90)),
            tbt_p99_ms=ms(percentile(tbts, 99)),
            per_request_tok_s=rate_median(tbts),
            tokens_per_chunk=tokens / chunks if chunks else None,
            latency_ms=ms(median(latencies)),
            latency_p90_ms=ms(percentile(latencies, 90)),
            latency_p99_ms=ms(percentile(latencies, 99)),
            e2e_per_request_tok_s=median(
                [r.tokens / lat for r, lat in zip(completed, latencies, strict=True) if lat > 0]
            ),
            client_cpu_pct=self.monitor.cpu_pct,
            loop_lag_p99_ms=self.monitor.lag_p99_ms,
        )
        if completed:
            start = min(r.sent_at for r in reqs if r.sent_at is not None)
            span = max(r.last_at for r in completed) - start  # type: ignore[type-var,operator]
            if span > 0:
                cell.update(measured_s=span, total_tok_s=tokens / span)
            self._server_figures(start, start + span)
        counts = {r.prompt_tokens for r in reqs if r.prompt_tokens is not None}
        if len(counts) == 1:
            cell["context_tokens"] = next(iter(counts))
            cell["context_label"] = context_label(int(cell["context_tokens"]))  # type: ignore[arg-type]
        cell["status"], cell["error"] = self._judge(failed, counts)
        scale_times(cell, cfg.time_scale)
        origin = min((r.sent_at for r in reqs if r.sent_at is not None), default=None)
        rows = [request_row(r, "burst", cfg.context, self.N, origin, cfg.workload) for r in reqs]
        for row in rows:
            scale_times(row, cfg.time_scale, rows=True)
        return cell, rows if cfg.keep_requests else []

    def _server_figures(self, start: float, end: float) -> None:
        cell = self.cell
        inside = [s for s in self.samples if start <= s.at <= end]
        running = [v for v in (s.get("running") for s in inside) if v is not None]
        if running:
            cell["avg_active_requests"] = sum(running) / len(running)
            cell["active_source"] = "server"
        else:  # the client's in-flight time over the burst
            busy = sum(
                max(0.0, min(end, r.ended_at or end) - max(start, r.sent_at))
                for r in self.requests
                if r.sent_at is not None
            )
            cell["avg_active_requests"] = busy / (end - start) if end > start else None
            cell["active_source"] = "client"
        a, b = self.before, self.after
        server_figures(cell, [*inside, *(s for s in (a, b) if s is not None)], a, b)

    def _judge(self, failed: list[Request], counts: set[int | None]) -> tuple[str, str | None]:
        """failed: something broke; invalid: it ran, but the numbers cannot be trusted. A
        request waiting on the server is part of what a burst measures (its admission), so
        `server_max_waiting` is recorded, never a reason."""
        cfg, cell = self.cfg, self.cell
        if self.failure is not None or failed:
            reason = self.failure or str(failed[0].error)
            if len(failed) > 1:
                reason += f" ({len(failed)} failed requests)"
            return "failed", "; ".join([reason, *self.notes])
        reasons: list[str] = []
        if counts != {cfg.context}:
            seen = ", ".join(str(c) for c in sorted(counts, key=lambda c: c or 0))
            reasons.append(f"server counted prompt tokens {seen or 'none'}, not {cfg.context}")
        if cell["server_preemptions"]:
            reasons.append(f"{cell['server_preemptions']} preemptions during the burst")
        gen, out = cell["server_generation_tokens"], cell["output_tokens"]
        # both readings on an idle server: the counts must agree, up to the tolerance
        if (
            isinstance(gen, int)
            and isinstance(out, int)
            and abs(gen - out) > cfg.token_tolerance * max(gen, out)
        ):
            reasons.append(
                f"client counted {out} output tokens, server {gen} "
                f"(vllm:generation_tokens_total); over {cfg.token_tolerance:.0%}"
            )
        reasons += self.monitor.saturation(cfg.max_loop_lag_ms, cfg.max_client_cpu_pct)
        if reasons:
            return "invalid", "; ".join(reasons + self.notes)
        return "valid", None


def _size(parts: list[bytes]) -> int:
    return sum(len(p) for p in parts)
