"""The `article` workload: the published tool's chat conversation, as exact token ids.

docs/measurement.md rule 11. A decode prompt that the model can simply continue (or copy) makes
speculative decoding accept drafts almost for free, so every decode figure comes out inflated
on a speculative-decoding server. The published pages were measured with a conversation that
asks for fresh prose instead; this module builds that conversation (our own words and our own
document, `document.txt`):

1. user: the run/stream header, then a long reference document about one topic (lighthouses);
2. assistant: it has read the document;
3. user: write an extremely detailed, comprehensive encyclopedia article on an unrelated
   subject (the history of mathematics); do not summarize.

The conversation is rendered by the server's own chat template (`/tokenize` with `messages`
and `add_generation_prompt`), so the prompt is what that server's chat endpoint would build.
It is still sent as token ids to `/v1/completions` (rule 1: exact context).

How the document is fitted to an exact context without tokenizing a 512K-token conversation
per stream: the conversation is rendered twice with two short stand-in documents; the ids the
two renders share at the start are the template's opening plus the header (`head`), the ids
they share at the end are everything after the document: the end of that message, the
assistant's reply, the instruction and the generation prompt (`tail`). The document's own ids
(tokenized once, repeated paragraph by paragraph) go between them, cut to the token so that
head + document + tail is exactly the context. So the instruction is always the last thing the
model reads, the header keeps prompts distinct per stream and per run, and every stream shares
one document-and-tail body (prompts.py). The two seams are token boundaries the template's
render would also have (the document is cut at its end, mid-sentence, as any exact-length
prompt must be).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from .control import CellNotAttempted, ControlClient

# Short on purpose: these words are part of every context, so the smallest context is the
# template, the header and these (about 220 tokens with the cpu recipe's tiny tokenizer, some
# 60 with a real model's); the rest of the prompt is the document.
INTRO = "Here is a reference document about lighthouses."
ACK = "I have read the document."
INSTRUCTION = (
    "Now write an extremely detailed, comprehensive encyclopedia article on the history of "
    "mathematics. Do not summarize."
)
# Two stand-in documents that share neither their first nor their last characters, so the
# two renders differ exactly where the document sits. Each starts after a space: tokenizers
# that glue punctuation to the next word would otherwise swallow the intro's last word.
_STAND_INS = (" Kestrel", " Osprey heron")


def document_sentences() -> list[str]:
    """The reference document, one sentence per line (works from a zipapp too)."""
    text = resources.files(__package__).joinpath("document.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def document_paragraph() -> str:
    """One pass over the document, starting with the paragraph break that separates it from
    the intro and from the previous pass, so that repeating its ids reads as paragraphs."""
    return "\n\n" + " ".join(document_sentences())


def messages(first_user: str) -> list[dict[str, str]]:
    """The three-message conversation, with `first_user` as the first message's content."""
    return [
        {"role": "user", "content": first_user},
        {"role": "assistant", "content": ACK},
        {"role": "user", "content": INSTRUCTION},
    ]


def prompt_text(header: str) -> str:
    """The conversation's own words (what the copy check compares outputs with)."""
    return "\n".join([header + INTRO, *document_sentences(), ACK, INSTRUCTION])


@dataclass(frozen=True)
class Frame:
    """The template's ids around the document: head (opening + header + intro), tail (the
    end of that message, the assistant's reply, the instruction, the generation prompt)."""

    head: list[int]
    tail: list[int]


def split_renders(a: list[int], b: list[int]) -> Frame:
    """The common start and the common end of two renders that differ only in the document."""
    n = min(len(a), len(b))
    p = 0
    while p < n and a[p] == b[p]:
        p += 1
    s = 0
    while s < n - p and a[-1 - s] == b[-1 - s]:
        s += 1
    if p == len(a) or p == len(b):
        raise CellNotAttempted("the chat template dropped the document (two renders are equal)")
    return Frame(a[:p], a[len(a) - s :] if s else [])


async def render(ctl: ControlClient, model: str, first_user: str) -> list[int]:
    return await ctl.tokenize_chat(model, messages(first_user))


async def frames(ctl: ControlClient, model: str, headers: list[str]) -> list[Frame]:
    """One Frame per header. The first costs two renders; every further one a single render,
    checked to end exactly as the first did (else it gets its own two)."""
    out: list[Frame] = []
    ref_tail: list[int] | None = None
    ref_mid_tail: list[int] | None = None
    for header in headers:
        first = header + INTRO
        a = await render(ctl, model, first + _STAND_INS[0])
        known = len(ref_mid_tail) if ref_mid_tail is not None else 0
        if ref_mid_tail is not None and len(a) > known and a[len(a) - known :] == ref_mid_tail:
            out.append(Frame(a[: len(a) - known], list(ref_tail or [])))
            continue
        b = await render(ctl, model, first + _STAND_INS[1])
        frame = split_renders(a, b)
        if not frame.tail:
            raise CellNotAttempted(
                "the chat template puts nothing after the document: the instruction would not "
                "be the last thing in the prompt"
            )
        if ref_mid_tail is None:
            ref_tail = frame.tail
            ref_mid_tail = a[len(frame.head) :]
        out.append(frame)
    return out


async def document_ids(ctl: ControlClient, model: str) -> list[int]:
    """The ids of one pass over the document (repeated for long contexts)."""
    ids = await ctl.tokenize(model, document_paragraph(), add_special_tokens=False)
    if not ids:
        raise CellNotAttempted("the server tokenized the reference document to nothing")
    return ids
