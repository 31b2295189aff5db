"""Run alerts: what a regressed or failed speed_matrix run tells people, and where it goes.

Users ask one question (*did the last commit make this model slower on this hardware?*); a
run that answers "yes", or that failed, must say so where they look: by mail and in a chat
channel. This module builds the message from the warehouse (the run row, its failed / invalid
cells, its `comparisons` verdicts) and delivers it; it does not import Airflow, so it is
tested without it. The Airflow side is one notifier (speedmatrix.flows.notifier.RunNotifier,
attached to the DAG's ``on_failure_callback``) that calls :func:`deliver`.

Deployment settings (environment of the scheduler / DAG processor; never a run's conf, since a
conf could redirect the alert or leak it):

- ``SPEEDMATRIX_NOTIFY_EMAIL_TO``: comma-separated recipients; mail is on when set. It goes
  through the SMTP provider's notifier over the Airflow connection
  ``SPEEDMATRIX_NOTIFY_SMTP_CONN_ID`` (default ``smtp_default``), sender
  ``SPEEDMATRIX_NOTIFY_EMAIL_FROM`` (else the connection's ``from_email``).
- ``SPEEDMATRIX_NOTIFY_WEBHOOK_URL``: a Slack-compatible incoming webhook (JSON ``{"text"}``);
  or ``SPEEDMATRIX_NOTIFY_WEBHOOK_CONN_ID``: an Airflow connection holding that URL in its
  password (as the Slack provider's webhook connections do) or host. The URL is a secret.
- ``SPEEDMATRIX_REPORT_BASE_URL``: where the warehouse's ``artifacts/`` directory is
  published; the message links ``<base>/<run>/report.html``. Unset: the report's path.
"""

from __future__ import annotations

import html
import logging
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from speedmatrix.records import cell_name
from speedmatrix.redact import redact
from speedmatrix.settings import Settings
from speedmatrix.settings import settings as deployment_settings
from speedmatrix.store.protocol import WarehouseReader
from speedmatrix.words import count

log = logging.getLogger("speedmatrix.notify")
# The warehouse and verdict imports sit inside the functions: they bring pandas and pyarrow,
# and speed_matrix's DAG file imports this module (through the notifier) when it is parsed.

WEBHOOK_TIMEOUT_S = 10.0
MAX_LISTED = 20
"""Cells listed per section of a message; the rest are counted (the page has them all)."""


@dataclass(frozen=True)
class NotifySettings:
    """Where alerts go, from the deployment's environment (see the module docstring)."""

    email_to: tuple[str, ...] = ()
    email_from: str | None = None
    smtp_conn_id: str = "smtp_default"
    webhook_url: str | None = None
    webhook_conn_id: str | None = None
    report_base_url: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NotifySettings:
        """The alert settings of ``env`` (None: this process's settings)."""
        s = deployment_settings() if env is None else Settings.from_env(env)
        return cls(
            email_to=s.notify_email_to,
            email_from=s.notify_email_from,
            smtp_conn_id=s.notify_smtp_conn_id,
            webhook_url=s.notify_webhook_url,
            webhook_conn_id=s.notify_webhook_conn_id,
            report_base_url=s.report_base_url,
        )

    @property
    def mail_on(self) -> bool:
        return bool(self.email_to)

    @property
    def webhook_on(self) -> bool:
        return bool(self.webhook_url or self.webhook_conn_id)


@dataclass
class RunSummary:
    """What an alert says about one run; every field may be missing for a run that failed
    before it landed (then `reason` says why)."""

    run_id: str | None
    recipe_id: str | None = None
    engine_ref: str | None = None
    engine_commit: str | None = None
    engine_version: str | None = None
    host: str | None = None
    status: str | None = None
    baseline_run_id: str | None = None
    baseline_engine_commit: str | None = None
    regressions: list[dict[str, Any]] = field(default_factory=list)
    improvements: list[dict[str, Any]] = field(default_factory=list)
    bad_cells: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    # steps of the recipe's history on this host that this run newly makes detectable
    # (analysis.trend.new_change_points): a slowdown spread over commits, or one a regressed
    # baseline hid, that no one run's verdict reported
    change_points: list[dict[str, Any]] = field(default_factory=list)
    report: str | None = None
    reason: str | None = None
    dag_run_id: str | None = None
    failed_task: str | None = None

    @property
    def alarming(self) -> bool:
        """Worth a message: a regression, a new change point, a failed run, or a DAG run
        that failed."""
        return bool(
            self.regressions or self.change_points or self.status == "failed" or self.reason
        )


def report_link(warehouse: WarehouseReader, run_id: str, base_url: str | None = None) -> str:
    """The run page's URL under the published ``artifacts/`` base, else its path/URI."""
    if base_url:
        from speedmatrix.store.layout import file_name

        run_dir = urllib.parse.quote(file_name(run_id)[: -len(".parquet")], safe="")
        return f"{base_url.rstrip('/')}/{run_dir}/report.html"
    return warehouse.artifact_path(run_id, "report.html")


