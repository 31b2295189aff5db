"""The one Jinja environment of the report's templates (report/templates): autoescaped, strict
about undefined names, so a page never shows a blank where a value was misspelt."""

from __future__ import annotations

from typing import Any


def environment() -> Any:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("speedmatrix.report", "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
    )
