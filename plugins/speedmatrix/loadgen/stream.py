"""The streaming hot path: one HTTP/1.1 connection per stream, parsed in `data_received`.

Why not aiohttp here: every chunk read through aiohttp's StreamReader wakes a coroutine, which
costs several times the parsing itself; at 60K chunks/s on one core that is the difference
between measuring the server and measuring the client (docs/measurement.md rule 8). An asyncio
Protocol stamps each socket read once (`perf_counter`) and parses every SSE event in it without
a task switch. The control plane (tokenize, metrics, models) still goes through aiohttp.

Timing rules implemented here (docs/measurement.md rules 2-4):
- a request is stamped when its last byte left for the socket (not when it was queued);
- tokens come from the rise of `usage.completion_tokens`, never from counting chunks;
- a chunk that carries no new token is neither a first token nor an interval;
- every event in one socket read shares that read's time, so coalesced chunks are one arrival;
  time-between-tokens counts the tokens after the first arrival, so the estimator is exact for
  multi-token and coalesced chunks: (t_last - t_first) / (tokens - tokens at t_first);
- only tokens arriving inside the window (ws, we] count toward window figures.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from time import perf_counter
from urllib.parse import urlsplit

from speedmatrix.errors import InputError

try:  # orjson parses a typical 300-byte chunk several times faster than json
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - exercised only without orjson
    _loads = json.loads

INF = float("inf")

# Every byte the client holds for a response is bounded: a server answering 500 with an
# endless body would grow the client from 42 to 226 MB before the first-token timeout.
# A response that passes a bound ends its request, with the reason, and is not read further.
MAX_HEAD = 64 * 1024
"""The response's status line and headers (vLLM's are a few hundred bytes)."""
MAX_ERROR_BODY = 64 * 1024
"""An error response's body: the message is its first 200 characters anyway."""
MAX_BUFFERED = 1024 * 1024
"""One stream event not yet ended (vLLM's are under a few KB, a long text chunk included)."""
MAX_CHUNK_LINE = 1024
"""A chunk-size line of the chunked encoding (hex digits and extensions)."""


class Window:
    """The measurement window, shared by every stream: tokens count when ws < t <= we."""

    __slots__ = ("we", "ws")

    def __init__(self) -> None:
        self.ws = INF
        self.we = INF


class Request:
    """Everything measured about one request; filled in by the connection as chunks arrive."""

    __slots__ = (
        "chunks",
        "done_marker",
        "ended_at",
        "error",
        "finish_reason",
        "first_at",
        "first_n",
        "index",
        "last_at",
        "max_gap",
        "max_tokens",
        "prompt_tokens",
        "second_at",
        "sent_at",
        "status",
        "stream",
        "text_parts",
        "tokens",
        "usage_missing",
        "w_chunks",
        "w_first",
        "w_first_n",
        "w_last",
        "w_tokens",
    )

    def __init__(self, index: int, stream: int, max_tokens: int, keep_text: bool) -> None:
        self.index = index
        self.stream = stream
        self.max_tokens = max_tokens
        self.sent_at: float | None = None
        self.first_at: float | None = None
        self.first_n = 0
        self.last_at: float | None = None
        self.second_at: float | None = None  # the second arrival that carried tokens
        self.tokens = 0
        self.chunks = 0
        self.max_gap = 0.0
        self.w_first: float | None = None
        self.w_first_n = 0
        self.w_last: float | None = None
        self.w_tokens = 0
        self.w_chunks = 0
        self.prompt_tokens: int | None = None
        self.finish_reason: str | None = None
        self.done_marker = False
        self.usage_missing = False
        self.status: int | None = None
        self.error: str | None = None
        self.ended_at: float | None = None
        self.text_parts: list[str] | None = [] if keep_text else None

    def ttst(self) -> float | None:
        """Time to the second token: its second token-carrying arrival - its first (seconds)."""
        if self.first_at is None or self.second_at is None:
            return None
        return self.second_at - self.first_at

    @property
    def finished(self) -> bool:
        """Completed all of its max_tokens without error."""
        return self.error is None and self.ended_at is not None and self.done_marker

    def tbt(self) -> float | None:
        """Per-token time between tokens over the whole request (seconds)."""
        if self.first_at is None or self.last_at is None or self.tokens - self.first_n <= 0:
            return None
        return (self.last_at - self.first_at) / (self.tokens - self.first_n)

    def window_tbt(self) -> float | None:
        """Per-token time between tokens over the tokens that arrived inside the window."""
        if self.w_first is None or self.w_last is None or self.w_tokens - self.w_first_n <= 0:
            return None
        return (self.w_last - self.w_first) / (self.w_tokens - self.w_first_n)


