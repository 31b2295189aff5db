"""Exact-length prompts as token ids, and the request bodies that carry them.

docs/measurement.md rule 1: the prompt is sent as token ids to `/v1/completions`, so the server
counts exactly the context we mean. The ids come from the server's own `/tokenize` (no client
tokenizer). Two workloads (rule 11, records.WORKLOADS):

- `article` (default): the chat conversation of `article.py`, rendered by the server's chat
  template; the reference document is repeated and cut so the whole prompt is exactly the
  context, and the instruction stays last;
- `continuation`: the natural-text corpus shipped with the package, repeated, as a raw
  continuation (for servers without a chat template).

Every prompt starts with a header naming the run tag, the context and the stream (for
`article`: at the start of the first message, after the template's opening), so no prompt is
a prefix of another cell's prompt or of an earlier run's, and the prefill of a context warms
exactly stream 0's prompt for that context's decode cells.

Bodies are built once, before any timing, as a list of byte strings: a per-request prefix and
a tail shared by every stream with the same header length, so 128 distinct 512K prompts do not
mean 128 copies of a 3.5 MB JSON array.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from speedmatrix.records import DEFAULT_WORKLOAD

from . import article
from .control import CellNotAttempted, ControlClient


def corpus_text() -> str:
    """The shipped public-domain prose (works from a zipapp too)."""
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def header_text(tag: str, context: int, stream: int | None) -> str:
    who = "shared" if stream is None else f"stream {stream}"
    return f"[speedmatrix run {tag}, context {context}, {who}]\n\n"


@dataclass
class PromptSet:
    """Token-id prompts of exactly `context` tokens, one per stream (or one shared):
    header ids, then the corpus repeated and cut, then `suffix` (the article's end of the
    document message, reply and instruction; empty for a continuation)."""

    context: int
    headers: list[list[int]]  # per distinct prompt
    corpus: list[int]
    suffix: list[int] = field(default_factory=list)
    # the prompt's own words, for the copy check (stats.CopyCheck)
    text: str = ""
    _tails: dict[int, bytes] = field(default_factory=dict)

    def ids(self, i: int) -> list[int]:
        """The full prompt (tests and the prefill use it; streams use `json_parts`)."""
        head = self.headers[i]
        return head + self._tail_ids(self.context - len(head))

    def _tail_ids(self, n: int) -> list[int]:
        body = n - len(self.suffix)
        reps = -(-body // len(self.corpus))
        return (self.corpus * reps)[:body] + self.suffix

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
    workload: str = DEFAULT_WORKLOAD,
) -> PromptSet:
    """`prompts` distinct prompts (1 when shared) of the workload, from a few /tokenize calls
    (the long part is tokenized once and repeated at the id level)."""
    count = 1 if shared else prompts
    texts = [header_text(tag, context, None if shared else i) for i in range(count)]
    if workload == "article":
        return await _article_prompts(ctl, model, context, texts)
    if workload != "continuation":
        raise CellNotAttempted(f"unknown workload {workload!r}")
    corpus = await ctl.tokenize(model, corpus_text(), add_special_tokens=False)
    if not corpus:
        raise CellNotAttempted("the server tokenized the corpus to nothing")
    headers = []
    for text in texts:
        ids = await ctl.tokenize(model, text, add_special_tokens=True)
        if len(ids) >= context:
            raise CellNotAttempted(
                f"context {context} is shorter than the prompt header ({len(ids)} tokens)"
            )
        headers.append(ids)
    return PromptSet(context, headers, corpus, text=corpus_text())


async def _article_prompts(
    ctl: ControlClient, model: str, context: int, texts: list[str]
) -> PromptSet:
    frames = await article.frames(ctl, model, texts)
    doc = await article.document_ids(ctl, model)
    tail = frames[0].tail
    for frame in frames:
        if frame.tail != tail:
            raise CellNotAttempted("the chat template ends the conversation differently per stream")
        room = context - len(frame.head) - len(tail)
        if room < 1:
            raise CellNotAttempted(
                f"context {context} is too short for the article conversation: its template, "
                f"header and instruction alone take {len(frame.head) + len(tail)} tokens "
                "(use --workload continuation for such short contexts)"
            )
    return PromptSet(
        context, [f.head for f in frames], doc, suffix=tail, text=article.prompt_text("")
    )


class BodyBuilder:
    """Request bodies for /v1/completions with fixed output length (docs/measurement.md rule 5)."""

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
