"""Render a run as the published "Speed test matrix" page: Markdown and one-file HTML.

``render_markdown(run, cells, baseline=None)`` reproduces the published page: the title, the
Hardware / Engine / Run header fields, the launch command, the Prefill summary, the Sustained
decode matrix and the "All measurements" table, in that order and with the same labels; every
"All measurements" row is formatted exactly as the published pages write it (see
``speedmatrix.published.formats``). The Markdown parses back (``speedmatrix.published.parse``) to the
same run fields and cells, hence the same run id. With ``baseline=(run, cells)`` a section
"Change against baseline" follows, one row per cell present in both runs.

``render_html(run, cells, baseline=None)`` has the same content as one self-contained HTML file
(inline CSS, charts as inline SVG): colour-scaled prefill and decode matrices, prefill tok/s
and TTFT against context, decode total and per-request tok/s against concurrency.

``run`` and ``cells`` are dicts keyed by the records.py field names (what
``Warehouse.read_run`` returns; extra keys are ignored).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from speedmatrix.commits import engine_text
from speedmatrix.published import formats as F
from speedmatrix.records import DEFAULT_WORKLOAD, cell_key, cell_sort_key
from speedmatrix.report import burst, palette
from speedmatrix.report.cellchange import cell_changes
from speedmatrix.report.matrices import (
    ACCEPTANCE_NOTE,
    OVER_CAPACITY_NOTE,
    acceptance_matrix,
    cost_matrix,
    prefill_row,
    throughput_matrix,
)

TTFT_NOTE = (
    "TTFT is measured after the benchmark warms the server's prompt cache, so it mostly "
    "excludes prefill."
)
TABLE_NOTE = "Latencies are medians. Total tok/s is output across all simultaneous requests."
MATRIX_NOTE = "total tok/s · rows are context length, columns are simultaneous requests"
PREFILL_NOTE = "prompt tok/s by context length"

Baseline = tuple[dict, list[dict]]


def _absent(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _v(run: dict, key: str) -> Any:
    value = run.get(key)
    return None if _absent(value) else value


def sort_cells(cells: Sequence[dict]) -> list[dict]:
    """Page order (`records.cell_sort_key`): prefill then decode; by context, then concurrency."""
    return sorted(cells, key=cell_sort_key)


def _label(cell: dict) -> str:
    return cell_key(cell)[1]


def _vram_text(run: dict) -> str | None:
    per = _v(run, "hardware_vram_gb")
    if per is None:
        return None
    count = _v(run, "hardware_gpu_count")
    per_text = F.fmt_gb(per)
    if count:
        return f"{F.fmt_gb(per * count)} ({count} × {per_text})"
    return per_text


def decode_test_text(run: dict) -> str | None:
    """The "Decode test" value, with a workload other than the published one annotated.

    Why only then: the published pages were measured with the `article` workload and do not
    name it, so an article run's Markdown stays byte for byte the published format (and
    ingests back to the same run); a `continuation` run says so where a reader of the page
    looks for how decode was tested, ``Fixed duration (continuation workload)``, which the
    parser reads back into decode_test and workload. The HTML names the workload always.
    """
    value = _v(run, "decode_test")
    workload = _v(run, "workload")
    if value is not None and workload not in (None, DEFAULT_WORKLOAD):
        value = f"{value} ({workload} workload)"
    # our run measured by the published tool's definitions says so; a page the
    # published tool made is that profile by its nature and keeps its own text
    if value is not None and _v(run, "measurement_profile") == "published" and _ours(run):
        value = f"{value} {PUBLISHED_PROFILE_NOTE}"
    return value


PUBLISHED_PROFILE_NOTE = "(published profile)"
"""The Markdown's note of a run measured by the `published` profile (parse reads it back)."""


def _ours(run: dict) -> bool:
    return _v(run, "bench_tool") in (None, "speedmatrix")


