"""Two configurations of one model side by side, cell by cell: two recipes,
or one recipe on two kinds of hardware; in the site (``compare/<a>--vs--<b>.html``, linked
from the model's Pareto view) and from ``speedmatrix report --versus A B``.

B is read against A as a run against its baseline, in the same colours (report.palette:
orange = B slower, purple = B faster, grey = unchanged), with the change in every cell of the
decode matrix and the prefill table (report.cellchange.from_cells: the plain ratio, no verdict
mark: noise verdicts judge one configuration over time, not two configurations). Since two
configurations may have a different number of GPUs, every cell also says its change per GPU,
and its cost per million output tokens where the deployment prices both (analysis.cost).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from speedmatrix.analysis.cost import Prices, cost_per_million, fmt_cost
from speedmatrix.analysis.pareto import gpu_text, model_of
from speedmatrix.commits import engine_text
from speedmatrix.errors import InputError
from speedmatrix.published import formats as F
from speedmatrix.records import cell_key, cell_sort_key
from speedmatrix.report import palette
from speedmatrix.report.cellchange import from_cells, make_change

Side = tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]


class VersusError(InputError):
    """The two sides cannot be compared (not found, not the same model)."""


def pick_run(runs: Sequence[Mapping[str, Any]], ref: str) -> Mapping[str, Any]:
    """A run id, or a recipe id (its latest successful run, any host)."""
    for r in runs:
        if r.get("run_id") == ref:
            return r
    mine = [r for r in runs if r.get("recipe_id") == ref and r.get("status") == "success"]
    if not mine:
        raise VersusError(f"{ref!r} is neither a run id nor a recipe with a successful run")
    return max(mine, key=lambda r: str(r.get("started_at")))


def check_same_model(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    ma, mb = model_of(a), model_of(b)
    if ma is None or ma != mb:
        raise VersusError(
            f"{a.get('run_id')} serves {ma or 'an unknown model'} and {b.get('run_id')} "
            f"{mb or 'an unknown model'}: a comparison is of one model on two configurations"
        )
    return ma


def side_label(run: Mapping[str, Any]) -> str:
    engine = engine_text(run)
    return f"{run.get('recipe_id') or 'no recipe'} · {gpu_text(run)} · engine {engine}"


def _pct(new: float | None, old: float | None) -> float | None:
    if new is None or not old:
        return None
    return (new - old) / old * 100


def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if x != x else x


def _per_gpu(cell: Mapping[str, Any] | None, run: Mapping[str, Any]) -> float | None:
    gpus = _num(run.get("hardware_gpu_count"))
    total = _num(cell.get("total_tok_s")) if cell else None
    return total / gpus if total is not None and gpus else None


def _cost(cell: Mapping[str, Any] | None, run: Mapping[str, Any], prices: Prices | None) -> Any:
    if cell is None or cell.get("status") != "valid" or prices is None:
        return None
    return cost_per_million(
        cell.get("total_tok_s"), run.get("hardware_gpu_count"), prices.for_run(run)
    )


def _text(cell: Mapping[str, Any] | None, digits: int = 1) -> str:
    if cell is None:
        return F.DASH
    if cell.get("status") != "valid":
        return F.fmt_status(cell.get("status"))
    return F.fmt_rate_summary(cell.get("total_tok_s"), digits)


def _ok(cell: Mapping[str, Any] | None) -> bool:
    return cell is not None and cell.get("status") == "valid"


def versus_cells(a: Side, b: Side, prices: Prices | None = None) -> dict[str, Any]:
    """The page's content: the decode grid and the prefill rows, each cell with both values,
    B's change against A (total and per GPU) and both costs."""
    (run_a, cells_a), (run_b, cells_b) = a, b
    changes = from_cells(cells_b, cells_a)
    by_a = {cell_key(c): c for c in cells_a}
    by_b = {cell_key(c): c for c in cells_b}
    currency = prices.currency if prices is not None else "USD"
    same_gpus = run_a.get("hardware_gpu_count") == run_b.get("hardware_gpu_count")
    keys = sorted(set(by_a) | set(by_b), key=lambda k: cell_sort_key(by_b.get(k) or by_a[k]))
    decode_rows: dict[str, dict[int, dict[str, Any]]] = {}
    row_tokens: dict[str, int] = {}
    prefill = []
    any_cost = False
    for k in keys:
        ca, cb = by_a.get(k), by_b.get(k)
        per_gpu = _pct(_per_gpu(cb, run_b), _per_gpu(ca, run_a))
        # a cost of output tokens: decode cells only (a prefill cell's tokens are the prompt's)
        decode = k[0] == "decode"
        cost_a = _cost(ca, run_a, prices) if decode else None
        cost_b = _cost(cb, run_b, prices) if decode else None
        any_cost = any_cost or cost_a is not None or cost_b is not None
        total = changes.get(k)
        # On a different number of GPUs the fair figure is per GPU: it gets the colour, and
        # the total's change is said beside it.
        badge = total
        if not same_gpus:
            badge = make_change(per_gpu, "", total.title if total else "")
            if badge is not None:
                badge = replace(badge, text=f"{badge.text} per GPU")
        entry = {
            "a": _text(ca),
            "b": _text(cb),
            "change": badge,
            "other": f"{total.text} total" if total is not None and not same_gpus else "",
            "cost": (
                f"{fmt_cost(cost_b, currency)} vs {fmt_cost(cost_a, currency)} per 1M"
                if cost_a is not None or cost_b is not None
                else ""
            ),
            "cls": str((cb or {}).get("status") or "empty"),
        }
        # a status both sides share (over capacity on both) is said once, not "X / A: X"
        entry["same"] = entry["a"] == entry["b"] and not _ok(ca) and not _ok(cb)
        if k[0] == "decode":
            decode_rows.setdefault(k[1], {})[k[2]] = entry
            row_tokens[k[1]] = int((cb or ca or {}).get("context_tokens") or 0)
        elif k[0] == "prefill":
            prefill.append({"label": f"{k[1]} context", **entry})
    cols = sorted({c for row in decode_rows.values() for c in row})
    empty = {
        "same": True,
        "a": F.DASH,
        "b": F.DASH,
        "change": None,
        "other": "",
        "cost": "",
        "cls": "empty",
    }
    matrix = [
        {"label": label, "cells": [decode_rows[label].get(c, empty) for c in cols]}
        for label in sorted(decode_rows, key=lambda lbl: row_tokens[lbl])
    ]
    return {
        "cols": cols,
        "matrix": matrix,
        "prefill": prefill,
        "any_cost": any_cost,
        "same_gpus": same_gpus,
    }


