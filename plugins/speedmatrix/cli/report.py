"""``speedmatrix ingest`` and ``speedmatrix report``.

``ingest REPORT.txt… [--warehouse W] [--recipe-id R]``: parse every page first (any error: a
one-line reason naming the file and line, exit 2, nothing lands), then land each as a run and
keep the page as the run's ``source.txt`` artifact. Prints the run ids on stdout, one per line,
and nothing else there.

``report --pareto MODEL [--by-commit]`` / ``report --versus A B``: the views across
configurations (report.pareto, report.versus), in the same formats.

``report --run-id ID [--warehouse W] [--format md|html] [--out F] [--baseline B] [--save]``:
render a landed run (stdout without ``--out``). ``--format html`` is the pipeline's run page
(report.page.render_run_page): the summary of verdicts against ``--baseline`` (a run id or an
engine commit/ref) or, without it, the automatic baseline (compare.select_baseline), then the
matrix and the details. ``--format md`` is the published page; ``--baseline`` adds each cell's
change against that run after it. ``--save`` also keeps the page as the run's ``report.md`` /
``report.html`` artifact.
"""

from __future__ import annotations

# The speedmatrix imports sit inside the command functions on purpose: `speedmatrix <cmd>
# --help` and the other commands must not pay for pyarrow, pandas, DuckDB or matplotlib;
# CliError comes from speedmatrix.cli, which imports this module (a cycle if at the top).
import argparse
import os
import sys


def register(sub: argparse._SubParsersAction, name: str) -> None:
    if name == "ingest":
        p = sub.add_parser(
            "ingest",
            help="land published Speed test matrix reports",
            description="Parse published 'Speed test matrix' pages and land each as a run "
            "(trigger 'ingest'). Prints the run ids, one per line.",
        )
        p.add_argument("reports", nargs="+", metavar="REPORT.txt", help="page(s) to ingest")
        p.add_argument(
            "--warehouse",
            help="warehouse root (default $SPEEDMATRIX_WAREHOUSE, else the checkout's warehouse/)",
        )
        p.add_argument("--recipe-id", help="tag the runs with this recipe id (changes the run id)")
        p.set_defaults(func=cmd_ingest)
    else:
        p = sub.add_parser(
            "report",
            help="render a run from the warehouse",
            description="Render a landed run as the published Speed test matrix page (md) or "
            "its run page (html); or a model's Pareto view (--pareto), or two configurations "
            "side by side (--versus). Costs come from $SPEEDMATRIX_GPU_PRICES when set.",
        )
        what = p.add_mutually_exclusive_group(required=True)
        what.add_argument("--run-id", help="the run to render")
        what.add_argument(
            "--pareto",
            metavar="MODEL",
            help="the Pareto view of a model: tok/s per GPU against tok/s per request, every "
            "recipe and hardware that served it, the frontier per context",
        )
        what.add_argument(
            "--versus",
            nargs=2,
            metavar=("A", "B"),
            help="two configurations of one model cell by cell, B against A (each a run id, "
            "or a recipe id: its latest successful run)",
        )
        p.add_argument(
            "--by-commit",
            action="store_true",
            help="with --pareto: one series per engine commit of each recipe, not only its latest",
        )
        p.add_argument(
            "--warehouse",
            help="warehouse root (default $SPEEDMATRIX_WAREHOUSE, else the checkout's warehouse/)",
        )
        p.add_argument("--format", choices=("md", "html"), default="md")
        p.add_argument("--out", help="write here instead of stdout")
        p.add_argument(
            "--baseline",
            metavar="RUN",
            help="compare with this run (id, or engine commit/ref); html: without it, the "
            "automatic baseline (the latest earlier run of the recipe and host)",
        )
        p.add_argument(
            "--save", action="store_true", help="also keep the page as the run's artifact"
        )
        p.set_defaults(func=cmd_report)


def _cli_error(message: str) -> Exception:
    from speedmatrix.cli import CliError

    return CliError(message)


def _one_commit_name(run: dict) -> None:
    """The page's Commit line becomes the run's engine ref (as the tool was asked for it), and
    engine_commit the value every path lands for that commit (speedmatrix.commits): a page of
    9fedd24fa864 and a run measured at it group together."""
    from speedmatrix.upstream.github_commits import engine_commit

    page = run.get("engine_commit")
    run["engine_ref"] = run.get("engine_ref") or page
    run["engine_commit"] = engine_commit(
        recorded=page, version=run.get("engine_version"), repository=run.get("engine_repository")
    )


