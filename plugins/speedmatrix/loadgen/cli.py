"""`speedmatrix loadgen prefill|decode|burst …` and `python -m speedmatrix.loadgen …`.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from datetime import datetime
from typing import Any

from speedmatrix.records import MEASUREMENT_PROFILES, PROMPT_MODES, WORKLOADS, parse_context
from speedmatrix.renames import StoreRenamed

from .config import BurstConfig, CellConfig, DecodeConfig, PrefillConfig
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


@dataclass(frozen=True)
class Flag:
    """One option that sets one config field.

    Why a table: the parser adds each option from it (its default the config field's), and
    `config_to_argv` writes a config back from it, so the command line a remote host's cell
    runs with carries every field a local cell's config has, and a field added here reaches
    both at once."""

    field: str  # the CellConfig / DecodeConfig field it sets
    option: str
    group: str
    help: str
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    required: bool = False  # no default on the command line, whatever the config's
    # "off": `option` is a --no-… switch setting the field False; "both": --x / --no-x, unset None
    switch: str = ""
    short: str | None = None
    old: tuple[str, ...] = ()  # old spellings still read, each with a deprecation note (renames)


COMMON_FLAGS: tuple[Flag, ...] = (
    Flag("base_url", "--base-url", "server", "server root, e.g. http://127.0.0.1:8000",
         required=True),
    Flag("model", "--model", "server", "served model name sent in every request", required=True),
    Flag("context", "--context", "prompt", "exact prompt length in tokens (8192 or 8K); checked "
         "against usage.prompt_tokens", type=parse_tokens, metavar="N", required=True),
    Flag("workload", "--workload", "prompt", "article: a chat conversation (a reference "
         "document, then a request for a long new article) rendered by the server's chat "
         "template, as the published pages measure; continuation: raw continuation of repeated "
         "prose, for servers without a chat template", choices=WORKLOADS),
    Flag("measurement_profile", "--profile", "prompt", "whose definitions measure the cell: "
         "default (ours: exact token contexts, distinct prompts, TTFT from the last byte sent, "
         "min_tokens = max_tokens) or published (llm-inference-bench's: one shared chat-text "
         "prompt sized by characters, TTFT from before the body is built, ignore_eos without "
         "min_tokens, the window opening once running == C is stable, per-request tok/s = "
         "total / C); recorded in every row", choices=MEASUREMENT_PROFILES),
    Flag("global_warmup_context", "--global-warmup", "prompt", "published profile: the tool's "
         "warm-up before this cell (a short request, a hidden 8K prefill, a short C=1 decode at "
         "N, the run's largest context)", type=parse_tokens, metavar="N"),
    Flag("largest_context", "--largest-context", "prompt", "published profile: the run's "
         "largest context (the chars-per-token probe is min(8K, N)); default this cell's",
         type=parse_tokens, metavar="N"),
    Flag("run_tag", "--run-tag", "prompt", "tag starting every prompt (unset: random). Give "
         "prefill and decode cells of one run the same tag so the prefill warms the decode "
         "prompts"),
    Flag("cache_salt", "--no-cache-salt", "prompt", "do not send cache_salt (for servers that "
         "reject it); the run tag still keeps prompts apart", switch="off"),
    Flag("extra_body", "--extra-body", "prompt", "extra request fields, e.g. "
         "'{\"temperature\": 0}' (default: server defaults)", type=_json_object, metavar="JSON"),
    Flag("connect_timeout_s", "--connect-timeout", "timeouts (seconds)", "TCP connect",
         type=_positive_float),
    Flag("first_token_timeout_s", "--first-token-timeout", "timeouts (seconds)",
         "base first-token timeout ...", type=_positive_float),
    Flag("first_token_s_per_1k", "--first-token-per-1k", "timeouts (seconds)",
         "... plus S seconds per 1K context tokens and queued prompt", type=_positive_float,
         metavar="S"),
    Flag("stall_timeout_s", "--stall-timeout", "timeouts (seconds)",
         "longest silence between chunks before a stream fails", type=_positive_float),
    Flag("idle_timeout_s", "--idle-timeout", "timeouts (seconds)",
         "how long to wait for the server to be idle before and after the cell",
         type=_positive_float),
    Flag("time_scale", "--time-scale", "timeouts (seconds)", "the server is a simulator "
         "running X times faster than the wall clock: --window-s and every reported time are "
         "simulated seconds", type=_positive_float, metavar="X"),
    Flag("progress", "--progress", "output",
         "live progress line on stderr (unset: only when stderr is a terminal)", switch="both"),
)  # fmt: skip

PREFILL_FLAGS: tuple[Flag, ...] = (
    Flag("samples", "--samples", "load", "cold prompts measured one after the other, each with "
         "a fresh run tag (the run's own last); the cell's TTFT is their median",
         type=_positive_int, metavar="N"),
)  # fmt: skip

DECODE_FLAGS: tuple[Flag, ...] = (
    Flag("concurrency", "--concurrency", "load", "streams kept in flight", type=int,
         metavar="C", required=True, short="-c"),
    Flag("window_s", "--window-s", "load", "measurement window in seconds",
         type=_positive_float, metavar="S", old=("--duration",)),
    Flag("max_output_tokens", "--max-output", "load",
         "output tokens per request (max_tokens = min_tokens, ignore_eos)", type=parse_tokens,
         metavar="T"),
    Flag("prompt_mode", "--prompt-mode", "load", "distinct: one prompt per stream (true KV "
         "footprint); shared: one prompt for all (llm-inference-bench style, streams share KV "
         "blocks)", choices=PROMPT_MODES),
    Flag("ttft_probes", "--ttft-probes", "load", "C=1: this many requests of the cell's prompt "
         "with max_tokens=1 after the window, each a TTFT sample beside the window's (the "
         "cell's TTFT is their median; 0: none)", type=int, metavar="N"),
    Flag("warm_cache", "--no-warm", "load",
         "skip the max_tokens=1 cache warm-up (TTFT then includes prefill)", switch="off"),
    Flag("adaptive", "--adaptive", "load", "stop the window once total tok/s's 95%% interval "
         "is within --adaptive-target of it (after --adaptive-min; --window-s is the cap; a "
         "window that trends, queues or preempts runs to the cap)", switch="both"),
    Flag("adaptive_target_pct", "--adaptive-target", "load", "adaptive: the interval's "
         "half-width, %% of total tok/s, that is tight enough", type=_positive_float,
         metavar="PCT"),
    Flag("adaptive_min_s", "--adaptive-min", "load", "adaptive: the window's least length in "
         "seconds", type=_positive_float, metavar="S"),
    Flag("window_check_s", "--window-check", "load", "seconds between the window's "
         "checkpoints of its tokens (the interval's data)", type=_positive_float, metavar="S"),
    Flag("token_tolerance", "--token-tolerance", "validity limits",
         "largest client vs vllm:generation_tokens_total disagreement (fraction)", type=float),
    Flag("max_loop_lag_ms", "--max-loop-lag-ms", "validity limits",
         "client event-loop lag p90 above which the cell is invalid (client saturated)",
         type=_positive_float),
    Flag("max_client_cpu_pct", "--max-client-cpu", "validity limits",
         "client CPU percent above which the cell is invalid (client saturated)",
         type=_positive_float, metavar="PCT"),
    Flag("max_blind_fraction", "--max-blind-fraction", "validity limits", "share of the window "
         "a single client stall, or the two /metrics readings' round trips, may take before "
         "the cell is invalid (its stamps or its cross-check cannot be trusted)",
         type=_positive_float, metavar="F"),
    Flag("repetition_check", "--no-repetition-check", "validity limits",
         "do not mark the cell invalid for outputs stuck in a repetition loop", switch="off"),
    Flag("max_loop_fraction", "--max-loop-fraction", "validity limits", "share of the checked "
         "outputs stuck in a repetition loop above which the cell is invalid",
         type=_positive_float, metavar="F"),
    Flag("copy_check", "--no-copy-check", "validity limits",
         "do not mark the cell invalid for outputs that copy their own prompt", switch="off"),
    Flag("max_copy_share", "--max-copy-share", "validity limits", "share of the outputs' word "
         "8-grams found in their prompt above which the cell is invalid (copying)",
         type=_positive_float, metavar="F"),
    Flag("metrics_interval_s", "--metrics-interval", "validity limits", "how often /metrics is "
         "sampled during the window (at most; see --min-window-readings)",
         type=_positive_float, metavar="S"),
    Flag("max_active_deviation", "--max-active-deviation", "validity limits", "share of C by "
         "which the server's average running requests may differ from C before the cell is "
         "invalid (short requests leave it idle between them)", type=_positive_float,
         metavar="F"),
    Flag("min_window_readings", "--min-window-readings", "validity limits", "sample /metrics "
         "more often in a short window so it gets at least N readings of the running requests "
         "(see --max-active-deviation); a window with fewer than half of them (failed reads) "
         "is invalid", type=_positive_int, metavar="N"),
)  # fmt: skip


def _decode_flag(name: str) -> Flag:
    return next(f for f in DECODE_FLAGS if f.field == name)


BURST_FLAGS: tuple[Flag, ...] = (
    Flag("concurrency", "--concurrency", "load", "requests sent at once, each measured to its "
         "completion", type=int, metavar="N", required=True, short="-c"),
    _decode_flag("max_output_tokens"),
    _decode_flag("prompt_mode"),
    _decode_flag("warm_cache"),
    Flag("max_burst_s", "--max-burst", "load", "the longest the burst may run, first request "
         "sent to last token (seconds); past it the cell fails", type=_positive_float,
         metavar="S"),
    _decode_flag("token_tolerance"),
    _decode_flag("max_loop_lag_ms"),
    _decode_flag("max_client_cpu_pct"),
)  # fmt: skip

IN_PROCESS_ONLY: dict[str, str] = {
    "api_key": "a secret: read from the environment variable --api-key-env names, never a flag "
    "(`ps` shows flags)",
    "on_window": "a callback into the calling process",
    "keep_requests": "whether run_cell hands the rows back in memory; the command line writes "
    "them when --requests is given",
}
"""The config fields no flag carries, and why: every other field has a flag."""


def flags_of(cls: type[CellConfig]) -> tuple[Flag, ...]:
    """The flags that make a config of `cls` (decode's and burst's add their load and limits)."""
    if issubclass(cls, DecodeConfig):
        return COMMON_FLAGS + DECODE_FLAGS
    if issubclass(cls, BurstConfig):
        return COMMON_FLAGS + BURST_FLAGS
    return COMMON_FLAGS + PREFILL_FLAGS if issubclass(cls, PrefillConfig) else COMMON_FLAGS


def _field_defaults(cls: type[CellConfig]) -> dict[str, Any]:
    """Each field's plain default (fields without one, or made by a factory, are absent)."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def _add(group: argparse._ArgumentGroup, flag: Flag, defaults: Mapping[str, Any]) -> None:
    names = (flag.option, flag.short) if flag.short else (flag.option,)
    names += flag.old
    if flag.switch == "off":
        group.add_argument(*names, dest=flag.field, action="store_false", help=flag.help)
        return
    kwargs: dict[str, Any] = {"dest": flag.field, "help": flag.help}
    if flag.switch == "both":
        kwargs["action"] = argparse.BooleanOptionalAction
    if flag.old:
        kwargs["action"] = StoreRenamed
        kwargs["help"] += f" ({', '.join(flag.old)}: the old name, deprecated)"
    if flag.type is not None:
        kwargs["type"] = flag.type
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    elif flag.choices is None and not flag.switch:  # named as the option, not as the field
        kwargs["metavar"] = flag.option.removeprefix("--").replace("-", "_").upper()
    if flag.choices is not None:
        kwargs["choices"] = flag.choices
    if flag.required:
        kwargs["required"] = True
    else:
        kwargs["default"] = defaults.get(flag.field)
    group.add_argument(*names, **kwargs)


def _add_flags(p: argparse.ArgumentParser, cls: type[CellConfig]) -> None:
    """The options of one subcommand: the flag table's for `cls`, and the three that are the
    command line's own (where the key is, where the record goes)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in ("server", "prompt", "timeouts (seconds)", "output", "load", "validity limits"):
        if any(f.group == name for f in flags_of(cls)):
            groups[name] = p.add_argument_group(name)
    defaults = _field_defaults(cls)
    for flag in flags_of(cls):
        _add(groups[flag.group], flag, defaults)
    groups["server"].add_argument(
        "--api-key-env",
        default="SPEEDMATRIX_API_KEY",
        metavar="NAME",
        help="environment variable holding the API key (unset or empty = no key)",
    )
    groups["output"].add_argument(
        "--json",
        metavar="F",
        nargs="?",
        const="-",
        help="the cell record as a JSON object: to file F, or on stdout with no F (or -). "
        "Unset: a readable summary on a terminal, the JSON object when stdout is not one",
    )
    groups["output"].add_argument(
        "--requests", metavar="F", help="write per-request rows (JSON lines) to F"
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The prefill and decode subcommands, shared by both entry points."""
    fmt = _Help
    p = sub.add_parser(
        "prefill",
        help="one cold request with max_tokens=1: prompt tok/s = prompt tokens / TTFT",
        description="Measure one prefill cell: --samples cold prompts (default 3) of exactly "
        "--context tokens with max_tokens=1, one after the other; its TTFT is their median. "
        "Prints/writes the cell record; exit 0 whenever it was attempted.",
        formatter_class=fmt,
    )
    _add_flags(p, PrefillConfig)
    p.set_defaults(func=_run, phase="prefill")

    d = sub.add_parser(
        "decode",
        help="C streams over a fixed window: total tok/s, TTFT, time between tokens",
        description="Measure one sustained-decode cell: --concurrency streams kept busy (a stream "
        "that finishes restarts at once) over an exact --window-s window that opens when all "
        "streams have their first token. Prompts are exact token ids from the server's "
        "/tokenize; output length is fixed (ignore_eos, min_tokens = max_tokens). The cell is "
        "valid, failed or invalid with the reason; exit 0 whenever it was attempted.",
        formatter_class=fmt,
    )
    _add_flags(d, DecodeConfig)
    d.set_defaults(func=_run, phase="decode")

    b = sub.add_parser(
        "burst",
        help="N requests at once, each to completion: latency, per-user end-to-end tok/s",
        description="Measure one burst cell (the published tool's request-count mode): "
        "--concurrency requests of exactly --context tokens (the prefix cache warmed first) "
        "sent at once and measured to their completion: completed-request latency (median, "
        "p90, p99), per-user end-to-end tok/s (output tokens / latency) and total tok/s (every "
        "token / the burst's time). Never compared with a decode cell. Exit 0 whenever it was "
        "attempted.",
        formatter_class=fmt,
    )
    _add_flags(b, BurstConfig)
    b.set_defaults(func=_run, phase="burst")


def register(sub: argparse._SubParsersAction, name: str) -> None:  # type: ignore[type-arg]
    """Hook for the `speedmatrix` command (cli.COMMANDS)."""
    p = sub.add_parser(
        name,
        help="measure one prefill, decode or burst cell",
        description="The load generator: measure one prefill, sustained-decode or burst cell.",
    )
    inner = p.add_subparsers(dest="loadgen_command", metavar="{prefill,decode,burst}")
    inner.required = True
    add_parsers(inner)


CONFIGS: dict[str, type[CellConfig]] = {
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
    "burst": BurstConfig,
}
"""The subcommand (a cell's phase) -> the config it builds."""


def build_config(args: argparse.Namespace) -> CellConfig:
    """The config the parsed flags describe; the API key from the variable --api-key-env
    names."""
    cls = CONFIGS[args.phase]
    values = {flag.field: getattr(args, flag.field) for flag in flags_of(cls)}
    if not values["run_tag"]:
        del values["run_tag"]  # the config's own: a fresh random tag
    return cls(**values, api_key=os.environ.get(args.api_key_env) or None)


def config_to_argv(cfg: CellConfig) -> list[str]:
    """The subcommand and flags that make `cfg` again: `build_config` of them parsed equals
    `cfg` on every field but the IN_PROCESS_ONLY ones (the API key travels in the environment).

    Written from the parser's own table. A value equal to its field's default is left out, as
    the parser's default is that same field's; a required flag and the run tag (the config
    draws a fresh one when none is given) are always written."""
    phase = next(name for name, cls in CONFIGS.items() if type(cfg) is cls)
    defaults = _field_defaults(type(cfg))
    argv = [phase]
    for flag in flags_of(type(cfg)):
        value = getattr(cfg, flag.field)
        if not flag.required and flag.field in defaults and value == defaults[flag.field]:
            continue
        if flag.switch == "off":
            if not value:
                argv.append(flag.option)
        elif flag.switch == "both":
            if value is not None:
                argv.append(flag.option if value else "--no-" + flag.option.removeprefix("--"))
        else:
            argv += [flag.option, _flag_text(value)]
    return argv


def _flag_text(value: object) -> str:
    """A value as its flag's type reads it back exactly (repr keeps every float's digits)."""
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


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
    if phase in ("decode", "burst"):
        head += f" x {cell.get('concurrency')}"
    lines = [f"{head}: {status}"]
    if cell.get("error"):
        lines.append(f"  why:             {cell['error']}")
    if phase == "prefill":
        lines += [
            f"  prompt:          {_num(cell.get('total_tok_s'), 'tok/s')}",
            f"  TTFT:            {_num(cell.get('ttft_ms'), 'ms')} (median of "
            f"{cell.get('ttft_samples') or cell.get('samples') or 1}, spread "
            f"{_num(cell.get('ttft_spread_pct'), '%')})",
        ]
        return "\n".join(lines)

    def pct(name: str) -> str:
        return (
            f"median {_num(cell.get(name + '_ms'), 'ms')}, p90 {_num(cell.get(name + '_p90_ms'), 'ms')}, "
            f"p99 {_num(cell.get(name + '_p99_ms'), 'ms')}"
        )

    if phase == "burst":
        lines += [
            f"  latency:         {pct('latency')}",
            f"  per user e2e:    {_num(cell.get('e2e_per_request_tok_s'), 'tok/s')}",
            f"  total:           {_num(cell.get('total_tok_s'), 'tok/s')} over "
            f"{_num(cell.get('measured_s'), 's', 2)}",
            f"  TTFT:            {pct('ttft')}",
            f"  between tokens:  {pct('tbt')}",
            f"  requests:        {_num(cell.get('completed_requests'), 'completed', 0)} of "
            f"{cell.get('concurrency')}, {_num(cell.get('requests_failed'), 'failed', 0)}",
        ]
        return "\n".join(lines)
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
        description="The speedmatrix load generator: one prefill, sustained-decode or burst cell.",
    )
    sub = parser.add_subparsers(dest="loadgen_command", metavar="{prefill,decode,burst}")
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
