"""An ideal streaming completion server with exactly known timing (the load generator's ruler).

It speaks just enough of vLLM's OpenAI surface for three clients (ours, `vllm bench serve`,
GuideLLM): POST /v1/completions (streamed, usage per chunk), POST /tokenize, GET /v1/models,
GET /metrics (running, waiting, generation_tokens_total), GET /health, and GET /truth (what it
actually did, measured on its own side).

Timing: a request's first token is written `ttft` after its body was received; emission j
(j >= 1) is written at t_first + j * interval, on an absolute schedule, so the long-run rate is
exact even when single timers fire late. Emission 0 carries 1 token (the "prefill" token, as
vLLM does); later emissions carry `tokens_per_chunk` tokens, and `coalesce` emissions are
written in one socket write. Truth per token: interval / tokens_per_chunk.

No aiohttp: a raw asyncio Protocol keeps the server's cost per chunk a few microseconds, so it is
not the bottleneck at 60K+ tokens/s on one core. Deliberately shares no code with the client.

Run: `python benchmarks/ideal_server.py --port 0 --interval-s 0.004 --ttft-s 0.02` (prints READY url)
In tests: `with run_in_thread(IdealConfig(...)) as (base_url, server): ...`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "had",
    "been",
    "one",
    "all",
    "we",
    "can",
    "their",
    "has",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "if",
    "out",
    "up",
    "what",
    "about",
    "time",
    "only",
    "into",
    "other",
    "new",
    "some",
    "could",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
]


@dataclass
class IdealConfig:
    ttft_s: float = 0.020
    interval_s: float = 0.004
    tokens_per_chunk: int = 1
    coalesce: int = 1
    prefill_tok_s: float | None = None  # when set, TTFT += prompt tokens / this
    max_running: int | None = None  # beyond this, requests wait (vllm:num_requests_waiting)
    model: str = "ideal"
    # injected faults (tests): each is "every Nth completion request" (1-based), 0 = off
    http_500_every: int = 0
    disconnect_every: int = 0
    disconnect_after_tokens: int = 5
    short_every: int = 0
    short_by: int = 3
    report_waiting: int = 0  # while busy, /metrics claims this many waiting (a queueing server)
    api_key: str | None = None
    metrics_count_scale: float = 1.0  # /metrics over- or under-counts generated tokens
    record_emissions: bool = True  # (perf_counter time, tokens) per write, for /truth


@dataclass(eq=False)
class _Req:
    rid: int
    conn: _Conn
    prompt_tokens: int
    max_tokens: int
    received: float
    disconnect_at: int | None = None
    short: int = 0
    sent: int = 0
    emissions: int = 0
    t_first: float | None = None
    first_n: int = 0
    t_last: float | None = None
    handle: asyncio.TimerHandle | None = None
    rng: random.Random = field(default_factory=random.Random)
    done: bool = False


class IdealServer:
    def __init__(self, cfg: IdealConfig) -> None:
        self.cfg = cfg
        self.loop: asyncio.AbstractEventLoop | None = None
        self.counter = 0
        self.running: set[_Req] = set()
        self.waiting: deque[_Req] = deque()
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.truth: list[dict[str, float | int | None]] = []
        self.lateness: list[float] = []
        self.emissions: list[tuple[float, int]] = []

    # -- request handling ---------------------------------------------------------------------
    def completion(self, conn: _Conn, raw: bytes) -> None:
        cfg = self.cfg
        self.counter += 1
        n = self.counter
        if cfg.http_500_every and n % cfg.http_500_every == 0:
            conn.respond(500, {"error": {"message": "injected internal error", "code": 500}})
            return
        # A token-id prompt is counted, not parsed: json.loads of a 512K-id array costs
        # tens of milliseconds, which would be server time hidden from the truth.
        start = raw.find(b'"prompt":[')
        ptoks: int | None = None
        if start >= 0:
            stop = raw.find(b"]", start)
            inner = raw[start + 10 : stop].strip()
            if inner and inner[:1] != b'"':
                ptoks = inner.count(b",") + 1
                raw = raw[:start] + b'"prompt":null' + raw[stop + 1 :]
        body = json.loads(raw or b"{}")
        prompt = body.get("prompt")
        if ptoks is None and isinstance(prompt, str):
            ptoks = len(tokenize(prompt, True))
        elif ptoks is None and isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            ptoks = len(tokenize(prompt[0], True))
        if ptoks is None:
            conn.respond(400, {"error": {"message": "prompt must be a string or token ids"}})
            return
        if not body.get("stream"):
            conn.respond(400, {"error": {"message": "only stream=true is served"}})
            return
        req = _Req(
            n,
            conn,
            ptoks,
            int(body.get("max_tokens") or 16),
            conn.received,
            rng=random.Random(n),
        )
        if cfg.disconnect_every and n % cfg.disconnect_every == 0:
            req.disconnect_at = cfg.disconnect_after_tokens
        if cfg.short_every and n % cfg.short_every == 0:
            req.short = cfg.short_by
        conn.req = req
        conn.start_stream()
        self.prompt_tokens += ptoks
        if cfg.max_running is not None and len(self.running) >= cfg.max_running:
            self.waiting.append(req)
        else:
            self._admit(req)

    def _admit(self, req: _Req) -> None:
        assert self.loop is not None
        self.running.add(req)
        ttft = self.cfg.ttft_s
        if self.cfg.prefill_tok_s:
            ttft += req.prompt_tokens / self.cfg.prefill_tok_s
        start = max(req.received, time.perf_counter())
        req.t_first = None
        self._schedule(req, start + ttft)

    def _schedule(self, req: _Req, at: float) -> None:
        assert self.loop is not None
        delay = at - time.perf_counter()
        req.handle = self.loop.call_later(max(0.0, delay), self._emit, req, at)

    def _emit(self, req: _Req, due: float) -> None:
        if req.done:
            return
        now = time.perf_counter()
        self.lateness.append(now - due)
        cfg = self.cfg
        target = req.max_tokens - req.short
        events = []
        before = req.sent
        k = 1 if req.emissions == 0 else cfg.tokens_per_chunk
        groups = 1 if req.emissions == 0 else cfg.coalesce
        for _ in range(groups):
            n = min(k, target - req.sent)
            if n <= 0:
                break
            req.sent += n
            req.emissions += 1
            self.generation_tokens += n
            finished = req.sent >= target
            events.append(self._chunk(req, n, "length" if finished else None))
            if finished:
                break
        if req.t_first is None:
            req.t_first = now
            req.first_n = req.sent
        else:
            req.t_last = now
        finished = req.sent >= target
        if cfg.record_emissions:
            self.emissions.append((now, req.sent - before))
        if finished:
            events.append(self._usage_chunk(req))
            events.append(b"data: [DONE]\n\n")
        req.conn.write_chunk(b"".join(events))
        if req.disconnect_at is not None and req.sent >= req.disconnect_at:
            self._end(req, finished=False)
            req.conn.close()
            return
        if finished:
            req.conn.end_stream()
            self._end(req, finished=True)
            return
        # absolute schedule: write g (g >= 1) carries emissions (g-1)*m+1 .. g*m and leaves at
        # t_first + g * m * interval, so a late timer never shifts the ones after it
        assert req.t_first is not None
        m = cfg.coalesce
        g = (req.emissions - 1) // m + 1
        self._schedule(req, req.t_first + g * m * cfg.interval_s)

    def _chunk(self, req: _Req, n: int, finish: str | None) -> bytes:
        text = " ".join(req.rng.choice(WORDS) for _ in range(n)) + " "
        fin = "null" if finish is None else f'"{finish}"'
        ct = req.sent
        return (
            f'data: {{"id":"cmpl-{req.rid}","object":"text_completion","created":0,'
            f'"model":"{self.cfg.model}","choices":[{{"index":0,"text":"{text}",'
            f'"logprobs":null,"finish_reason":{fin},"stop_reason":null}}],'
            f'"usage":{{"prompt_tokens":{req.prompt_tokens},'
            f'"total_tokens":{req.prompt_tokens + ct},"completion_tokens":{ct}}}}}\n\n'
        ).encode()

    def _usage_chunk(self, req: _Req) -> bytes:
        return (
            f'data: {{"id":"cmpl-{req.rid}","object":"text_completion","created":0,'
            f'"model":"{self.cfg.model}","choices":[],"usage":{{"prompt_tokens":'
            f'{req.prompt_tokens},"total_tokens":{req.prompt_tokens + req.sent},'
            f'"completion_tokens":{req.sent}}}}}\n\n'
        ).encode()

    def _end(self, req: _Req, finished: bool) -> None:
        if req.done:
            return
        req.done = True
        if req.handle is not None:
            req.handle.cancel()
        if req in self.waiting:
            self.waiting.remove(req)
        was_running = req in self.running
        self.running.discard(req)
        tbt = None
        if req.t_first is not None and req.t_last is not None and req.sent > req.first_n:
            tbt = (req.t_last - req.t_first) / (req.sent - req.first_n)
        self.truth.append(
            {
                "rid": req.rid,
                "ttft_s": None if req.t_first is None else req.t_first - req.received,
                "received": req.received,
                "t_first": req.t_first,
                "tbt_s": tbt,
                "tokens": req.sent,
                "finished": finished,
            }
        )
        if was_running and self.waiting:
            self._admit(self.waiting.popleft())

    def abort(self, req: _Req) -> None:
        self._end(req, finished=False)

    def metrics_text(self) -> str:
        m = self.cfg.model
        return (
            f'vllm:num_requests_running{{model_name="{m}"}} {len(self.running)}\n'
            f'vllm:num_requests_waiting{{model_name="{m}"}} '
            f"{len(self.waiting) + (self.cfg.report_waiting if self.running else 0)}\n"
            f'vllm:generation_tokens_total{{model_name="{m}"}} '
            f"{self.generation_tokens * self.cfg.metrics_count_scale:.0f}\n"
            f'vllm:prompt_tokens_total{{model_name="{m}"}} {self.prompt_tokens}\n'
            f'vllm:num_preemptions_total{{model_name="{m}"}} 0\n'
        )

    def truth_summary(self) -> dict:
        lat = sorted(self.lateness)
        return {
            "requests": self.truth,
            "late_p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
            "late_p99_ms": 1000 * lat[int(len(lat) * 0.99)] if lat else None,
            "generation_tokens": self.generation_tokens,
            "emissions": self.emissions,
        }

    def tokens_between(self, t0: float, t1: float) -> int:
        """Tokens written in (t0, t1] (perf_counter; CLOCK_MONOTONIC, shared by processes)."""
        return sum(n for t, n in self.emissions if t0 < t <= t1)


def tokenize(text: str, special: bool) -> list[int]:
    """Deterministic word-level ids: enough for exact counts (ids 2..31999, BOS = 1)."""
    ids = [2 + zlib.crc32(w.encode()) % 31998 for w in text.split()]
    return ([1] if special else []) + ids


class _Conn(asyncio.Protocol):
    def __init__(self, server: IdealServer) -> None:
        self.server = server
        self.pieces: list[bytes] = []
        self.have = 0
        self.head: tuple[str, int, str | None] | None = None
        self.received = 0.0
        self.transport: asyncio.Transport | None = None
        self.req: _Req | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.req is not None:
            self.server.abort(self.req)
            self.req = None

    def data_received(self, data: bytes) -> None:
        # Pieces are kept in a list (no quadratic re-concatenation of 3 MB prompts); the
        # request's receive time is this read, before any parsing: the truth's TTFT start.
        now = time.perf_counter()
        self.pieces.append(data)
        self.have += len(data)
        while True:
            if self.head is None:
                buf = b"".join(self.pieces)
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    self.pieces = [buf]
                    return
                lines = buf[:end].decode("latin-1").split("\r\n")
                length = 0
                auth = None
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    name = name.strip().lower()
                    if name == "content-length":
                        length = int(value.strip())
                    elif name == "authorization":
                        auth = value.strip()
                self.head = (lines[0], length, auth)
                rest = buf[end + 4 :]
                self.pieces = [rest]
                self.have = len(rest)
            first, length, auth = self.head
            if self.have < length:
                return
            buf = b"".join(self.pieces)
            body, rest = buf[:length], buf[length:]
            self.pieces = [rest] if rest else []
            self.have = len(rest)
            self.head = None
            method, path = first.split()[:2]
            self.received = now
            self.dispatch(method, path.split("?")[0], body, auth)
            if not rest:
                return

    def dispatch(self, method: str, path: str, body: bytes, auth: str | None = None) -> None:
        s = self.server
        key = s.cfg.api_key
        if key and path.startswith("/v1/") and auth != f"Bearer {key}":
            self.respond(401, {"error": {"message": "invalid API key"}})
            return
        if path == "/v1/completions" and method == "POST":
            s.completion(self, body)
        elif path == "/tokenize" and method == "POST":
            obj = json.loads(body or b"{}")
            if "messages" in obj:  # a chat conversation: a plain "role: content" template
                text = "".join(f"{m['role']}: {m['content']}\n" for m in obj["messages"])
                text += "assistant:" if obj.get("add_generation_prompt", True) else ""
                ids = tokenize(text, True)
            else:
                ids = tokenize(obj.get("prompt", ""), bool(obj.get("add_special_tokens", True)))
            self.respond(200, {"tokens": ids, "count": len(ids), "max_model_len": 1 << 20})
        elif path == "/v1/models":
            self.respond(200, {"object": "list", "data": [{"id": s.cfg.model, "object": "model"}]})
        elif path == "/metrics":
            self.respond(200, s.metrics_text(), "text/plain; version=0.0.4")
        elif path == "/health":
            self.respond(200, "")
        elif path == "/truth":
            self.respond(200, s.truth_summary())
        else:
            self.respond(404, {"error": {"message": f"no route {method} {path}"}})

    def respond(self, status: int, payload: object, ctype: str = "application/json") -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        reason = {
            200: "OK",
            400: "Bad Request",
            401: "Unauthorized",
            404: "Not Found",
            500: "Internal Server Error",
        }
        assert self.transport is not None
        self.transport.write(
            f"HTTP/1.1 {status} {reason.get(status, 'X')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )

    def start_stream(self) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )

    def write_chunk(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"0\r\n\r\n")
        self.req = None

    def close(self) -> None:
        self.req = None
        if self.transport is not None:
            self.transport.abort()


async def serve(server: IdealServer, host: str, port: int) -> asyncio.base_events.Server:
    server.loop = asyncio.get_running_loop()
    return await server.loop.create_server(lambda: _Conn(server), host, port)


@contextlib.contextmanager
def run_in_thread(cfg: IdealConfig, host: str = "127.0.0.1") -> Iterator[tuple[str, IdealServer]]:
    """Serve on a free port in a background thread; yields (base_url, server).

    Shares the GIL with the caller: fine for functional tests, not for accuracy figures (use a
    separate process for those: `python benchmarks/ideal_server.py --port 0 …`).
    """
    server = IdealServer(cfg)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, object] = {}

    def thread_main() -> None:
        asyncio.set_event_loop(loop)
        srv = loop.run_until_complete(serve(server, host, 0))
        holder["port"] = srv.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()
        srv.close()
        loop.close()

    thread = threading.Thread(target=thread_main, name="ideal-server", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("ideal server did not start")
    try:
        yield f"http://{host}:{holder['port']}", server
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8123, help="0 = any free port (printed)")
    for f in fields(IdealConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("int", "int | None"):
            p.add_argument(flag, type=int, default=f.default)
        elif f.type in ("float", "float | None"):
            p.add_argument(flag, type=float, default=f.default)
        elif f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, default=f.default)
    a = p.parse_args(argv)
    cfg = IdealConfig(**{f.name: getattr(a, f.name) for f in fields(IdealConfig)})
    server = IdealServer(cfg)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run

    async def forever() -> None:
        srv = await serve(server, a.host, a.port)
        port = srv.sockets[0].getsockname()[1]
        print(f"READY http://{a.host}:{port}", flush=True)
        async with srv:
            await srv.serve_forever()

    runner(forever())


if __name__ == "__main__":
    main()
