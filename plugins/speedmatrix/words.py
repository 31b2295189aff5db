"""Counted words: "1 recipe", "2 regressions", "0 improvements".

One job: a count and its noun, said right, so that no message writes `regression(s)` or
`1 recipes`. Stdlib only: the bottom layer, for every layer's messages.
"""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """``word`` for one, else ``many`` (default: ``word`` + s)."""
    return word if n == 1 else (many if many is not None else word + "s")


def count(n: int, word: str, many: str | None = None) -> str:
    """``"<n> <word>"`` with the noun in the number the count asks for."""
    return f"{n} {plural(n, word, many)}"