def _baseline_commit(warehouse: WarehouseReader, row: Mapping[str, Any]) -> str | None:
    """The baseline's engine commit by its longest known name: the comparison keeps its
    engine_commit (a dev version's 9 hex, one value per commit), its run row may know more
    (the ref it was asked for: 9fedd24fa864)."""
    from speedmatrix.commits import longest_commit

    commit, run_id = row.get("baseline_engine_commit"), row.get("baseline_run_id")
    if not run_id:
        return commit
    found = warehouse.query("SELECT engine_ref FROM runs WHERE run_id = ?", [run_id])
    ref = found["engine_ref"].iloc[0] if len(found) else None
    return longest_commit({"engine_commit": commit, "engine_ref": ref}) or commit


def summarize_run(
    warehouse: WarehouseReader,
    run_id: str,
    *,
    base_url: str | None = None,
    reason: str | None = None,
    dag_run_id: str | None = None,
    failed_task: str | None = None,
) -> RunSummary:
    """The summary of a landed run (KeyError when it is not in the warehouse)."""
    from speedmatrix.store.extra import read_extra

    run, cells, _ = warehouse.read_run(run_id)
    rows = read_extra(warehouse, "comparisons", run_id=run_id).to_dict("records")
    # one row per cell: the cell-level status rows and each figure's row
    bad = [c for c in cells if c.get("status") in ("failed", "invalid")]
    first = rows[0] if rows else {}
    return RunSummary(
        run_id=run_id,
        recipe_id=run.get("recipe_id"),
        engine_ref=run.get("engine_ref"),
        engine_commit=run.get("engine_commit"),
        engine_version=run.get("engine_version"),
        host=run.get("host"),
        status=run.get("status"),
        baseline_run_id=first.get("baseline_run_id"),
        baseline_engine_commit=_baseline_commit(warehouse, first),
        regressions=[r for r in rows if r.get("verdict") == "regression"],
        improvements=[r for r in rows if r.get("verdict") == "improvement"],
        bad_cells=bad,
        rows=rows,
        change_points=_new_change_points(warehouse, run),
        report=report_link(warehouse, run_id, base_url),
        reason=reason,
        dag_run_id=dag_run_id,
        failed_task=failed_task,
    )


