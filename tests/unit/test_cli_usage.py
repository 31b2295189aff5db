"""What a newcomer meets on the command line (issue #34 item 8): a mistyped flag gets the
subcommand's usage and a suggestion, --help says how to use a command (no notes meant for
developers), and the site the DAG writes beside the warehouse is not committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from speedmatrix.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (["run", "--contxts", "8K", "--model", "m"], "usage: speedmatrix run", "--contexts"),
        (["sim", "serve", "--profle", "p.yaml"], "usage: speedmatrix sim serve", "--profile"),
        (["report", "--run_id", "r1"], "usage: speedmatrix report", "--run-id"),
    ],
)
def test_a_mistyped_flag_gets_the_subcommands_usage_and_a_suggestion(argv, usage, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith(usage), err
    assert f"did you mean {hint}?" in err


NESTED = {"recipes": ["validate", "render", "list"], "sim": ["serve", "calibrate", "predict"],
          "loadgen": ["prefill", "decode"]}  # fmt: skip
DEVELOPER_NOTES = ("Why ", ".py", "issue #", ":mod:", "XCom", "Imports stay")


@pytest.mark.parametrize(
    "argv",
    [[c] for c in COMMANDS] + [[c, s] for c, subs in NESTED.items() for s in subs],
    ids=lambda a: " ".join(a),
)
def test_help_texts_carry_no_developer_notes(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith("usage: speedmatrix")
    assert not [n for n in DEVELOPER_NOTES if n in out], out


def test_the_site_directory_is_ignored_by_git():
    lines = (ROOT / ".gitignore").read_text().splitlines()
    assert "site/" in lines


def test_a_value_that_starts_like_a_flag_is_not_taken_for_one(tmp_path, capsys):
    """SQL may open with a comment: `-- 1. one recipe` is the query, not a mistyped flag."""
    rc = main(["query", "-- a comment\nSELECT 1 AS one", "--warehouse", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "unrecognized" not in err and "did you mean" not in err
    assert rc == 0 and "one" in out, err
