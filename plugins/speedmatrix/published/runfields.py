"""A published page's run record: its header fields and launch command as runs-table fields,
and the two names an ingested page is filed under (its recipe id and its content run id).

Values written as the pages write them (``768 GB (8 × 96 GB)``, ``#1234``, ``30.0 s``,
``8,192``: ``formats``); the decode test's notes (the measurement profile, the workload) are
taken off into fields of their own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re

from speedmatrix.published import formats as F
from speedmatrix.published.pagetext import (
    HEADER_LABELS,
    Line,
    ReportParseError,
    launch_text,
    parse_header,
)
from speedmatrix.records import DEFAULT_WORKLOAD, RUN_FIELDS, WORKLOADS


def run_record(
    sections: dict[str, list[Line]], source: str | None
) -> tuple[dict[str, object], dict[str, str], str | None]:
    """(the run's fields, header fields the format does not know as ``Section.Label``, the
    launch command's comment lines): ``trigger`` = ``ingest``, ``status`` = ``success``,
    ``source`` = the given source, ``recipe_id`` = :func:`published_recipe_id`; ``run_id`` is
    left for :func:`content_run_id` over the run and its cells."""
    run: dict[str, object] = {f.name: None for f in RUN_FIELDS}
    extra: dict[str, str] = {}
    for name in ("Hardware", "Engine", "Run"):
        values = parse_header(name, sections[name], source, extra)
        for label, field_name in HEADER_LABELS[name]:
            if label in values:
                value, no = values[label]
                run[field_name] = _header_value(field_name, value, no, source)
    tool = run.get("bench_tool")
    if isinstance(tool, str):
        m = re.fullmatch(r"(.+?)\s+v?(\d[\w.+-]*)", tool)
        if m:
            run["bench_tool"], run["bench_tool_version"] = m.group(1), m.group(2)
    command, comment = launch_text(sections.get("Launch command", []), source)
    run["launch_command"] = command
    for k, v in _from_launch(command).items():
        run[k] = v
    decode_test, run["measurement_profile"] = _profile_of(
        run.get("decode_test"), run.get("bench_tool")
    )
    run["decode_test"], run["workload"] = _workload_of(decode_test)
    run["trigger"] = "ingest"
    run["status"] = "success"
    run["recipe_id"] = published_recipe_id(run)
    run["source"] = source
    return run, extra, comment


def _header_value(field_name: str, text: str, no: int, source: str | None) -> object:
    try:
        if field_name == "hardware_gpu_count":
            return F.parse_int(text)
        if field_name == "hardware_vram_gb":
            # "768 GB (8 × 96 GB)" -> 96 per GPU; "96 GB" -> 96
            m = re.search(r"\(\s*(\d+)\s*[×x]\s*([\d.,]+)\s*GB\s*\)", text)
            if m:
                return F.parse_number(m.group(2))
            m = re.fullmatch(r"([\d.,]+)\s*GB", text.strip())
            if m:
                return F.parse_number(m.group(1))
            raise F.QuantityError(f"not a VRAM size like '768 GB (8 × 96 GB)': {text!r}")
        if field_name == "engine_pr":
            return F.parse_int(text.lstrip("#"))
        if field_name == "window_s":
            return F.parse_seconds(text)
        if field_name == "max_output_tokens":
            return F.parse_tokens(text)
    except F.QuantityError as exc:
        raise ReportParseError(str(exc), no, source) from None
    return None if text in ("", F.DASH) else text


# One piece of a POSIX shell word, as shlex.split reads it (whitespace_split, no comments):
# unquoted text, '...' (literal), "..." (a backslash escapes only " and \), \x (x itself). The
# double-quoted body is unrolled (no nested quantifier), so an unclosed quote fails in linear
# time rather than backtracking.
_PIECE = re.compile(
    r"(?P<space>[ \t\r\n]+)"
    r"|(?P<plain>[^ \t\r\n'\"\\]+)"
    r"|'(?P<single>[^']*)'"
    r'|"(?P<double>[^"\\]*(?:\\.[^"\\]*)*)"'
    r"|\\(?P<escaped>.)"
    r"|(?P<bad>.)",
    re.DOTALL,
)
_DOUBLE_ESCAPE = re.compile(r'\\([\\"])')


def launch_argv(command: str) -> list[str]:
    """The words of a launch command, as ``shlex.split`` gives them, in linear work.

    shlex builds each word one character at a time by string concatenation, which is
    quadratic in a word's length (20 s of a 600 KB word); here a word is a list of whole
    pieces (runs of plain text, quoted strings) joined once. ValueError on an unclosed quote
    or a trailing backslash, as shlex."""
    words: list[str] = []
    word: list[str] | None = None
    for m in _PIECE.finditer(command):
        kind = m.lastgroup or "bad"
        if kind == "space":
            if word is not None:
                words.append("".join(word))
            word = None
            continue
        if kind == "bad":
            raise ValueError(f"no closing quotation or escaped character at {m.start()}")
        piece = m.group(kind)
        if kind == "double":
            piece = _DOUBLE_ESCAPE.sub(r"\1", piece)
        if word is None:
            word = []
        word.append(piece)
    if word is not None:
        words.append("".join(word))
    return words


def _from_launch(command: str | None) -> dict:
    out: dict[str, object] = {}
    if not command:
        return out
    try:
        argv = launch_argv(command.replace("\\\n", " "))
    except ValueError:
        argv = command.split()
    if "serve" in argv:
        k = argv.index("serve")
        if k + 1 < len(argv) and not argv[k + 1].startswith("-"):
            out["model"] = argv[k + 1]
    for k, arg in enumerate(argv):
        value = None
        if arg == "--max-model-len" and k + 1 < len(argv):
            value = argv[k + 1]
        elif arg.startswith("--max-model-len="):
            value = arg.split("=", 1)[1]
        if value is not None:
            with contextlib.suppress(F.QuantityError):
                out["max_model_len"] = F.parse_int(value)
    return out


_WORKLOAD_NOTE = re.compile(r"^(?P<test>.*?)\s*\((?P<workload>[a-z]+) workload\)$")


PUBLISHED_PROFILE_NOTE = " (published profile)"
"""render.decode_test_text's note on our runs measured by the `published` profile."""


def _profile_of(decode_test: object, bench_tool: object) -> tuple[object, str]:
    """(decode test without the profile note, measurement profile): a page the published tool
    made is the `published` profile by its nature; ours says so in a note, else default."""
    if isinstance(decode_test, str) and decode_test.endswith(PUBLISHED_PROFILE_NOTE):
        return decode_test[: -len(PUBLISHED_PROFILE_NOTE)], "published"
    ours = bench_tool in (None, "speedmatrix")
    return decode_test, "default" if ours else "published"


def _workload_of(decode_test: object) -> tuple[object, str]:
    """("Fixed duration (continuation workload)") -> ("Fixed duration", "continuation"): the
    note render.decode_test_text adds for a workload other than the published one. A page
    without it was measured with the published tool's workload: article."""
    if isinstance(decode_test, str):
        m = _WORKLOAD_NOTE.match(decode_test)
        if m and m.group("workload") in WORKLOADS:
            return m.group("test") or None, m.group("workload")
    return decode_test, DEFAULT_WORKLOAD


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.") or "unknown"


def published_recipe_id(run: dict) -> str:
    """The recipe id an ingested page is filed under: ``published/<gpu>-x<count>/<model>``
    (e.g. ``published/rtx-pro-6000-blackwell-server-edition-x8/kimi-k2.7-code-nvfp4``), so
    pages of one configuration group together in the warehouse."""
    hw = _slug(str(run.get("hardware_gpu") or "unknown"))
    if run.get("hardware_gpu_count"):
        hw += f"-x{run['hardware_gpu_count']}"
    model = _slug(str(run.get("served_model") or run.get("model") or "unknown"))
    return f"published/{hw}/{model}"


def content_run_id(run: dict, cells: list[dict]) -> str:
    """``ingest-`` + 16 hex of a SHA-256 over the parsed content (not the raw text, not the
    source path): the same page, wherever it lies and however it is laid out, is the same run.
    The published workload (`article`) is left out of the hash, so pages ingested before the
    workload was recorded keep their ids; so is `recipe_sha256` (always null for a page: no
    recipe of ours ran it), added to the runs row after pages were ingested."""

    def hashed(row: dict, drop: tuple[str, ...] = ()) -> dict:
        return {
            k: v
            for k, v in row.items()
            if k not in drop and not (k == "workload" and v == DEFAULT_WORKLOAD)
        }

    keep_run = hashed(run, ("run_id", "source", "recipe_sha256"))
    payload = json.dumps(
        {"run": keep_run, "cells": [hashed(c) for c in cells]},
        sort_keys=True,
        default=str,
        separators=(",", ":"),
    )
    return "ingest-" + hashlib.sha256(payload.encode()).hexdigest()[:16]