def header_fields(run: dict, html: bool = False) -> dict[str, list[tuple[str, str]]]:
    """Section -> [(label, value text)] in page order; optional fields without a value are
    left out, required ones show ``—``. `html` adds the Run section's Workload row (the
    Markdown keeps the published labels; see decode_test_text)."""
    from speedmatrix.commits import commit_text
    from speedmatrix.published.pagetext import HEADER_LABELS, REQUIRED_LABELS

    out: dict[str, list[tuple[str, str]]] = {}
    for section, labels in HEADER_LABELS.items():
        rows = []
        for label, key in labels:
            value = _v(run, key)
            if key.startswith("hardware_") and not hardware_known(run):
                text = HARDWARE_NOT_KNOWN
            elif key == "hardware_vram_gb":
                text = _vram_text(run)
            elif key == "window_s":
                text = F.fmt_seconds_header(value) if value is not None else None
            elif key == "max_output_tokens":
                text = F.fmt_tokens(value) if value is not None else None
            elif key == "bench_tool":
                version = _v(run, "bench_tool_version")
                text = f"{value} v{version}" if value and version else value
            elif key == "engine_pr":
                text = f"#{value}" if value is not None else None
            elif key == "decode_test":
                text = decode_test_text(run)
            elif key == "engine_commit":
                text = commit_text(run)
            else:
                text = None if value is None else str(value)
            if text is None:
                if label not in REQUIRED_LABELS[section]:
                    continue
                text = F.DASH
            rows.append((label, text))
            if section == "Run" and key == "served_model" and measured_on(run):
                # said in the Run section too, where a reader of the figures looks (only for
                # such runs: a real run's page keeps the published labels)
                rows.append(("Measured on", str(measured_on(run))))
            if html and key == "decode_test":
                rows.append(("Workload", str(_v(run, "workload") or F.DASH)))
                profile = _v(run, "measurement_profile") or "default"
                rows.append(("Measurement profile", str(profile)))
        out[section] = rows
    return out


SIMULATED = "simulated engine (profile {profile})"
HARDWARE_NOT_KNOWN = "hardware not known"


def hardware_known(run: dict) -> bool:
    """Whether the run says what it ran on (a server already running elsewhere does not)."""
    gpu = _v(run, "hardware_gpu")
    return bool(gpu) and str(gpu).lower() != "unknown"


def measured_on(run: dict) -> str | None:
    """What a reader must be told before any figure: the run was simulated, or its hardware is
    not known (None for a real engine on known hardware, whose page stays the published one)."""
    if _v(run, "sim_profile"):
        return SIMULATED.format(profile=_v(run, "sim_profile"))
    if not hardware_known(run):
        return HARDWARE_NOT_KNOWN
    return None


def title_lines(run: dict, cells: Sequence[dict]) -> tuple[str, str]:
    """The two lines under "Speed test matrix": model on hardware; engine and matrix shape.
    A simulated run says so first (its hardware is what the profile was calibrated from); a
    run on hardware not known says that instead of `unknown 0GB`."""
    model = _v(run, "served_model") or _v(run, "model") or "model"
    if not hardware_known(run):
        hw = f"{model} on {measured_on(run)}"
    else:
        hw = f"{model} on {_v(run, 'hardware_gpu')}"
        per, count = _v(run, "hardware_vram_gb"), _v(run, "hardware_gpu_count")
        if per is not None:
            hw += f" {per:g}GB"
        if count:
            hw += f" ×{count}"
        if _v(run, "sim_profile"):
            hw = f"{model} on a {measured_on(run)}, modelled on {hw.split(' on ', 1)[1]}"
    parts = [
        p for p in (_v(run, "engine"), _v(run, "engine_version"), _v(run, "quantization")) if p
    ]
    decode = [c for c in cells if c.get("phase") == "decode"]
    prefill = sort_cells([c for c in cells if c.get("phase") == "prefill"])
    ctx = sorted({c["context_tokens"] for c in decode})
    labels = {c["context_tokens"]: _label(c) for c in decode}
    conc = sorted({c["concurrency"] for c in decode})
    if ctx:
        parts.append(
            f"{len(ctx)} contexts ({labels[ctx[0]]}–{labels[ctx[-1]]}) × {len(conc)} "
            f"concurrency levels ({conc[0]}–{conc[-1]})"
        )
    if prefill:
        parts.append("prefill at " + ", ".join(_label(c) for c in prefill))
    return hw, " · ".join(str(p) for p in parts)


