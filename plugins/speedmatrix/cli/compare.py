"""`speedmatrix compare` and `speedmatrix trend`: the regression views from the command line.

    speedmatrix compare RUN_A RUN_B [--warehouse W] [--format table|md|json] [--all]
        RUN_B compared with RUN_A (A is the baseline, as in `git diff A B`).
    speedmatrix compare RUN [--baseline REF]      (or --run-id RUN, as `report` takes it)
        RUN compared with its baseline: the previous successful run of its recipe and host,
        or REF (a run id or an engine commit / ref).
    speedmatrix trend --recipe R --cell 64Kx16 [--metric total_tok_s] [--host H] [--chart F.svg]

Exit codes: 0 when the comparison ran (regressions or not: this is a viewer; the Airflow
`regressions` task is what fails), 2 with a one-line reason on bad input.
"""

from __future__ import annotations

# The speedmatrix imports sit inside the command functions on purpose: `speedmatrix <cmd>
# --help` and the other commands must not pay for pyarrow, pandas, DuckDB or matplotlib;
# CliError comes from speedmatrix.cli, which imports this module (a cycle if at the top).
import argparse
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from speedmatrix.errors import InputError
from speedmatrix.store.protocol import WarehouseReader

FORMATS = ("table", "md", "json")


def register(subparsers: argparse._SubParsersAction, name: str) -> None:
    if name == "compare":
        p = subparsers.add_parser(
            "compare",
            help="compare a run with a baseline, cell by cell, with noise-aware verdicts",
            description="Compare RUN_B with RUN_A (the baseline), or RUN with its baseline.",
        )
        p.add_argument(
            "run_a", metavar="RUN_A", nargs="?", help="baseline run id (or the run, if alone)"
        )
        p.add_argument("run_b", metavar="RUN_B", nargs="?", help="run compared with RUN_A")
        p.add_argument(
            "--run-id",
            metavar="ID",
            help="the run to compare (as `report --run-id`); with RUN_A, RUN_A is its baseline",
        )
        p.add_argument("--baseline", help="with one run: baseline run id or engine commit/ref")
        p.add_argument("--warehouse", help="warehouse root (default $SPEEDMATRIX_WAREHOUSE)")
        p.add_argument("--format", choices=FORMATS, default="table")
        p.add_argument(
            "--threshold-pct", type=float, help="relative threshold, %% (default: recipe's, else 3)"
        )
        p.add_argument("--all", action="store_true", help="show noise rows too")
        p.add_argument(
            "--rejudge",
            action="store_true",
            help="judge the run again on today's history instead of showing its stored verdict",
        )
        p.set_defaults(func=run_compare)
    elif name == "trend":
        p = subparsers.add_parser(
            "trend",
            help="one cell's figure over a recipe's runs, with verdicts",
            description="One cell's figure over the successful and partial runs of a recipe, "
            "oldest first, with each run's verdict and the change points of the whole history "
            "(Apache Otava's e-divisive means, p < 0.001: docs/measurement.md): a step's "
            "direction, size and commit range.",
        )
        p.add_argument(
            "--recipe", required=True, help="recipe id, e.g. sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
        )
        p.add_argument("--cell", required=True, help="64Kx16 (decode) or 'prefill 64K'")
        p.add_argument(
            "--metric",
            default="total_tok_s",
            help="total_tok_s, per_request_tok_s, ttft_ms, tbt_ms, prefill_tok_s, spec_acceptance_length",
        )
        p.add_argument("--host", help="only runs on this host")
        p.add_argument("--warehouse", help="warehouse root (default $SPEEDMATRIX_WAREHOUSE)")
        p.add_argument("--format", choices=FORMATS, default="table")
        p.add_argument("--threshold-pct", type=float, default=3.0)
        p.add_argument("--chart", metavar="FILE.svg", help="also write the trend chart (SVG)")
        p.set_defaults(func=run_trend)
    else:  # pragma: no cover - cli.py only calls with the names in COMMANDS
        raise ValueError(f"unknown command {name}")


def _warehouse(root: str | None) -> Any:
    from speedmatrix.cli.opening import open_existing_warehouse

    return open_existing_warehouse(root)


def run_compare(args: argparse.Namespace) -> int:
    from speedmatrix.analysis.compare import comparison_for_run

    if args.run_id is not None:
        if args.run_b is not None:
            raise InputError("give RUN_A RUN_B, or --run-id ID with at most one baseline")
        if args.run_a is not None and args.baseline is not None:
            raise InputError("give the baseline once: RUN_A or --baseline")
        args.run_a, args.run_b = (args.run_a, args.run_id) if args.run_a else (args.run_id, None)
    if args.run_a is None:
        raise InputError("name the run: compare RUN, compare RUN_A RUN_B, or --run-id ID")
    wh = _warehouse(args.warehouse)
    if args.run_b is not None and args.baseline is not None:
        raise InputError("give either RUN_A RUN_B or RUN --baseline REF, not both")
    if args.run_b is not None:
        run_id, ref = args.run_b, args.run_a
    else:
        run_id, ref = args.run_a, args.baseline
    threshold = args.threshold_pct / 100 if args.threshold_pct is not None else None
    note = ""
    if ref is None and threshold is None and not args.rejudge:
        stored = _stored(wh, run_id)
        if stored is not None:
            run, baseline, rows = stored
            when = rows[0].get("compared_at")
            note = f"stored verdict (judged {str(when)[:19]}; --rejudge to judge again)"
            out = render_comparison(rows, run, baseline, args.format, show_all=args.all)
            print(out if args.format == "json" else f"{note}\n{out}")
            return 0
    elif args.rejudge:
        note = "re-judged now on the history before the run (not the stored verdict)"
    try:
        result = comparison_for_run(
            wh, run_id, baseline_ref=ref, threshold=threshold, with_noise=False
        )
    except KeyError as exc:  # read_run: the run is not in the warehouse
        raise InputError(str(exc.args[0]) if exc.args else str(exc)) from None
    if result.baseline is None:
        raise InputError(
            f"no baseline for run {run_id}: no earlier successful run of recipe "
            f"{result.run.get('recipe_id')} on host {result.run.get('host')} (name one)"
        )
    out = render_comparison(
        result.rows, result.run, result.baseline, args.format, show_all=args.all
    )
    print(f"{note}\n{out}" if note and args.format != "json" else out)
    return 0


