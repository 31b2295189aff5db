"""The `published` measurement profile's cells: the published tool's definitions.

What llm-inference-bench (``llm_decode_bench.py``) does, read line by line, and done here
(where ours differs, it says so):

- prompts: one chat-text payload per context, sized by characters (``published_prompt``), the
  same for all C streams of a decode cell;
- TTFT runs from before the request body is built, on a new client per cell: the first request
  of each stream also pays its TCP connect;
- ``ignore_eos`` without ``min_tokens``;
- a global warm-up before the run's first cell: a short request, a hidden 8K prefill, and at
  the largest context one 32-token request where the tool runs a hidden 3 s C=1 decode cell
  (``global_warmup``; docs/measurement.md lists this and the other differences: the window's
  edges, TTFT's client work, the prompt text);
- a decode cell sends one ``max_tokens=1`` scout request (the prefill into the prefix cache),
  then starts C streams; its window opens once, at least 2 s in, the server has had
  ``running >= C`` with nothing waiting and every stream its first token for 3 s (ours reads
  /metrics at every 0.5 s poll, the tool once a second), and lasts the cell's duration; with
  short outputs (``SHORT_OUTPUT_TOKENS``) C completed requests stand in for ``running >= C``;
  not ready by the first-token timeout, the window opens anyway and the cell is kept with its
  figures, marked invalid with the reason (the tool's capacity-limited cell);
- total tok/s = the tokens whose usage rose inside the window / the time from the window's
  start to the last of them (the tool's ``usage_measure_end``, which is also what it records
  as the cell's measured time, the page's "Measured for"), not / the window: a window that
  ends while a restart waits for its first token leaves that wait out; per-request tok/s =
  total / C ("derive per-request from aggregate"); time between tokens = median over every
  request of the cell (the ramp's too) that has two token arrivals of (last token - first
  token) / (usage tokens - 1); TTFT = median over every request; a prefill's tok/s =
  ``usage.prompt_tokens`` / TTFT (``decode_figures``).

Our safeguards that change no figure stay (queueing, preemption and active-request checks make
a cell invalid; the window is exact). The record carries the prompt the server counted in
``context_tokens`` and the planned label in ``context_label``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from time import perf_counter

from speedmatrix.records import CellRecord, context_label, empty_cell

from . import published_prompt as pp
from .common import check_model, request_row
from .config import DecodeConfig, PrefillConfig
from .control import ControlClient, MetricsUnavailable
from .monitor import ClientMonitor
from .prometheus import Snapshot, rise
from .published_window import MIN_WARMUP_S, POLL_S, STABLE_S
from .stats import median, ms, percentile, scale_times
from .stream import INF, Endpoint, Request, StreamConnection, Window, connect

PROFILE = "published"
CHAT_PATH = "/v1/chat/completions"
SHORT_OUTPUT_TOKENS = 512
"""At most this many output tokens, requests end between two /metrics readings and ``running
>= C`` seldom holds for 3 s: the tool (8649-8668) then reads readiness off completed request
flow instead (at least C requests that produced tokens, nothing waiting, tokens flowing)."""
WARMUP_SHORT_TOKENS = 64
WARMUP_DECODE_TOKENS = 32
"""The global warm-up's short request and short decode (output tokens)."""


def request_tbt(req: Request) -> float | None:
    """The tool's time between tokens of one request: (its last token's arrival - its first's)
    / (its usage tokens - 1), the first arrival's tokens included however many it carried;
    none for a request with fewer than two arrivals (the tool's median drops a zero)."""
    if req.first_at is None or req.last_at is None or req.tokens < 2:
        return None
    if req.last_at <= req.first_at:
        return None
    return (req.last_at - req.first_at) / (req.tokens - 1)