def decode_matrix(cells: Sequence[dict]) -> tuple[list[dict], list[int], dict]:
    """-> context rows [{tokens, label}], concurrency columns, {(tokens, conc): cell}."""
    decode = [c for c in cells if c.get("phase") == "decode"]
    rows = sorted({c["context_tokens"] for c in decode})
    labels = {c["context_tokens"]: _label(c) for c in decode}
    cols = sorted({c["concurrency"] for c in decode})
    grid = {(c["context_tokens"], c["concurrency"]): c for c in decode}
    return [{"tokens": t, "label": labels[t]} for t in rows], cols, grid


def matrix_text(cell: dict | None, sep: str = " · ") -> str:
    """A decode matrix cell: ``54.9 · 87 ms TTFT``, ``Over capacity``, ``—``."""
    if cell is None:
        return F.DASH
    if cell.get("status") != "valid":
        return F.fmt_status(cell.get("status"))
    return f"{F.fmt_rate_summary(cell.get('total_tok_s'), 1)}{sep}{F.fmt_ms(cell.get('ttft_ms'), 0)} TTFT"


def prefill_entries(cells: Sequence[dict]) -> list[tuple[str, str, str]]:
    """[(``8K context``, ``6,206``, ``1,320 ms TTFT``)]"""
    out = []
    for c in sort_cells([c for c in cells if c.get("phase") == "prefill"]):
        if c.get("status") == "valid":
            out.append(
                (
                    f"{_label(c)} context",
                    F.fmt_rate_summary(c.get("total_tok_s"), 0),
                    f"{F.fmt_ms(c.get('ttft_ms'), 0)} TTFT",
                )
            )
        else:
            out.append((f"{_label(c)} context", F.fmt_status(c.get("status")), F.DASH))
    return out


def _pct(new: Any, old: Any) -> str:
    if _absent(new) or _absent(old) or not old:
        return F.DASH
    change = (float(new) - float(old)) / float(old) * 100
    return f"{change:+.1f}%"


FIGURE_MARKS = {"regression": "▼", "improvement": "▲", "unverified": "?"}
"""A judged figure's mark in the change table: beyond noise either way, or moved beyond the
threshold with no noise to judge it by."""
# The change table's figures: (key, the comparison's metric by phase, the cell column).
TABLE_FIGURES: tuple[tuple[str, Mapping[str, str], str], ...] = (
    ("total", {"decode": "total_tok_s", "prefill": "prefill_tok_s"}, "total_tok_s"),
    ("per_request", {"decode": "per_request_tok_s"}, "per_request_tok_s"),
    ("ttft", {"decode": "ttft_ms"}, "ttft_ms"),
    ("tbt", {"decode": "tbt_ms"}, "tbt_ms"),
)
JUDGED_NOTE = (
    "Beside each change, the interval its verdict was judged with: the change ± its noise "
    "band (▼ a regression, ▲ an improvement beyond noise, ? unverified: beyond the threshold "
    "with no noise estimate to judge it by; unknown: no noise known for the figure; — not "
    "judged)."
)
NOT_JUDGED_NOTE = (
    "These changes are plain ratios, not judged against noise (no noise-aware comparison was "
    "made for this page)."
)


def _judged_index(
    judged: Sequence[Mapping[str, Any]],
) -> dict[tuple[Any, ...], Mapping[str, Any]]:
    """(cell key, metric) -> the comparison's row, cells paired by label as it pairs them."""
    out: dict[tuple[Any, ...], Mapping[str, Any]] = {}
    for r in judged:
        if r.get("phase") not in ("decode", "prefill"):  # the run-level KV capacity row
            continue
        key = cell_key(
            {k: r.get(k) for k in ("phase", "context_label", "context_tokens", "concurrency")}
        )
        out[(*key, r.get("metric"))] = r
    return out


def _figure(
    c: dict, b: dict, column: str, row: Mapping[str, Any] | None, judged: bool
) -> tuple[str, str]:
    """(change text, interval text) of one figure: the comparison's numbers and mark when it
    judged the figure, else the cells' plain ratio ("—" for its interval when a comparison was
    made but did not judge this figure, "" when none was made)."""
    from speedmatrix.analysis.display import interval_text
    from speedmatrix.analysis.verdict import number

    change = number(row.get("change_pct")) if row is not None else None
    if row is None or change is None:
        plain = _pct(c.get(column), b.get(column))
        return plain, (F.DASH if judged and plain != F.DASH else "")
    mark = FIGURE_MARKS.get(str(row.get("verdict")), "")
    return f"{mark} {change:+.1f}%".strip(), interval_text(row)


