"""The control plane: `/v1/models`, `/tokenize`, `/metrics`, through one aiohttp session.

None of this is timed, so aiohttp's convenience is worth more than speed here. The streams
themselves use `stream.py`. A connection failure on the first call means the cell cannot be
attempted (`CellNotAttempted`, non-zero exit); later failures make the cell `failed`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from time import perf_counter
from typing import Any

import aiohttp

from .prometheus import Snapshot, snapshot
from .stream import normalize_base_url

IDLE_POLL_S = 0.05
"""Between /metrics reads while waiting for the server to be idle. After a window the first
read usually still shows the cut streams (the server has not yet seen their aborts), and the
host sits idle until the next read: 0.2 s would cost every cell one full sleep (measured on the
simulator); a read is a few ms on the simulator, ~20 ms on vLLM."""


class CellNotAttempted(Exception):
    """The cell could not be attempted at all (unreachable server, unknown model, bad input)."""


class MetricsUnavailable(Exception):
    """A /metrics read failed, retries included, on a server that did not say it has none.

    Not the same as a server without /metrics (a 404, or no vLLM gauges, at the first read:
    `metrics()` returns None and the cell is measured from the client's side, declared).
    A failed read must never be taken for that: it would switch the server checks off."""


METRICS_ATTEMPTS = 3
"""One read of /metrics is this many requests at most (a failed one is retried at once)."""
METRICS_RETRY_S = 0.05


def reading_times(start: float, interval: float, rng: random.Random) -> Iterator[float]:
    """When to read the server's gauges: one reading at a random moment of each `interval`.

    A time-average of `vllm:num_requests_running` is only as good as the moments it is read
    at. Readings a fixed sleep apart lock onto a server whose work is periodic: 8-token requests
    at C = 1 on real vLLM (the gauge at 0 for about a third of each 51 ms cycle) read in runs of
    equal values at 0.17 s steps and sometimes all 1.0, a cell that looked held when it was not.
    One reading drawn uniformly inside each slot (stratified sampling) cannot stay in phase
    with any cycle, averages to the true share, and still gives the window its count.
    """
    k = 0
    while True:
        yield start + (k + rng.random()) * interval
        k += 1


class ControlClient:
    """Small JSON/text requests to the server, each bounded by a timeout."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 30.0) -> None:
        self.base_url = normalize_base_url(base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, 10.0)),
            # /tokenize answers for a long corpus and /metrics pages are far above 64 KiB
            read_bufsize=1 << 22,
            connector=aiohttp.TCPConnector(limit=8),
        )
        self.has_metrics: bool | None = None
        self.metrics_failures = 0  # failed requests to /metrics (retries included)
        self.metrics_error: str | None = None  # the last one's reason

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def models(self) -> list[str]:
        """Served model ids; raises CellNotAttempted when the server cannot be reached."""
        try:
            async with self._session.get(f"{self.base_url}/v1/models") as resp:
                if resp.status in (401, 403):
                    raise CellNotAttempted(
                        f"server refused the API key (HTTP {resp.status} on /v1/models)"
                    )
                if resp.status != 200:
                    raise CellNotAttempted(f"GET /v1/models answered HTTP {resp.status}")
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise CellNotAttempted(
                f"server unreachable at {self.base_url}: {_one_line(exc)}"
            ) from exc
        return [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]

    async def tokenize(self, model: str, text: str, add_special_tokens: bool) -> list[int]:
        payload: dict[str, Any] = {
            "model": model,
            "prompt": text,
            "add_special_tokens": add_special_tokens,
        }
        return await self._tokenize(payload)

    async def tokenize_chat(self, model: str, messages: list[dict[str, str]]) -> list[int]:
        """A conversation rendered by the server's own chat template, as vLLM's /tokenize
        takes it (TokenizeChatRequest: `messages`, `add_generation_prompt`; special tokens
        are the template's own, so `add_special_tokens` stays false as vLLM advises)."""
        payload: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "add_generation_prompt": True,
            "add_special_tokens": False,
        }
        try:
            return await self._tokenize(payload)
        except CellNotAttempted as exc:
            raise CellNotAttempted(
                f"{exc} (the article workload renders a chat conversation with the server's "
                "chat template: give the server one, e.g. vLLM's --chat-template, or use "
                "--workload continuation)"
            ) from exc

    async def chat_prompt_tokens(self, model: str, messages: list[dict[str, str]]) -> int:
        """usage.prompt_tokens of a one-token chat completion: how the `published` profile
        measures characters per token (as the published tool does, on the chat endpoint)."""
        payload = {"model": model, "messages": messages, "stream": False, "max_tokens": 1}
        try:
            async with self._session.post(
                f"{self.base_url}/v1/chat/completions", json=payload
            ) as resp:
                if resp.status != 200:
                    detail = _one_line((await resp.text())[:200])
                    raise CellNotAttempted(
                        f"POST /v1/chat/completions answered HTTP {resp.status} ({detail})"
                    )
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise CellNotAttempted(f"POST /v1/chat/completions failed: {_one_line(exc)}") from exc
        tokens = (body.get("usage") or {}).get("prompt_tokens")
        if not isinstance(tokens, int) or tokens <= 0:
            raise CellNotAttempted("the chat completion reported no usage.prompt_tokens")
        return tokens

    async def _tokenize(self, payload: dict[str, Any]) -> list[int]:
        try:
            async with self._session.post(f"{self.base_url}/tokenize", json=payload) as resp:
                if resp.status != 200:
                    detail = (await resp.text())[:200]
                    raise CellNotAttempted(
                        f"POST /tokenize answered HTTP {resp.status} ({_one_line(detail)}); "
                        "the load generator needs the server's tokenizer for exact contexts"
                    )
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise CellNotAttempted(f"POST /tokenize failed: {_one_line(exc)}") from exc
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise CellNotAttempted("POST /tokenize returned no token ids")
        return tokens

    async def metrics(self) -> Snapshot | None:
        """One reading of /metrics, or None when the server has none (then: client figures).

        "Has none" is decided once, by the first answer: a 404, or a page without vLLM's
        running gauge. Any other failure (timeout, connection error, 5xx, and a 404 from a
        server that had /metrics) is retried at once, up to METRICS_ATTEMPTS requests, then
        raises MetricsUnavailable: the caller decides what a missing reading means."""
        if self.has_metrics is False:
            return None
        # A hand-written loop on purpose, not tenacity like the hosts and the warehouse: this
        # module runs on the GPU host inside the zipapp, with the engine env's Python and only
        # the standard library and aiohttp (loadgen/zipapp.py); tenacity is not there.
        for attempt in range(METRICS_ATTEMPTS):
            if attempt:
                await asyncio.sleep(METRICS_RETRY_S * attempt)
            sent = perf_counter()
            try:
                async with self._session.get(f"{self.base_url}/metrics") as resp:
                    if resp.status == 404 and self.has_metrics is None:
                        self.has_metrics = False
                        return None
                    if resp.status != 200:
                        detail = _one_line((await resp.text())[:120])
                        raise _ReadFailed(f"HTTP {resp.status} ({detail})")
                    text = await resp.text()
            except (TimeoutError, aiohttp.ClientError, OSError, _ReadFailed) as exc:
                self.metrics_failures += 1
                self.metrics_error = (
                    str(exc)
                    if isinstance(exc, _ReadFailed)
                    else f"{exc.__class__.__name__}: {_one_line(exc)}"
                )
                continue
            snap = snapshot(perf_counter(), text, sent)
            if self.has_metrics is None:
                self.has_metrics = snap.get("running") is not None
                if not self.has_metrics:
                    return None
            return snap
        raise MetricsUnavailable(
            f"GET /metrics failed {METRICS_ATTEMPTS} times: {self.metrics_error}"
        )

    async def wait_idle(self, timeout_s: float) -> tuple[bool, Snapshot | None]:
        """Poll until running = waiting = 0 (docs/measurement.md rule 4); (idle?, last reading).

        A failed read is not idle: it is read again until the deadline, and a server whose
        /metrics never answered is reported not idle (last reading None; `metrics_error`
        says why). Idle without a reading only for a server that has no /metrics."""
        deadline = perf_counter() + timeout_s
        snap: Snapshot | None = None
        while True:
            try:
                read = await self.metrics()
            except MetricsUnavailable:
                read = None
            else:
                if read is None:
                    return True, None  # no /metrics: nothing to check against
                snap = read
                if not read.get("running") and not read.get("waiting"):
                    return True, read
            if perf_counter() >= deadline:
                return False, snap
            await asyncio.sleep(IDLE_POLL_S)

    def describe(self, snap: Snapshot | None) -> str:
        """The server's load as a reason's detail: its gauges, or why there are none."""
        if snap is not None:
            return f"running={snap.get('running') or 0:g}, waiting={snap.get('waiting') or 0:g}"
        if self.has_metrics is False:
            return "no /metrics"
        return f"/metrics unreadable: {self.metrics_error}"


class _ReadFailed(Exception):
    """A /metrics answer that is not a reading (non-200)."""


def _one_line(value: object) -> str:
    return " ".join(str(value).split())[:200] or value.__class__.__name__