class Endpoint:
    """Where the streams connect and what every request's head looks like."""

    def __init__(self, base_url: str, api_key: str | None, path: str = "/v1/completions") -> None:
        parts = urlsplit(normalize_base_url(base_url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InputError(f"--base-url must be http(s)://host[:port], got {base_url!r}")
        self.host = parts.hostname
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        host_header = self.host if parts.port is None else f"{self.host}:{self.port}"
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {host_header}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"{auth}Content-Length: "
        ).encode()

    def head(self, content_length: int, request_id: str | None = None) -> bytes:
        """The request head; X-Request-Id lets server logs and ground truth name the request."""
        rid = b"" if request_id is None else b"X-Request-Id: %s\r\n" % request_id.encode()
        return self._head + b"%d\r\n%s\r\n" % (content_length, rid)

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context() if self.tls else None


def normalize_base_url(base_url: str) -> str:
    """Accept `http://h:p`, `http://h:p/` and `http://h:p/v1`; return it without either."""
    url = base_url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _TRAILER, _LENGTH, _UNTIL_CLOSE, _IDLE = range(7)


class StreamConnection(asyncio.Protocol):
    """One keep-alive connection carrying one streamed completion at a time."""

    def __init__(self, window: Window, on_first_token: Callable[[Request, float], None]) -> None:
        self.window = window
        self.on_first_token = on_first_token
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep_alive = True
        self.req: Request | None = None
        self.fut: asyncio.Future[Request] | None = None
        self._state = _IDLE
        self._raw = b""
        self._sse = b""
        self._left = 0
        self._chunked = False
        self._error_body = b""
        self._paused = False
        self._sent_pending = False

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # pause_writing fires as soon as anything is buffered, resume_writing when the last
        # byte of the request has been handed to the kernel: that is the request's send time.
        transport.set_write_buffer_limits(high=0, low=0)  # type: ignore[attr-defined]

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._sent_pending and self.req is not None:
            self._sent_pending = False
            self.req.sent_at = perf_counter()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.req is None or self.fut is None or self.fut.done():
            return
        req = self.req
        if self._state == _UNTIL_CLOSE:
            self._finish(perf_counter())
            return
        where = "before the response" if req.status is None else f"after {req.tokens} tokens"
        reason = f": {exc}" if exc else ""
        self._fail(f"connection closed by server {where}{reason}")

    def data_received(self, data: bytes) -> None:
        t = perf_counter()
        if self.req is None or self.fut is None or self.fut.done():
            return  # late bytes after an abort or a failure: not ours to count
        if self._state == _HEAD:
            data = self._raw + data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > MAX_HEAD:
                    self._fail(
                        f"response head longer than {MAX_HEAD // 1024} KiB: not read further"
                    )
                    return
                self._raw = data
                return
            self._raw = b""
            if not self._parse_head(data[:end]):
                return
            data = data[end + 4 :]
            if not data:
                return
        state = self._state
        if state in (_CHUNK_SIZE, _CHUNK_DATA, _TRAILER):
            self._feed_chunked(data, t)
        elif state == _LENGTH:
            self._feed_body(data[: self._left], t)
            self._left -= len(data)
            if self._left <= 0:
                self._finish(t)
        elif state == _UNTIL_CLOSE:
            self._feed_body(data, t)

    # -- sending ------------------------------------------------------------------------------
    def send(
        self, req: Request, parts: list[bytes], t0: float | None = None
    ) -> asyncio.Future[Request]:
        """Write one request; the future resolves with it when it ends (done, failed, cut).

        `t0`: the request's start as the caller defines it (the `published` profile's TTFT
        runs from before its body is built); by default the last byte's hand-over."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.req = req
        self.fut = loop.create_future()
        self._state = _HEAD
        self._raw = b""
        self._sse = b""
        self._error_body = b""
        # Stamped just before the write: when the kernel takes the whole request at once (the
        # usual case), that is within microseconds of the last byte leaving, whereas a stamp
        # after the call also counts whatever delays the return. When the request does not fit
        # the socket buffer (long prompts), the stamp moves to resume_writing: the moment the
        # last byte was handed over.
        stamp = perf_counter()
        self.transport.writelines(parts)
        if t0 is not None:
            req.sent_at = t0
        elif self.transport.get_write_buffer_size() == 0:
            req.sent_at = stamp
        else:
            self._sent_pending = True
        return self.fut

    def cut(self, t: float) -> None:
        """End the current request at the window's end: not an error, not a token time."""
        if self.req is not None and self.fut is not None and not self.fut.done():
            self.req.ended_at = t
            self.fut.set_result(self.req)
        self.close()

    def fail(self, reason: str) -> None:
        if self.fut is not None and not self.fut.done():
            self._fail(reason)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # -- parsing ------------------------------------------------------------------------------
    def _parse_head(self, head: bytes) -> bool:
        req = self.req
        assert req is not None
        lines = head.split(b"\r\n")
        try:
            req.status = int(lines[0].split(None, 2)[1])
        except (IndexError, ValueError):
            self._fail(f"malformed HTTP status line {lines[0][:80]!r}")
            return False
        length = None
        self._chunked = False
        self.keep_alive = not lines[0].startswith(b"HTTP/1.0")
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value:
                self._chunked = True
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection":
                self.keep_alive = value != b"close"
        if self._chunked:
            self._state = _CHUNK_SIZE
        elif length is not None:
            self._state = _LENGTH
            self._left = length
            if length == 0:
                self._finish(perf_counter())
                return False
        else:
            self._state = _UNTIL_CLOSE
            self.keep_alive = False
        return True

    def _feed_chunked(self, data: bytes, t: float) -> None:
        buf = self._raw + data if self._raw else data
        pos = 0
        n = len(buf)
        payload: list[bytes] = []
        while pos < n:
            state = self._state
            if state == _CHUNK_SIZE:
                j = buf.find(b"\r\n", pos)
                if j < 0:
                    break
                try:
                    size = int(buf[pos:j].split(b";", 1)[0], 16)
                except ValueError:
                    self._fail(f"malformed chunk size {buf[pos:j][:40]!r}")
                    return
                pos = j + 2
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._state = _CHUNK_DATA
                    self._left = size + 2  # the data and its CRLF
            elif state == _CHUNK_DATA:
                take = min(n - pos, self._left)
                data_left = self._left - 2
                if data_left > 0:
                    payload.append(buf[pos : pos + min(take, data_left)])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = _CHUNK_SIZE
            else:  # trailer section: empty line ends the message
                if buf.startswith(b"\r\n", pos):
                    pos += 2
                else:
                    j = buf.find(b"\r\n\r\n", pos)
                    if j < 0:
                        break
                    pos = j + 4
                self._raw = b""
                if payload:
                    self._feed_body(b"".join(payload), t)
                self._finish(t)
                return
        self._raw = buf[pos:] if pos < n else b""
        if len(self._raw) > (MAX_CHUNK_LINE if self._state == _CHUNK_SIZE else MAX_HEAD):
            what = "chunk size" if self._state == _CHUNK_SIZE else "trailer"
            self._fail(f"malformed {what}: no line end in {len(self._raw)} bytes, not read further")
            return
        if payload:
            self._feed_body(payload[0] if len(payload) == 1 else b"".join(payload), t)

    def _feed_body(self, data: bytes, t: float) -> None:
        req = self.req
        assert req is not None
        if req.status != 200:
            self._error_body += data[: MAX_ERROR_BODY + 1 - len(self._error_body)]
            if len(self._error_body) > MAX_ERROR_BODY:
                self._fail(
                    f"HTTP {req.status}: {_error_message(self._error_body[:MAX_ERROR_BODY])} "
                    f"(error body longer than {MAX_ERROR_BODY // 1024} KiB: not read further)"
                )
            return
        sse = self._sse + data if self._sse else data
        if b"\r" in sse:
            sse = sse.replace(b"\r\n", b"\n")
        events = sse.split(b"\n\n")
        self._sse = events.pop()
        if len(self._sse) > MAX_BUFFERED:
            self._sse = b""
            self._fail(
                f"stream event longer than {MAX_BUFFERED // 1024} KiB without an end: "
                "not read further"
            )
            return
        for event in events:
            if event:
                self._on_event(event, t)
                if self.fut is not None and self.fut.done():
                    return

    def _on_event(self, event: bytes, t: float) -> None:
        req = self.req
        assert req is not None
        if event.startswith(b"data: "):
            payload = event[6:]
            if b"\n" in payload:  # multi-line data: field (never seen from vLLM)
                payload = b"\n".join(
                    line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")
                )
        elif event.startswith(b"data:"):
            payload = event[5:].lstrip()
        else:
            return  # comments (":"), event:/id: lines
        if payload == b"[DONE]":
            req.done_marker = True
            return
        try:
            obj = _loads(payload)
        except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
            obj = None
        if not isinstance(obj, dict):
            self._fail(f"unparseable stream chunk {payload[:80]!r}")
            return
        usage = obj.get("usage")
        choices = obj.get("choices")
        if usage:
            ct = usage.get("completion_tokens") or 0
            n = ct - req.tokens
            pt = usage.get("prompt_tokens")
            if pt is not None:
                req.prompt_tokens = pt
        else:
            n = 0
        if choices:
            choice = choices[0]
            text = _choice_text(choice)
            if not usage and text:
                n = 1
                req.usage_missing = True
            if req.text_parts is not None and text:
                req.text_parts.append(text)
            reason = choice.get("finish_reason")
            if reason:
                req.finish_reason = reason
        elif not usage and "error" in obj:
            err = obj["error"]
            message = err.get("message") if isinstance(err, dict) else err
            self._fail(f"server error in stream: {str(message)[:200]}")
            return
        if n > 0:
            req.tokens += n
            if req.first_at is None:
                req.first_at = t
                req.first_n = n
                req.last_at = t
                req.chunks = 1
                self.on_first_token(req, t)
            elif t == req.first_at:
                req.first_n += n  # coalesced with the first arrival: same instant
            else:
                gap = t - req.last_at
                if gap > req.max_gap:
                    req.max_gap = gap
                if req.second_at is None:
                    req.second_at = t
                req.last_at = t
                req.chunks += 1
            w = self.window
            if w.ws < t <= w.we:
                req.w_tokens += n
                if req.w_first is None:
                    req.w_first = t
                    req.w_first_n = n
                    req.w_chunks = 1
                elif t == req.w_first:
                    req.w_first_n += n
                else:
                    req.w_last = t
                    req.w_chunks += 1

    # -- endings ------------------------------------------------------------------------------
    def _finish(self, t: float) -> None:
        req = self.req
        assert req is not None and self.fut is not None
        if self.fut.done():
            return
        self._state = _IDLE
        req.ended_at = t
        if req.status != 200:
            req.error = f"HTTP {req.status}: {_error_message(self._error_body)}"
        elif req.usage_missing:
            req.error = "server sent chunks without usage (continuous_usage_stats unsupported)"
        elif req.finish_reason not in (None, "length", "stop"):
            req.error = f"request ended with finish_reason={req.finish_reason!r}"
        elif req.tokens < req.max_tokens:
            req.error = f"short output: {req.tokens} of {req.max_tokens} tokens"
        elif not req.done_marker:
            req.error = "stream ended without [DONE]"
        self.fut.set_result(req)

    def _fail(self, reason: str) -> None:
        req = self.req
        assert req is not None and self.fut is not None
        self._state = _IDLE
        req.error = reason
        req.ended_at = perf_counter()
        if not self.fut.done():
            self.fut.set_result(req)
        self.close()


def _choice_text(choice: dict) -> str | None:
    """A chunk's text: `text` on /v1/completions, the delta's content (or reasoning) on
    /v1/chat/completions (the `published` profile's endpoint)."""
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return text or None


def _error_message(body: bytes) -> str:
    """The server's own words for an HTTP error, on one line."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return " ".join(text.split())[:200] or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            err = err.get("message", err)
        msg = obj.get("message") or err
        return " ".join(str(msg).split())[:200]
    return " ".join(text.split())[:200]


async def connect(
    endpoint: Endpoint,
    window: Window,
    on_first_token: Callable[[Request, float], None],
    timeout_s: float,
) -> StreamConnection:
    """Open one stream connection (TCP_NODELAY is asyncio's default for TCP)."""
    loop = asyncio.get_running_loop()
    ctx = endpoint.ssl_context()
    _, proto = await asyncio.wait_for(
        loop.create_connection(
            lambda: StreamConnection(window, on_first_token),
            endpoint.host,
            endpoint.port,
            ssl=ctx,
            server_hostname=endpoint.host if ctx else None,
        ),
        timeout_s,
    )
    return proto