def comparison_rows(
    cells: Sequence[dict],
    baseline_cells: Sequence[dict],
    judged: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict]:
    """Cells of both runs matched by `records.cell_key` (phase, context label, concurrency),
    as analysis.compare pairs them, with changes. `judged`: the noise-aware comparison's rows
    (analysis.verdict.compare_runs): each figure then shows the comparison's change, its mark
    and the interval it was judged with (the summary's numbers, against each cell's own
    baseline); None: plain ratios against `baseline_cells`."""
    base = {cell_key(c): c for c in baseline_cells}
    index = _judged_index(judged) if judged is not None else {}
    rows = []
    for c in sort_cells(cells):
        b = base.get(cell_key(c))
        if b is None:
            continue
        key = cell_key(c)
        phase = str(c.get("phase"))
        figures: dict[str, str] = {}
        for name, metrics, column in TABLE_FIGURES:
            row = index.get((*key, metrics.get(phase)))
            text, interval = _figure(c, b, column, row, judged is not None)
            figures[f"{name}_change"], figures[f"{name}_interval"] = text, interval
        total_row = index.get((*key, TABLE_FIGURES[0][1].get(phase)))
        base_total = (total_row or {}).get("baseline_value", b.get("total_tok_s"))
        skipped = index.get((*key, "status"))
        status = F.fmt_status(c.get("status")) + (
            f" (was {F.fmt_status(b.get('status'))})" if b.get("status") != c.get("status") else ""
        )
        if skipped is not None and skipped.get("verdict") == "not_comparable":
            status += f" ({skipped.get('reason')})"
        rows.append(
            {
                "cell": c,
                "base": b,
                "phase": F.PHASE_LABELS.get(c.get("phase"), str(c.get("phase"))),
                "context": _label(c),
                "concurrency": c.get("concurrency"),
                "status": status,
                "total": F.fmt_rate(c.get("total_tok_s")),
                "total_base": F.fmt_rate(base_total),
                **figures,
                "total_change_value": (
                    None
                    if _absent(c.get("total_tok_s")) or _absent(base_total) or not base_total
                    else (c["total_tok_s"] - base_total) / base_total
                ),
            }
        )
    return rows


def _with_interval(change: str, interval: str) -> str:
    return f"{change} {interval}" if interval else change


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", F.table_rule(len(header))]
    out += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return out


