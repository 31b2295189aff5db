"""The one Jinja environment of the report's templates (report/templates): autoescaped, strict
about undefined names, so a page never shows a blank where a value was misspelt, and every
text value passed through the redaction rule (speedmatrix.redact), so a page never shows a
credential (a URL's password, a presigned URL's signature, a token in an error)."""

from __future__ import annotations

from typing import Any

from speedmatrix.commits import engine_text
from speedmatrix.redact import redact


def _shown(value: Any) -> Any:
    """A value as a page prints it: text redacted; markup built by our code (already escaped:
    a chart, a table) as it is, numbers as they are."""
    import markupsafe

    if isinstance(value, str) and not isinstance(value, markupsafe.Markup):
        return redact(value)
    return value


SHORT_ID = 32
"""Characters of a run id a table shows whole; a longer one is shortened (:func:`short_id`)."""


def short_id(run_id: Any) -> str:
    """A run id short enough for a table column at 1280 px: the DAG's ids
    (`<recipe>__<ref>__<trigger>__<UTC stamp>__<tag>`, ~80 characters, the recipe already in
    its own column) as `<ref> <trigger> <stamp to the minute> <tag's first 4>`; any other long
    id as its start and end. The whole id goes beside it (a title, the link)."""
    text = str(run_id)
    if len(text) <= SHORT_ID:
        return text
    parts = text.split("__")
    if len(parts) == 5:
        _recipe, ref, trigger, stamp, tag = parts
        return f"{ref[:12]} {trigger} {stamp[:13]} {tag[:4]}"
    return text[:14] + "…" + text[-(SHORT_ID - 15) :]


def environment() -> Any:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("speedmatrix.report", "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        finalize=_shown,
    )
    env.filters["short_id"] = short_id
    env.filters["engine"] = engine_text  # a run's engine as every commit is shown (commits)
    return env
