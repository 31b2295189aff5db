"""The data dictionary: what each column of each warehouse table means, its unit and values.

One job: saying what a column is, from the one place columns are defined (the field docs of
records.py, carried into the schemas of store/schemas.py; units by records.unit_of; enumerated
values by records.allowed_values). The extra tables' columns (comparisons, noise), whose
schemas carry no docs, are described here. Read by the query layer (DuckDB column comments:
``SELECT column_name, comment FROM duckdb_columns()``), by the docs page
docs/data-dictionary.md (generated: ``python -m speedmatrix.store.dictionary``) and by the
site's data dictionary page.
"""

from __future__ import annotations

from dataclasses import dataclass

from speedmatrix import records
from speedmatrix.store.schemas import view_schema, view_tables

_EXTRA_DOCS: dict[str, str] = {
    "run_id": "the run this row belongs to",
    "baseline_run_id": "the run it is compared against",
    "recipe_id": "partition key: the run's recipe",
    "host": "the host the run measured on",
    "engine_commit": "the engine's commit the run measured",
    "baseline_engine_commit": "the baseline run's engine commit",
    "phase": "prefill, decode, or run (a run-level row)",
    "context_tokens": "the cell's context (prompt tokens)",
    "context_label": "8K, 251K… (tokens / 1024)",
    "concurrency": "requests kept in flight",
    "metric": "the figure compared: a cells column (total_tok_s, ttft_ms…)",
    "higher_is_better": "true when a larger value is better (tok/s), false for latencies",
    "status": "the cell's status in this run",
    "baseline_status": "the cell's status in the baseline run",
    "value": "the figure in this run (the metric's unit)",
    "baseline_value": "the figure in the baseline run (the metric's unit)",
    "change_abs": "value - baseline_value (the metric's unit)",
    "change_pct": "the change relative to the baseline (3.0 = 3%)",
    "threshold_pct": "the smallest change that counts (3.0 = 3%)",
    "noise_pct": "the combined noise of both figures (3.0 = 3%)",
    "ci_low": "low end of the figure's within-window confidence interval",
    "ci_high": "high end of the figure's within-window confidence interval",
    "baseline_ci_low": "low end of the baseline figure's confidence interval",
    "baseline_ci_high": "high end of the baseline figure's confidence interval",
    "ci_rel_halfwidth": "the interval's half-width relative to the value (0.02 = 2%)",
    "ci_samples": "samples the interval was bootstrapped from",
    "confidence": "the interval's confidence level (0.95)",
    "between_rel_sd": "relative spread of the figure between runs (0.02 = 2%)",
    "noise_source": "what the noise was made of: within, between-cell / between-pooled, "
    "resolution (joined by +), exact, or none",
    "between_source": "where the between-run spread came from",
    "verdict": "the figure's verdict against the baseline (regression, improvement, noise…)",
    "reason": "why, where the verdict needs saying",
    "compared_at": "when the comparison was made (UTC)",
}

_EXTRA_VALUES: dict[str, dict[str, tuple[str, ...]]] = {
    "noise": {"between_source": ("cell", "pooled", "none"), "phase": records.PHASES},
    "comparisons": {"status": records.STATUSES, "baseline_status": records.STATUSES},
    "cell_repeats": records.ALLOWED_VALUES["cells"],
}


@dataclass(frozen=True)
class Column:
    table: str
    name: str
    type: str
    nullable: bool
    doc: str
    unit: str | None
    values: tuple[str, ...]

    @property
    def comment(self) -> str:
        """One line, as DuckDB's column comment: the description, [unit], values."""
        text = self.doc
        if self.unit:
            text += f" [{self.unit}]"
        if self.values:
            text += f" (values: {', '.join(self.values)})"
        return text


def columns(table: str) -> list[Column]:
    """Every column of ``table``'s view, described."""
    values = {**records.allowed_values(table), **_EXTRA_VALUES.get(table, {})}
    out = []
    for f in view_schema(table):
        meta = {k.decode(): v.decode() for k, v in (f.metadata or {}).items()}
        out.append(
            Column(
                table,
                f.name,
                str(f.type),
                f.nullable,
                meta.get("doc") or _EXTRA_DOCS.get(f.name, ""),
                meta.get("unit") or records.unit_of(f.name),
                tuple(values.get(f.name, ())),
            )
        )
    return out


def dictionary() -> dict[str, list[Column]]:
    """Every table's columns, in the order the query layer defines its views."""
    return {table: columns(table) for table in view_tables()}


def markdown() -> str:
    """docs/data-dictionary.md, whole."""
    lines = [
        "# Data dictionary",
        "",
        "Generated from the code (`python -m speedmatrix.store.dictionary > "
        "docs/data-dictionary.md`;",
        "a test fails when it is out of date). The same descriptions are DuckDB's column",
        "comments in `speedmatrix query` (`SELECT table_name, column_name, comment FROM",
        "duckdb_columns()`), the `doc` / `unit` field metadata of the tables' Parquet and Delta",
        "schemas (what `DeltaTable(...).schema()` shows to pandas and Polars users), and the",
        "site's `data-dictionary.html`. Units: `[ms]`, `[s]`, `[tok/s]`, `[tokens]`, `[%]`.",
    ]
    for table, cols in dictionary().items():
        lines += ["", f"## {table}", "", "| column | type | null | unit | description |"]
        lines.append("|---|---|---|---|---|")
        for c in cols:
            doc = c.doc.replace("|", "\\|")
            if c.values:
                doc = (
                    (doc.rstrip(".") + ". " if doc else "")
                    + "Values: "
                    + ", ".join(f"`{v}`" for v in c.values)
                    + "."
                )
            null = "yes" if c.nullable else "no"
            lines.append(f"| `{c.name}` | {c.type} | {null} | {c.unit or ''} | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
