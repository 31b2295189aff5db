"""The run's comparison, carried from `land` to `report` and `regressions`.

Why a hand-off: comparing a run with its baseline reads history and computes noise; the page
and the verdict must be of one comparison. `land` has it made once the run has landed (by its
one owner, analysis/compare.py) and this module writes it next to the run's artifacts (typed
Parquet, not XCom: it can be large); `report` and `regressions` read it back when it is of the
same landing of the run, and otherwise hand analysis/compare.py nothing, which then makes it
again. This module only carries it. Why `land` and not `report`: so that `report` and
`regressions` need nothing of each other and run side by side, one task after the host's
server has stopped instead of two in a row.
"""

from __future__ import annotations

import json
from typing import Any

from speedmatrix.records import Field, from_wire, to_wire
from speedmatrix.store.protocol import Warehouse, WarehouseReader

COMPARISON_HANDOFF = "comparison"
"""The run's artifacts folder where `land` leaves the comparison for `report` and `regressions`:
rows.parquet and noise.parquet (the comparisons / noise tables' schemas: typed, timestamps
included) and meta.json (the baseline, and the run's landed_at the comparison was made of)."""


def hand_on_comparison(wh: Warehouse, run_id: str, result: Any) -> None:
    """Leave the comparison made by `land` for `report` and `regressions` (COMPARISON_HANDOFF);
    None leaves a marker saying there is none, so a comparison of an earlier landing of the
    run is never taken for this one's."""
    import io

    import pyarrow.parquet as pq

    from speedmatrix.analysis.noise import noise_table
    from speedmatrix.analysis.verdict import comparisons_table

    meta: dict[str, Any] = {"made": result is not None}
    if result is not None:
        for name, table in (
            ("rows", comparisons_table(result.rows)),
            ("noise", noise_table(result.noise)),
        ):
            buf = io.BytesIO()
            pq.write_table(table, buf)
            wh.write_artifact(run_id, f"{COMPARISON_HANDOFF}/{name}.parquet", buf.getvalue())
        meta.update(
            baseline_run_id=(result.baseline or {}).get("run_id"),
            landed_at=result.run.get("landed_at"),
        )
    # last: a reader finds the meta of this landing only once its tables are written
    wh.write_artifact(
        run_id, f"{COMPARISON_HANDOFF}/meta.json", json.dumps(to_wire(meta, [_LANDED_AT]))
    )


_LANDED_AT = Field("landed_at", "timestamp", True, "the landing a comparison was made of")


def handed_on_comparison(wh: WarehouseReader, run_id: str):
    """The comparison `land` made of this landing of the run (a ComparisonResult), or None
    when there is none to take: not made, not found, or made of an earlier landing."""
    import io

    import pyarrow.parquet as pq

    from speedmatrix.analysis.compare import ComparisonResult

    try:
        raw = json.loads(wh.read_artifact(run_id, f"{COMPARISON_HANDOFF}/meta.json"))
        meta = from_wire(raw, [_LANDED_AT])
        run, _, _ = wh.read_run(run_id)
    except (OSError, KeyError, ValueError):
        return None
    if not meta.get("made") or meta.get("landed_at") != run.get("landed_at"):
        return None
    tables = {
        name: pq.read_table(
            io.BytesIO(wh.read_artifact(run_id, f"{COMPARISON_HANDOFF}/{name}.parquet"))
        ).to_pylist()
        for name in ("rows", "noise")
    }
    base = meta.get("baseline_run_id")
    baseline = wh.read_run(base)[0] if base else None
    return ComparisonResult(run, baseline, tables["rows"], tables["noise"])