def render_markdown(
    run: dict,
    cells: list[dict],
    baseline: Baseline | None = None,
    *,
    comparison: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The published page as Markdown (see the module docstring). `comparison`: the
    noise-aware comparison's rows with the baseline (analysis.verdict.compare_runs): the
    change table then shows each judged figure's mark and interval."""
    cells = sort_cells(cells)
    hw, shape = title_lines(run, cells)
    out: list[str] = ["# Speed test matrix", "", f"**{hw}**", "", shape, ""]
    for section, fields in header_fields(run).items():
        out += [f"## {section}", ""]
        out += [f"- {label}: {text}" for label, text in fields]
        out.append("")
    command = _v(run, "launch_command")
    if command:
        out += ["## Launch command", "", "```", str(command), "```", ""]
    prefill = prefill_entries(cells)
    if prefill:
        out += ["## Prefill", "", PREFILL_NOTE, ""]
        out += _md_table(["Context", "Prompt tok/s", "TTFT"], prefill)
        out.append("")
    rows, cols, grid = decode_matrix(cells)
    if rows:
        out += ["## Sustained decode", "", MATRIX_NOTE, ""]
        out += _md_table(
            ["Context", *(str(c) for c in cols)],
            [[r["label"], *(matrix_text(grid.get((r["tokens"], c))) for c in cols)] for r in rows],
        )
        out += ["", OVER_CAPACITY_NOTE, "", TTFT_NOTE, ""]
    out += burst.markdown_section(cells)
    out += ["## All measurements", "", TABLE_NOTE, "", F.table_header(), F.table_rule()]
    out += [F.table_row(c) for c in cells]
    out += ["", OVER_CAPACITY_NOTE, ""]
    if baseline is not None:
        base_run, base_cells = baseline
        out += [f"## Change against baseline {base_run.get('run_id')}", ""]
        out.append(
            f"Baseline: {base_run.get('run_id')} ({_v(base_run, 'engine') or ''} "
            f"{_v(base_run, 'engine_version') or ''}"
            + (f", {_v(base_run, 'started_at')}" if _v(base_run, "started_at") else "")
            + "). Changes are relative to the baseline; for TTFT and time between tokens "
            "lower is better."
        )
        out.append("")
        comp = comparison_rows(cells, base_cells, comparison)
        judged = comparison is not None
        out += [JUDGED_NOTE if judged else NOT_JUDGED_NOTE, ""]
        out += _md_table(
            [
                "Phase",
                "Context",
                "Requests at once",
                "Status",
                "Total tok/s",
                "Baseline tok/s",
                "Change",
                *(["Interval"] if judged else []),
                "Per request",
                "TTFT",
                "Time between tokens",
            ],
            [
                [
                    r["phase"],
                    r["context"],
                    r["concurrency"],
                    r["status"],
                    r["total"],
                    r["total_base"],
                    r["total_change"],
                    *([r["total_interval"]] if judged else []),
                    *(
                        _with_interval(r[f"{f}_change"], r[f"{f}_interval"])
                        for f in ("per_request", "ttft", "tbt")
                    ),
                ]
                for r in comp
            ],
        )
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# HTML


def _change_colour(change: float | None) -> str:
    """A total tok/s change (a fraction, higher is better) in the diverging change scale."""
    return palette.change_colour(None if change is None else change * 100)


TAIL_NOTE = (
    "Tail latencies: TTFT and time between tokens at the 90th and 99th percentile over the "
    "cell's requests (the matrix shows the p99 TTFT under the median). Time to 2nd token: "
    "the median over requests of their second token's arrival minus their first, the first "
    "decode step apart from the prefill (as the published tool reports it)."
)
# The HTML "All measurements" table adds these after the published columns (the Markdown
# keeps the published format, which has none of them): the time to the second token beside
# the TTFT tails, the tails, and why a cell is not valid.
EXTRA_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("Time to 2nd token", "ttst_ms", 1),
    ("TTFT p90", "ttft_p90_ms", 0),
    ("TTFT p99", "ttft_p99_ms", 0),
    ("Time between tokens p90", "tbt_p90_ms", 1),
    ("Time between tokens p99", "tbt_p99_ms", 1),
)


def window_text(cell: dict) -> str:
    """How an adaptive run's cell window ended, with its interval against its target
    (loadgen/adaptive.py), for the measurements table's note; short, the table is wide."""
    stop = cell.get("window_stop")
    half, target = cell.get("window_halfwidth_pct"), cell.get("adaptive_target_pct")
    interval = (
        f"±{half:.2f}% vs ±{target:.2f}%"
        if isinstance(half, float | int) and isinstance(target, float | int)
        else ""
    )
    if stop == "converged":
        return f"early: {interval}"
    if stop == "cap_not_steady":
        return "to cap: not steady"
    if stop == "cap_not_converged":
        return f"to cap: {interval}"
    return "fixed" if stop == "cap" else ""


def adaptive_run(cells: Sequence[dict]) -> bool:
    return any(c.get("window_mode") == "adaptive" for c in cells)


def extra_cells(cell: dict, window: bool = False) -> list[str]:
    """The HTML table's tail-latency texts of a cell, and its note: the reason (`error`) and,
    in an adaptive run, how its window ended (in the note, not a column of its own: the table
    must stay readable at 1280 px)."""
    out = [F.fmt_ms(cell.get(key), digits) for _, key, digits in EXTRA_COLUMNS]
    error = cell.get("error")
    notes = [error] if isinstance(error, str) and error else []
    if window and (text := window_text(cell)):
        notes.append(f"window {text}")
    out.append("; ".join(notes))
    return out


def run_charts(cells: list[dict], baseline: Sequence[dict] | None = None) -> list[dict]:
    """The run's charts ({id, title, svg}) as its page shows them."""
    from speedmatrix.report.charts import render_all

    return render_all(sort_cells(cells), baseline)


def run_charts_key(cells: list[dict], baseline: Sequence[dict] | None = None) -> str:
    """run_charts' inputs and drawing code as one digest, the cells in the page's order
    (report.charts.charts_fingerprint)."""
    from speedmatrix.report.charts import charts_fingerprint

    return charts_fingerprint(sort_cells(cells), baseline)


