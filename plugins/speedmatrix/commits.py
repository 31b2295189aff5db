"""Which vLLM commit a run measured, under one name, and how it is shown.

Why one rule: analysts group runs by `engine_commit`, so every run of one commit must carry
the same value whichever path landed it (the DAG, `speedmatrix run` against a server already
running, an ingested page). The sources differ in what they know:

- provisioning resolves a commit or PR ref to 40 hex, and a wheel may record `__commit_id__`;
- a 40-hex engine ref names the commit;
- a short hex ref (`9fedd24fa864`), a published page's Commit line, or a dev build's version
  (`0.1.dev1+g9fedd24fa`: 9 hex digits, git's abbreviation in vLLM's history) know a prefix;
- a release (`v0.32.0`) knows a tag.

The value is the full SHA when any source has it or GitHub can tell it (the deployment's API,
speedmatrix.upstream.github_commits). Where only a prefix is known it is the prefix's first
PREFIX_LEN hex digits, the length a vLLM version string carries, so the DAG's `9fedd24fa864`
and the CLI's `9fedd24fa` land as one value. A release GitHub cannot resolve has none.

Shown (pages, charts, trends, verdicts, comparisons, bisection): one length, LABEL_LEN (12) hex
digits, whatever is stored (:func:`shown_commit`). A commit known only by a shorter prefix (the
9 of a dev build's version) is shown as those digits marked ABBREVIATED (`9fedd24fa…`): the rest
is not known, and no digit is made up; a longer engine ref of the same commit, or a commit list
at hand (GitHub's compare between a baseline and a run: :func:`resolved`), names it whole.
Stdlib only: the bottom layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

PREFIX_LEN = 9
"""Hex digits kept of a commit known only by a prefix (what `+g<hash>` in a vLLM version has)."""
LABEL_LEN = 12
"""Hex digits a commit is shown with, everywhere one is shown (as run ids and refs show it):
enough to tell vLLM's commits apart (GitHub's own short form is 7; 12 has no collision in its
history)."""
ABBREVIATED = "…"
"""Follows a commit shown with fewer than LABEL_LEN hex digits because no more are known."""

_HEX = re.compile(r"[0-9a-f]{7,40}")
_VERSION_HASH = re.compile(r"\+g([0-9a-f]{7,40})")
_RELEASE = re.compile(r"v?\d+\.\d+\.\d+")


def _hex(value: Any) -> str | None:
    text = str(value or "").strip().lower().removesuffix(ABBREVIATED)
    return text if _HEX.fullmatch(text) else None


def version_hash(version: Any) -> str | None:
    """The commit prefix a dev build's version carries (`0.1.dev1+g9fedd24fa` -> 9fedd24fa)."""
    m = _VERSION_HASH.search(str(version or ""))
    return m.group(1) if m else None


def release_tag(ref: Any, version: Any = None) -> str | None:
    """The release a ref names (`v0.32.0`), else the one an exact release version is."""
    for text in (str(ref or ""), str(version or "")):
        if _RELEASE.fullmatch(text):
            return text if text.startswith("v") else f"v{text}"
    return None


def same_commit(a: Any, b: Any) -> bool:
    """Whether two commit names (full or prefixes of 7+ hex) can name the same commit."""
    x, y = _hex(a), _hex(b)
    return bool(x and y and (x.startswith(y) or y.startswith(x)))


def known_commit(recorded: Any = None, ref: Any = None, version: Any = None) -> str | None:
    """The longest commit name the sources agree on, without asking anyone: a full SHA
    (recorded, else the ref) wins; else the longest prefix among the ref and the version's
    hash that does not contradict it. None when no source names a commit."""
    for full in (_hex(recorded), _hex(ref)):
        if full and len(full) == 40:
            return full
    names = [n for n in (_hex(recorded), _hex(ref), version_hash(version)) if n]
    if not names:
        return None
    first = names[0]
    agreeing = [n for n in names if same_commit(n, first)]
    return max(agreeing, key=len)


def canonical(name: str | None) -> str | None:
    """The engine_commit of a commit name: a full SHA as is, a prefix cut to PREFIX_LEN."""
    if not name:
        return None
    return name if len(name) == 40 else name[:PREFIX_LEN]


def shown_commit(commit: Any, width: int = LABEL_LEN) -> str | None:
    """A commit as it is shown: its first `width` hex digits; a prefix shorter than that as it
    is, marked ABBREVIATED (`9fedd24fa…`: only 9 are known). None when it names no commit."""
    name = _hex(commit)
    if name is None:
        return None
    return name[:width] if len(name) >= width else name + ABBREVIATED


def resolved(commit: Any, commits: Iterable[str] = ()) -> str | None:
    """A commit prefix made whole from a commit list at hand (GitHub's compare between two runs,
    a bisection's range): the one listed commit it starts; else the commit as it was (not in
    the list, or two of it match: not guessed)."""
    name = _hex(commit)
    if name is None or len(name) == 40:
        return commit if name is None else name
    matches = {c for c in (_hex(x) for x in commits) if c and c.startswith(name) and len(c) == 40}
    return matches.pop() if len(matches) == 1 else name


def longest_commit(run: Mapping[str, Any]) -> str | None:
    """The longest name of a run's engine commit it knows (engine_commit, or its engine ref
    where the two agree and the ref is longer): what is shown for it."""
    return _longest(run)


def _longest(run: Mapping[str, Any]) -> str | None:
    """The longest of the run's engine_commit and its engine ref that agree (a prefix landed
    as 9fedd24fa of a run asked for 9fedd24fa864 is 9fedd24fa864), else engine_commit."""
    commit = run.get("engine_commit")
    commit = commit if isinstance(commit, str) and commit else None
    ref = _hex(run.get("engine_ref"))
    if commit and ref and same_commit(commit, ref) and len(ref) > len(commit):
        return ref
    return commit


def commit_text(run: Mapping[str, Any]) -> str | None:
    """The commit as a page's Commit line names it: the longest name the run knows
    (:func:`_longest`), shown as every commit is (:func:`shown_commit`: 12 hex, as the
    published page shows `9fedd24fa864`)."""
    commit = _longest(run)
    return shown_commit(commit) or commit


def engine_text(run: Mapping[str, Any]) -> str:
    """The engine a line of text names (a verdict's, a comparison's): the commit shown as
    every commit is, else the engine version, else `?`."""
    return commit_text(run) or str(run.get("engine_version") or "") or "?"


def commit_label(run: Mapping[str, Any], width: int = LABEL_LEN) -> str:
    """A run's engine, short but whole enough to tell commits apart (axes, trends, bisection,
    comparisons): the commit (the longest name the run knows) shown as :func:`shown_commit`
    shows it, else the version's hash so, else the version or ref whole (never a version cut
    mid-way, which read `0.1.dev1+g` on every axis)."""
    for value in (_longest(run), version_hash(run.get("engine_version"))):
        if shown := shown_commit(value, width):
            return shown
    commit = run.get("engine_commit")
    if isinstance(commit, str) and commit:
        return commit[:width]
    for value in (run.get("engine_version"), run.get("engine_ref"), run.get("run_id")):
        if isinstance(value, str) and value:
            return value
    return "—"
