"""Run alerts without Airflow: the summary read from the warehouse, the message, the
settings, and a delivery that never raises (speedmatrix.flows.notify)."""

from __future__ import annotations

import logging

import pytest
from test_compare_warehouse import _land

from speedmatrix.analysis.compare import judge_regressions
from speedmatrix.analysis.verdict import RegressionError
from speedmatrix.flows.notify import (
    NotifySettings,
    RunSummary,
    deliver,
    message_text,
    summarize_run,
)
from speedmatrix.store.warehouse import Warehouse


@pytest.fixture(scope="module")
def wh(tmp_path_factory):
    w = Warehouse(str(tmp_path_factory.mktemp("notify") / "wh"))
    _land(w, "r0", "a" * 40, 0, seed=0)
    _land(w, "r1", "a" * 40, 1, seed=1)
    _land(w, "r2", "b" * 40, 2, slow={(65536, 2): 0.9}, seed=2)
    judge_regressions(w, "r1")
    with pytest.raises(RegressionError):
        judge_regressions(w, "r2")
    yield w
    w.close()


def test_a_regressed_run_is_summarized_verdict_first_with_the_page(wh):
    s = summarize_run(wh, "r2", base_url="https://perf.example.test/artifacts/")
    assert s.alarming and s.baseline_run_id == "r1" and s.status == "success"
    assert {r["concurrency"] for r in s.regressions} == {2}
    text = message_text(s)
    first = text.splitlines()[0]
    assert first.startswith("[speedmatrix] ") and "3 regressions" in first and "r2" in first
    assert "Baseline: run r1 (commit " + "a" * 40 in text
    line = next(ln for ln in text.splitlines() if "64Kx2 total_tok_s" in ln)
    assert "->" in line and line.rstrip().endswith("%)") and "(-" in line
    assert "Report: https://perf.example.test/artifacts/r2/report.html" in text
    assert f"commit {'b' * 40}" in text and "host local" in text


def test_the_baselines_commit_is_shown_as_long_as_its_run_knows_it(tmp_path):
    """The demo's verdict line read "(engine commit 9fedd24fa…)" where the baseline run was
    asked for 9fedd24fa864 and its run id and page show 12 hex: a dev version's 9-hex hash is
    what engine_commit keeps (one value per commit), but the run's ref says more."""
    from speedmatrix.cli.verdict import verdict_text

    w = Warehouse(str(tmp_path / "wh"))
    for i in range(2):
        _land(w, f"p{i}", "9fedd24fa", i, seed=i, engine_ref="9fedd24fa864")
    judge_regressions(w, "p1")
    s = summarize_run(w, "p1")
    assert s.baseline_run_id == "p0" and s.baseline_engine_commit == "9fedd24fa864"
    assert "(engine commit 9fedd24fa864)" in verdict_text(s)
    w.close()


def test_a_clean_run_sends_nothing(wh):
    s = summarize_run(wh, "r1")
    assert not s.alarming
    sent = []
    settings = NotifySettings(email_to=("a@example.test",), webhook_url="http://127.0.0.1:9/x")
    assert deliver(s, settings, send_mail=lambda *a: sent.append(a)) == {}
    assert sent == []
    assert s.report == wh.artifact_path("r1", "report.html")  # no base URL: the path


def test_settings_come_from_the_environment_only():
    env = {
        "SPEEDMATRIX_NOTIFY_EMAIL_TO": " a@x.test, b@x.test ,",
        "SPEEDMATRIX_NOTIFY_WEBHOOK_CONN_ID": "hook",
    }
    s = NotifySettings.from_env(env)
    assert s.email_to == ("a@x.test", "b@x.test") and s.smtp_conn_id == "smtp_default"
    assert s.mail_on and s.webhook_on and s.webhook_url is None
    off = NotifySettings.from_env({})
    assert not off.mail_on and not off.webhook_on


