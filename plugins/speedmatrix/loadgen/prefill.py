"""One prefill cell: `samples` cold requests (default 3) of exactly `context` tokens with
max_tokens=1, one after the other.

Cold because each prompt starts with a run tag of its own and carries that tag's cache salt (a
fresh tag per sample, the run's own tag last); the server's prefix-cache counters confirm it when
it has them. Prompt tok/s = prompt tokens / the median TTFT; the record says how many samples
(`samples`, `ttft_samples`) and how far apart they were (`ttft_spread_pct`), so a verdict can
tell one slow moment of the host from a slower engine. The last prompt is stream 0's
decode prompt for this context and run tag, so the prefill also warms the cache for the decode
cells that follow ("measured during decode warm-up"), and nothing sent after it pushes it out.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from time import perf_counter

from speedmatrix.records import WARM_PREFILL, CellRecord, context_label, empty_cell

from .common import Progress, Watchdog, check_model, progress_enabled, request_row
from .config import PrefillConfig
from .control import ControlClient, MetricsUnavailable
from .prometheus import rise
from .prompts import BodyBuilder, build_prompts
from .stats import median, ms, percentile, scale_times
from .stream import Endpoint, Request, Window, connect


def sample_tags(cfg: PrefillConfig) -> list[str]:
    """The run tag of each sample, in the order sent: fresh ones (`<tag>s1`, `<tag>s2` …: a
    prompt no earlier request of the run sent, so the prefix cache cannot hold it), then the
    run's own, whose prompt the decode cells' stream 0 reuses."""
    return [f"{cfg.run_tag}s{k}" for k in range(1, cfg.samples)] + [cfg.run_tag]


class _NotAttempted(Exception):
    """The server was busy or unreachable before a sample: nothing of it was measured."""


async def run_prefill(cfg: PrefillConfig) -> tuple[CellRecord, list[dict[str, object]]]:
    """Measure one prefill cell; returns (cell record, [one row per request sent])."""
    cfg.validate()
    if cfg.measurement_profile == "published":  # the published tool's definitions
        from .published import run_published_prefill

        return await run_published_prefill(cfg)
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
    reqs: list[Request] = []
    problems: list[str] = []
    hits = queries = 0.0
    async with ControlClient(cfg.base_url, cfg.api_key) as ctl:
        await check_model(ctl, cfg.model)
        for index, tag in enumerate(sample_tags(cfg)):
            try:
                req, rose, missing = await _sample(replace(cfg, run_tag=tag), ctl, index)
            except _NotAttempted as exc:
                cell["error"] = str(exc)
                return cell, _rows(reqs, cfg)
            reqs.append(req)
            if req.error is not None:
                break
            hits, queries = hits + (rose[0] or 0.0), queries + (rose[1] or 0.0)
            if ctl.has_metrics and missing:
                # the server has prefix-cache counters, but not around this request: cold unproven
                problems.append(f"{missing}: the cold check cannot be made")
    rows = _rows(reqs, cfg)
    cell["requests_started"] = len(reqs)
    failed = [r for r in reqs if r.error is not None]
    if failed:
        cell["requests_failed"] = len(failed)
        cell["error"] = failed[0].error
        return cell, rows
    ttfts = [r.first_at - r.sent_at for r in reqs if r.first_at and r.sent_at]
    ttft = median(ttfts)
    assert ttft is not None
    counted = {r.prompt_tokens for r in reqs}
    prompt_tokens = next(iter(counted)) if len(counted) == 1 else None
    tokens = prompt_tokens if prompt_tokens is not None else cfg.context
    cell.update(
        context_tokens=tokens,
        context_label=context_label(tokens),
        ttft_ms=ms(ttft),
        ttft_p90_ms=ms(percentile(ttfts, 90)),
        ttft_p99_ms=ms(percentile(ttfts, 99)),
        total_tok_s=tokens / ttft if ttft > 0 else None,
        completed_requests=len(reqs),
        samples=len(ttfts),
        ttft_samples=len(ttfts),
        ttft_spread_pct=(max(ttfts) - min(ttfts)) / ttft * 100 if len(ttfts) > 1 else None,
    )
    scale_times(cell, cfg.time_scale)
    if queries:
        cell["prefix_cache_hit_rate"] = hits / queries
    if None in counted:
        problems.insert(0, "server did not report usage.prompt_tokens")
    elif counted != {cfg.context}:
        got = ", ".join(str(c) for c in sorted(counted))  # type: ignore[type-var]
        problems.insert(0, f"server counted {got} prompt tokens, not {cfg.context}")
    if hits:
        problems.append(f"{WARM_PREFILL}: {hits:g} tokens came from the prefix cache")
    problems = list(dict.fromkeys(problems))
    cell["status"] = "invalid" if problems else "valid"
    cell["error"] = "; ".join(problems) or None
    return cell, rows


async def _sample(
    cfg: PrefillConfig, ctl: ControlClient, index: int
) -> tuple[Request, tuple[float | None, float | None], str | None]:
    """One cold request of the cell, with its own run tag (`cfg`): (the request, the rise of
    the prefix-cache hits and queries around it, why /metrics could not be read after it)."""
    endpoint = Endpoint(cfg.base_url, cfg.api_key)
    prompts = await build_prompts(ctl, cfg.model, cfg.context, cfg.run_tag, 1, False, cfg.workload)
    builder = BodyBuilder(cfg.model, prompts, cfg.salt, cfg.extra_body)
    parts = builder.parts(0, 1)
    message = [endpoint.head(sum(len(p) for p in parts)), *parts]
    idle, before = await ctl.wait_idle(cfg.idle_timeout_s)
    if not idle:
        raise _NotAttempted(f"server not idle before the cell ({ctl.describe(before)})")
    req = Request(index, 0, 1, False)
    try:
        conn = await connect(endpoint, Window(), lambda r, t: None, cfg.connect_timeout_s)
    except (TimeoutError, OSError) as exc:
        raise _NotAttempted(f"could not connect: {exc!r}") from None
    first_token_s = cfg.first_token_timeout(1)
    watchdog = Watchdog(lambda: [(conn, req, first_token_s)], cfg.stall_timeout_s)
    t0 = perf_counter()
    progress = Progress(
        f"prefill {context_label(cfg.context)} ({index + 1}/{cfg.samples})",
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
        return req, (None, None), f"no /metrics reading after the request ({exc})"
    return req, (rise(before, after, "prefix_hits"), rise(before, after, "prefix_queries")), None


def _rows(reqs: list[Request], cfg: PrefillConfig) -> list[dict[str, object]]:
    out = []
    for req in reqs:
        row = request_row(req, "prefill", cfg.context, 1, req.sent_at, cfg.workload)
        scale_times(row, cfg.time_scale, rows=True)
        out.append(row)
    return out


def _summary(req: Request) -> str:
    if req.error:
        return f"failed: {req.error}"
    if req.first_at is None or req.sent_at is None:
        return "no first token"
    return f"TTFT {(req.first_at - req.sent_at) * 1000:,.0f} ms"