def decode_figures(
    reqs: Sequence[Request], window: Window, concurrency: int
) -> dict[str, float | None]:
    """A decode cell's window figures by the tool's definitions (module docstring).

    measured_s runs from the window's start to the last arrival that raised a request's usage
    inside the window: the tool stamps every usage rise and divides by the last stamp's
    distance from the start, so time after the last token (a restart still waiting for its
    first) is not measured. With no token in the window it is the window (the tool then falls
    back to the server's counters, which we do not use: the cell has no rate).
    """
    tokens = sum(r.w_tokens for r in reqs)
    arrivals = [
        r.w_last if r.w_last is not None else r.w_first for r in reqs if r.w_first is not None
    ]
    last = max(arrivals, default=None)
    measured = last - window.ws if tokens and last is not None else window.we - window.ws
    total = tokens / measured if measured > 0 else 0.0
    return {
        "measured_s": measured,
        "output_tokens": tokens,
        "total_tok_s": total,
        "per_request_tok_s": total / concurrency,
        "tbt_ms": ms(median([x for x in map(request_tbt, reqs) if x is not None])),
    }


def _record(cfg: PrefillConfig | DecodeConfig, phase: str, concurrency: int) -> CellRecord:
    return empty_cell(
        phase=phase,
        context_tokens=cfg.context,
        context_label=context_label(cfg.context),
        concurrency=concurrency,
        status="failed",
        workload=cfg.workload,
        measurement_profile=PROFILE,
        started_at=datetime.now(UTC),
    )


class _Client:
    """A new client per cell: connections opened when a request is made (inside its TTFT)."""

    def __init__(self, cfg: PrefillConfig | DecodeConfig, window: Window, on_first=None):
        self.cfg = cfg
        self.endpoint = Endpoint(cfg.base_url, cfg.api_key, CHAT_PATH)
        self.window = window
        self.on_first = on_first or (lambda r, t: None)
        self.conns: list[StreamConnection] = []
        self.closing = False  # the cell is ending: no request may start (none would be cut)

    async def request(
        self, req: Request, msgs: list[dict[str, str]], conn: StreamConnection | None
    ) -> tuple[Request, StreamConnection | None]:
        """One request, its clock started before its connection and body exist."""
        t0 = perf_counter()
        if conn is None or conn.closed:
            try:
                conn = await connect(
                    self.endpoint, self.window, self.on_first, self.cfg.connect_timeout_s
                )
            except (TimeoutError, OSError) as exc:
                req.error = f"could not connect: {exc!r}"
                return req, None
            self.conns.append(conn)
        if self.closing:
            conn.close()
            return req, None
        data = pp.body(self.cfg.model, msgs, req.max_tokens, self.cfg.extra_body)
        await conn.send(req, [self.endpoint.head(len(data)), data], t0=t0)
        if not conn.keep_alive:
            conn.close()
        return req, conn

    def close(self) -> None:
        self.closing = True
        for conn in self.conns:
            conn.close()


async def global_warmup(
    cfg: PrefillConfig | DecodeConfig, ctl: ControlClient, cpt: float, hidden: int
) -> None:
    """The tool's warm-up before its first cell; nothing of it is measured. `hidden`: the
    hidden prefill's context (8K on the published pages: their smallest)."""
    client = _Client(cfg, Window())
    try:
        steps = [
            ([{"role": "user", "content": "Count from 1 to 20."}], WARMUP_SHORT_TOKENS),
            (pp.messages(pp.context_text(cfg.run_tag, hidden, cpt, "WARMUP")), 1),
        ]
        largest = cfg.global_warmup_context
        if largest:
            text = pp.context_text(cfg.run_tag, largest, cpt, "WARMUP_DECODE_CTX")
            steps.append((pp.messages(text), WARMUP_DECODE_TOKENS))
        conn = None
        for msgs, tokens in steps:
            _, conn = await client.request(Request(-1, 0, tokens, False), msgs, conn)
    finally:
        client.close()
    await ctl.wait_idle(cfg.idle_timeout_s)


async def _prepare(
    cfg: PrefillConfig | DecodeConfig, ctl: ControlClient
) -> tuple[list[dict[str, str]], str | None]:
    """(the cell's conversation, why the server is not idle or None)."""
    await check_model(ctl, cfg.model)
    largest = cfg.largest_context or max(cfg.context, cfg.global_warmup_context or 0)
    cpt = await pp.chars_per_token(ctl, cfg.model, cfg.run_tag, largest)
    if cfg.global_warmup_context is not None:
        await global_warmup(cfg, ctl, cpt, pp.probe_context(largest))
    idle, snap = await ctl.wait_idle(cfg.idle_timeout_s)
    msgs = pp.messages(pp.context_text(cfg.run_tag, cfg.context, cpt))
    return msgs, None if idle else f"server not idle before the cell ({ctl.describe(snap)})"


