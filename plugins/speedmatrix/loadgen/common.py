"""Pieces both cell kinds share: model check, timeouts watchdog, progress line, request rows."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import Any

from speedmatrix.records import CellRecord

from .control import CellNotAttempted, ControlClient
from .prometheus import Snapshot, rise
from .prompts import BodyBuilder, build_prompts
from .stats import ms
from .stream import Endpoint, Request, StreamConnection


async def check_model(ctl: ControlClient, model: str) -> None:
    """Fail fast (not attempted) when the server is down or does not serve the model."""
    served = await ctl.models()
    if served and model not in served:
        raise CellNotAttempted(f"model {model!r} is not served here (served: {', '.join(served)})")


class Watchdog:
    """One task enforcing first-token and stall timeouts on every in-flight request.

    A timer per chunk would cost more than the parsing; a 0.25 s sweep is plenty for timeouts
    measured in tens of seconds.
    """

    def __init__(
        self,
        active: Callable[[], Iterable[tuple[StreamConnection, Request, float]]],
        stall_s: float,
        tick_s: float = 0.25,
    ) -> None:
        self._active = active
        self.stall_s = stall_s
        self.tick_s = tick_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            now = perf_counter()
            for conn, req, first_token_s in list(self._active()):
                if req.first_at is None:
                    since = req.sent_at
                    if since is not None and now - since > first_token_s:
                        conn.fail(f"no first token within {first_token_s:.0f} s")
                elif req.last_at is not None and now - req.last_at > self.stall_s:
                    conn.fail(f"stream stalled: no token for {self.stall_s:.0f} s")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def measure_with_prompts(
    cfg: Any, cell: Callable[..., Any]
) -> tuple[CellRecord, list[dict[str, object]]]:
    """What a decode and a burst cell do before any clock starts: the model checked, the
    prompts of the cell's streams (one when shared) as exact token ids, their bodies' builder;
    then `cell(cfg, endpoint, control client, builder).run()`. Raises CellNotAttempted when
    the server is unreachable or does not serve the model."""
    endpoint = Endpoint(cfg.base_url, cfg.api_key)
    async with ControlClient(cfg.base_url, cfg.api_key) as ctl:
        await check_model(ctl, cfg.model)
        shared = cfg.prompt_mode == "shared"
        prompts = await build_prompts(
            ctl, cfg.model, cfg.context, cfg.run_tag, cfg.concurrency, shared, cfg.workload
        )
        builder = BodyBuilder(cfg.model, prompts, cfg.salt, cfg.extra_body)
        result: tuple[CellRecord, list[dict[str, object]]] = await cell(
            cfg, endpoint, ctl, builder
        ).run()
        return result


def progress_enabled(flag: bool | None) -> bool:
    if flag is not None:
        return flag
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """A live one-line status on stderr, rewritten in place (terminals only)."""

    def __init__(self, label: str, line: Callable[[], str], enabled: bool) -> None:
        self.label = label
        self.line = line
        self.enabled = enabled
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            sys.stderr.write(f"\r\x1b[2K{self.label} {self.line()}")
            sys.stderr.flush()
            await asyncio.sleep(0.5)

    async def stop(self, final: str | None = None) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.enabled:
            sys.stderr.write(f"\r\x1b[2K{self.label} {final or self.line()}\n")
            sys.stderr.flush()


def request_row(
    req: Request,
    phase: str,
    context: int,
    concurrency: int,
    origin: float | None,
    workload: str | None = None,
) -> dict[str, object]:
    """One `requests` table row (records.REQUEST_FIELDS)."""
    ttft = None
    if req.first_at is not None and req.sent_at is not None:
        ttft = ms(req.first_at - req.sent_at)
    return {
        "phase": phase,
        "context_tokens": context,
        "concurrency": concurrency,
        "request_index": req.index,
        "stream": req.stream,
        "prompt_tokens": req.prompt_tokens,
        "output_tokens": req.tokens,
        "window_tokens": req.w_tokens if phase == "decode" else None,
        "ttft_ms": ttft,
        "tbt_ms": ms(req.tbt()),
        "chunks": req.chunks,
        "max_chunk_gap_ms": ms(req.max_gap) if req.chunks > 1 else None,
        "start_offset_s": _offset(req.sent_at, origin),
        "end_offset_s": _offset(req.ended_at, origin),
        "finished": req.finished,
        "error": req.error,
        "workload": workload,
    }


def _offset(t: float | None, origin: float | None) -> float | None:
    if t is None or origin is None:
        return None
    return t - origin


def server_figures(
    cell: dict, points: Iterable[Snapshot], start: Snapshot | None, end: Snapshot | None
) -> None:
    """The cell's figures from the server's /metrics (decode and burst cells alike): the
    gauges' maxima over `points` (queued requests, KV usage) and the counters' rises from
    `start` to `end` (generated tokens, preemptions, prefix-cache hit rate, spec-decode
    acceptance length, 1 + accepted / drafts)."""
    points = list(points)
    waiting = [v for v in (s.get("waiting") for s in points) if v is not None]
    kv = [v for v in (s.get("kv_usage") for s in points) if v is not None]
    cell["server_max_waiting"] = max(waiting) if waiting else None
    cell["kv_cache_usage_max"] = max(kv) if kv else None
    gen = rise(start, end, "generation_tokens")
    cell["server_generation_tokens"] = None if gen is None else round(gen)
    pre = rise(start, end, "preemptions")
    cell["server_preemptions"] = None if pre is None else round(pre)
    queries, hits = rise(start, end, "prefix_queries"), rise(start, end, "prefix_hits")
    if queries and hits is not None:
        cell["prefix_cache_hit_rate"] = hits / queries
    drafts, accepted = rise(start, end, "spec_drafts"), rise(start, end, "spec_accepted")
    if drafts and accepted is not None:
        cell["spec_acceptance_length"] = 1.0 + accepted / drafts