def render_versus_html(
    a: Side,
    b: Side,
    *,
    prices: Prices | None = None,
    links: Sequence[tuple[str, str]] = (),
    run_href: Mapping[str, str] | None = None,
) -> str:
    """The comparison page of B against A (one HTML file, inline CSS, no script)."""
    from speedmatrix.report.jinja import environment

    model = check_same_model(a[0], b[0])
    content = versus_cells(a, b, prices)
    hrefs = dict(run_href or {})
    return (
        environment()
        .get_template("versus.html.j2")
        .render(
            model=model,
            a={"run": a[0], "label": side_label(a[0]), "href": hrefs.get(str(a[0].get("run_id")))},
            b={"run": b[0], "label": side_label(b[0]), "href": hrefs.get(str(b[0].get("run_id")))},
            links=list(links),
            palette=palette,
            change_legend=palette.CHANGE_LEGEND,
            **content,
        )
    )


def render_versus_markdown(a: Side, b: Side, *, prices: Prices | None = None) -> str:
    """The comparison as Markdown: one row per cell (B, A, change, change per GPU, cost)."""
    model = check_same_model(a[0], b[0])
    content = versus_cells(a, b, prices)
    out = [
        f"# {model}: B against A",
        "",
        f"- A: {side_label(a[0])} (run {a[0].get('run_id')})",
        f"- B: {side_label(b[0])} (run {b[0].get('run_id')})",
        "",
        "| Cell | B tok/s | A tok/s | Change | Total |"
        + (" Cost B vs A |" if content["any_cost"] else ""),
        "|---|---|---|---|---|" + ("---|" if content["any_cost"] else ""),
    ]
    rows = [(p["label"].replace(" context", ""), p, "prefill ") for p in content["prefill"]]
    for row in content["matrix"]:
        for col, e in zip(content["cols"], row["cells"], strict=True):
            rows.append((f"{row['label']}x{col}", e, ""))
    for name, e, prefix in rows:
        change = e["change"].label if e["change"] is not None else F.DASH
        line = f"| {prefix}{name} | {e['b']} | {e['a']} | {change} | {e['other'] or change} |"
        if content["any_cost"]:
            line += f" {e['cost'] or F.DASH} |"
        out.append(line)
    out.append("")
    return "\n".join(out)
