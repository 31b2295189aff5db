"""Rows as the tables hold them, for tests: one place that knows every column (issue #41).

`run_row` is a `runs` row with every column present (None unless given), `prefill_cell` and
`decode_cell` a cell record with its label made by the one rule (records.context_label). A
test says only the values its case is about; a column added to the tables reaches every test.
"""

from __future__ import annotations

from typing import Any

from speedmatrix.records import RUN_FIELDS, CellRecord, context_label, empty_cell

SIM_RECIPE = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"


def run_row(run_id: str = "r-1", **values: Any) -> dict[str, Any]:
    """A `runs` row: every column, None where not given; a successful manual run of the
    simulated recipe on `local` by default."""
    row: dict[str, Any] = {f.name: None for f in RUN_FIELDS}
    row.update(
        run_id=run_id,
        recipe_id=SIM_RECIPE,
        trigger="manual",
        status="success",
        host="local",
        engine="vllm",
    )
    unknown = set(values) - set(row)
    if unknown:
        raise KeyError(f"not runs columns: {sorted(unknown)}")
    row.update(values)
    return row


def prefill_cell(tokens: int, **values: Any) -> CellRecord:
    """A prefill cell record at ``tokens`` (concurrency 1, valid unless told)."""
    fields: dict[str, Any] = {"concurrency": 1, "status": "valid", **values}
    return empty_cell(
        phase="prefill", context_tokens=tokens, context_label=context_label(tokens), **fields
    )


def decode_cell(tokens: int, concurrency: int, **values: Any) -> CellRecord:
    """A decode cell record at ``tokens`` x ``concurrency`` (valid unless told)."""
    fields: dict[str, Any] = {"status": "valid", **values}
    return empty_cell(
        phase="decode",
        context_tokens=tokens,
        context_label=context_label(tokens),
        concurrency=concurrency,
        **fields,
    )
