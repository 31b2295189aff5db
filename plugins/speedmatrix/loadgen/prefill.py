"""One prefill cell: a single cold request of exactly `context` tokens with max_tokens=1.

Cold because the prompt starts with the run tag and carries the run's cache salt; the server's
prefix-cache counters confirm it when it has them. Prompt tok/s = prompt tokens / TTFT.
The prompt is stream 0's decode prompt for this context and run tag, so the prefill also warms
the cache for the decode cells that follow ("measured during decode warm-up").
"""

from __future__ import annotations

from datetime import UTC, datetime
from time import perf_counter

from speedmatrix.records import WARM_PREFILL, CellRecord, context_label, empty_cell

from .common import Progress, Watchdog, check_model, progress_enabled, request_row
from .config import PrefillConfig
from .control import ControlClient, MetricsUnavailable
from .prompts import BodyBuilder, build_prompts
from .promtext import rise
from .stats import ms, scale_times
from .stream import Endpoint, Request, Window, connect


async def run_prefill(cfg: PrefillConfig) -> tuple[CellRecord, list[dict[str, object]]]:
    """Measure one prefill cell; returns (cell record, [the request's row])."""
    cfg.validate()
    if cfg.measurement_profile == "published":  # the published tool's definitions
        from .published import run_published_prefill

        return await run_published_prefill(cfg)
    endpoint = Endpoint(cfg.base_url, cfg.api_key)
    cell = empty_cell(
        phase="prefill",
        context_tokens=cfg.context,
        context_label=context_label(cfg.context),
        concurrency=1,
        status="failed",
        max_output_tokens=1,
        workload=cfg.workload,
        requests_started=0,
        requests_failed=0,
        started_at=datetime.now(UTC),
        measurement_profile="default",
    )
    async with ControlClient(cfg.base_url, cfg.api_key) as ctl:
        await check_model(ctl, cfg.model)
        prompts = await build_prompts(
            ctl, cfg.model, cfg.context, cfg.run_tag, 1, False, cfg.workload
        )
        builder = BodyBuilder(cfg.model, prompts, cfg.salt, cfg.extra_body)
        parts = builder.parts(0, 1)
        message = [endpoint.head(sum(len(p) for p in parts)), *parts]
        idle, before = await ctl.wait_idle(cfg.idle_timeout_s)
        if not idle:
            cell["error"] = f"server not idle before the cell ({ctl.describe(before)})"
            return cell, []
        req = Request(0, 0, 1, False)
        try:
            conn = await connect(endpoint, Window(), lambda r, t: None, cfg.connect_timeout_s)
        except (TimeoutError, OSError) as exc:
            cell["error"] = f"could not connect: {exc!r}"
            return cell, []
        first_token_s = cfg.first_token_timeout(1)
        watchdog = Watchdog(lambda: [(conn, req, first_token_s)], cfg.stall_timeout_s)
        t0 = perf_counter()
        progress = Progress(
            f"prefill {context_label(cfg.context)}",
            lambda: f"waiting for the first token: {perf_counter() - t0:.1f} s",
            progress_enabled(cfg.progress),
        )
        watchdog.start()
        progress.start()
        try:
            await conn.send(req, message)
        finally:
            await watchdog.stop()
            conn.close()
            await progress.stop(_summary(req))
        try:
            after = await ctl.metrics()
        except MetricsUnavailable as exc:
            after, missing = None, f"no /metrics reading after the request ({exc})"
        else:
            missing = None
        has_metrics = ctl.has_metrics
    cell["requests_started"] = 1
    row = request_row(req, "prefill", cfg.context, 1, req.sent_at, cfg.workload)
    if req.error is not None:
        cell["requests_failed"] = 1
        cell["error"] = req.error
        return cell, [row]
    assert req.first_at is not None and req.sent_at is not None
    ttft = req.first_at - req.sent_at
    prompt_tokens = req.prompt_tokens if req.prompt_tokens is not None else cfg.context
    cell.update(
        context_tokens=prompt_tokens,
        context_label=context_label(prompt_tokens),
        ttft_ms=ms(ttft),
        ttft_p90_ms=ms(ttft),
        ttft_p99_ms=ms(ttft),
        total_tok_s=prompt_tokens / ttft if ttft > 0 else None,
        completed_requests=1,
        samples=1,
    )
    scale_times(cell, cfg.time_scale)
    scale_times(row, cfg.time_scale, rows=True)
    hits = rise(before, after, "prefix_hits")
    queries = rise(before, after, "prefix_queries")
    if queries:
        cell["prefix_cache_hit_rate"] = (hits or 0.0) / queries
    problems = []
    if req.prompt_tokens is None:
        problems.append("server did not report usage.prompt_tokens")
    elif req.prompt_tokens != cfg.context:
        problems.append(f"server counted {req.prompt_tokens} prompt tokens, not {cfg.context}")
    if hits:
        problems.append(f"{WARM_PREFILL}: {hits:g} tokens came from the prefix cache")
    if has_metrics and missing:
        # the server has prefix-cache counters, but not around this request: cold unproven
        problems.append(f"{missing}: the cold check cannot be made")
    cell["status"] = "invalid" if problems else "valid"
    cell["error"] = "; ".join(problems) or None
    return cell, [row]


def _summary(req: Request) -> str:
    if req.error:
        return f"failed: {req.error}"
    if req.first_at is None or req.sent_at is None:
        return "no first token"
    return f"TTFT {(req.first_at - req.sent_at) * 1000:,.0f} ms"
