"""Exact-length prompts as token ids, and the request bodies that carry them.

measurement.md rule 1: the prompt is sent as token ids to `/v1/completions`, so the server
counts exactly the context we mean. The ids come from the server's own `/tokenize` over the
natural-text corpus shipped with the package (no client tokenizer); a long context repeats
the tokenized corpus. Every prompt starts with a header naming the run tag, the context and
the stream, so no prompt is a prefix of another cell's prompt or of an earlier run's, and the
prefill of a context warms exactly stream 0's prompt for that context's decode cells.

Bodies are built once, before any timing, as a list of byte strings: a per-request prefix and
a tail shared by every stream with the same header length, so 128 distinct 512K prompts do not
mean 128 copies of a 3.5 MB JSON array.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from .control import CellNotAttempted, ControlClient


def corpus_text() -> str:
    """The shipped public-domain prose (works from a zipapp too)."""
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def header_text(tag: str, context: int, stream: int | None) -> str:
    who = "shared" if stream is None else f"stream {stream}"
    return f"[speedmatrix run {tag}, context {context}, {who}]\n\n"


@dataclass
class PromptSet:
    """Token-id prompts of exactly `context` tokens, one per stream (or one shared)."""

    context: int
    headers: list[list[int]]  # per distinct prompt
    corpus: list[int]
    _tails: dict[int, bytes] = field(default_factory=dict)

    def ids(self, i: int) -> list[int]:
        """The full prompt (tests and the prefill use it; streams use `json_parts`)."""
        head = self.headers[i]
        return head + self._tail_ids(self.context - len(head))

    def _tail_ids(self, n: int) -> list[int]:
        reps = -(-n // len(self.corpus))
        return (self.corpus * reps)[:n]

    def json_parts(self, i: int) -> tuple[bytes, bytes]:
        """(header ids, tail ids) as JSON-array fragments; the tail is shared across streams."""
        head = self.headers[i]
        n = self.context - len(head)
        tail = self._tails.get(n)
        if tail is None:
            tail = ",".join(map(str, self._tail_ids(n))).encode()
            self._tails[n] = tail
        return ",".join(map(str, head)).encode(), tail


async def build_prompts(
    ctl: ControlClient,
    model: str,
    context: int,
    tag: str,
    prompts: int,
    shared: bool,
) -> PromptSet:
    """Tokenize the headers and the corpus once; `prompts` distinct prompts (1 when shared)."""
    corpus = await ctl.tokenize(model, corpus_text(), add_special_tokens=False)
    if not corpus:
        raise CellNotAttempted("the server tokenized the corpus to nothing")
    headers = []
    for i in range(1 if shared else prompts):
        text = header_text(tag, context, None if shared else i)
        ids = await ctl.tokenize(model, text, add_special_tokens=True)
        if len(ids) >= context:
            raise CellNotAttempted(
                f"context {context} is shorter than the prompt header ({len(ids)} tokens)"
            )
        headers.append(ids)
    return PromptSet(context, headers, corpus)


class BodyBuilder:
    """Request bodies for /v1/completions with fixed output length (measurement.md rule 5)."""

    def __init__(
        self,
        model: str,
        prompts: PromptSet,
        cache_salt: str | None,
        extra_body: dict[str, Any] | None,
    ) -> None:
        self.prompts = prompts
        self.model = model
        self.cache_salt = cache_salt
        self.extra_body = extra_body or {}
        self._cache: dict[tuple[int, int], list[bytes]] = {}

    def fields(self, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
        }
        if self.cache_salt:
            body["cache_salt"] = self.cache_salt
        body.update(self.extra_body)
        return body

    def parts(self, prompt_index: int, max_tokens: int) -> list[bytes]:
        """Body fragments (without the HTTP head); cached, so built before the window."""
        key = (prompt_index, max_tokens)
        cached = self._cache.get(key)
        if cached is None:
            head_ids, tail_ids = self.prompts.json_parts(prompt_index)
            opening = json.dumps(self.fields(max_tokens), separators=(",", ":"))[:-1]
            cached = [
                opening.encode() + b',"prompt":[' + head_ids + b",",
                tail_ids,
                b"]}",
            ]
            self._cache[key] = cached
        return cached