def _new_change_points(warehouse: WarehouseReader, run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The change points this run newly shows over its recipe's history on its host."""
    from speedmatrix.analysis.baseline import read_history
    from speedmatrix.analysis.trend import new_change_points

    recipe, host = run.get("recipe_id"), run.get("host")
    if not recipe or run.get("status") not in ("success", "partial"):
        return []
    runs, cells, comparisons, noise = read_history(warehouse, recipe, host)
    return new_change_points(
        runs,
        cells,
        recipe=recipe,
        run_id=str(run["run_id"]),
        host=host,
        comparisons=comparisons,
        noise=noise,
    )


def _cell(r: Mapping[str, Any]) -> str:
    return cell_name(
        r.get("phase"), r.get("context_label") or r.get("context_tokens"), r.get("concurrency")
    )


def _change_line(r: Mapping[str, Any]) -> str:
    from speedmatrix.analysis.verdict import STATUS_METRIC, _fmt, number

    if r.get("metric") == STATUS_METRIC:
        return f"{_cell(r)}: {r.get('reason') or r.get('status')}"
    pct = number(r.get("change_pct"))
    change = f"{pct:+.1f}%" if pct is not None else "—"
    return (
        f"{_cell(r)} {r.get('metric')}: {_fmt(r.get('baseline_value'))} -> "
        f"{_fmt(r.get('value'))} ({change})"
    )


def _listed(lines: list[str]) -> list[str]:
    out = [f"  - {ln}" for ln in lines[:MAX_LISTED]]
    if len(lines) > MAX_LISTED:
        out.append(f"  … and {len(lines) - MAX_LISTED} more (see the page)")
    return out


_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def header_value(text: str) -> str:
    """`text` fit for a mail header: every run of control characters (CR, LF, NUL, ESC… and
    Unicode's line separators) becomes one space. A conf's `recipe` holding `\r\nBcc: …`
    otherwise split the Subject, and the stdlib then refused the whole message: no alert."""
    return _CONTROL_RE.sub(" ", text)


def chat_text(text: str) -> str:
    """`text` as literal text in Slack's mrkdwn (and the compatible webhooks): `&`, `<`, `>`
    escaped, as Slack asks, so a value from a conf or a server's error body can neither ping
    (`<!channel>`) nor add a link (`<https://…|…>`). The message builds no markup of its own,
    so the whole text is escaped: the only links are the URLs it writes, auto-linked."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def subject(s: RunSummary) -> str:
    """The mail's Subject: one line, whatever the run's values hold (header_value)."""
    parts = []
    if s.status == "failed" or (s.reason and not s.regressions):
        parts.append("run failed")
    if s.regressions:
        parts.append(count(len(s.regressions), "regression"))
    if s.change_points:
        parts.append(f"{count(len(s.change_points), 'new change point')}")
    what = ", ".join(parts) or "run finished"
    return header_value(
        redact(f"[speedmatrix] {what}: {s.recipe_id or '?'} on {s.host or '?'} ({s.run_id or '?'})")
    )


def message_text(s: RunSummary) -> str:
    """The plain-text message (mail body and chat text): verdict first, then the details."""
    engine = s.engine_commit or s.engine_version or "?"
    lines = [subject(s), ""]
    lines.append(
        f"Recipe {s.recipe_id or '?'}, engine {s.engine_ref or '?'} (commit {engine}), "
        f"host {s.host or '?'}; run {s.run_id or '?'}, status {s.status or '?'}."
    )
    if s.baseline_run_id:
        lines.append(
            f"Baseline: run {s.baseline_run_id} (commit {s.baseline_engine_commit or '?'})."
        )
    if s.regressions:
        lines += [
            "",
            f"Regressions ({len(s.regressions)}):",
            *_listed([_change_line(r) for r in s.regressions]),
        ]
    if s.change_points:
        lines += [
            "",
            f"New change points over the recipe's history ({len(s.change_points)}; "
            "a step of the cell's level between two commits, found over every run):",
            *_listed(
                [f"{c['cell']}: {c['text']} (p = {c['pvalue']:.1g})" for c in s.change_points]
            ),
        ]
    if s.improvements:
        lines += [
            "",
            f"Improvements ({len(s.improvements)}):",
            *_listed([_change_line(r) for r in s.improvements]),
        ]
    if s.bad_cells:
        lines += [
            "",
            f"Failed or invalid cells ({len(s.bad_cells)}):",
            *_listed(
                [f"{_cell(c)} {c.get('status')}: {c.get('error') or '—'}" for c in s.bad_cells]
            ),
        ]
    if s.reason:
        where = f" in task {s.failed_task}" if s.failed_task else ""
        lines += ["", f"Airflow run {s.dag_run_id or '?'} failed{where}: {s.reason}"]
    if s.report:
        lines += ["", f"Report: {s.report}"]
    # a server's error body, a conf value, an exception may hold a URL with a credential
    return redact("\n".join(lines)) + "\n"


def message_html(s: RunSummary) -> str:
    """The mail's HTML body: the text, escaped, with the report as a link."""
    body = html.escape(message_text(s))
    if s.report:
        link = html.escape(s.report)
        href = s.report if "://" in s.report else f"file://{s.report}"
        body = body.replace(link, f'<a href="{html.escape(href, quote=True)}">{link}</a>')
    return f'<pre style="font-family: monospace">{body}</pre>'


def post_webhook(url: str, text: str, timeout: float = WEBHOOK_TIMEOUT_S) -> None:
    """POST ``{"text": …}`` (Slack's incoming-webhook format, which Mattermost, Rocket.Chat,
    Discord's /slack endpoint and Teams' Slack-compatible connectors accept)."""
    import requests

    resp = requests.post(url, json={"text": text}, timeout=timeout)
    resp.raise_for_status()


def deliver(
    s: RunSummary,
    settings: NotifySettings,
    *,
    send_mail: Callable[[RunSummary, NotifySettings], None] | None = None,
    webhook_url: Callable[[NotifySettings], str | None] | None = None,
) -> dict[str, str]:
    """Send the message on every channel the deployment switched on; returns each channel's
    outcome (``sent`` / ``error: …``). Never raises: an alert that cannot be sent is logged,
    and must not hide or change the run's own result. ``send_mail`` delivers the mail (the
    Airflow notifier passes the SMTP provider's); ``webhook_url`` resolves a webhook
    connection (Airflow's connections)."""
    out: dict[str, str] = {}
    if not s.alarming:
        return out
    text = message_text(s)
    if settings.mail_on:
        try:
            if send_mail is None:
                raise RuntimeError("no mail sender configured")
            send_mail(s, settings)
            out["mail"] = "sent"
        except Exception as exc:
            log.exception("speedmatrix alert: mail to %s failed", ", ".join(settings.email_to))
            out["mail"] = f"error: {exc}"
    if settings.webhook_on:
        try:
            url = settings.webhook_url
            if not url and webhook_url is not None:
                url = webhook_url(settings)
            if not url:
                raise RuntimeError(f"no webhook URL in connection {settings.webhook_conn_id!r}")
            post_webhook(url, chat_text(text))
            out["webhook"] = "sent"
        except Exception as exc:
            # the URL is a secret: never logged
            log.error("speedmatrix alert: webhook post failed: %s", type(exc).__name__)
            out["webhook"] = f"error: {type(exc).__name__}"
    for channel, result in out.items():
        log.info("speedmatrix alert for run %s: %s %s", s.run_id, channel, result)
    return out
