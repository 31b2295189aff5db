"""Run a cell on the best event loop available (uvloop when importable)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from speedmatrix.records import CellRecord

from .config import BurstConfig, DecodeConfig, PrefillConfig

T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed: a cheaper loop leaves more room per chunk."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_cell(
    cfg: DecodeConfig | PrefillConfig | BurstConfig,
) -> tuple[CellRecord, list[dict[str, object]]]:
    """Synchronous entry point for callers without an event loop (Airflow tasks)."""
    from .burst import run_burst
    from .decode import run_decode
    from .prefill import run_prefill

    if isinstance(cfg, BurstConfig):
        return run_loop(run_burst(cfg))
    if isinstance(cfg, DecodeConfig):
        return run_loop(run_decode(cfg))
    return run_loop(run_prefill(cfg))
