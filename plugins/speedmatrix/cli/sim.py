"""`speedmatrix sim serve | calibrate | predict`: the simulated engine on the command line.

Imports stay lean on the serve path (aiohttp, yaml, the sim package; no pandas, numpy or
Airflow) so that `sim serve` is up well within its start-up budget.
"""

from __future__ import annotations

# The speedmatrix imports sit inside the command functions on purpose: `speedmatrix <cmd>
# --help` and the other commands must not pay for pyarrow, pandas, DuckDB or matplotlib;
# CliError comes from speedmatrix.cli, which imports this module (a cycle if at the top).
import argparse
import json
import sys
from pathlib import Path

from speedmatrix.errors import InputError


def _profile_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile", required=True, help="profile file, or a name under include/sim-profiles/"
    )


def register(sub: argparse._SubParsersAction, name: str) -> None:
    parser = sub.add_parser(
        name,
        help="the simulated vLLM engine",
        description="The simulated vLLM engine: serve vLLM's HTTP API over a performance "
        "model, fit a profile to a published page, predict a page's matrix with a profile.",
    )
    cmds = parser.add_subparsers(dest="sim_command", metavar="SIM_COMMAND")
    cmds.required = True

    serve = cmds.add_parser("serve", help="serve vLLM's HTTP API over the simulated engine")
    _profile_option(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)"
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this bearer key under /v1 (visible in the process list: prefer "
        "VLLM_API_KEY in the environment, read when neither key option is given, as vLLM does)",
    )
    serve.add_argument(
        "--api-key-env", default=None, help="read the key from this environment variable instead"
    )
    serve.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="simulated seconds per wall-clock second (default 1)",
    )
    serve.add_argument(
        "--faults", default=None, help="faults as JSON, e.g. '{\"http_500_every\": 3}'"
    )
    serve.set_defaults(func=_serve)

    cal = cmds.add_parser("calibrate", help="fit a profile to a published Speed test matrix report")
    cal.add_argument("report", help="the report text file")
    cal.add_argument("--out", required=True, help="profile to write (.yaml or .json)")
    cal.add_argument(
        "--block-size", type=int, default=16, help="KV block size assumed (default 16)"
    )
    cal.add_argument("--name", default=None, help="profile name (default: the out file's stem)")
    cal.add_argument(
        "--spec-tokens",
        type=int,
        default=None,
        help="draft tokens per step (k) of a speculative-decoding report "
        "(default: num_speculative_tokens in its launch command)",
    )
    cal.add_argument(
        "--acceptance-length",
        type=float,
        default=None,
        help="mean acceptance length the step-time model assumes for a speculative-decoding "
        "report (default 1 + k/2, lowered where its steps would not fit the page's TTFTs; "
        "the server's measured value when known)",
    )
    cal.set_defaults(func=_calibrate)

    pred = cmds.add_parser(
        "predict", help="predict every cell of a report's matrix with a profile and compare"
    )
    pred.add_argument("report", help="the published report text file to predict")
    _profile_option(pred)
    tolerance = "largest relative error of a cell counted as a match (default 0.05 = 5%%)"
    pred.add_argument("--tolerance", type=float, default=0.05, help=tolerance)
    pred.set_defaults(func=_predict)


def _serve(args: argparse.Namespace) -> int:
    from speedmatrix.settings import settings
    from speedmatrix.sim.profile import load_profile
    from speedmatrix.sim.runner import serve

    if args.time_scale <= 0:
        raise InputError("--time-scale must be positive")
    s = settings()
    key = args.api_key if args.api_key is not None else s.vllm_api_key
    if args.api_key_env:
        key = s.secret_named(args.api_key_env)
        if key is None:
            raise InputError(f"--api-key-env {args.api_key_env} is not set")
    faults = None
    if args.faults:
        try:
            faults = json.loads(args.faults)
        except json.JSONDecodeError as exc:
            raise InputError(f"--faults is not JSON: {exc}") from exc
    profile = load_profile(args.profile)
    return serve(
        profile, args.host, args.port, api_key=key, time_scale=args.time_scale, faults=faults
    )


def _calibrate(args: argparse.Namespace) -> int:
    from speedmatrix.sim.calibrate import calibrate, compare, fit_summary
    from speedmatrix.sim.profile import save_profile

    report = Path(args.report)
    text = report.read_text(encoding="utf-8")
    out = Path(args.out)
    if out.suffix not in (".yaml", ".yml", ".json"):
        raise InputError(f"--out must end in .yaml, .yml or .json: {out}")
    profile = calibrate(
        text,
        source=report.name,
        block_size=args.block_size,
        name=args.name or out.stem,
        spec_tokens=args.spec_tokens,
        acceptance_length=args.acceptance_length,
    )
    rows, bad = compare(profile, text, source=report.name)
    worst = max((abs(r["rel_error"]) for r in rows if r["rel_error"] is not None), default=0.0)
    header = (
        f"Simulator profile calibrated from {report.name} by `speedmatrix sim calibrate`.\n"
        f"Predicts every published cell within {worst:.2%} (statuses identical: "
        f"{all(r['ok'] for r in rows if r['metric'] == 'status')}). Regenerate, do not hand-edit."
    )
    save_profile(profile, out, header=header)
    print(
        f"wrote {out}: {profile.num_gpu_blocks} KV blocks x {profile.block_size}, worst cell error {worst:.2%}"
    )
    for line in fit_summary(profile, text, source=report.name):
        print(f"  {line}")
    for m in bad:
        print(f"  off: {m}", file=sys.stderr)
    return 0 if not bad else 1


def _predict(args: argparse.Namespace) -> int:
    from speedmatrix.sim.calibrate import compare
    from speedmatrix.sim.profile import load_profile

    text = Path(args.report).read_text(encoding="utf-8")
    profile = load_profile(args.profile)
    rows, _ = compare(profile, text, source=Path(args.report).name)
    bad = 0
    for r in rows:
        err = r["rel_error"]
        ok = r["ok"] if r["metric"] == "status" else (err is None or abs(err) <= args.tolerance)
        bad += not ok
        if r["metric"] == "status" or err is not None:
            e = "" if err is None else f" {err:+.2%}"
            print(
                f"{'ok ' if ok else 'BAD'} {r['phase']:7} {r['context_tokens']:>7} x{r['concurrency']:<3} {r['metric']:17} {r['published']} -> {r['predicted'] if not isinstance(r['predicted'], float) else round(r['predicted'], 2)}{e}"
            )
    return 0 if not bad else 1
