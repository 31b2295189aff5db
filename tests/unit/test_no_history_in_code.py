"""Comments and docstrings in plugins/ and dags/ say why the code is as it is, in the present
tense; which issue asked for it is history, and history is git's. An issue tag (`issue #19`,
`issue 7`, `(#33)`, `: #33)`, `#34 item 5`) in a comment or a docstring fails here.

Only comments and docstrings are read, through `tokenize`: a string the code uses (a header, a
message, a pattern) may hold anything.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("plugins", "dags")

# Files allowed to keep an issue tag: none. The set stays so that a rewrite in flight can
# name a file here for its duration (the test below fails once the file no longer needs it).
ALLOWED: frozenset[str] = frozenset()

TAG = re.compile(
    r"\bissues?\s+#?\d+"  # issue #19, issue 7, issues 11
    r"|\(#\d+"  # (#33), (#34 item 5)
    r"|(?<![\w&#/])#\d+(?:\)|\s+items?\b)",  # ...: #33), #34 item 5 (not a repeat `8K x 1 #2`)
    re.IGNORECASE,
)

_SKIPPED = {tokenize.NL, tokenize.COMMENT}
_STATEMENT_START = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a module's source.

    A docstring is a string (or adjacent strings) that makes a statement of its own: a module's,
    a class's or a function's docstring, and an attribute's (a string under an assignment)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    found: list[tuple[int, str]] = []
    prev_type = tokenize.ENCODING
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string.lstrip("#")))
        elif tok.type == tokenize.STRING:
            j = i
            while j + 1 < len(tokens) and tokens[j + 1].type in (tokenize.STRING, tokenize.NL):
                j += 1
            k = j + 1
            while k < len(tokens) and tokens[k].type in _SKIPPED:
                k += 1
            ends = k == len(tokens) or tokens[k].type in (tokenize.NEWLINE, tokenize.ENDMARKER)
            if prev_type in _STATEMENT_START and ends:
                text = " ".join(t.string for t in tokens[i : j + 1] if t.type == tokenize.STRING)
                found.append((tok.start[0], text))
            prev_type = tokenize.STRING
            i = j + 1
            continue
        if tok.type not in _SKIPPED:
            prev_type = tok.type
        i += 1
    return found


def history_tags(path: Path) -> list[str]:
    """`line: tag` for every issue tag in a comment or docstring of the file."""
    return [
        f"{line + text[: m.start()].count(chr(10))}: {m.group(0)!r}"
        for line, text in comments_and_docstrings(path.read_text(encoding="utf-8"))
        for m in TAG.finditer(text)
    ]


def tagged_files(root: Path, allowed: frozenset[str] = frozenset()) -> dict[str, list[str]]:
    """Every scanned file under `root` with an issue tag, but the allowed ones."""
    out: dict[str, list[str]] = {}
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel not in allowed and (tags := history_tags(path)):
                out[rel] = tags
    return out


def test_no_comment_or_docstring_in_plugins_or_dags_carries_an_issue_tag():
    assert tagged_files(ROOT, ALLOWED) == {}


def test_the_allow_list_holds_only_files_that_still_need_it():
    stale = [rel for rel in sorted(ALLOWED) if not history_tags(ROOT / rel)]
    assert stale == [], f"no tag left: remove {stale} from ALLOWED"


def test_a_planted_tag_fails_and_a_code_string_does_not(tmp_path):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "dags").mkdir()
    (tmp_path / "plugins" / "clean.py").write_text(
        '"""Why: the host is shared, so a cell waits its turn."""\n'
        'HEADER = {"X-GitHub-Api-Version": "2022-11-28", "ref": "issue #19"}\n'
        "COLOUR = '#000000'  # black: #fff reads as white; a repeat is `8K x 1 #2`\n"
        'log = f"see issue #{HEADER}"\n'
        "x = call(\n    'issue #5',\n)\n"
    )
    (tmp_path / "dags" / "tagged.py").write_text(
        '"""The DAG (issue #34 item 9)."""\n'
        "\n"
        "def f():\n"
        '    """Fast enough.\n\n    Measured on the reference host, issue\n    #19."""\n'
        "    return 1  # side by side (#19)\n"
        "\n"
        "\n"
        "class C:\n"
        "    x = 1\n"
        '    """An attribute: the bound from issue 7."""\n'
        "    # what a failure said: #33)\n"
    )
    found = tagged_files(tmp_path)
    assert list(found) == ["dags/tagged.py"]
    assert found["dags/tagged.py"] == [
        "1: 'issue #34'",
        "6: 'issue\\n    #19'",
        "8: '(#19'",
        "13: 'issue 7'",
        "14: '#33)'",
    ]
    assert tagged_files(tmp_path, frozenset({"dags/tagged.py"})) == {}