def _stored(wh: WarehouseReader, run_id: str) -> tuple[dict, dict, list[dict]] | None:
    """The verdict landed with the run (the `comparisons` rows the `regressions` task wrote),
    with the run and its baseline; None when none was landed."""
    from speedmatrix.store.extra import read_extra

    rows = read_extra(wh, "comparisons", run_id=run_id)
    if rows.empty:
        return None
    records = [
        {k: (None if not isinstance(v, str) and _missing(v) else v) for k, v in r.items()}
        for r in rows.to_dict("records")
    ]
    run = wh.read_run(run_id)[0]
    base_id = str(records[0].get("baseline_run_id"))
    try:
        baseline = wh.read_run(base_id)[0]
    except KeyError:
        baseline = {"run_id": base_id}
    return run, baseline, records


def _missing(v: Any) -> bool:
    try:
        return bool(v != v)  # NaN, as a warehouse read gives an empty float
    except (TypeError, ValueError):
        return False


def render_comparison(
    rows: Sequence[Mapping[str, Any]],
    run: Mapping[str, Any],
    baseline: Mapping[str, Any],
    fmt: str,
    *,
    show_all: bool = False,
) -> str:
    from speedmatrix.analysis.display import (
        comparison_markdown,
        display_rows,
        headline,
        notable,
        verdict_counts,
    )

    if fmt == "md":
        return comparison_markdown(rows, run, baseline, show_all=show_all).rstrip("\n")
    if fmt == "json":
        return json.dumps(
            {
                "run_id": run.get("run_id"),
                "baseline_run_id": baseline.get("run_id"),
                "counts": verdict_counts(rows),
                "rows": [_jsonable(r) for r in rows],
            },
            indent=2,
        )
    counts = verdict_counts(rows)
    head = (
        f"run {run.get('run_id')} vs baseline {baseline.get('run_id')}: {headline(rows)}\n"
        + "figures: "
        + ", ".join(f"{n} {v}" for v, n in counts.items())
    )
    shown = display_rows(rows if show_all else notable(rows))
    if not shown:
        return head + "\nno cell changed beyond its noise"
    return head + "\n" + _table(shown)


def _jsonable(row: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in row.items():
        if hasattr(v, "isoformat"):
            v = v.isoformat()
        elif isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


def _table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Plain aligned columns (numbers right-aligned) for a terminal."""
    cols = list(rows[0])
    cells = [[str(r.get(c, "")) if r.get(c) is not None else "" for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    right = {i for i, c in enumerate(cols) if all(_numeric(row[i]) for row in cells)}

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if i in right else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(cols), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _numeric(text: str) -> bool:
    t = text.replace(",", "").replace("%", "").replace("±", "").replace("+", "").strip()
    if t in ("", "—"):
        return True
    try:
        float(t)
    except ValueError:
        return False
    return True


def run_trend(args: argparse.Namespace) -> int:
    from speedmatrix.analysis.baseline import read_history
    from speedmatrix.analysis.changepoints import describe
    from speedmatrix.analysis.trend import trend
    from speedmatrix.commits import commit_label
    from speedmatrix.report.charts import trend_chart_svg

    wh = _warehouse(args.warehouse)
    runs, cells, comparisons, noise = read_history(wh, args.recipe, args.host)
    points = trend(
        runs,
        cells,
        recipe=args.recipe,
        cell=args.cell,
        metric=args.metric,
        host=args.host,
        comparisons=comparisons,
        threshold=args.threshold_pct / 100,
        noise=noise,
    )
    if points.empty:
        raise InputError(
            f"no successful or partial runs of recipe {args.recipe} with cell {args.cell}"
        )
    if args.chart:
        svg = trend_chart_svg(points, title=f"{args.recipe} {args.cell}", ylabel=args.metric)
        with open(args.chart, "w", encoding="utf-8") as fh:
            fh.write(svg)
    if args.format == "json":
        print(points.to_json(orient="records", date_format="iso", indent=2))
        return 0
    shown = [
        {
            "Started": str(r["started_at"])[:19],
            "Run": str(r["run_id"]),
            "Commit": commit_label(r) + (" (partial run)" if r["run_status"] == "partial" else ""),
            args.metric: "—"
            if r["value"] is None or r["value"] != r["value"]
            else f"{r['value']:,.1f}",
            "Change": "—"
            if r["change_pct"] is None or r["change_pct"] != r["change_pct"]
            else f"{r['change_pct']:+.1f}%",
            "Change point": describe(r),
            "Verdict": str(r["verdict"] or ""),
        }
        for r in points.to_dict("records")
    ]
    if args.format == "md":
        cols = list(shown[0])
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(r[c] for c in cols) + " |" for r in shown]
        print("\n".join(out))
    else:
        print(_table(shown))
    return 0
