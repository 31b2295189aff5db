"""The `speedmatrix` command.

Each subcommand group lives next to the code it drives (``<module>.register(subparsers)``), so
this file only wires them together and turns expected errors into a one-line reason and a
non-zero exit. Modules are imported lazily so that `speedmatrix loadgen --help` does not pay for
Airflow or pandas.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# command name -> (module providing register(subparsers), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "recipes": ("speedmatrix.cli.recipes", "validate and render recipes"),
    "sim": ("speedmatrix.cli.sim", "the simulated vLLM engine"),
    "loadgen": ("speedmatrix.loadgen.cli", "measure one prefill or decode cell"),
    "ingest": ("speedmatrix.cli.report", "land published Speed test matrix reports"),
    "report": ("speedmatrix.cli.report", "render a run from the warehouse"),
    "query": ("speedmatrix.cli.warehouse", "SQL over the runs / cells / requests tables"),
    "compare": ("speedmatrix.cli.compare", "compare a run with its baseline, cell by cell"),
    "trend": ("speedmatrix.cli.compare", "one cell over a recipe's runs, with verdicts"),
    "run": ("speedmatrix.cli.run", "measure a matrix now, without Airflow, and land it"),
    "site": ("speedmatrix.cli.site", "write the static site over the warehouse"),
    "export": ("speedmatrix.cli.tables", "write a plain Parquet snapshot of the warehouse"),
    "warehouse": ("speedmatrix.cli.tables", "maintain (compact, vacuum) or migrate the warehouse"),
}


class CliError(Exception):
    """An expected failure: printed as one line, exit code 2."""


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speedmatrix",
        description="Speed test matrices for vLLM servers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        if name == wanted:
            importlib.import_module(module).register(sub, name)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.parse_args([*argv, "--help"])
        return 2
    try:
        rc = func(args)
    except KeyboardInterrupt:
        print("speedmatrix: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, FileNotFoundError, PermissionError) as exc:
        message = str(exc).strip() or exc.__class__.__name__
        print(f"speedmatrix {args.command}: {message}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
