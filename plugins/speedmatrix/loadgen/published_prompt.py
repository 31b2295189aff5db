"""The `published` profile's prompts and request bodies: the published tool's way.

llm-inference-bench (``llm_decode_bench.py``) does not send exact contexts. It measures
characters per token once, on an 8K chat prompt (starting from 4 chars/token, up to three
probes until the probe lands within 5%), then sends ``context x chars_per_token`` characters
of text as a chat conversation to ``/v1/chat/completions``; the server's chat template and
tokenizer decide the real count, and long prompts come out 1-2.5% short of their label. One
payload serves all C streams of a cell (their KV blocks are shared by the prefix cache). A
request asks ``ignore_eos`` and ``max_tokens`` but no ``min_tokens``, and carries no cache
salt (the run's tag at the start of the text keeps runs apart).

Our words and our document (``article.py``), the tool's sizing and shape; the conversation is
the article workload's three messages.
"""

from __future__ import annotations

import json
from typing import Any

from . import article
from .control import CellNotAttempted, ControlClient

CAL_CONTEXT = 8192
"""The context of the chars-per-token probe (the tool's default calibration context)."""

START_CHARS_PER_TOKEN = 4.0
"""The tool's starting guess before its first probe."""

MAX_REFUSED_PROBES = 4
CAL_PROBES = 3
CAL_CLOSE = 0.05
"""The tool probes at most 3 times, and stops once a probe lands within 5% of its target."""


def base_text(min_chars: int) -> str:
    """Our reference document repeated to at least `min_chars` characters."""
    para = article.document_paragraph().lstrip()
    reps = max(1, -(-min_chars // max(len(para), 1)) + 1)
    return " ".join([para] * reps)


def context_text(tag: str, context: int, chars_per_token: float, label: str = "CTX") -> str:
    """The text of a context: the run's tag, then the document, cut to context x chars/token."""
    prefix = f"[BENCH_{tag}_{label}_{context}] "
    target = int(context * chars_per_token)
    return (prefix + base_text(target))[:target]


def messages(text: str) -> list[dict[str, str]]:
    """The conversation: the intro and the text, the assistant's acknowledgement, the request."""
    return article.messages(f"{article.INTRO}\n\n{text}" if text else article.INTRO)


def probe_context(largest: int) -> int:
    """The probe's context: 8K, or the run's largest context when smaller (as the tool's)."""
    return max(1, min(CAL_CONTEXT, largest))


async def chars_per_token(ctl: ControlClient, model: str, tag: str, largest: int) -> float:
    """The tool's calibration: probe an 8K chat prompt (``probe_context``), chars / the
    server's prompt tokens.

    The probe's text is the same for every cell of a run (its tag), so after the run's first
    cell the probe is a prefix-cache hit and costs next to nothing."""
    cpt = START_CHARS_PER_TOKEN
    probe = probe_context(largest)
    refused = 0
    probes = 0
    while probes < CAL_PROBES:
        text = context_text(tag, probe, cpt, "CAL")
        try:
            actual = await ctl.chat_prompt_tokens(model, messages(text))
        except CellNotAttempted:
            # Ours, not the tool's (which keeps its guess and fails later): a probe the server
            # refuses (more tokens than its max-model-len: a tokenizer far below 4 chars per
            # token, e.g. the CPU recipe's tiny model) is tried again at half the guess.
            refused += 1
            if refused > MAX_REFUSED_PROBES:
                raise
            cpt /= 2.0
            continue
        probes += 1
        cpt = len(text) / actual
        if abs(actual - probe) / probe < CAL_CLOSE:
            break
    if cpt <= 0:
        raise CellNotAttempted("chars-per-token probe gave nothing")
    return cpt


def body(
    model: str, msgs: list[dict[str, str]], max_tokens: int, extra: dict[str, Any] | None
) -> bytes:
    """One request body, built when the request is made (the tool's TTFT includes this)."""
    payload: dict[str, Any] = {
        "model": model,
        "messages": msgs,
        "stream": True,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    payload.update(extra or {})
    return json.dumps(payload).encode()
