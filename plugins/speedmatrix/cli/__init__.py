"""The `speedmatrix` command.

Each subcommand group lives next to the code it drives (``<module>.register(subparsers)``), so
this file only wires them together and turns a user's mistake (an :class:`InputError`, or an
``OSError``: a missing file, a full disk) into a one-line reason and exit 2; anything else is a
bug, shown with its traceback (exit 1). Modules are imported lazily so that `speedmatrix loadgen --help` does not pay for
Airflow or pandas.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

# stdlib-only, imported with the package so that entry() starts with nothing left to import
import speedmatrix.cli.exiting
import speedmatrix.cli.interrupts  # noqa: F401
from speedmatrix.errors import InputError

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
    "config": ("speedmatrix.cli.config", "print the effective settings (secrets redacted)"),
}


class CliError(InputError):
    """A mistake in the command's arguments: printed as one line, exit code 2."""


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


_FLAG = re.compile(r"--[A-Za-z][A-Za-z0-9_-]*")
"""What a mistyped long option looks like (`-- 1. a SQL comment` is a value, not a flag)."""


def _deepest(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The (sub)command parser `argv` names, however deep (`sim serve`, `recipes validate`)."""
    words = [a for a in argv if not a.startswith("-")]
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return parser
        chosen = next((subs[0].choices[w] for w in words if w in subs[0].choices), None)
        if chosen is None:
            return parser
        parser = chosen


def unknown_arguments(parser: argparse.ArgumentParser, extra: Sequence[str]) -> str:
    """argparse's "unrecognized arguments", with the closest option of that command for each
    mistyped flag (`--contxts` -> did you mean --contexts?)."""
    import difflib

    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in extra:
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
        if flag.startswith("-") and close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    message = "unrecognized arguments: " + " ".join(extra)
    return message + ("; " + "; ".join(hints) if hints else "")


def entry() -> NoReturn:
    """The process's entry point (`speedmatrix`, `python -m speedmatrix`): main, then the
    process's end (cli.exiting: what is open closed in order, no native destructor left to
    abort the exit). An interrupt from the first import to the exit is exit code 130 (the
    two modules it needs are imported with the package: an interrupt while importing them is
    `python -m speedmatrix`'s to catch, never a traceback here)."""
    from speedmatrix.cli.exiting import end_process
    from speedmatrix.cli.interrupts import EXIT_INTERRUPTED, interrupted, note_only

    try:
        rc = main()
        note_only()  # from here an interrupt is noted: no gap where one raises uncaught
    except KeyboardInterrupt:  # before main could catch it, or as it returned
        with contextlib.suppress(KeyboardInterrupt, OSError):
            print("speedmatrix: interrupted", file=sys.stderr)
        rc = EXIT_INTERRUPTED
    except SystemExit as exc:  # argparse's usage errors and --help
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    note_only()
    end_process(EXIT_INTERRUPTED if interrupted() else rc)


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit code: 0, 2 for an expected error (one line), 130 when interrupted,
    whatever the moment (an error an interrupt causes on its way out is the interrupt's)."""
    from speedmatrix.cli.interrupts import (
        EXIT_INTERRUPTED,
        catch_interrupts,
        interrupted,
        restore,
    )

    handlers = catch_interrupts()
    try:
        return _main(argv)
    except (KeyboardInterrupt, Exception) as exc:
        if not isinstance(exc, KeyboardInterrupt) and not interrupted():
            raise
        with contextlib.suppress(KeyboardInterrupt, OSError):
            print("speedmatrix: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        restore(handlers)


def _main(argv: Sequence[str] | None) -> int:
    from speedmatrix.cli.interrupts import interrupted

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    # a mistyped flag is the subcommand's error, with its usage and a suggestion (argparse
    # would print the top-level usage, which does not name the subcommand's flags)
    command = _deepest(parser, argv)
    known = [o for a in command._actions for o in a.option_strings]
    mistyped = [
        a
        for a in argv
        if _FLAG.fullmatch(a.split("=", 1)[0])  # as argparse reads a flag: no space in it
        and not any(o.startswith(a.split("=", 1)[0]) for o in known)  # argparse's abbreviations
    ]
    if mistyped:  # before the parse: it would first complain of a required option missing
        command.error(unknown_arguments(command, mistyped))
    args, extra = parser.parse_known_args(argv)
    if extra:
        command.error(unknown_arguments(command, extra))
    func = getattr(args, "func", None)
    if func is None:
        parser.parse_args([*argv, "--help"])
        return 2
    try:
        rc = func(args)
    # OSError: a missing file, a refused permission, a full disk (ENOSPC): one line each
    except (InputError, OSError) as exc:
        if interrupted():  # an error the interrupt caused: main says it was interrupted
            raise
        from speedmatrix.redact import redact

        message = redact(str(exc).strip()) or exc.__class__.__name__
        print(f"speedmatrix {args.command}: {message}", file=sys.stderr)
        return 2
    except Exception:  # a bug: where it happened matters more than a tidy line
        if interrupted():  # unless an interrupt caused it: main says it was interrupted
            raise
        from speedmatrix.redact import redact

        # the one redaction rule for the traceback too: an exception may quote a URL's password
        print(redact(traceback.format_exc()), file=sys.stderr, end="")
        print(f"speedmatrix {args.command}: internal error (traceback above)", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
