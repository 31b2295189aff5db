"""A published page's launch line: capped, and split into words in linear work (issue #42
item 8).

A 1 MB launch line cost 32 s to ingest against 7 s without it: `shlex` builds each token one
character at a time by string concatenation (quadratic). Published launch lines are under
4 KB; one past `pagetext.MAX_LAUNCH_CHARS` is refused naming its line, and the words are split
by `runfields.launch_argv`, whose work is counted here (Python steps), not timed.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from speedmatrix.published.pagetext import MAX_LAUNCH_CHARS, ReportParseError
from speedmatrix.published.parse import parse_report
from speedmatrix.published.runfields import launch_argv

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "include" / "reference" / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt"


@pytest.fixture(scope="module")
def text() -> str:
    return REFERENCE.read_text(encoding="utf-8")


def with_launch(text: str, command: str) -> str:
    lines = text.splitlines()
    at = lines.index("Launch command") + 1
    lines[at] = command
    return "\n".join(lines) + "\n"


def test_a_launch_line_past_the_cap_is_refused_naming_its_line(text):
    assert 4096 < MAX_LAUNCH_CHARS <= 256 * 1024
    long = "vllm serve m --max-model-len 4096 --x " + "y" * MAX_LAUNCH_CHARS
    with pytest.raises(ReportParseError, match="launch command") as exc:
        parse_report(with_launch(text, long), source="p.txt")
    assert exc.value.line == text.splitlines().index("Launch command") + 2
    assert f"{MAX_LAUNCH_CHARS // 1024} KiB" in str(exc.value)


def test_a_long_real_launch_line_is_kept(text):
    command = "vllm serve org/m --max-model-len 8192 " + "--flag value " * 600  # ~8 KB
    run = parse_report(with_launch(text, command)).run
    assert run["max_model_len"] == 8192 and run["model"] == "org/m"
    assert run["launch_command"] == command.strip()


@pytest.mark.parametrize(
    "line",
    [
        'env A=1 "$HOME/env x/bin/vllm" serve m --api-key "a b" --x=\'c d\'',
        r"vllm serve m --a \"q\" --b 'it'\''s' --c \\ --d \x",
        r'vllm serve "a\"b\\c\d" \'\' "" \$x',
        "a\tb\r\nc   d ''",
        "",
        "   ",
    ],
)
def test_words_split_as_a_posix_shell_would(line):
    assert launch_argv(line) == shlex.split(line)


@pytest.mark.parametrize("line", ['vllm serve "unclosed', "vllm serve 'x", "trailing \\"])
def test_an_unclosed_quote_is_a_value_error_as_with_shlex(line):
    with pytest.raises(ValueError):
        shlex.split(line)
    with pytest.raises(ValueError):
        launch_argv(line)


def _steps(func, arg) -> int:
    """Python line events while `func(arg)` runs: the work done one step at a time."""
    count = 0

    def tracer(frame, event, _arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        func(arg)
    finally:
        sys.settrace(None)
    return count


@pytest.mark.parametrize(
    "word",
    [
        lambda n: "y" * n,
        lambda n: '"' + "y " * (n // 2) + '"',
        lambda n: "'" + "y" * n + "'",
    ],
)
def test_splitting_does_not_step_through_a_long_word(word):
    small = _steps(launch_argv, "vllm serve m --x " + word(2_000))
    large = _steps(launch_argv, "vllm serve m --x " + word(20_000))
    # a step per character (shlex: ~20 lines per character) makes `large` ~10x `small`
    assert large <= small + 20, (small, large)