async def run_published_prefill(cfg: PrefillConfig) -> tuple[CellRecord, list[dict[str, object]]]:
    """One cold chat request with max_tokens=1: prompt tok/s = usage.prompt_tokens / TTFT."""
    cfg.validate()
    cell = _record(cfg, "prefill", 1)
    cell.update(max_output_tokens=1, requests_started=0, requests_failed=0)
    async with ControlClient(cfg.base_url, cfg.api_key) as ctl:
        msgs, busy = await _prepare(cfg, ctl)
        if busy:
            cell["error"] = busy
            return cell, []
        client = _Client(cfg, Window())
        req = Request(0, 0, 1, False)
        try:
            await asyncio.wait_for(client.request(req, msgs, None), cfg.first_token_timeout(1))
        except TimeoutError:
            req.error = "no answer within the first-token timeout"
        finally:
            client.close()
    cell["requests_started"] = 1
    row = request_row(req, "prefill", cfg.context, 1, req.sent_at, cfg.workload)
    if req.error is not None or req.first_at is None or req.sent_at is None:
        cell.update(requests_failed=1, error=req.error or "no first token")
        return cell, [row]
    ttft = req.first_at - req.sent_at
    tokens = req.prompt_tokens
    cell.update(
        context_tokens=tokens or cfg.context,
        ttft_ms=ms(ttft),
        ttft_p90_ms=ms(ttft),  # one request: its percentiles are its TTFT, as a default cell's
        ttft_p99_ms=ms(ttft),
        total_tok_s=tokens / ttft if tokens and ttft > 0 else None,
        completed_requests=1,
        samples=1,
    )
    scale_times(cell, cfg.time_scale)
    scale_times(row, cfg.time_scale, rows=True)
    ok = tokens is not None
    cell["status"] = "valid" if ok else "invalid"
    cell["error"] = None if ok else "server did not report usage.prompt_tokens"
    return cell, [row]


async def run_published_decode(cfg: DecodeConfig) -> tuple[CellRecord, list[dict[str, object]]]:
    """One sustained-decode cell by the published tool's definitions (module docstring)."""
    cfg.validate()
    async with ControlClient(cfg.base_url, cfg.api_key) as ctl:
        msgs, busy = await _prepare(cfg, ctl)
        cell = _PublishedDecode(cfg, ctl, msgs)
        if busy:
            cell.cell["error"] = busy
            return cell.cell, []
        return await cell.run()


