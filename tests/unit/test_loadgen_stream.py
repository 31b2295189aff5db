"""The streaming parser and its timing rules, fed byte by byte with a controlled clock.

No sockets: a fake transport and a fake perf_counter, so every figure has an exact expected
value (docs/measurement.md rules 2-4).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from speedmatrix.loadgen import stream as stream_mod
from speedmatrix.loadgen.stream import Request, StreamConnection, Window


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def set_write_buffer_limits(self, high: int = 0, low: int = 0) -> None:
        pass

    def writelines(self, parts: list[bytes]) -> None:
        self.written.extend(parts)

    def get_write_buffer_size(self) -> int:
        return 0

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sse(completion_tokens: int | None, text: str = "x", finish: str | None = None) -> bytes:
    obj: dict = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }
    if completion_tokens is not None:
        obj["usage"] = {
            "prompt_tokens": 100,
            "completion_tokens": completion_tokens,
            "total_tokens": 100 + completion_tokens,
        }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def usage_only(completion_tokens: int) -> bytes:
    obj = {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": completion_tokens}}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


END = b"0\r\n\r\n"


def run_feed(
    reads: list[tuple[float, bytes]],
    max_tokens: int,
    window: Window | None = None,
    clock: Clock | None = None,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> Request:
    """Send a request at t=0, deliver each (t, bytes) read, return the request."""
    clock = clock or Clock()
    assert monkeypatch is not None
    monkeypatch.setattr(stream_mod, "perf_counter", clock)
    firsts: list[float] = []

    async def go() -> Request:
        conn = StreamConnection(window or Window(), lambda r, t: firsts.append(t))
        conn.connection_made(FakeTransport())  # type: ignore[arg-type]
        req = Request(0, 0, max_tokens, keep_text=True)
        clock.now = 0.0
        fut = conn.send(req, [b"POST / HTTP/1.1\r\n\r\n"])
        for t, data in reads:
            clock.now = t
            conn.data_received(data)
        if not fut.done():
            conn.connection_lost(None)
        return await fut

    req = asyncio.run(go())
    if req.first_at is not None:
        assert firsts == [req.first_at]
    return req


def full_stream(max_tokens: int, per_chunk: int = 1) -> list[bytes]:
    """The SSE events of a vLLM-like stream: role chunk, tokens, usage chunk, [DONE]."""
    events = [sse(0, text="")]  # a chunk with no token (role / empty)
    sent = 0
    first = True
    while sent < max_tokens:
        n = 1 if first else min(per_chunk, max_tokens - sent)
        first = False
        sent += n
        events.append(sse(sent, finish="length" if sent == max_tokens else None))
    events += [usage_only(max_tokens), b"data: [DONE]\n\n"]
    return events


def test_any_split_of_the_bytes_gives_the_same_request(monkeypatch: pytest.MonkeyPatch) -> None:
    body = b"".join(chunked(e) for e in full_stream(40, per_chunk=3)) + END
    whole = HEAD + body
    rng = random.Random(7)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(whole)), rng.randint(1, 40)))
        pieces = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
        reads = [(1.0 + i * 0.001, p) for i, p in enumerate(pieces)]
        req = run_feed(reads, 40, monkeypatch=monkeypatch)
        assert req.error is None, req.error
        assert req.tokens == 40
        assert req.prompt_tokens == 100
        assert req.finished
        assert req.finish_reason == "length"


def test_multi_token_chunks_give_per_token_tbt(monkeypatch: pytest.MonkeyPatch) -> None:
    events = full_stream(1 + 4 * 50, per_chunk=4)  # 1 prefill token, then 50 chunks of 4
    reads = [(0.0005, HEAD)]
    t = 0.25  # first token at 250 ms
    for e in events:
        reads.append((t, chunked(e)))
        if e.startswith(b"data: {") and b'"completion_tokens": 0' not in e:
            t += 0.040
    reads.append((t, END))
    req = run_feed(reads, 201, monkeypatch=monkeypatch)
    assert req.error is None
    assert req.first_at == pytest.approx(0.25)
    assert req.first_at - req.sent_at == pytest.approx(0.25)  # TTFT from the write
    assert req.first_n == 1
    assert req.tbt() == pytest.approx(0.040 / 4)  # per token, not per chunk (4x)
    assert req.chunks == 51


def test_coalesced_chunks_are_one_arrival(monkeypatch: pytest.MonkeyPatch) -> None:
    events = full_stream(61)
    token_events = [e for e in events[1:] if e.startswith(b'data: {"id"')]
    reads = [(0.0, HEAD), (0.1, chunked(events[0]))]
    t = 0.2
    reads.append((t, chunked(token_events[0])))
    for i in range(1, len(token_events), 3):  # three token events per socket read
        t += 0.030
        reads.append((t, b"".join(chunked(e) for e in token_events[i : i + 3])))
    reads.append((t, chunked(events[-2]) + chunked(events[-1]) + END))
    req = run_feed(reads, 61, monkeypatch=monkeypatch)
    assert req.error is None
    assert req.tbt() == pytest.approx(0.010)  # 3 tokens per 30 ms
    assert req.first_at == pytest.approx(0.2)  # the role chunk at 0.1 s is not a token


def test_window_counts_only_tokens_inside(monkeypatch: pytest.MonkeyPatch) -> None:
    w = Window()
    w.ws, w.we = 1.0, 2.0
    events = [e for e in full_stream(300) if e.startswith(b'data: {"id"')]
    reads = [(0.0, HEAD)]
    for i, e in enumerate(events[1:]):  # token i+1 at 0.5 + i*0.01
        reads.append((0.5 + i * 0.01, chunked(e)))
    req = run_feed(reads, 300, window=w, monkeypatch=monkeypatch)
    inside = [0.5 + i * 0.01 for i in range(300) if 1.0 < 0.5 + i * 0.01 <= 2.0]
    assert req.w_tokens == len(inside)
    assert req.window_tbt() == pytest.approx(0.01)
    assert req.error == "stream ended without [DONE]" or req.error.startswith("connection closed")


@pytest.mark.parametrize(
    ("reads_fn", "expected"),
    [
        (
            lambda: [
                (
                    0.1,
                    b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 43\r\n\r\n"
                    + b'{"error": {"message": "boom", "code": 500}}',
                )
            ],
            "HTTP 500: boom",
        ),
        (
            lambda: [(0.1, HEAD + b"".join(chunked(e) for e in full_stream(10)[:5]))],
            "connection closed by server after 4 tokens",
        ),
        (
            lambda: [(0.1, HEAD + b"".join(chunked(sse(None, "a")) for _ in range(3)) + END)],
            "server sent chunks without usage",
        ),
        (
            lambda: [(0.1, HEAD + b"".join(chunked(e) for e in full_stream(7)) + END)],
            "short output: 7 of 10 tokens",
        ),
        (
            lambda: [
                (
                    0.1,
                    HEAD + chunked(b'data: {"error": {"message": "engine dead", "code": 500}}\n\n'),
                )
            ],
            "server error in stream: engine dead",
        ),
    ],
)
def test_failures_are_named(
    monkeypatch: pytest.MonkeyPatch, reads_fn: object, expected: str
) -> None:
    req = run_feed(reads_fn(), 10, monkeypatch=monkeypatch)  # type: ignore[operator]
    assert req.error is not None
    assert req.error.startswith(expected), req.error
    assert not req.finished


def test_crlf_events_and_comments(monkeypatch: pytest.MonkeyPatch) -> None:
    events = full_stream(5)
    body = b": keep-alive\r\n\r\n" + b"".join(e.replace(b"\n\n", b"\r\n\r\n") for e in events)
    req = run_feed([(0.1, HEAD + chunked(body) + END)], 5, monkeypatch=monkeypatch)
    assert req.error is None
    assert req.tokens == 5


def test_keep_alive_connection_serves_two_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(stream_mod, "perf_counter", clock)
    body = HEAD + b"".join(chunked(e) for e in full_stream(3)) + END

    async def go() -> list[Request]:
        conn = StreamConnection(Window(), lambda r, t: None)
        conn.connection_made(FakeTransport())  # type: ignore[arg-type]
        out = []
        for i in range(2):
            req = Request(i, 0, 3, keep_text=False)
            fut = conn.send(req, [b"x"])
            conn.data_received(body[:50])
            conn.data_received(body[50:])
            out.append(await fut)
        return out

    reqs = asyncio.run(go())
    assert [r.error for r in reqs] == [None, None]
    assert [r.tokens for r in reqs] == [3, 3]


HEAD_500 = b"HTTP/1.1 500 Internal Server Error\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("first", "more", "expected"),
    [
        # a 500 whose body never ends: the client grew to 226 MB before (issue #33 item 12)
        (HEAD_500 + chunked(b'{"error": {"message": "boom"'), chunked(b" " * 65536), "HTTP 500: "),
        (HEAD, chunked(b"data: " + b"x" * 65536), "stream event longer than"),  # no event end
        (b"HTTP/1.1 200 OK\r\n", b"x-pad: " + b"p" * 65536 + b"\r\n", "response head longer"),
        (HEAD, b"f" * 65536, "malformed chunk size"),  # a chunk-size line that never ends
        (b"HTTP/1.1 500 Oops\r\n\r\n", b"e" * 65536, "HTTP 500: "),  # read until close
    ],
)
def test_endless_responses_end_the_request_with_a_bounded_buffer(
    monkeypatch: pytest.MonkeyPatch, first: bytes, more: bytes, expected: str
) -> None:
    """Every buffer of the connection is capped (loadgen.stream.MAX_BUFFERED): a response that
    never ends what it started ends the request with a reason, not the client's memory."""
    clock = Clock()
    monkeypatch.setattr(stream_mod, "perf_counter", clock)

    async def go() -> tuple[Request, int, int]:
        conn = StreamConnection(Window(), lambda r, t: None)
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        fut = conn.send(Request(0, 0, 10, keep_text=True), [b"POST / HTTP/1.1\r\n\r\n"])
        conn.data_received(first)
        fed = 0
        while not fut.done() and fed < 200:  # 13 MB at most
            conn.data_received(more)
            fed += 1
        largest = max(len(conn._raw), len(conn._sse), len(conn._error_body))
        assert fut.done(), "still reading after 13 MB"
        return fut.result(), fed, largest

    req, fed, largest = asyncio.run(go())
    assert req.error is not None and req.error.startswith(expected), req.error
    assert "not read further" in req.error or "malformed" in req.error or "longer" in req.error
    assert largest <= stream_mod.MAX_BUFFERED
    assert fed <= stream_mod.MAX_BUFFERED // 65536 + 2


def test_a_deeply_nested_stream_chunk_fails_the_request_not_the_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue #33 item 14, the load generator's side: a server's chunk nested 100,000 deep is
    a RecursionError for the stdlib's json (the zipapp's parser where orjson is absent)."""
    monkeypatch.setattr(stream_mod, "_loads", json.loads)
    deep = b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n"
    req = run_feed([(0.1, HEAD + chunked(deep))], 10, monkeypatch=monkeypatch)
    assert req.error is not None and req.error.startswith("unparseable stream chunk"), req.error
    body = b"[" * 50_000
    bad = b"HTTP/1.1 500 Oops\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    req = run_feed([(0.1, bad)], 10, monkeypatch=monkeypatch)
    assert req.error is not None and req.error.startswith("HTTP 500: [[["), req.error
    req = run_feed([(0.1, HEAD + chunked(b"data: [1]\n\n"))], 10, monkeypatch=monkeypatch)
    assert req.error is not None and req.error.startswith("unparseable stream chunk"), req.error
