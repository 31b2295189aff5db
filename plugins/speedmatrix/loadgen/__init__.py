"""speedmatrix.loadgen: the measuring client (standard library + aiohttp; uvloop/orjson if there).

In-process use (Airflow tasks, tests)::

    cell, rows = asyncio.run(run_decode(DecodeConfig(base_url=..., model=..., context=8192,
                                                     concurrency=16, window_s=30)))

`cell` is the flat cell record (records.CELL_FIELDS, every key present), `rows` the per-request
rows (records.REQUEST_FIELDS). CellNotAttempted means the cell could not be attempted at all.
This package imports nothing from speedmatrix but `speedmatrix.records`, so it ships to a GPU
host as one zipapp (`speedmatrix.loadgen.zipapp.build`).
"""

from .burst import run_burst
from .config import BurstConfig, CellConfig, DecodeConfig, PrefillConfig, new_run_tag
from .control import CellNotAttempted
from .decode import run_decode
from .prefill import run_prefill
from .runner import run_cell

__all__ = [
    "BurstConfig",
    "CellConfig",
    "CellNotAttempted",
    "DecodeConfig",
    "PrefillConfig",
    "new_run_tag",
    "run_burst",
    "run_cell",
    "run_decode",
    "run_prefill",
]
