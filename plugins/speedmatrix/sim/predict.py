"""Predict a matrix cell by driving the engine model directly in simulated time (no HTTP).

This is a load generator in simulated time that follows docs/measurement.md the way the published
tool does: a prefill cell is one cold request with max_tokens=1 (prompt tok/s = tokens / TTFT);
a decode cell warms the prompt(s) into the prefix cache, starts C streams at once, restarts a
stream the moment it finishes, opens the window when all C have their first token (ours) or,
for a page of the published tool (``aggregate``), at that tool's readiness judgement 3-4 s
later (``loadgen/published_window.py``), and counts only tokens inside the window. Time between tokens is per token, per request, then the median.

Calibration fits the profile against these predictions, and the tests hold the calibrated
profile to the published report through them: fast and exact, with no wall clock involved.
"""

from __future__ import annotations

import statistics
from typing import Any

from speedmatrix.errors import InputError
from speedmatrix.loadgen.published_window import STABLE_S, judgements
from speedmatrix.loadgen.stats import rate_median
from speedmatrix.records import context_label, empty_cell
from speedmatrix.sim.engine import Engine, Request, block_hashes
from speedmatrix.sim.profile import Profile

PER_STREAM = "per_stream"
AGGREGATE = "aggregate"
ACCOUNTINGS = (PER_STREAM, AGGREGATE)
"""How a cell's per-request tok/s is formed: ``per_stream`` (ours, and the reference page's
tool version: 1 / the median per-request time between tokens) or ``aggregate`` (the published
tool's current code, llm_decode_bench.py: "derive per-request from aggregate", total / C, and
total over the time from the window's start to its last token).
They part when the streams are not busy the whole window: a request that ends restarts with
a first-token wait that lowers total tok/s and no time between tokens, and with speculation
the streams' acceptances differ."""

READY_TIMEOUT_S = 3600.0
"""A published-tool window not ready this long into its cell opens anyway (the tool measures
a cell it judged not ready, marked capacity-limited): a guard, no page's cell comes near it."""

ARRIVAL_GAP_S = 0.002
"""Simulated seconds between the C first requests of a decode cell (a client's write spacing)."""


_PROMPTS: dict[tuple[int, int, int], list[int]] = {}
_HASHES: dict[tuple[int, int, int, int], list[int]] = {}


def make_prompt(tokens: int, tag: int, vocab_size: int) -> list[int]:
    """A deterministic prompt whose first block is unique to `tag` (no accidental cache hits).

    Cached (calibration predicts the same cells many times); callers must not mutate it.
    """
    key = (tokens, tag, vocab_size)
    hit = _PROMPTS.get(key)
    if hit is None:
        if len(_PROMPTS) > 512:
            _PROMPTS.clear()
            _HASHES.clear()
        hit = _PROMPTS[key] = _make_prompt(tokens, tag, vocab_size)
    return hit


def _request(rid: str, prompt: list[int], max_tokens: int, profile: Profile) -> Request:
    """A request whose prompt block hashes come from a cache (same prompt, same hashes)."""
    key = (id(prompt), len(prompt), profile.block_size, prompt[0] if prompt else 0)
    hashes = _HASHES.get(key)
    if hashes is None:
        hashes = _HASHES[key] = block_hashes(prompt, profile.block_size, None)
    return Request(rid, prompt, max_tokens, hashes=hashes)


def _make_prompt(tokens: int, tag: int, vocab_size: int) -> list[int]:
    span = max(vocab_size - 1000, 1)
    head = [1000 + (tag * 7919 + j * 104729) % span for j in range(16)]
    body = [1000 + (i * 2654435761 + tag) % span for i in range(max(tokens - 16, 0))]
    return (head + body)[:tokens]


def default_prompt_mode(profile: Profile) -> str:
    """``distinct`` (the load generator's default) when the profile speculates: acceptance is
    drawn per prompt, so C streams on one shared prompt would all accept alike and a cell would
    not average C draws as the load generator's distinct prompts do; else ``shared`` (cheaper:
    one warm-up, and without speculation the two agree once warmed)."""
    return "distinct" if profile.spec_decode is not None else "shared"


