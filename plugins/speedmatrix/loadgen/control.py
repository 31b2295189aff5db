"""The control plane: `/v1/models`, `/tokenize`, `/metrics`, through one aiohttp session.

None of this is timed, so aiohttp's convenience is worth more than speed here. The streams
themselves use `stream.py`. A connection failure on the first call means the cell cannot be
attempted (`CellNotAttempted`, non-zero exit); later failures make the cell `failed`.
"""

from __future__ import annotations

import asyncio
from time import perf_counter
from typing import Any

import aiohttp

from .promtext import Snapshot, snapshot
from .stream import normalize_base_url


class CellNotAttempted(Exception):
    """The cell could not be attempted at all (unreachable server, unknown model, bad input)."""


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
        """One reading of /metrics, or None when the server has none (then: client figures)."""
        if self.has_metrics is False:
            return None
        sent = perf_counter()
        try:
            async with self._session.get(f"{self.base_url}/metrics") as resp:
                if resp.status != 200:
                    self.has_metrics = False
                    return None
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        at = perf_counter()
        snap = snapshot(at, text, sent)
        if self.has_metrics is None:
            self.has_metrics = snap.get("running") is not None
            if not self.has_metrics:
                return None
        return snap

    async def wait_idle(self, timeout_s: float) -> tuple[bool, Snapshot | None]:
        """Poll until running = waiting = 0 (measurement.md rule 4); (idle?, last reading)."""
        deadline = perf_counter() + timeout_s
        snap = await self.metrics()
        while snap is not None:
            if not snap.get("running") and not snap.get("waiting"):
                return True, snap
            if perf_counter() >= deadline:
                return False, snap
            await asyncio.sleep(0.2)
            snap = await self.metrics()
        return True, None  # nothing to check against


def _one_line(value: object) -> str:
    return " ".join(str(value).split())[:200] or value.__class__.__name__