class _PublishedDecode:
    def __init__(self, cfg: DecodeConfig, ctl: ControlClient, msgs: list[dict[str, str]]):
        self.cfg, self.ctl, self.msgs = cfg, ctl, msgs
        self.C = cfg.concurrency
        self.window = Window()
        self.client = _Client(cfg, self.window, self._on_first)
        self.requests: list[Request] = []
        self.started: set[int] = set()
        self.ended_with_tokens = 0  # requests that ended having produced a token (short path)
        self.readings: list[Snapshot] = []
        self.snap_start: Snapshot | None = None
        self.snap_end: Snapshot | None = None
        self.stopping = False
        self.failure: str | None = None
        self.degraded: str | None = None  # readiness timed out: measured anyway, marked
        self.sampler: asyncio.Future[None] | None = None
        self.monitor = ClientMonitor()  # rule 8, as in every cell: the client's own load
        self.cell = _record(cfg, "decode", self.C)
        self.cell.update(
            prompt_mode="shared", max_output_tokens=cfg.max_output_tokens, window_s=cfg.window_s
        )

    def _on_first(self, req: Request, t: float) -> None:
        if req.index >= 0:
            self.started.add(req.stream)

    async def run(self) -> tuple[CellRecord, list[dict[str, object]]]:
        cfg = self.cfg
        warm_from = perf_counter()
        scout = Request(-1, 0, 1, False)
        try:  # the tool's scout: the prefill into the prefix cache
            await asyncio.wait_for(
                self.client.request(scout, self.msgs, None), cfg.first_token_timeout(1)
            )
        except TimeoutError:
            scout.error = scout.error or "no answer within the first-token timeout"
        self.cell["warmup_s"] = perf_counter() - warm_from
        if scout.error:
            self.failure = f"scout request failed: {scout.error}"
            self.client.close()
            return self._finish()
        streams = [asyncio.ensure_future(self._stream(i)) for i in range(self.C)]
        self.monitor.start()
        try:
            opened = await self._open_window(perf_counter())
            if opened:
                await asyncio.sleep(max(self.window.we - perf_counter(), 0.0))
                self.snap_end = await self._read()
                self.monitor.end_window()
        finally:
            await self.monitor.stop()
            self.stopping = True
            self.client.closing = True
            t = perf_counter()
            for conn in self.client.conns:
                conn.cut(t)
            await asyncio.gather(*streams, return_exceptions=True)
            if self.sampler is not None:
                self.sampler.cancel()
                await asyncio.gather(self.sampler, return_exceptions=True)
            self.client.close()
        await self.ctl.wait_idle(cfg.idle_timeout_s)
        return self._finish()

    async def _stream(self, i: int) -> None:
        conn = None
        while not self.stopping:
            req = Request(len(self.requests), i, self.cfg.max_output_tokens, False)
            self.requests.append(req)
            _, conn = await self.client.request(req, self.msgs, conn)
            if req.first_at is not None:
                self.ended_with_tokens += 1
            if req.error is not None and not self.stopping:
                self.failure = self.failure or req.error
                self.stopping = True

    async def _read(self) -> Snapshot | None:
        try:
            return await self.ctl.metrics()
        except MetricsUnavailable:
            return None

    async def _open_window(self, t_start: float) -> bool:
        """Poll as the tool does until ready for STABLE_S; then the window is [now, now + d].

        Not ready by the first-token timeout, the tool measures anyway from then and marks the
        cell (capacity-limited, llm_decode_bench.py 8709-8742): so do we, the cell kept with
        its figures and made invalid with the reason (``_judge``), never failed."""
        deadline = t_start + self.cfg.first_token_timeout(self.C)
        stable_since: float | None = None
        while not self.stopping:
            await asyncio.sleep(POLL_S / 2)
            now = perf_counter()
            snap = await self._read()
            if snap is not None:
                self.readings.append(snap)
            if now > deadline:
                state = f"{len(self.started)} of {self.C} streams started"
                if snap is not None:
                    state += f", running {snap.get('running')}, waiting {snap.get('waiting')}"
                self.degraded = (
                    f"not ready within {deadline - t_start:.0f} s ({state}): measured anyway, "
                    f"as the published tool does"
                )
                self._open(now, snap)
                return True
            if now - t_start < MIN_WARMUP_S / self.cfg.time_scale:
                continue
            ready = len(self.started) >= self.C
            if snap is not None:
                short_flow = (
                    self.cfg.max_output_tokens <= SHORT_OUTPUT_TOKENS
                    and self.ended_with_tokens >= self.C
                    and any(r.first_at is not None for r in self.requests)
                )
                ready = ready and (snap.get("waiting") or 0) == 0
                ready = ready and ((snap.get("running") or 0) >= self.C or short_flow)
            if not ready:
                stable_since = None
            elif stable_since is None:
                stable_since = now
            elif now - stable_since >= STABLE_S / self.cfg.time_scale:
                self._open(now, snap)
                return True
        return False

    def _open(self, now: float, snap: Snapshot | None) -> None:
        """The window is [now, now + the cell's duration]."""
        self.snap_start = snap
        self.window.ws = now
        self.window.we = now + self.cfg.window_s / self.cfg.time_scale
        self.monitor.begin_window()
        self.sampler = asyncio.ensure_future(self._sample())

    async def _sample(self) -> None:
        step = min(POLL_S, self.cfg.window_s / self.cfg.time_scale / 20)
        while not self.stopping and perf_counter() < self.window.we:
            await asyncio.sleep(step)
            snap = await self._read()
            if snap is not None:
                self.readings.append(snap)

    def _finish(self) -> tuple[CellRecord, list[dict[str, object]]]:
        cfg, cell, w = self.cfg, self.cell, self.window
        reqs = self.requests
        ttfts = [r.first_at - r.sent_at for r in reqs if r.first_at and r.sent_at]
        itls = [x for x in map(request_tbt, reqs) if x is not None]
        counted = {r.prompt_tokens for r in reqs if r.prompt_tokens}
        cell.update(
            requests_started=len(reqs),
            requests_failed=sum(1 for r in reqs if r.error and not r.finished),
            samples=len(itls),
            ttft_ms=ms(median(ttfts)),
            tbt_ms=ms(median(itls)),
            ttft_p90_ms=ms(percentile(ttfts, 90)),
            ttft_p99_ms=ms(percentile(ttfts, 99)),
            ttst_ms=ms(median([x for x in (r.ttst() for r in reqs) if x is not None])),
            tbt_p90_ms=ms(percentile(itls, 90)),
            tbt_p99_ms=ms(percentile(itls, 99)),
            client_cpu_pct=self.monitor.cpu_pct,
            loop_lag_p99_ms=self.monitor.lag_p99_ms,
        )
        if counted:
            cell["context_tokens"] = max(counted)
        if w.ws != INF and self.failure is None:
            figures = decode_figures(reqs, w, self.C)
            inside = [s for s in self.readings if w.ws <= s.at <= w.we + 0.05]
            running = [v for v in (s.get("running") for s in inside) if v is not None]
            waiting = [v for v in (s.get("waiting") for s in inside) if v is not None]
            cell.update(
                **figures,
                completed_requests=sum(
                    1 for r in reqs if r.finished and w.ws < (r.ended_at or 0) <= w.we
                ),
                avg_active_requests=sum(running) / len(running) if running else None,
                active_source="server" if running else None,
                server_max_waiting=max(waiting) if waiting else None,
            )
            gen = rise(self.snap_start, self.snap_end, "generation_tokens")
            cell["server_generation_tokens"] = None if gen is None else round(gen)
            pre = rise(self.snap_start, self.snap_end, "preemptions")
            cell["server_preemptions"] = None if pre is None else round(pre)
            drafts = rise(self.snap_start, self.snap_end, "spec_drafts")
            accepted = rise(self.snap_start, self.snap_end, "spec_accepted")
            if drafts and accepted is not None:
                cell["spec_acceptance_length"] = 1.0 + accepted / drafts
        cell["status"], cell["error"] = self._judge()
        scale_times(cell, cfg.time_scale)
        rows = [
            request_row(
                r, "decode", cfg.context, self.C, w.ws if w.ws != INF else None, cfg.workload
            )
            for r in reqs
        ]
        for row in rows:
            scale_times(row, cfg.time_scale, rows=True)
        return cell, rows if cfg.keep_requests else []

    def _judge(self) -> tuple[str, str | None]:
        """Our safeguards, which change no figure: failures fail; a queue, a preemption, fewer
        than C running in the window or a saturated client (rule 8) make the cell invalid."""
        cell = self.cell
        if self.failure is not None:
            return "failed", self.failure
        if self.window.ws == INF:
            return "failed", "the window never opened"
        reasons = [self.degraded] if self.degraded else []
        if cell["server_max_waiting"]:
            reasons.append(f"requests queued during the window ({cell['server_max_waiting']:g})")
        if cell["server_preemptions"]:
            reasons.append(f"{cell['server_preemptions']} preemptions during the window")
        active = cell["avg_active_requests"]
        if (
            isinstance(active, float)
            and abs(active - self.C) > self.cfg.max_active_deviation * self.C
        ):
            reasons.append(f"average active requests {active:.2f} of C={self.C}")
        reasons += self.monitor.saturation(self.cfg.max_loop_lag_ms, self.cfg.max_client_cpu_pct)
        return ("invalid", "; ".join(reasons)) if reasons else ("valid", None)
