"""What the command line does with an error (issue #41): a mistake in what the user gave is one
line naming it and exit 2; a bug in the code shows where it happened (the traceback), never a
one-line message that hides it."""

from __future__ import annotations

import argparse

from speedmatrix.cli import COMMANDS, main
from speedmatrix.errors import InputError


def _a_bug_deep_inside(args: argparse.Namespace) -> int:
    # a programming error that happens to be a ValueError (int() of a bad constant)
    return int("not-a-number-by-mistake")


def register(sub: argparse._SubParsersAction, name: str) -> None:
    """This module stands in as a command whose body has a bug (see the test below)."""
    sub.add_parser(name).set_defaults(func=_a_bug_deep_inside)


def test_an_input_error_is_one_line_and_exit_2(tmp_path, capsys):
    rc = main(["compare", "--warehouse", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        err
        == "speedmatrix compare: name the run: compare RUN, compare RUN_A RUN_B, or --run-id ID\n"
    )


def test_a_bug_shows_its_traceback_and_where_it_happened(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "buggy", (__name__, "a command with a bug"))
    rc = main(["buggy"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "Traceback (most recent call last)" in err
    assert "_a_bug_deep_inside" in err and "test_cli_errors.py" in err
    assert "ValueError: invalid literal for int()" in err


def test_an_input_error_is_still_a_value_error():
    # callers that catch ValueError around input checks keep working
    assert issubclass(InputError, ValueError)
