"""``speedmatrix export --format parquet DIR`` and ``speedmatrix warehouse maintain|migrate``:
the warehouse's Delta tables handed out as plain Parquet, kept compact, and imported from the
older layout (speedmatrix.store.export, .maintain, .migrate)."""

from __future__ import annotations

# speedmatrix imports inside the command functions: `speedmatrix <cmd> --help` stays cheap.
import argparse
import json
import sys

from speedmatrix.words import count

_WAREHOUSE_HELP = "warehouse root (default $SPEEDMATRIX_WAREHOUSE, else the checkout's warehouse/)"


def register(sub: argparse._SubParsersAction, name: str) -> None:
    if name == "export":
        p = sub.add_parser(
            name,
            help="write a plain Parquet snapshot of every table",
            description="Write the current version of every table as plain hive-partitioned "
            "Parquet (DIR/<table>/recipe_id=…/run_month=…/*.parquet) for tools that read only "
            "files.",
        )
        p.add_argument("dir", help="where to write (a local directory)")
        p.add_argument("--format", choices=("parquet",), default="parquet")
        p.add_argument("--warehouse", help=_WAREHOUSE_HELP)
        p.set_defaults(func=cmd_export)
        return
    p = sub.add_parser(name, help="maintain or migrate the warehouse")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    m = actions.add_parser(
        "maintain",
        help="compact, checkpoint and vacuum every table (what the daily DAG does)",
    )
    m.add_argument("--warehouse", help=_WAREHOUSE_HELP)
    m.add_argument(
        "--retention-hours",
        type=float,
        default=None,
        help="vacuum only files no version of the last N hours needs, and files no version "
        "ever referenced once N hours old (default 24; at least 1, the longest a landing "
        "takes, unless --force; a fraction is kept: 1.5 is 90 minutes)",
    )
    m.add_argument(
        "--force",
        action="store_true",
        help="allow a retention below the floor (a landing under way may lose its files)",
    )
    m.set_defaults(func=cmd_maintain)
    g = actions.add_parser(
        "migrate", help="import a warehouse of the older layout (one Parquet file per run)"
    )
    g.add_argument("--from", dest="source", required=True, help="the older warehouse's root")
    g.add_argument("--warehouse", help=_WAREHOUSE_HELP)
    g.set_defaults(func=cmd_migrate)


def cmd_export(args: argparse.Namespace) -> int:
    from speedmatrix.store.export import export_parquet
    from speedmatrix.store.warehouse import Warehouse

    counts = export_parquet(Warehouse(args.warehouse), args.dir)
    for table, rows in counts.items():
        print(f"{table}: {rows} rows")
    return 0


def cmd_maintain(args: argparse.Namespace) -> int:
    from speedmatrix.store.maintain import (
        MIN_RETENTION_HOURS,
        RETENTION_HOURS,
        failure_line,
        format_report,
        maintain,
    )
    from speedmatrix.store.warehouse import Warehouse

    hours = RETENTION_HOURS if args.retention_hours is None else args.retention_hours
    report = maintain(Warehouse(args.warehouse), hours, force=args.force)
    if hours < MIN_RETENTION_HOURS:
        print(
            f"speedmatrix warehouse maintain: --force: vacuum retention {hours:g} h is below "
            f"the floor of {MIN_RETENTION_HOURS:g} h (delta-rs's retention check off)",
            file=sys.stderr,
        )
    sys.stdout.write(format_report(report))
    failed = failure_line(report)
    if failed:
        print(f"speedmatrix warehouse maintain: {failed}", file=sys.stderr)
        return 1
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    """Every old run takes the landing's checks (`landing_check`); refused runs are listed in
    the report and on stderr, and the exit code is 1 when there is any."""
    from speedmatrix.store.migrate import migrate
    from speedmatrix.store.warehouse import Warehouse

    wh = Warehouse(args.warehouse)
    report = migrate(wh, args.source, check=landing_check(wh))
    print(json.dumps(report, indent=2, default=str))
    refused = report.get("refused") or []
    for r in refused:
        print(f"speedmatrix warehouse migrate: refused {r['run_id']!r}: {r['reason']}",
              file=sys.stderr)  # fmt: skip
    if refused:
        print(
            f"speedmatrix warehouse migrate: {count(len(refused), 'run')} refused, quarantined under "
            f"{wh.root}/_quarantine/runs",
            file=sys.stderr,
        )
        return 1
    return 0


def landing_check(wh):
    """The landing's checks for one migrated run (store.migrate.Check): the names
    (records.path_field_problems; a run refused for its name is quarantined under a name of
    its hash), then quality.check_for_landing (numbers, the suites, quarantine)."""
    import hashlib

    from speedmatrix.quality import check_for_landing
    from speedmatrix.records import path_field_problems
    from speedmatrix.store.migrate import Checked

    def check(run: dict, cells: list[dict], requests: list[dict]) -> Checked:
        if problems := path_field_problems(run):
            safe = "refused-" + hashlib.sha256(str(run.get("run_id")).encode()).hexdigest()[:16]
            where = wh.quarantine(safe, "runs", [run], {"reasons": problems})
            return Checked(refused=f"{'; '.join(problems)}; quarantined at {where}")
        try:
            ok = check_for_landing(wh, dict(run), cells, requests)
        except RuntimeError as exc:
            return Checked(refused=str(exc))
        keys = {(q["phase"], q["context_tokens"], q["concurrency"]) for q in ok["quarantined"]}
        return Checked(status=ok["run"]["status"], quarantined=keys)

    return check
