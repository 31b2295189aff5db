"""vLLM's HTTP surface over the simulated engine (aiohttp; uvloop where importable).

Endpoints, as vLLM 0.32 answers them:

- ``GET /health`` (200; 503 when the ``engine_dead`` fault is set), ``GET /version``,
  ``GET /metrics`` (Prometheus text, vLLM's metric names), ``POST /tokenize``,
  ``POST /detokenize``: always open, as in vLLM.
- ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``: with an API key
  set, anything under ``/v1`` needs ``Authorization: Bearer <key>`` (401 otherwise).
- Completions take ``prompt`` as a string, a list of token ids, or a one-element list of either;
  ``max_tokens`` (default 16), ``min_tokens``, ``ignore_eos``, ``stream``, ``stream_options``
  (``include_usage``, ``continuous_usage_stats``), ``cache_salt``. A prompt of more than
  max-model-len tokens (vLLM's "exceeds this limit even without any output tokens"), one of
  exactly max-model-len (no room for an output token: "max_tokens must be at least 1, got 0."),
  ids outside the vocabulary, or bad fields are a 400 with vLLM's error body
  ``{"error": {"message", "type", "param", "code"}}`` (type "Bad Request" and param null for a
  ``stream`` or ``ignore_eos`` that is no boolean: vLLM's request model rejects those before its
  handler runs). Output that would pass max-model-len is silently shortened (finish_reason
  "length"), as vLLM does: max_tokens is clamped to the room left, before min_tokens is checked
  against it (so min_tokens = max_tokens past max-model-len is a 400, as in vLLM). With a profile's ``natural_stop_tokens``, a request without
  ``ignore_eos`` ends "stop" there, or at token ``min_tokens + 1`` if later (vLLM masks EOS
  while fewer than min_tokens are out), unless max_tokens comes first. An ``X-Request-Id``
  header becomes the request id (``cmpl-<id>``) and is echoed. A request's modelled front end
  starts when the server receives it and runs while the simulator reads, parses and tokenizes
  it (a real server's parsing and tokenizing is what that modelled delay holds, as a page's
  first tokens do); the engine gets it once that is done. The simulator's own work never
  lengthens the modelled time (on a loaded host a long chat prompt's tokenizing took hundreds
  of ms): where it outlasts the modelled delay, the arrival is moved so the recorded TTFT stays
  the model's, and only a client's wall-clock TTFT sees the excess (docs/measurement.md).
- A client that disconnects has its request aborted (blocks freed), as vLLM does.

Simulated time. The engine runs on a simulated clock that starts at 0 when the server starts
and runs ``time_scale`` times faster than the wall clock (default 1: real time). Everything the
server reports is on that clock, consistently: ``created`` is the start's Unix time plus the
simulated seconds, and ground truth is in simulated seconds. A client measuring with its wall
clock sees durations divided by ``time_scale`` and rates multiplied by it: multiply its wall
durations by ``time_scale`` (the load generator's ``--time-scale``) to get simulated figures.
Every response carries ``X-Sim-Time-Scale`` so a client can tell. When the event loop falls
behind, the engine still steps at exact simulated times; only the
delivery of chunks is late (visible in ground truth as chunk times after token times).

Ground truth (open, not in vLLM):

- ``GET /sim/state``: clock, time scale, running / waiting / front-end counts, KV usage, engine
  counters, the server's own event-loop lag (``loop_lag``: timer lateness; ``loop_queue_lag``:
  how long a ready callback waits; ``loop_io_lag``: how long a stamped datagram sent to UDP
  ``<host>:<port>`` waits for its read callback; p50 / p99 / max, ms), the CPU time one engine
  step holds the loop for (``engine_step_cpu_ms``; unlike wall-clock lag it does not count time
  the process waited for a CPU) and the chunk count. ``?reset_lag=1`` restarts the windows.
- ``GET /sim/requests`` (summaries; ``?detail=1`` adds per-token times; every live request and
  the last 2,000 finished ones: ``keep_finished``) and
  ``GET /sim/requests/{id}``: per request, arrival, front-end exit, first scheduling, every
  token's emission time (simulated s), steps, spec-decode acceptances, chunks written
  (simulated time, tokens), finish reason, preemptions, cached prompt tokens.
- ``GET /sim/faults``, ``POST /sim/faults``: the faults (see ``speedmatrix.sim.faults``).

Faults (details in ``speedmatrix.sim.faults``), set in the profile (``faults:``), with
``--faults JSON``, ``run_in_thread(faults=...)`` or ``POST /sim/faults``: every Nth request
answered HTTP 500 (``http_500_every``); every Nth stream dropped mid-stream after K tokens
(``disconnect_every``, ``disconnect_after_tokens``); every Nth request cut short with
finish_reason "length" (``short_output_every``, ``short_output_tokens``); a repetition loop
in the text (``repetition_every``); the prompt echoed as the output (``echo_every``); at most N running so that the rest queue and
``vllm:num_requests_waiting`` rises (``max_running``); a dead engine (``engine_dead``: /health
503, new requests 500 EngineDeadError, open streams dropped). Preemption needs no switch: a
profile with fewer KV blocks than the load needs preempts by itself.

One job, hence its length: the server of the simulated engine, i.e. the engine's clock driven
by the event loop and vLLM's routes answered from it (whole responses and streams). Running it
(on a thread, or as the process) is :mod:`speedmatrix.sim.runner`; the wire rules
(error bodies, request checks) are :mod:`speedmatrix.sim.api`; ``/metrics`` is rendered by
:mod:`speedmatrix.sim.metrics`; the loop-lag figures come from :mod:`speedmatrix.sim.lag`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from speedmatrix.sim.api import (
    ApiError,
    chat_text,
    completion_params,
    dumps,
    error_response,
    loads,
    prompt_ids,
)
from speedmatrix.sim.engine import FINISHED, Engine, Request
from speedmatrix.sim.faults import Faults
from speedmatrix.sim.lag import LagMonitor
from speedmatrix.sim.metrics import render_metrics
from speedmatrix.sim.profile import Profile
from speedmatrix.sim.tokenizer import Tokenizer, output_words

CATCH_UP_S = 0.005  # wall seconds behind schedule before catching up in bigger bites


CATCH_UP_EVENTS = 16  # ~8 steps per callback: about 1.5 ms at 128 sequences


WAKE_SLICE = 8  # streams woken per loop iteration (vLLM chunks its output processing too)


class SimServer:
    """The engine, its clock against the event loop, and the aiohttp application."""

    def __init__(
        self,
        profile: Profile,
        *,
        api_key: str | None = None,
        time_scale: float = 1.0,
        faults: Faults | dict[str, Any] | None = None,
        keep_finished: int = 2_000,
    ):
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.profile = profile
        self.api_key = api_key
        self.time_scale = float(time_scale)
        base = profile.raw.get("faults") if isinstance(profile.raw, dict) else None
        self.faults = Faults.coerce(faults if faults is not None else base)
        self._metrics_reads = 0
        self.engine = Engine(
            profile,
            max_running=self.faults.max_running,
            on_emit=self._on_emit,
            keep_finished=keep_finished,
        )
        self.engine.step_scale = 1.0 + self.faults.slow_steps_pct / 100.0
        self.tokenizer = Tokenizer(profile.vocab_size)
        self.lag = LagMonitor()
        self.step_cpu: deque[float] = deque(maxlen=20_000)
        self.chunks_sent = 0
        # Output tokens the API layer has handed to clients (written to a stream, or in a
        # whole response): what /metrics reports as vllm:generation_tokens_total. vLLM counts
        # in its API-server process as outputs reach the requests' queues; counting at the
        # write keeps the counter in step with what clients receive (the engine's own count,
        # a step ahead of delivery, stays in /sim/state counters).
        self.tokens_out = 0
        self._counter = itertools.count(1)
        self._dirty: list[Request] = []
        self._flush_pending = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wall0 = 0.0
        self._epoch0 = time.time()
        self._streams: set[Request] = set()
        self._model_json = json.dumps(profile.served_model_name)
        # vLLM's completions carry "vllm-<version>-<build hash>"; the simulator says it is one
        self._fingerprint = f"vllm-{profile.version}-sim"
        self._scale_header = f"{self.time_scale:g}"

    # --- clock and driver ---------------------------------------------------------------------
    def sim_now(self) -> float:
        # perf_counter, not loop.time(): uvloop's loop clock has millisecond resolution.
        return (time.perf_counter() - self._wall0) * self.time_scale

    def _start_clock(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wall0 = time.perf_counter()
        self._epoch0 = time.time()

    def sync(self) -> None:
        """Bring the engine to the current simulated time, deliver, and re-arm the timer."""
        self.engine.advance(max(self.sim_now(), self.engine.now))
        self._arm()
        self._flush()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        t = self.engine.next_event_time()
        if t is not None:
            delay = t / self.time_scale - (time.perf_counter() - self._wall0)
            self._timer = self._loop.call_later(max(delay, 0.0), self._fire, t)

    def _fire(self, t: float) -> None:
        c0 = time.thread_time()
        self._timer = None
        now = self.sim_now()
        # On time: one event per callback (a step's end, or the next step's start), so no
        # callback holds the loop long. Behind by more than CATCH_UP_S of wall time (the
        # process was not scheduled, or a huge prompt was hashed): catch up in bigger bites;
        # tokens then pile up per request and go out coalesced in one chunk, as vLLM's API
        # server does when it falls behind its engine.
        behind = (now - t) / self.time_scale > CATCH_UP_S
        self.engine.advance(max(now, t), max_events=CATCH_UP_EVENTS if behind else 1)
        self._arm()
        if self._dirty and not self._flush_pending:  # wake streams on the next loop pass
            self._flush_pending = True
            self._loop.call_soon(self._flush)
        # CPU time (not wall: immune to other processes) the engine step held the loop for.
        self.step_cpu.append(time.thread_time() - c0)

    def _on_emit(self, req: Request) -> None:
        if req.waiter is not None:
            self._dirty.append(req)

    def _flush(self) -> None:
        self._flush_pending = False
        dirty = self._dirty
        if not dirty:
            return
        batch, self._dirty = dirty[:WAKE_SLICE], dirty[WAKE_SLICE:]
        for r in batch:
            w = r.waiter
            if w is not None and not w.done():
                w.set_result(None)
        if self._dirty and not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def created(self) -> int:
        return int(self._epoch0 + self.sim_now())

    def set_faults(self, faults: Faults | dict[str, Any]) -> Faults:
        self.faults = Faults.coerce(faults)
        self._metrics_reads = 0  # metrics_error_reads counts from here
        self.engine.max_running = self.faults.max_running
        self.engine.step_scale = 1.0 + self.faults.slow_steps_pct / 100.0
        if self.faults.engine_dead:
            for req in list(self._streams):
                w = req.waiter
                if w is not None and not w.done():
                    w.set_exception(ConnectionAbortedError("engine dead"))
        if self._loop is not None:
            self.sync()
        return self.faults

    # --- the application ----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_get("/version", self.version)
        r.add_get("/metrics", self.metrics)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/sim/state", self.state)
        r.add_get("/sim/requests", self.requests)
        r.add_get("/sim/requests/{rid}", self.request_detail)
        r.add_get("/sim/faults", self.get_faults)
        r.add_post("/sim/faults", self.post_faults)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._start_clock()
        self.lag.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        self.lag.stop()
        if self._timer is not None:
            self._timer.cancel()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable):
        if (
            self.api_key
            and request.path.startswith("/v1")
            and request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        try:
            resp = await handler(request)
        except ApiError as exc:
            resp = error_response(exc.status, exc.message, exc.etype, exc.param)
        if not resp.prepared:  # streams sent their headers already (they carry it too)
            resp.headers["X-Sim-Time-Scale"] = self._scale_header
        return resp

    async def health(self, request: web.Request) -> web.Response:
        if self.faults.engine_dead:
            return web.Response(status=503)
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.profile.version})

    async def models(self, request: web.Request) -> web.Response:
        p = self.profile
        card = {
            "id": p.served_model_name,
            "object": "model",
            "created": self.created(),
            "owned_by": "vllm",
            "root": p.model,
            "parent": None,
            "max_model_len": p.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                    "object": "model_permission",
                    "created": self.created(),
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            data = loads(await request.read())
        except ValueError as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from exc
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return data

    async def tokenize(self, request: web.Request) -> web.Response:
        data = await self._json(request)
        if "messages" in data:
            generation = data.get("add_generation_prompt", True)
            ids = self.tokenizer.encode(chat_text(data["messages"], bool(generation)))
        elif isinstance(data.get("prompt"), str):
            ids = self.tokenizer.encode(data["prompt"])
        else:
            raise ApiError(400, "tokenize needs 'prompt' (a string) or 'messages'", param="prompt")
        body = {
            "count": len(ids),
            "max_model_len": self.profile.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        return web.Response(body=dumps(body), content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        data = await self._json(request)
        ids = data.get("tokens")
        if not isinstance(ids, list):
            raise ApiError(400, "detokenize needs 'tokens' (a list of ids)", param="tokens")
        bad = self.tokenizer.out_of_vocab(ids)
        if bad is not None:
            raise ApiError(400, f"Token id {bad} is out of vocabulary", param="tokens")
        return web.json_response({"prompt": self.tokenizer.decode(ids)})

    async def metrics(self, request: web.Request) -> web.Response:
        f = self.faults
        if f.metrics_error is not None:
            self._metrics_reads += 1
            if not f.metrics_error_reads or self._metrics_reads <= f.metrics_error_reads:
                return web.Response(status=f.metrics_error, text="simulated /metrics fault")
        self.sync()
        text = render_metrics(self.engine, self.profile, generation_tokens=self.tokens_out)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def state(self, request: web.Request) -> web.Response:
        self.sync()
        e = self.engine
        c = e.counters
        body = {
            "sim_time": e.now,
            "time_scale": self.time_scale,
            "running": len(e.running),
            "waiting": len(e.waiting),
            "frontend": e._n_frontend,
            "kv_usage": e.kv_usage(),
            "kv_free_blocks": e.pool.free,
            "counters": c.__dict__,
            "chunks_sent": self.chunks_sent,
            "tokens_out": self.tokens_out,
            "loop_lag": self.lag.summary(),
            "loop_queue_lag": self.lag.queue_summary(),
            "loop_io_lag": self.lag.io_summary(),
            "profile": self.profile.name,
        }
        steps = sorted(self.step_cpu)
        body["engine_step_cpu_ms"] = {
            "samples": len(steps),
            "p50": steps[len(steps) // 2] * 1000 if steps else None,
            "p99": steps[min(len(steps) - 1, int(0.99 * len(steps)))] * 1000 if steps else None,
            "max": steps[-1] * 1000 if steps else None,
        }
        if request.query.get("reset_lag"):
            self.lag.reset()
            self.step_cpu.clear()
        return web.Response(body=dumps(body), content_type="application/json")

    async def requests(self, request: web.Request) -> web.Response:
        detail = request.query.get("detail") in ("1", "true")
        reqs = list(self.engine.finished.values()) + list(self.engine.live.values())
        out = []
        for r in sorted(reqs, key=lambda r: r.index):
            gt = r.ground_truth()
            if not detail:
                for key in ("token_times", "steps", "accepted", "chunks"):
                    gt.pop(key)
            out.append(gt)
        return web.Response(body=dumps(out), content_type="application/json")

    async def request_detail(self, request: web.Request) -> web.Response:
        r = self.engine.get(request.match_info["rid"])
        if r is None:
            raise ApiError(404, f"no request {request.match_info['rid']}", "NotFoundError")
        return web.Response(body=dumps(r.ground_truth()), content_type="application/json")

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.to_dict())

    async def post_faults(self, request: web.Request) -> web.Response:
        data = await self._json(request)
        try:
            faults = self.set_faults(data)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc), param="faults") from exc
        return web.json_response(faults.to_dict())

    # --- completions ----------------------------------------------------------------------------
    def _text(self, req: Request, start: int, count: int) -> str:
        """Output tokens start..start+count as text: made-up words, or (the echo fault) the
        request's own prompt from its start, as a model that copies it would write."""
        ids = req.fault_echo
        if ids:
            return self.tokenizer.decode([ids[i % len(ids)] for i in range(start, start + count)])
        return output_words(req.index, start, count, req.fault_repeat)

    def _new_request(
        self, request: web.Request, ids, max_tokens, min_tokens, ignore_eos, salt, prefix
    ):
        p = self.profile
        n = next(self._counter)
        f = self.faults
        if f.engine_dead:
            raise ApiError(500, "EngineCore encountered an issue.", "EngineDeadError")
        if f.hits(f.http_500_every, n):
            raise ApiError(500, "Internal server error (simulated fault)", "InternalServerError")
        xrid = request.headers.get("X-Request-Id")
        rid = f"{prefix}-{xrid}" if xrid else f"{prefix}-{uuid.uuid4().hex}"
        if rid in self.engine.live:  # as vLLM: an id may be reused, not while in flight
            raise ApiError(400, f"Request id {rid} already running.", param="X-Request-Id")
        target, reason = max_tokens, "length"
        room = p.max_model_len - len(ids)
        if target > room:  # vLLM shortens silently what would pass max-model-len
            target = room
        if p.natural_stop_tokens and not ignore_eos:
            # EOS is masked while fewer than min_tokens are out, so the earliest it can come is
            # token min_tokens + 1; at max_tokens (or max-model-len) vLLM reports "length".
            stop_at = max(p.natural_stop_tokens, min_tokens + 1)
            if stop_at < target:
                target, reason = stop_at, "stop"
        if f.hits(f.short_output_every, n):
            target, reason = min(target, f.short_output_tokens), "length"
        req = Request(rid, ids, max_tokens, salt=salt, target=max(target, 1))
        req.finish_on_target = reason
        req.fault_disconnect = f.disconnect_after_tokens if f.hits(f.disconnect_every, n) else None
        req.fault_repeat = f.hits(f.repetition_every, n)
        req.fault_echo = ids if f.hits(f.echo_every, n) else None
        return req

    async def completions(self, request: web.Request) -> web.StreamResponse:
        received = self.sim_now()
        data = await self._json(request)
        if "prompt" not in data:
            raise ApiError(400, "'prompt' is required", param="prompt")
        ids = prompt_ids(self.tokenizer, data["prompt"])
        return await self._serve(request, data, ids, received, chat=False, default_max=16)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        received = self.sim_now()
        data = await self._json(request)
        ids = self.tokenizer.encode(chat_text(data.get("messages")))
        return await self._serve(request, data, ids, received, chat=True, default_max=None)

    async def _serve(self, request, data, ids, received: float, *, chat: bool, default_max):
        max_tokens, min_tokens, ignore_eos, stream, opts, salt = completion_params(
            self.profile, data, ids, default_max
        )
        prefix = "chatcmpl" if chat else "cmpl"
        req = self._new_request(request, ids, max_tokens, min_tokens, ignore_eos, salt, prefix)
        self.sync()
        # handed over now, its body read, parsed and tokenized: the simulator's own work
        # (hundreds of ms for a long chat prompt on a loaded host) runs inside the modelled
        # front end's delay from `received` and never lengthens the modelled time (Engine.add)
        self.engine.add(req, max(self.sim_now(), self.engine.now), received)
        self._arm()
        self._flush()
        headers = (
            {"X-Request-Id": request.headers["X-Request-Id"]}
            if "X-Request-Id" in request.headers
            else {}
        )
        try:
            if stream:
                return await self._stream(request, req, chat, opts, headers)
            return await self._whole(req, chat, headers)
        finally:
            if req.state != FINISHED:
                self.engine.abort(req.rid, max(self.sim_now(), self.engine.now))
                self._arm()
            self._streams.discard(req)
            req.waiter = None

    async def _wait(self, req: Request, sent: int) -> None:
        while req.out == sent and req.state != FINISHED:
            if self.faults.engine_dead:
                raise ConnectionAbortedError("engine dead")
            fut = self._loop.create_future()
            req.waiter = fut
            try:
                await fut
            finally:
                req.waiter = None

    async def _whole(self, req: Request, chat: bool, headers) -> web.Response:
        self._streams.add(req)
        try:
            while req.state != FINISHED:
                await self._wait(req, req.out)
        except ConnectionAbortedError as exc:  # engine_dead while waiting
            raise ApiError(500, "EngineCore encountered an issue.", "EngineDeadError") from exc
        text = self._text(req, 0, req.out)
        self.tokens_out += req.out
        usage = {
            "prompt_tokens": req.prompt_len,
            "total_tokens": req.prompt_len + req.out,
            "completion_tokens": req.out,
            "prompt_tokens_details": None,
        }
        if chat:
            message = {"role": "assistant", "content": text}
            message.update(dict.fromkeys(("refusal", "annotations", "audio", "function_call")))
            message["reasoning"] = None
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
            obj = "text_completion"
        body = {
            "id": req.rid,
            "object": obj,
            "created": self.created(),
            "model": self.profile.served_model_name,
            "choices": [choice],
            "usage": usage,
        }
        # the rest of vLLM 0.32's response, all null but the build (tests/integration/
        # test_sim_matches_vllm.py holds these shapes to a real vLLM server's)
        usage["completion_tokens_details"] = None
        body.update(service_tier=None, system_fingerprint=self._fingerprint)
        if chat:
            body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return web.Response(body=dumps(body), content_type="application/json", headers=headers)

    async def _stream(self, request, req: Request, chat: bool, opts, headers):
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "X-Sim-Time-Scale": self._scale_header,
                **headers,
            }
        )
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        self._streams.add(req)
        head = (
            f'data: {{"id":"{req.rid}","object":"'
            + ("chat.completion.chunk" if chat else "text_completion")
            + f'","created":{self.created()},"model":{self._model_json},"choices":['
        )
        plen = req.prompt_len
        repeat = req.fault_repeat
        cut = req.fault_disconnect

        # vLLM's chat chunks carry completion_tokens_details in their running usage
        details = ',"completion_tokens_details":null' if chat else ""

        def usage(n: int, running: bool = True) -> str:
            more = details if running else ""
            return f'"usage":{{"prompt_tokens":{plen},"total_tokens":{plen + n},"completion_tokens":{n}{more}}}'

        if chat:
            role = (
                head
                + '{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
            )
            role += ("," + usage(0) if continuous else "") + ',"prompt_token_ids":null'
            role += ',"prompt_text":null}\n\n'
            try:
                await resp.write(role.encode())
            except ConnectionResetError:
                return resp
        sent = 0
        try:
            while True:
                await self._wait(req, sent)
                n = req.out
                if n > sent:
                    if cut is not None and n >= cut:
                        n = max(cut, sent)
                    if req.fault_echo:  # prompt text: any character, so JSON-encode it
                        text = json.dumps(self._text(req, sent, n - sent))
                    else:  # the words are plain ASCII: quoting them needs no JSON encoder.
                        text = '"' + output_words(req.index, sent, n - sent, repeat) + '"'
                    done = req.state == FINISHED and n == req.out
                    fr = f'"{req.finish_reason}"' if done else "null"
                    if chat:  # vLLM names stop_reason in the last chunk only
                        last = ',"stop_reason":null' if done else ""
                        choice = f'{{"index":0,"delta":{{"content":{text}}},"logprobs":null,"finish_reason":{fr}{last},"token_ids":null}}]'
                    else:
                        choice = f'{{"index":0,"text":{text},"logprobs":null,"finish_reason":{fr},"stop_reason":null,"prompt_token_ids":null,"token_ids":null}}]'
                    line = head + choice + ("," + usage(n) if continuous else "")
                    if done and not include_usage:  # the stream's last chunk names the build
                        line += f',"system_fingerprint":"{self._fingerprint}"'
                    line += "}\n\n"
                    self.tokens_out += n - sent
                    await resp.write(line.encode())
                    self.chunks_sent += 1
                    req.chunk_times.append(self.sim_now())
                    req.chunk_tokens.append(n - sent)
                    sent = n
                    if cut is not None and sent >= cut:
                        # The disconnect fault: drop the connection mid-stream.
                        self.engine.abort(req.rid, max(self.sim_now(), self.engine.now))
                        self._arm()
                        if request.transport is not None:
                            request.transport.abort()
                        return resp
                if req.state == FINISHED and sent == req.out:
                    break
        except ConnectionAbortedError:  # engine_dead fault: open streams are dropped
            if request.transport is not None:
                request.transport.abort()
            return resp
        except ConnectionResetError:  # the client went away mid-write: abort (in _serve)
            return resp
        tail = ""
        if include_usage:
            build = f',"system_fingerprint":"{self._fingerprint}"'
            tail = head + "]," + usage(sent, running=False) + build + "}\n\n"
        try:
            await resp.write((tail + "data: [DONE]\n\n").encode())
            await resp.write_eof()
        except ConnectionResetError:
            pass  # finished; the client left before the last bytes
        return resp
