"""The one Jinja environment of the report's templates (report/templates): autoescaped, strict
about undefined names, so a page never shows a blank where a value was misspelt, and every
text value passed through the redaction rule (speedmatrix.redact), so a page never shows a
credential (a URL's password, a presigned URL's signature, a token in an error)."""

from __future__ import annotations

from typing import Any

from speedmatrix.redact import redact


def _shown(value: Any) -> Any:
    """A value as a page prints it: text redacted; markup built by our code (already escaped:
    a chart, a table) as it is, numbers as they are."""
    import markupsafe

    if isinstance(value, str) and not isinstance(value, markupsafe.Markup):
        return redact(value)
    return value


def environment() -> Any:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("speedmatrix.report", "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        finalize=_shown,
    )