def cmd_ingest(args: argparse.Namespace) -> int:
    from speedmatrix.published.parse import parse_report
    from speedmatrix.quality import check_for_landing
    from speedmatrix.records import path_field_problems
    from speedmatrix.store.warehouse import Warehouse

    parsed = []
    for path in args.reports:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except UnicodeDecodeError as exc:
            raise _cli_error(f"{path}: not UTF-8 text ({exc.reason})") from None
        # errors name the file as given on the command line, and the line
        report = parse_report(text, source=path)
        if args.recipe_id:
            from speedmatrix.published.runfields import content_run_id

            report.run["recipe_id"] = args.recipe_id
            report.run_id = content_run_id(report.run, report.cells)
            report.run["run_id"] = report.run_id
        report.run["source"] = os.path.basename(path)
        _one_commit_name(report.run)
        # every value that becomes part of a file name fits one, before anything lands (a
        # 300-character served model fails the landing and stops every later one)
        if problems := path_field_problems(report.run):
            raise _cli_error(f"{path}: {'; '.join(problems)}")
        parsed.append((path, text, report))
    wh = Warehouse(args.warehouse)
    # The same Great Expectations suites as a measured run's, before anything lands: a page's
    # impossible rows go to quarantine with GX's result, and a page whose run row fails lands
    # nothing (nor do the pages given with it).
    checked = []
    for path, text, report in parsed:
        try:
            ok = check_for_landing(wh, report.run, report.cells, report.requests)
        except RuntimeError as exc:
            raise _cli_error(f"{path}: {exc}") from None
        for q in ok["quarantined"]:
            print(
                f"speedmatrix ingest: {path}: {report.run_id}: {q['phase']} "
                f"{q['context_tokens']} x {q['concurrency']} quarantined: "
                f"{', '.join(q['reasons'])}",
                file=sys.stderr,
            )
        checked.append((text, report, ok))
    for text, report, ok in checked:
        wh.land_run(ok["run"], ok["cells"], ok["requests"])
        wh.write_artifact(report.run_id, "source.txt", text)
        print(report.run_id, flush=True)
    return 0


def _views_page(args: argparse.Namespace, wh) -> str:
    """The Pareto view (--pareto) or the comparison of two configurations (--versus), priced
    by the deployment (SPEEDMATRIX_GPU_PRICES; none set: no cost)."""
    from speedmatrix.analysis.pareto import model_ids
    from speedmatrix.report.page import deployment_prices
    from speedmatrix.report.pareto import (
        build_view,
        models,
        render_pareto_html,
        render_pareto_markdown,
        warehouse_runs,
    )
    from speedmatrix.report.versus import (
        VersusError,
        pick_run,
        render_versus_html,
        render_versus_markdown,
    )

    prices = deployment_prices()
    runs = warehouse_runs(wh)
    if args.pareto is not None:
        # a served name names its model id where the warehouse knows it
        args.pareto = model_ids(runs).get(args.pareto, args.pareto)
        known = models(runs)
        if args.pareto not in known:
            raise _cli_error(
                f"no successful run of model {args.pareto!r} (models: {', '.join(known) or 'none'})"
            )
        view = build_view(wh, args.pareto, by_commit=args.by_commit, prices=prices, runs=runs)
        render = render_pareto_html if args.format == "html" else render_pareto_markdown
        return render(view)
    try:
        a, b = (pick_run(runs, ref) for ref in args.versus)
        sides = [wh.read_run(str(r["run_id"]), r.get("recipe_id"))[:2] for r in (a, b)]
        # the model each side is grouped under (warehouse_runs: a served name -> its model id)
        sides = [
            ({**run, "model": r.get("model")}, cells)
            for r, (run, cells) in zip((a, b), sides, strict=True)
        ]
        if args.format == "html":
            return render_versus_html(sides[0], sides[1], prices=prices)
        return render_versus_markdown(sides[0], sides[1], prices=prices)
    except VersusError as exc:
        raise _cli_error(str(exc)) from None


def cmd_report(args: argparse.Namespace) -> int:
    from speedmatrix.cli.opening import open_existing_warehouse
    from speedmatrix.report.page import load_run_page, render_run_page
    from speedmatrix.report.render import render_markdown

    if args.by_commit and args.pareto is None:
        raise _cli_error("--by-commit goes with --pareto")
    wh = open_existing_warehouse(args.warehouse)
    if args.run_id is None:
        if args.save or args.baseline:
            raise _cli_error("--save and --baseline go with --run-id")
        page = _views_page(args, wh)
        if args.out:
            _write_out(args.out, page)
        else:
            sys.stdout.write(page if page.endswith("\n") else page + "\n")
        return 0
    try:
        if args.format == "html":
            # the pipeline's page: verdict first, against --baseline or the automatic one
            page = render_run_page(wh, args.run_id, baseline_ref=args.baseline)
        else:
            # the published page; with --baseline, the change table judged against noise as
            # the pipeline's report.md shows it (each judged change with its interval)
            data = load_run_page(
                wh,
                args.run_id,
                baseline_ref=args.baseline,
                figures=False,
                compare=bool(args.baseline),
            )
            page = render_markdown(data.run, data.cells, data.baseline, comparison=data.rows)
    except (KeyError, ValueError) as exc:
        raise _cli_error(str(exc.args[0]) if exc.args else str(exc)) from None
    if args.save:
        wh.write_artifact(args.run_id, f"report.{args.format}", page)
    if args.out:
        _write_out(args.out, page)
    else:
        sys.stdout.write(page if page.endswith("\n") else page + "\n")
    return 0


def _write_out(path: str, page: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(page)
    os.replace(tmp, path)
