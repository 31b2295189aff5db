"""Run alerts without Airflow: the summary read from the warehouse, the message, the
settings, and a delivery that never raises (speedmatrix.flows.notify)."""

from __future__ import annotations

import logging

import pytest
from test_compare_warehouse import _land

from speedmatrix.analysis.compare import regressions_check
from speedmatrix.analysis.verdict import RegressionError
from speedmatrix.flows.notify import NotifySettings, deliver, message_text, summarize_run
from speedmatrix.store.warehouse import Warehouse


@pytest.fixture(scope="module")
def wh(tmp_path_factory):
    w = Warehouse(str(tmp_path_factory.mktemp("notify") / "wh"))
    _land(w, "r0", "a" * 40, 0, seed=0)
    _land(w, "r1", "a" * 40, 1, seed=1)
    _land(w, "r2", "b" * 40, 2, slow={(65536, 2): 0.9}, seed=2)
    regressions_check(w, "r1")
    with pytest.raises(RegressionError):
        regressions_check(w, "r2")
    yield w
    w.close()


def test_a_regressed_run_is_summarized_verdict_first_with_the_page(wh):
    s = summarize_run(wh, "r2", base_url="https://perf.example.test/artifacts/")
    assert s.alarming and s.baseline_run_id == "r1" and s.status == "success"
    assert {r["concurrency"] for r in s.regressions} == {2}
    text = message_text(s)
    first = text.splitlines()[0]
    assert first.startswith("[speedmatrix] ") and "regression(s)" in first and "r2" in first
    assert "Baseline: run r1 (commit " + "a" * 40 in text
    line = next(ln for ln in text.splitlines() if "64Kx2 total_tok_s" in ln)
    assert "->" in line and line.rstrip().endswith("%)") and "(-" in line
    assert "Report: https://perf.example.test/artifacts/r2/report.html" in text
    assert f"commit {'b' * 40}" in text and "host local" in text


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
