"""``speedmatrix export --format parquet DIR`` and ``speedmatrix warehouse maintain|migrate``:
the warehouse's Delta tables handed out as plain Parquet, kept compact, and imported from the
older layout (speedmatrix.store.export, .maintain, .migrate)."""

from __future__ import annotations

# speedmatrix imports inside the command functions: `speedmatrix <cmd> --help` stays cheap.
import argparse
import json
import sys

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
        help="vacuum only files no version of the last N hours needs (default 24)",
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
    from speedmatrix.store.maintain import RETENTION_HOURS, format_report, maintain
    from speedmatrix.store.warehouse import Warehouse

    hours = RETENTION_HOURS if args.retention_hours is None else args.retention_hours
    sys.stdout.write(format_report(maintain(Warehouse(args.warehouse), hours)))
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from speedmatrix.store.migrate import migrate
    from speedmatrix.store.warehouse import Warehouse

    report = migrate(Warehouse(args.warehouse), args.source)
    print(json.dumps(report, indent=2))
    return 0
