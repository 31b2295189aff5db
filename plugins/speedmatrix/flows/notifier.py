"""The Airflow side of run alerts: a notifier for speed_matrix's ``on_failure_callback``.

Airflow's convention (BaseNotifier; the providers' notifiers are the same): an instance in a
DAG's callback list is called with the context when the DAG run ends. speed_matrix fails when
a cell failed (``conclude``) or a regression was found (``regressions``); both end the DAG
run failed, so the failure callback covers both. A run that succeeded calls it too
(``on="success"``): a new change point over the recipe's history fails no run, and
is alerted; a clean run sends nothing (notify.deliver sends only an alarming summary).

The message is built by speedmatrix.flows.notify from the warehouse; the mail goes through the SMTP
provider's SmtpNotifier (its connection holds the server and credentials). Whatever fails
here is logged and swallowed: the run's own result (and its other callbacks) stand.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import BaseNotifier

from speedmatrix.flows import notify

log = logging.getLogger("speedmatrix.notifier")


def _smtp_send(s: notify.RunSummary, settings: notify.NotifySettings) -> None:
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    # notify() directly, not __call__: our texts are not Jinja templates (a run id or an error
    # with "{{" in it must not be rendered)
    # every header value one line (notify.header_value), the deployment's as well as the run's
    SmtpNotifier(
        to=[notify.header_value(a) for a in settings.email_to],
        from_email=notify.header_value(settings.email_from) if settings.email_from else None,
        subject=notify.subject(s),
        html_content=notify.message_html(s),
        smtp_conn_id=settings.smtp_conn_id,
    ).notify({})


def _webhook_url(settings: notify.NotifySettings) -> str | None:
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(settings.webhook_conn_id)
    for value in (conn.password, conn.host):
        if value and value.startswith(("http://", "https://")):
            return value
    return None


def summary_from_context(
    context: Any, settings: notify.NotifySettings, *, failed: bool = True
) -> notify.RunSummary:
    """Which run the DAG run measured (resolved again from its conf: resolve touches no host,
    and a DAG callback cannot rely on XCom), and what it found (`failed`: the DAG run failed,
    so the summary says why)."""
    # flows.matrix loads the engine, GX and the warehouse: only a DAG callback that fires pays
    # for it, not every DAG file that builds a notifier at parse time
    from speedmatrix.flows import matrix, resolution

    dag_run = context.get("dag_run")
    ti = context.get("ti")
    reason = str(context.get("reason") or "failed") if failed else None
    dag_run_id = getattr(dag_run, "run_id", None) or context.get("run_id")
    failed_task = getattr(ti, "task_id", None)
    params = dict(context.get("params") or {})
    params.update(getattr(dag_run, "conf", None) or {})
    try:
        resolved = resolution.resolve(params, dag_run_id=dag_run_id, run_after=dag_run.run_after)
    except Exception as exc:
        return notify.RunSummary(
            run_id=None,
            recipe_id=params.get("recipe"),
            engine_ref=params.get("engine_ref"),
            reason=f"{reason or 'run'} ({type(exc).__name__}: {exc})",
            dag_run_id=dag_run_id,
            failed_task=failed_task,
        )
    wh = matrix.warehouse_of(resolved)
    try:
        return notify.summarize_run(
            wh,
            resolved["run_id"],
            base_url=settings.report_base_url,
            reason=reason,
            dag_run_id=dag_run_id,
            failed_task=failed_task,
        )
    except KeyError:  # failed before it landed
        return notify.RunSummary(
            run_id=resolved["run_id"],
            recipe_id=resolved["recipe_id"],
            engine_ref=resolved["engine_ref"],
            host=resolved["host"],
            status="failed",
            reason=f"{reason or 'run'} (nothing landed)",
            dag_run_id=dag_run_id,
            failed_task=failed_task,
        )


class RunNotifier(BaseNotifier):
    """Mail and chat alert for a failed or regressed speed_matrix run, or one that shows a new
    change point (see speedmatrix.flows.notify for the deployment settings that switch each
    channel on). `on`: the callback it sits in, "failure" or "success"."""

    def __init__(self, on: str = "failure") -> None:
        super().__init__()
        if on not in ("failure", "success"):
            raise ValueError(f"on must be 'failure' or 'success', got {on!r}")
        self.on = on

    def notify(self, context: Any) -> None:
        try:
            settings = notify.NotifySettings.from_env()
            if not (settings.mail_on or settings.webhook_on):
                return
            summary = summary_from_context(context, settings, failed=self.on == "failure")
            notify.deliver(summary, settings, send_mail=_smtp_send, webhook_url=_webhook_url)
        except Exception:
            log.exception("speedmatrix alert could not be built or sent")