def test_a_failing_channel_is_logged_and_never_raises(wh, caplog):
    """Neither a broken mail server nor an unreachable webhook hides the run's result, and
    one broken channel does not stop the other; the webhook URL (a secret) is not logged."""
    s = summarize_run(wh, "r2")

    def broken_mail(*_):
        raise ConnectionRefusedError("smtp down")

    secret = "http://127.0.0.1:9/services/T0/B0/very-secret"
    settings = NotifySettings(email_to=("a@example.test",), webhook_url=secret)
    with caplog.at_level(logging.INFO, logger="speedmatrix.notify"):
        out = deliver(s, settings, send_mail=broken_mail)
    assert out["mail"].startswith("error: smtp down")
    assert out["webhook"].startswith("error: ")
    assert "very-secret" not in caplog.text
    assert "mail to a@example.test failed" in caplog.text


HOSTILE = "kimi\r\nBcc: evil@example.test\r\n\r\n<!channel> <https://evil.example|Open report> & \x1b[2J\x00"


def _hostile_summary() -> RunSummary:
    """Every value an alert carries, from a conf, a host or a server's error body, hostile."""
    return RunSummary(
        run_id=f"run-{HOSTILE}",
        recipe_id=HOSTILE,
        engine_ref=HOSTILE,
        host=HOSTILE,
        status="failed",
        bad_cells=[
            {
                "phase": "decode",
                "context_label": "8K",
                "concurrency": 1,
                "status": "failed",
                "error": f"HTTP 500: {HOSTILE}",
            }
        ],
        reason=HOSTILE,
        failed_task=HOSTILE,
        dag_run_id=HOSTILE,
    )


def test_a_hostile_value_never_splits_the_mail_headers_and_the_mail_is_delivered(monkeypatch):
    """Issue #33 item 6: a conf `recipe` with `\\r\\nBcc: …` broke the Subject (and the
    stdlib then refused the message: no alert). Through the real SMTP provider into a real
    SMTP server on loopback: one mail, to the deployment's recipient only, one Subject line."""
    import email
    import email.policy
    import json
    import socket

    from aiosmtpd.controller import Controller

    from speedmatrix.flows import notifier

    got = []

    class Inbox:
        async def handle_DATA(self, server, session, envelope):
            got.append((envelope.rcpt_tos, envelope.content))
            return "250 OK"

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    smtp = Controller(Inbox(), hostname="127.0.0.1", port=port)
    smtp.start()
    try:
        conn = {
            "conn_type": "smtp",
            "host": "127.0.0.1",
            "port": port,
            "extra": {"from_email": "sm@example.test", "disable_tls": True, "disable_ssl": True},
        }
        monkeypatch.setenv("AIRFLOW_CONN_SMTP_I33", json.dumps(conn))
        settings = NotifySettings(email_to=("team@example.test",), smtp_conn_id="smtp_i33")
        out = deliver(_hostile_summary(), settings, send_mail=notifier._smtp_send)
    finally:
        smtp.stop()
    assert out == {"mail": "sent"}
    assert len(got) == 1
    rcpt, raw = got[0]
    assert rcpt == ["team@example.test"]
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert msg["Bcc"] is None
    subject = str(msg["Subject"])
    assert "kimi" in subject and "Bcc: evil@example.test" in subject  # kept, on one line
    assert not any(ch in subject for ch in "\r\n\x00\x1b")


def test_webhook_text_escapes_every_value_and_builds_the_only_links(monkeypatch):
    """Issue #33 item 7: `<!channel>`, `<https://…|…>` and `&` from a conf or a server's
    error body reach the chat as text: escaped as Slack's mrkdwn asks (&amp; &lt; &gt;)."""
    from speedmatrix.flows import notify

    posted = []
    monkeypatch.setattr(notify, "post_webhook", lambda url, text: posted.append(text))
    s = _hostile_summary()
    s.report = "https://perf.example.test/a?x=1&y=2"
    out = deliver(s, NotifySettings(webhook_url="http://127.0.0.1:9/hook"))
    assert out == {"webhook": "sent"} and len(posted) == 1
    text = posted[0]
    assert "<" not in text.replace("<redacted>", "") and ">" not in text
    assert "&lt;!channel&gt;" in text and "&lt;https://evil.example|Open report&gt;" in text
    assert "&amp; " in text and "&amp;&amp;" not in text
    assert "https://perf.example.test/a?x=1&amp;y=2" in text
