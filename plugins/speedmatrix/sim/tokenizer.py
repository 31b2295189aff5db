"""A deterministic tokenizer that needs no download: one token per word piece.

A piece is a run of non-space characters with the whitespace before it (GPT-style), and its id
is a CRC32 of its UTF-8 bytes folded into [FIRST_ID, vocab_size). Ids below FIRST_ID are never
produced (room for "special" tokens). Text is therefore mapped to the same ids in every process
and run, which is all a load generator needs (it slices ids from /tokenize and sends them back).
Decoding knows the pieces it has seen; other ids decode to a stable made-up word.
"""

from __future__ import annotations

import re
import zlib

FIRST_ID = 1000
_PIECE = re.compile(r"\s*\S+|\s+")
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
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
    "one",
    "all",
    "we",
    "their",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
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
]


class Tokenizer:
    def __init__(self, vocab_size: int):
        if vocab_size <= FIRST_ID + len(WORDS):
            raise ValueError(f"vocab_size must exceed {FIRST_ID + len(WORDS)}")
        self.vocab_size = vocab_size
        self._span = vocab_size - FIRST_ID
        self._seen: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        span, seen = self._span, self._seen
        ids = []
        for piece in _PIECE.findall(text):
            tid = FIRST_ID + zlib.crc32(piece.encode("utf-8")) % span
            if len(seen) < 200_000:
                seen.setdefault(tid, piece)
            ids.append(tid)
        return ids

    def piece(self, tid: int) -> str:
        known = self._seen.get(tid)
        if known is not None:
            return known
        return " " + WORDS[tid % len(WORDS)]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.piece(t) for t in ids)

    def out_of_vocab(self, ids: list[int]) -> int | None:
        """The first id outside [0, vocab_size), or None."""
        v = self.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= v:
                return t
        return None


def output_words(seed: int, start: int, count: int, repeat: bool = False) -> str:
    """Text of output tokens start..start+count of a request: pseudo-random words, no loops."""
    if repeat:
        return " again" * count
    n = len(WORDS)
    if count == 1:
        return " " + WORDS[((seed + start) * 2654435761 >> 7) % n]
    return "".join(
        " " + WORDS[((seed + i) * 2654435761 >> 7) % n] for i in range(start, start + count)
    )