def over_capacity(profile: Profile, context: int, concurrency: int, max_output: int) -> bool:
    """docs/measurement.md's rule: C x ceil((ctx + max_out) / block) > blocks - 1."""
    per_request = -(-(context + max_output) // profile.block_size)
    return concurrency * per_request > profile.num_gpu_blocks - 1


def _run_until_done(engine: Engine, req: Request) -> None:
    while not req.finished:
        t = engine.next_event_time()
        if t is None:
            raise RuntimeError(f"engine stalled with request {req.rid} unfinished")
        engine.advance(t)


def predict_prefill(profile: Profile, context: int, *, tag: int = 1) -> dict[str, Any]:
    """One cold request of `context` tokens with max_tokens=1, on an idle engine."""
    engine = Engine(profile)
    req = engine.add(_request("prefill", make_prompt(context, tag, profile.vocab_size), 1, profile))
    _run_until_done(engine, req)
    ttft = req.token_times[0] - req.arrival
    return empty_cell(
        phase="prefill",
        context_tokens=context,
        context_label=context_label(context),
        concurrency=1,
        status="valid",
        total_tok_s=context / ttft,
        ttft_ms=ttft * 1000.0,
        completed_requests=1,
        samples=1,
        requests_started=1,
        requests_failed=0,
    )


def predict_decode(
    profile: Profile,
    context: int,
    concurrency: int,
    *,
    window_s: float = 30.0,
    max_output: int = 4096,
    prompt_mode: str | None = None,
    arrival_gap_s: float = ARRIVAL_GAP_S,
    accounting: str = PER_STREAM,
    prompt_tag: int = 100,
) -> dict[str, Any]:
    """One sustained-decode cell; over_capacity (not run) by the KV-block rule.

    The C streams' first requests arrive `arrival_gap_s` apart (a client writes them one after
    the other): they then join the engine's steps the way they do over HTTP, rather than all
    landing in one idle step, which no real client achieves. `prompt_mode` defaults to
    ``default_prompt_mode(profile)``; `accounting` how per-request tok/s is formed (ACCOUNTINGS);
    `prompt_tag` the first prompt's tag (another tag: other prompts, as another client's).
    """
    if accounting not in ACCOUNTINGS:
        raise InputError(f"accounting must be one of {ACCOUNTINGS}, got {accounting!r}")
    prompt_mode = prompt_mode or default_prompt_mode(profile)
    cell = empty_cell(
        phase="decode",
        context_tokens=context,
        context_label=context_label(context),
        concurrency=concurrency,
        status="valid",
        prompt_mode=prompt_mode,
        max_output_tokens=max_output,
        window_s=window_s,
    )
    if over_capacity(profile, context, concurrency, max_output):
        cell["status"] = "over_capacity"
        return cell
    finished: list[Request] = []
    engine = Engine(profile, on_emit=lambda r: finished.append(r) if r.finished else None)
    n_prompts = 1 if prompt_mode == "shared" else concurrency
    prompts = [make_prompt(context, prompt_tag + i, profile.vocab_size) for i in range(n_prompts)]
    for i, prompt in enumerate(prompts):  # warm-up: the prefill request puts it in the cache
        _run_until_done(engine, engine.add(_request(f"warm-{i}", prompt, 1, profile)))
    finished.clear()
    engine.advance(engine.now + 1.0)
    requests: list[Request] = []

    def start(stream: int) -> None:
        req = _request(
            f"s{stream}-{len(requests)}", prompts[stream % n_prompts], max_output, profile
        )
        requests.append(engine.add(req))

    cell_start = engine.now
    for s in range(concurrency):
        if s:
            engine.advance(engine.now + arrival_gap_s)
        start(s)
    streams = {r.rid: i for i, r in enumerate(requests)}

    def restart_finished() -> None:
        for r in finished:
            s = streams[r.rid]
            start(s)
            streams[requests[-1].rid] = s
        finished.clear()

    def run_to(t: float) -> None:
        """Every event up to `t`, a finished stream restarting at its finish."""
        while (n := engine.next_event_time()) is not None and n <= t:
            engine.advance(n)
            restart_finished()
        engine.advance(t)

    # Ours opens the window when all C streams have their first token.
    while any(not r.token_times for r in requests[:concurrency]):
        engine.advance(engine.next_event_time())
        restart_finished()
    start_t = max(r.token_times[0] for r in requests[:concurrency])
    if accounting == AGGREGATE:
        # The published tool's opens at its readiness judgement (loadgen/published_window.py): 3-4 s
        # after that, which moves where a restarted request's first-token wait falls
        stable_since = None
        for t in judgements(cell_start):
            run_to(t)
            ready = len(engine.running) >= concurrency and not engine.waiting
            if not ready:
                stable_since = None
            elif stable_since is None:
                stable_since = t
            elif t - stable_since >= STABLE_S - 1e-9 or t - cell_start > READY_TIMEOUT_S:
                break
        start_t = engine.now
    end_t = start_t + window_s
    drafts0, accepted0 = engine.counters.spec_drafts, engine.counters.spec_accepted
    active_area = 0.0
    last_t = start_t
    while True:
        t = engine.next_event_time()
        if t is None or t > end_t:
            break
        if t > last_t:
            active_area += len(engine.running) * (t - last_t)
            last_t = t
        engine.advance(t)
        restart_finished()
    active_area += len(engine.running) * (end_t - last_t)
    window_tokens = 0
    last_token_t = start_t
    tbts: list[float] = []
    ttfts: list[float] = []
    completed = 0
    for r in requests:
        times = [x for x in r.token_times if x <= end_t]
        window_tokens += sum(1 for x in times if x >= start_t)
        if times and times[-1] > last_token_t:
            last_token_t = times[-1]
        if times:
            ttfts.append(times[0] - r.arrival)
        if len(times) > 1:
            tbts.append((times[-1] - times[0]) / (len(times) - 1))
        if r.finished_at is not None and start_t <= r.finished_at <= end_t:
            completed += 1
    tbt = statistics.median(tbts) if tbts else None
    drafts = engine.counters.spec_drafts - drafts0
    if drafts:  # as the load generator reads vLLM's counters: 1 + accepted / drafts
        cell["spec_acceptance_length"] = 1.0 + (engine.counters.spec_accepted - accepted0) / drafts
    # The published tool's current code divides by the time to the window's last token, not by
    # the window: a stream waiting for a restarted request's first token at the cut is not
    # counted (at C=1 with a long first-token wait that is seconds of a window).
    measured = window_s
    if accounting == AGGREGATE and last_token_t > start_t:
        measured = last_token_t - start_t
    total = window_tokens / measured
    cell.update(
        total_tok_s=total,
        per_request_tok_s=total / concurrency if accounting == AGGREGATE else rate_median(tbts),
        ttft_ms=statistics.median(ttfts) * 1000.0 if ttfts else None,
        tbt_ms=tbt * 1000.0 if tbt is not None else None,
        avg_active_requests=active_area / window_s,
        completed_requests=completed,
        output_tokens=window_tokens,
        measured_s=measured,
        requests_started=len(requests),
        requests_failed=0,
        samples=len(tbts),
        server_preemptions=engine.counters.preemptions,
        active_source="server",
    )
    return cell


def predict_burst(
    profile: Profile,
    context: int,
    requests: int,
    *,
    max_output: int = 4096,
    prompt_mode: str = "distinct",
    arrival_gap_s: float = ARRIVAL_GAP_S,
    prompt_tag: int = 100,
) -> dict[str, Any]:
    """One burst cell (loadgen/burst.py): the prompts warmed into the prefix cache, then
    `requests` requests sent at once (`arrival_gap_s` apart, as a client writes them) and run
    to completion. Latency is a request's last token - its arrival; per-user end-to-end tok/s
    its tokens / its latency; total tok/s every token / (the last token - the first arrival).
    Over capacity (not run) by the KV-block rule."""
    cell = empty_cell(
        phase="burst",
        context_tokens=context,
        context_label=context_label(context),
        concurrency=requests,
        status="valid",
        prompt_mode=prompt_mode,
        max_output_tokens=max_output,
    )
    if over_capacity(profile, context, requests, max_output):
        cell["status"] = "over_capacity"
        return cell
    engine = Engine(profile)
    n_prompts = 1 if prompt_mode == "shared" else requests
    prompts = [make_prompt(context, prompt_tag + i, profile.vocab_size) for i in range(n_prompts)]
    for i, prompt in enumerate(prompts):
        _run_until_done(engine, engine.add(_request(f"warm-{i}", prompt, 1, profile)))
    engine.advance(engine.now + 1.0)
    reqs: list[Request] = []
    for i in range(requests):
        if i:
            engine.advance(engine.now + arrival_gap_s)
        reqs.append(engine.add(_request(f"b{i}", prompts[i % n_prompts], max_output, profile)))
    for req in reqs:
        _run_until_done(engine, req)
    latencies = [r.token_times[-1] - r.arrival for r in reqs]
    tokens = sum(len(r.token_times) for r in reqs)
    span = max(r.token_times[-1] for r in reqs) - min(r.arrival for r in reqs)
    tbts = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in reqs]
    cell.update(
        total_tok_s=tokens / span,
        per_request_tok_s=rate_median(tbts),
        ttft_ms=statistics.median(r.token_times[0] - r.arrival for r in reqs) * 1000.0,
        tbt_ms=statistics.median(tbts) * 1000.0,
        latency_ms=statistics.median(latencies) * 1000.0,
        e2e_per_request_tok_s=statistics.median(
            len(r.token_times) / lat for r, lat in zip(reqs, latencies, strict=True)
        ),
        completed_requests=requests,
        output_tokens=tokens,
        measured_s=span,
        requests_started=requests,
        requests_failed=0,
    )
    return cell


def predict_matrix(
    profile: Profile,
    *,
    prefill_contexts: list[int],
    contexts: list[int],
    concurrencies: list[int],
    window_s: float = 30.0,
    max_output: int = 4096,
    prompt_mode: str | None = None,
    accounting: str = PER_STREAM,
) -> list[dict[str, Any]]:
    """Every cell of a matrix, prefill first, then decode row by row (the report's order)."""
    cells = [predict_prefill(profile, ctx, tag=i + 1) for i, ctx in enumerate(prefill_contexts)]
    for ctx in contexts:
        for c in concurrencies:
            cells.append(
                predict_decode(
                    profile,
                    ctx,
                    c,
                    window_s=window_s,
                    max_output=max_output,
                    prompt_mode=prompt_mode,
                    accounting=accounting,
                )
            )
    return cells