def render_html(
    run: dict,
    cells: list[dict],
    baseline: Baseline | None = None,
    *,
    verdicts: Sequence[Mapping[str, str]] = (),
    figures: Sequence[Mapping[str, str]] = (),
    comparison: Sequence[Mapping[str, Any]] | None = None,
    links: Sequence[tuple[str, str]] = (),
    charts: Sequence[Mapping[str, str]] | None = None,
    prices: Any = None,
) -> str:
    """The run page as one self-contained HTML file (see the module docstring).

    Verdict first: the page opens with the summary (report.summary: baseline, regressions
    and improvements beyond noise with their intervals, invalid and failed cells and why),
    then the matrix, then the details. `comparison` are the noise-aware comparison rows
    (analysis.verdict.compare_runs; None: not compared), `verdicts` (compare.display_rows)
    and `figures` ({id, title, svg}: the diff heat map and trends over commits) come from the
    same comparison; the page only lays them out, so that rendering never needs the
    warehouse (report.page.render_run_page gathers them). `links`: (text, href) shown above
    the title (a site's way back to its index). `charts`: the run's charts already drawn
    (run_charts, for these cells and this baseline); None: drawn here. `prices`: the
    deployment's GPU prices (analysis.cost.Prices); with a price for the run's hardware the
    page has a cost matrix, without one none (never a made-up price)."""
    import jinja2

    from speedmatrix.report.summary import build_summary

    cells = sort_cells(cells)
    hw, shape = title_lines(run, cells)
    rows, cols, grid = decode_matrix(cells)
    changes = cell_changes(
        cells,
        baseline[1] if baseline is not None else None,
        list(comparison) if comparison is not None and baseline is not None else None,
    )

    matrix = throughput_matrix(rows, cols, grid, changes)
    acceptance = acceptance_matrix(rows, cols, grid)
    cost = cost_matrix(run, rows, cols, grid, prices)
    prefill = prefill_row(cells, changes)
    comp = None
    if baseline is not None:
        comp = {
            "run": baseline[0],
            "rows": [
                dict(
                    r,
                    colour=(col := _change_colour(r["total_change_value"])),
                    fg=palette.text_colour(col),
                )
                for r in comparison_rows(cells, baseline[1], comparison)
            ],
            "judged": comparison is not None,
            "note": JUDGED_NOTE if comparison is not None else NOT_JUDGED_NOTE,
        }
    summary = build_summary(
        run,
        cells,
        baseline[0] if baseline is not None else None,
        list(comparison) if comparison is not None else None,
    )
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("speedmatrix.report", "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
    )
    env.filters["engine"] = engine_text  # a run's engine as every commit is shown (commits)
    template = env.get_template("report.html.j2")
    return template.render(
        title="Speed test matrix",
        hw=hw,
        shape=shape,
        run=run,
        links=list(links),
        summary=summary,
        change_legend=palette.CHANGE_LEGEND,
        throughput_legend=palette.THROUGHPUT_LEGEND,
        palette=palette,
        header=header_fields(run, html=True),
        launch_command=_v(run, "launch_command"),
        prefill=prefill,
        prefill_note=PREFILL_NOTE,
        matrix=matrix,
        cols=cols,
        matrix_note=MATRIX_NOTE,
        has_changes=bool(changes),
        acceptance=acceptance,
        cost=cost,
        acceptance_note=ACCEPTANCE_NOTE,
        over_note=OVER_CAPACITY_NOTE,
        ttft_note=TTFT_NOTE,
        tail_note=TAIL_NOTE,
        burst_title=burst.TITLE,
        burst_note=burst.NOTE,
        burst_header=burst.HEADER,
        burst_rows=burst.burst_rows(cells),
        table_note=TABLE_NOTE,
        table_header=[h for h, _ in F.TABLE_COLUMNS]
        + [h for h, _, _ in EXTRA_COLUMNS]
        + (["Reason, window"] if (adaptive := adaptive_run(cells)) else ["Reason"]),
        table_rows=[F.table_cells(c) + extra_cells(c, adaptive) for c in cells],
        table_status=[c.get("status") for c in cells],
        charts=run_charts(cells, baseline[1] if baseline else None) if charts is None else charts,
        comparison=comp,
        verdicts=list(verdicts),
        verdict_header=list(verdicts[0]) if verdicts else [],
        figures=list(figures),
        escape=html.escape,
    )
