"""The warehouse a reading command reads (`report`, `compare`, `trend`, `site`): it must exist.

Why a check of its own: a Warehouse object is lazy (nothing is touched until a table is read),
and an absent table reads as no rows, so without it `speedmatrix site --warehouse /nonexistent`
would write an empty site and exit 0. A typo in a path is an error, named as such.
Writing commands (`ingest`, `run`) create the warehouse and do not come here.
"""

from __future__ import annotations

from typing import Any


def open_existing_warehouse(root: str | None) -> Any:
    """The Warehouse at `root` (default: $SPEEDMATRIX_WAREHOUSE, else the checkout's warehouse/); a CliError
    naming the path when there is no directory there."""
    import pyarrow.fs as pafs

    from speedmatrix.cli import CliError
    from speedmatrix.store.warehouse import Warehouse

    wh = Warehouse(root)
    if wh.fs.get_file_info(wh.base).type != pafs.FileType.Directory:
        wh.close()
        raise CliError(f"no warehouse at {wh.root} (no such directory)")
    return wh
