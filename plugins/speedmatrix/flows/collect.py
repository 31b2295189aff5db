"""From the cell tasks' results to the run's records: every planned cell exactly once.

One job: pair each planned cell with the result its task left in XCom (records.from_wire reads
it back), by the exact key, else by the planned label when the server confirmed another prompt
length than planned; a planned cell with no result is recorded `failed`, never dropped. The
measured context is kept, never overwritten by the planned one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from speedmatrix.flows.contracts import CELL_RESULT, Planned
from speedmatrix.plan import ordered_cells
from speedmatrix.records import REQUEST_FIELDS, CellRecord, context_label, empty_cell, from_wire


def failed_cell(cell: Mapping[str, Any], reason: str, **values: Any) -> CellRecord:
    """A planned cell recorded as `failed` with its reason (nothing measured)."""
    phase = cell["phase"]
    return empty_cell(
        phase=phase,
        context_tokens=int(cell["context_tokens"]),
        context_label=context_label(int(cell["context_tokens"])),
        concurrency=int(cell["concurrency"]),
        status="failed",
        error=reason,
        max_output_tokens=cell.get("max_output_tokens"),
        window_s=cell.get("window_s"),
        prompt_mode=cell.get("prompt_mode"),
        workload=cell.get("workload"),
        measurement_profile=cell.get("measurement_profile"),
        **values,
    )


def _results(
    results: Sequence[Mapping[str, Any] | None], repeats: bool
) -> list[tuple[int, CellRecord, list[dict]]]:
    """(pass, cell record, request rows) of each cell task's XCom result, read back from its
    wire form (records.from_wire): primaries, or with `repeats` the later passes."""
    out = []
    for raw in results:
        if not raw:
            continue
        res = CELL_RESULT.from_wire(raw)  # a result of another shape is an error, named
        if bool(res.get("repeat")) != repeats:
            continue
        rows = [from_wire(r, REQUEST_FIELDS) for r in res.get("requests") or []]
        out.append((int(res.get("repeat") or 0), from_wire(res["cell"]), rows))  # type: ignore[arg-type]
    return out


def _pair(
    planned: Sequence[Mapping[str, Any]], got: list[tuple[int, CellRecord, list[dict]]]
) -> list[tuple[Mapping[str, Any], tuple[int, CellRecord, list[dict]] | None]]:
    """Each planned cell with its result, or None. A result is its planned cell's by the exact
    key (phase, context tokens, concurrency, pass), else, when the server confirmed another
    prompt length than planned (8,176 tokens for 8K), by the planned label run_cell gave it:
    the record keeps its measured tokens, never the planned ones."""
    left = list(got)

    def take(match) -> tuple[int, CellRecord, list[dict]] | None:
        for i, item in enumerate(left):
            if match(item):
                return left.pop(i)
        return None

    def ident(p: Mapping[str, Any]) -> tuple[str, int, int]:
        return str(p["phase"]), int(p["concurrency"]), int(p.get("repeat") or 0)

    found = [
        take(
            lambda r, p=p: (
                (r[1]["phase"], int(r[1]["concurrency"]), r[0]) == ident(p)
                and int(r[1]["context_tokens"]) == int(p["context_tokens"])
            )
        )
        for p in planned
    ]
    for i, p in enumerate(planned):
        if found[i] is None:
            label = context_label(int(p["context_tokens"]))
            found[i] = take(
                lambda r, p=p, label=label: (
                    (r[1]["phase"], int(r[1]["concurrency"]), r[0]) == ident(p)
                    and r[1].get("context_label") == label
                )
            )
    return list(zip(planned, found, strict=True))


def collect_cells(
    planned: Planned | None, results: Sequence[Mapping[str, Any] | None]
) -> tuple[list[CellRecord], list[dict]]:
    """Every planned cell exactly once, in report order: measured records, over-capacity
    records, and `failed` for a planned cell whose task left no result (it crashed).
    Records come back from their XCom form with datetimes (records.from_wire); a request row
    carries its cell's context_tokens (the measured count, the cells table's key)."""
    planned = planned or {"prefill": [], "decode": [], "over_capacity": []}
    primaries = [p for p in [*planned["prefill"], *planned["decode"]] if not p.get("repeat")]
    cells: list[CellRecord] = [from_wire(c) for c in planned["over_capacity"]]  # type: ignore[misc]
    requests: list[dict] = []
    for p, res in _pair(primaries, _results(results, repeats=False)):
        if res is None:
            cells.append(failed_cell(p, "the cell's task ended without a result"))
            continue
        _, cell, rows = res
        cells.append(cell)
        requests += [{**r, "context_tokens": cell["context_tokens"]} for r in rows]
    return ordered_cells(cells), requests


def collect_repeats(
    planned: Planned | None, results: Sequence[Mapping[str, Any] | None]
) -> list[dict]:
    """Every planned repeat (pass >= 1) exactly once, as its cell record plus `repeat`, in pass
    then report order; `failed` for a repeat whose task left no result. Their requests are
    not kept: the requests table holds one set per cell, and a repeat is only there to give
    the between-run spread of the cell's figures."""
    planned = planned or {"prefill": [], "decode": [], "over_capacity": []}
    later = [
        p for p in [*planned.get("prefill", []), *planned.get("decode", [])] if p.get("repeat")
    ]
    out = []
    for p, res in _pair(later, _results(results, repeats=True)):
        cell = failed_cell(p, "the cell's task ended without a result") if res is None else res[1]
        out.append({**cell, "repeat": int(p["repeat"])})
    rank = {"prefill": 0, "decode": 1}
    return sorted(
        out,
        key=lambda c: (c["repeat"], rank.get(c["phase"], 2), c["context_tokens"], c["concurrency"]),
    )
