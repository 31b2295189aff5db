"""How the site writes a warehouse value: missing values, times, the engine, the hardware.

Why a module of its own: the site's tables (site_pages), its trend charts (site_trend) and
its verdicts (site_fleet) show the same run fields, and each must show them the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from speedmatrix.commits import commit_label


def clean(value: Any) -> Any:
    """A warehouse value, with pandas' missing values (NaN, NaT) as None."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if value is pd.NaT:
        return None
    return value


def text(value: Any) -> str:
    value = clean(value)
    return "" if value is None else str(value)


def when(value: Any) -> str:
    value = clean(value)
    if value is None:
        return "—"
    try:
        return pd.Timestamp(value).strftime("%Y-%m-%d %H:%M")
    except (ValueError, TypeError):
        return str(value)


def engine(run: Mapping[str, Any]) -> str:
    commit = text(run.get("engine_commit"))
    version = text(run.get("engine_version"))
    if commit:
        return commit_label(run) + (f" ({version})" if version else "")
    return version or text(run.get("engine_ref")) or "—"


def gpu(run: Mapping[str, Any]) -> str:
    """The hardware column: what the run ran on, `simulated engine (profile …)` for a
    simulated run, `hardware not known` for a server whose hardware was not read."""
    from speedmatrix.report.render import measured_on

    said = measured_on({k: clean(v) for k, v in run.items()})
    gpu = text(run.get("hardware_gpu"))
    count = clean(run.get("hardware_gpu_count"))
    if said and clean(run.get("sim_profile")) is None:
        return said
    if not gpu:
        return "—"
    shown = f"{gpu} ×{int(count)}" if count else gpu
    return f"{said}: {shown}" if said else shown
