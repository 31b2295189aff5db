"""`speedmatrix loadgen prefill|decode …` and `python -m speedmatrix.loadgen …`.

Exit codes: 0 when the cell was attempted, whatever its status (the status is in the record);
2 for bad arguments; 3 when the cell could not be attempted (server unreachable, model not
served, no /tokenize). The API key is read from the environment variable named by
--api-key-env, never from a flag that would show in `ps`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from speedmatrix.records import (
    ACTIVE_TOLERANCE,
    DEFAULT_MEASUREMENT_PROFILE,
    DEFAULT_WORKLOAD,
    MEASUREMENT_PROFILES,
    WORKLOADS,
    parse_context,
)

from .config import CellConfig, DecodeConfig, PrefillConfig, new_run_tag
from .control import CellNotAttempted
from .runner import run_cell

EXIT_NOT_ATTEMPTED = 3


class _Help(argparse.HelpFormatter):
    """Shows a default only where there is one worth reading (not None, not a flag's bool)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "(default" in text or default in (None, True, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def parse_tokens(value: str) -> int:
    """`8192`, `8K` (= 8192) or `512k` (records.parse_context), positive; argparse's type for
    --context and --max-output."""
    try:
        tokens = parse_context(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {value!r}") from None
    if tokens < 1:
        raise argparse.ArgumentTypeError(f"must be positive: {value!r}")
    return tokens


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value!r}")
    return number


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value!r}")
    return number


