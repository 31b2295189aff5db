"""Every option of every subcommand says what it does in --help (#44 item 14), and the
warehouse default is named as it is (the checkout's warehouse/, not ./warehouse)."""

from __future__ import annotations

import argparse

from speedmatrix.cli import build_parser


def subparsers(parser: argparse.ArgumentParser, path: str = "speedmatrix"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subparsers(sub, f"{path} {name}")


def every_parser():
    # build_parser builds the subcommand named in argv fully; ask for each in turn
    top = build_parser([])
    names = [n for path, _p in subparsers(top) for n in [path.split()[1:]] if len(n) == 1]
    seen = {}
    for (name,) in names:
        for path, p in subparsers(build_parser([name])):
            seen[path] = p
    return seen


def test_every_option_of_every_subcommand_has_help():
    missing = []
    parsers = every_parser()
    assert {"speedmatrix sim predict", "speedmatrix trend", "speedmatrix sim serve"} <= set(parsers)
    for path, parser in parsers.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


def test_no_help_names_a_warehouse_default_it_does_not_use():
    for path, parser in every_parser().items():
        text = parser.format_help()
        assert "./warehouse" not in text, path
