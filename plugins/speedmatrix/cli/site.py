"""``speedmatrix site --out DIR [--warehouse W] [--force]``: the static site over the warehouse.

Writes (or refreshes: only what changed is rendered again) the index of recipes and hosts,
each recipe's trend page and every run's page under DIR (speedmatrix.report.site). DIR defaults
to ``$SPEEDMATRIX_SITE_DIR``, else ``site/`` beside the warehouse directory. Prints the path of
the index on stdout, the summary on stderr; exit 1 when a run page could not be rendered (the
rest is written).
"""

from __future__ import annotations

import argparse
import os
import sys


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        "site",
        help="write the static site over the warehouse",
        description="Write a static site (index of recipes and hosts, per-recipe trends, "
        "every run's page) that opens from file:// and any static host.",
    )
    p.add_argument(
        "--out",
        help="site directory (default $SPEEDMATRIX_SITE_DIR, else site/ beside the warehouse)",
    )
    p.add_argument(
        "--warehouse",
        help="warehouse root (default $SPEEDMATRIX_WAREHOUSE, else the checkout's warehouse/)",
    )
    p.add_argument("--force", action="store_true", help="render every page again, changed or not")
    p.add_argument(
        "--max-run-pages",
        type=int,
        metavar="N",
        help="render at most N run pages in this build, newest first (the rest next time)",
    )
    p.set_defaults(func=cmd_site)


def cmd_site(args: argparse.Namespace) -> int:
    from speedmatrix.cli.opening import open_existing_warehouse
    from speedmatrix.report.site import build_site, default_site_dir

    wh = open_existing_warehouse(args.warehouse)
    try:
        out = args.out or default_site_dir(wh.root)
        result = build_site(wh, out, force=args.force, max_run_pages=args.max_run_pages)
    finally:
        wh.close()
    print(result.summary(), file=sys.stderr)
    for failure in result.failed:
        print(f"speedmatrix site: no page for run {failure}", file=sys.stderr)
    print(os.path.join(result.out, "index.html"))
    return 1 if result.failed else 0