def _json_object(value: str) -> dict[str, Any]:
    try:
        obj = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--model", required=True, help="served model name sent in every request")
    g.add_argument(
        "--api-key-env",
        default="SPEEDMATRIX_API_KEY",
        metavar="NAME",
        help="environment variable holding the API key (unset or empty = no key)",
    )
    g = p.add_argument_group("prompt")
    g.add_argument(
        "--context",
        type=parse_tokens,
        required=True,
        metavar="N",
        help="exact prompt length in tokens (8192 or 8K); checked against usage.prompt_tokens",
    )
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=DEFAULT_WORKLOAD,
        help="article: a chat conversation (a reference document, then a request for a long "
        "new article) rendered by the server's chat template, as the published pages measure; "
        "continuation: raw continuation of repeated prose, for servers without a chat template",
    )
    g.add_argument(
        "--profile",
        dest="measurement_profile",
        choices=MEASUREMENT_PROFILES,
        default=DEFAULT_MEASUREMENT_PROFILE,
        help="whose definitions measure the cell: default (ours: exact token contexts, "
        "distinct prompts, TTFT from the last byte sent, min_tokens = max_tokens) or published "
        "(llm-inference-bench's: one shared chat-text prompt sized by characters, TTFT from "
        "before the body is built, ignore_eos without min_tokens, the window opening once "
        "running == C is stable, per-request tok/s = total / C); recorded in every row",
    )
    g.add_argument(
        "--global-warmup",
        type=parse_tokens,
        default=None,
        metavar="N",
        help="published profile: the tool's warm-up before this cell (a short request, a "
        "hidden 8K prefill, a short C=1 decode at N, the run's largest context)",
    )
    g.add_argument(
        "--largest-context",
        type=parse_tokens,
        default=None,
        metavar="N",
        help="published profile: the run's largest context (the chars-per-token probe is "
        "min(8K, N)); default this cell's",
    )
    g.add_argument(
        "--run-tag",
        default=None,
        help="tag starting every prompt (unset: random). Give prefill and decode cells of one "
        "run the same tag so the prefill warms the decode prompts",
    )
    g.add_argument(
        "--no-cache-salt",
        dest="cache_salt",
        action="store_false",
        help="do not send cache_salt (for servers that reject it); the run tag still keeps "
        "prompts apart",
    )
    g.add_argument(
        "--extra-body",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="extra request fields, e.g. '{\"temperature\": 0}' (default: server defaults)",
    )
    g = p.add_argument_group("timeouts (seconds)")
    g.add_argument("--connect-timeout", type=_positive_float, default=10.0, help="TCP connect")
    g.add_argument(
        "--first-token-timeout",
        type=_positive_float,
        default=60.0,
        help="base first-token timeout ...",
    )
    g.add_argument(
        "--first-token-per-1k",
        type=_positive_float,
        default=1.0,
        metavar="S",
        help="... plus S seconds per 1K context tokens and queued prompt",
    )
    g.add_argument(
        "--stall-timeout",
        type=_positive_float,
        default=60.0,
        help="longest silence between chunks before a stream fails",
    )
    g.add_argument(
        "--idle-timeout",
        type=_positive_float,
        default=60.0,
        help="how long to wait for the server to be idle before and after the cell",
    )
    g.add_argument(
        "--time-scale",
        type=_positive_float,
        default=1.0,
        metavar="X",
        help="the server is a simulator running X times faster than the wall clock: "
        "--duration and every reported time are simulated seconds",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--json",
        metavar="F",
        nargs="?",
        const="-",
        help="the cell record as a JSON object: to file F, or on stdout with no F (or -). "
        "Unset: a readable summary on a terminal, the JSON object when stdout is not one",
    )
    g.add_argument("--requests", metavar="F", help="write per-request rows (JSON lines) to F")
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress line on stderr (unset: only when stderr is a terminal)",
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The prefill and decode subcommands, shared by both entry points."""
    fmt = _Help
    p = sub.add_parser(
        "prefill",
        help="one cold request with max_tokens=1: prompt tok/s = prompt tokens / TTFT",
        description="Measure one prefill cell: a single cold prompt of exactly --context tokens "
        "with max_tokens=1. Prints/writes the cell record; exit 0 whenever it was attempted.",
        formatter_class=fmt,
    )
    _common(p)
    p.set_defaults(func=_run, phase="prefill")

    d = sub.add_parser(
        "decode",
        help="C streams over a fixed window: total tok/s, TTFT, time between tokens",
        description="Measure one sustained-decode cell: --concurrency streams kept busy (a stream "
        "that finishes restarts at once) over an exact --duration window that opens when all "
        "streams have their first token. Prompts are exact token ids from the server's "
        "/tokenize; output length is fixed (ignore_eos, min_tokens = max_tokens). The cell is "
        "valid, failed or invalid with the reason; exit 0 whenever it was attempted.",
        formatter_class=fmt,
    )
    _common(d)
    g = d.add_argument_group("load")
    g.add_argument(
        "--concurrency", "-c", type=int, required=True, metavar="C", help="streams kept in flight"
    )
    g.add_argument(
        "--duration",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="measurement window in seconds",
    )
    g.add_argument(
        "--max-output",
        type=parse_tokens,
        default=4096,
        metavar="T",
        help="output tokens per request (max_tokens = min_tokens, ignore_eos)",
    )
    g.add_argument(
        "--prompt-mode",
        choices=("distinct", "shared"),
        default="distinct",
        help="distinct: one prompt per stream (true KV footprint); shared: one prompt for all "
        "(llm-inference-bench style, streams share KV blocks)",
    )
    g.add_argument(
        "--no-warm",
        dest="warm_cache",
        action="store_false",
        help="skip the max_tokens=1 cache warm-up (TTFT then includes prefill)",
    )
    g = d.add_argument_group("validity limits")
    g.add_argument(
        "--token-tolerance",
        type=float,
        default=0.01,
        help="largest client vs vllm:generation_tokens_total disagreement (fraction)",
    )
    g.add_argument(
        "--max-loop-lag-ms",
        type=_positive_float,
        default=10.0,
        help="client event-loop lag p90 above which the cell is invalid (client saturated)",
    )
    g.add_argument(
        "--max-client-cpu",
        type=_positive_float,
        default=90.0,
        metavar="PCT",
        help="client CPU percent above which the cell is invalid (client saturated)",
    )
    g.add_argument(
        "--no-repetition-check",
        dest="repetition_check",
        action="store_false",
        help="do not mark the cell invalid for outputs stuck in a repetition loop",
    )
    g.add_argument(
        "--no-copy-check",
        dest="copy_check",
        action="store_false",
        help="do not mark the cell invalid for outputs that copy their own prompt",
    )
    g.add_argument(
        "--max-copy-share",
        type=_positive_float,
        default=0.2,
        metavar="F",
        help="share of the outputs' word 8-grams found in their prompt above which the cell "
        "is invalid (copying)",
    )
    g.add_argument(
        "--metrics-interval",
        type=_positive_float,
        default=0.5,
        metavar="S",
        help="how often /metrics is sampled during the window (at most; see --min-window-readings)",
    )
    g.add_argument(
        "--max-active-deviation",
        type=_positive_float,
        default=ACTIVE_TOLERANCE,
        metavar="F",
        help="share of C by which the server's average running requests may differ from C "
        "before the cell is invalid (short requests leave it idle between them)",
    )
    g.add_argument(
        "--min-window-readings",
        type=_positive_int,
        default=20,
        metavar="N",
        help="sample /metrics more often in a short window so it gets at least N readings of "
        "the running requests (see --max-active-deviation); a window with fewer than half "
        "of them (failed reads) is invalid",
    )
    d.set_defaults(func=_run, phase="decode")


def register(sub: argparse._SubParsersAction, name: str) -> None:  # type: ignore[type-arg]
    """Hook for the `speedmatrix` command (cli.COMMANDS)."""
    p = sub.add_parser(
        name,
        help="measure one prefill or decode cell",
        description="The load generator: measure one prefill or sustained-decode cell.",
    )
    inner = p.add_subparsers(dest="loadgen_command", metavar="{prefill,decode}")
    inner.required = True
    add_parsers(inner)


def build_config(args: argparse.Namespace) -> CellConfig:
    api_key = os.environ.get(args.api_key_env) or None
    common: dict[str, Any] = {
        "base_url": args.base_url,
        "model": args.model,
        "context": args.context,
        "api_key": api_key,
        "run_tag": args.run_tag or new_run_tag(),
        "cache_salt": args.cache_salt,
        "workload": args.workload,
        "measurement_profile": args.measurement_profile,
        "global_warmup_context": args.global_warmup,
        "largest_context": args.largest_context,
        "extra_body": args.extra_body,
        "connect_timeout_s": args.connect_timeout,
        "first_token_timeout_s": args.first_token_timeout,
        "first_token_s_per_1k": args.first_token_per_1k,
        "stall_timeout_s": args.stall_timeout,
        "idle_timeout_s": args.idle_timeout,
        "progress": args.progress,
        "time_scale": args.time_scale,
    }
    if args.phase == "prefill":
        return PrefillConfig(**common)
    return DecodeConfig(
        **common,
        concurrency=args.concurrency,
        duration_s=args.duration,
        max_output_tokens=args.max_output,
        prompt_mode=args.prompt_mode,
        warm_cache=args.warm_cache,
        token_tolerance=args.token_tolerance,
        max_loop_lag_ms=args.max_loop_lag_ms,
        max_client_cpu_pct=args.max_client_cpu,
        repetition_check=args.repetition_check,
        copy_check=args.copy_check,
        max_copy_share=args.max_copy_share,
        metrics_interval_s=args.metrics_interval,
        min_window_readings=args.min_window_readings,
        max_active_deviation=args.max_active_deviation,
    )


def _run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    cfg.validate()  # ValueError -> one line, exit 2 (speedmatrix.cli or main below)
    try:
        cell, rows = run_cell(cfg)  # type: ignore[arg-type]
    except CellNotAttempted as exc:
        print(f"speedmatrix loadgen {args.phase}: not attempted: {exc}", file=sys.stderr)
        return EXIT_NOT_ATTEMPTED
    tty = _stdout_is_terminal()
    if args.json and args.json != "-":
        _write_atomic(args.json, json.dumps(cell, default=_jsonable, indent=1) + "\n")
        if tty:
            print(summary(cell))
    elif args.json == "-" or not tty:  # a pipe keeps the machine-readable record
        print(json.dumps(cell, default=_jsonable))
    else:
        print(summary(cell))
    if args.requests:
        lines = "".join(json.dumps(r, default=_jsonable) + "\n" for r in rows)
        _write_atomic(args.requests, lines)
    return 0


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def _num(value: object, unit: str, digits: int = 1) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    return f"{value:,.{digits}f} {unit}".rstrip()


def summary(cell: dict[str, Any]) -> str:
    """The cell's figures for a person at a terminal (the JSON record has all of them).

    Why here and stdlib-only: the zipapp ships this module to the hosts; a person running a
    cell by hand reads this, the pipeline reads the `--json F` file."""
    phase, status = cell.get("phase"), cell.get("status")
    head = f"{phase} {cell.get('context_label') or cell.get('context_tokens')}"
    if phase == "decode":
        head += f" x {cell.get('concurrency')}"
    lines = [f"{head}: {status}"]
    if cell.get("error"):
        lines.append(f"  why:             {cell['error']}")
    if phase == "prefill":
        lines += [
            f"  prompt:          {_num(cell.get('total_tok_s'), 'tok/s')}",
            f"  TTFT:            {_num(cell.get('ttft_ms'), 'ms')}",
        ]
        return "\n".join(lines)

    def pct(name: str) -> str:
        return (
            f"median {_num(cell.get(name + '_ms'), 'ms')}, p90 {_num(cell.get(name + '_p90_ms'), 'ms')}, "
            f"p99 {_num(cell.get(name + '_p99_ms'), 'ms')}"
        )

    lines += [
        f"  total:           {_num(cell.get('total_tok_s'), 'tok/s')}",
        f"  per request:     {_num(cell.get('per_request_tok_s'), 'tok/s')}",
        f"  TTFT:            {pct('ttft')}",
        f"  between tokens:  {pct('tbt')}",
        f"  window:          {_num(cell.get('measured_s'), 's', 2)}, "
        f"{_num(cell.get('output_tokens'), 'output tokens', 0)}, "
        f"{_num(cell.get('completed_requests'), 'requests completed', 0)}, "
        f"{_num(cell.get('requests_failed'), 'failed', 0)}",
        f"  active requests: {_num(cell.get('avg_active_requests'), '', 2)} on average "
        f"({cell.get('active_source') or 'unknown'} count)",
    ]
    return "\n".join(lines)


def _jsonable(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _write_atomic(path: str, text: str) -> None:
    """Readers never see half a record."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".loadgen-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (python -m speedmatrix.loadgen, the zipapp)."""
    parser = argparse.ArgumentParser(
        prog="speedmatrix-loadgen",
        description="The speedmatrix load generator: one prefill or sustained-decode cell.",
    )
    sub = parser.add_subparsers(dest="loadgen_command", metavar="{prefill,decode}")
    sub.required = True
    add_parsers(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("speedmatrix loadgen: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:
        print(f"speedmatrix loadgen: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
