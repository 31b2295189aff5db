"""``speedmatrix config [--json]``: the settings this process would run with.

Every setting (speedmatrix.settings), its effective value, where it came from (the variable
that set it, or the default) and what it does; secrets print as ``<redacted>``, never their
value. A variable holding a value its setting cannot take is an error naming it (exit 2),
as it is for every other command. ``--json`` prints a list of objects for machines.
"""

from __future__ import annotations

import argparse
import json
import textwrap


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        "config",
        help="print the effective settings (secrets redacted)",
        description="Print every setting speedmatrix reads from the environment: its value "
        "here, its source (the variable or the default) and what it does. Secrets are "
        "redacted.",
    )
    p.add_argument("--json", action="store_true", help="a JSON list of settings, for machines")
    p.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    from speedmatrix.settings import settings

    rows = settings().rows()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    for row in rows:
        print(f"{' | '.join(row.env)} = {row.value}  [{row.source}]")
        print(textwrap.fill(row.doc, width=96, initial_indent="    ", subsequent_indent="    "))
    return 0
