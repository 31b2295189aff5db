"""Credentials inside URLs and tokens of more kinds (issue #42 item 6): the one redaction rule
(speedmatrix.redact) hides URL userinfo, secret query parameters (presigned S3 URLs) and
GitHub / GitLab / PyPI tokens, and every place that shows a value uses it: `speedmatrix
config`, a bad setting's error, the command line's errors, logs, pages and alerts. Each test
plants canaries and looks for them where a person would see them."""

from __future__ import annotations

import logging
import time

import pytest

from speedmatrix.cli import main
from speedmatrix.redact import REDACTED, SECRET_PATTERNS, redact

C = "Kanary7Q9"  # a canary: in no output, ever
HOSTILE = {
    "https userinfo": f"https://alice:{C}pass@git.example.test/org/repo.git",
    "token as user": f"https://{C}tok@github.com/org/repo.git",
    "s3 key:secret": f"s3://AKIDEXAMPLE:{C}secret@bucket/warehouse",
    "endpoint userinfo": f"http://minio:{C}pw@127.0.0.1:9000",
    "presigned": (
        "https://bucket.s3.amazonaws.com/k.whl?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        f"&X-Amz-Credential=AKIDEXAMPLE%2F{C}cred&X-Amz-Signature={C}sig"
        f"&X-Amz-Security-Token={C}tok&X-Amz-Expires=300"
    ),
    "html-escaped query": f"https://h.test/x?a=1&amp;X-Amz-Signature={C}sig&amp;b=2",
    "github_pat": f"github_pat_11ABCDEFG0{C}abcdefghijklmnopqrstuvwxyz0123456789",
    "glpat": f"glpat-{C}xyzABCDEFGHIJ12",
    "pypi": f"pypi-AgEIcHlwaS5vcmc{C}CJDEwZjQ5YjMtZWQzNy00",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_the_rule_hides_each_kind_and_keeps_the_rest(kind):
    text = f"fetching {HOSTILE[kind]} now"
    shown = redact(text)
    assert C not in shown and REDACTED in shown, shown
    assert shown.startswith("fetching ") and shown.endswith(" now")
    # what the runs suite refuses is what redaction hides: a redacted text passes it
    import re

    assert not any(re.search(p, shown) for p in SECRET_PATTERNS), shown
    assert any(re.search(p, text) for p in SECRET_PATTERNS), text


def test_what_is_not_a_secret_is_left_alone():
    for text in (
        "https://github.com/vllm-project/vllm.git",
        "http://127.0.0.1:9000",
        "https://h.test/x?page=2&sort=desc&X-Amz-Expires=300",
        "s3://bucket/warehouse",
        "git@github.com:org/repo.git",
        "pypi-package-name is a name",
    ):
        assert redact(text) == text


def test_the_rule_stays_linear_on_hostile_input():
    for text in ("://" + "a" * 1_000_000, "?" + "&a" * 500_000, "x://" * 300_000):
        t0 = time.process_time()
        redact(text)
        assert time.process_time() - t0 < 2.0


def test_config_prints_no_credential_in_a_url(monkeypatch, capsys):
    monkeypatch.setenv("SPEEDMATRIX_WAREHOUSE", HOSTILE["s3 key:secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", HOSTILE["endpoint userinfo"])
    monkeypatch.setenv("SPEEDMATRIX_VLLM_REPO_URL", HOSTILE["https userinfo"])
    monkeypatch.setenv("SPEEDMATRIX_WHEEL_INDEX", HOSTILE["presigned"])
    monkeypatch.setenv("SPEEDMATRIX_SITE_URL", f"https://h.test/?token={HOSTILE['glpat']}")
    monkeypatch.setenv("SPEEDMATRIX_GITHUB_API_URL", f"https://{HOSTILE['github_pat']}@api.x")
    for args in (["config"], ["config", "--json"]):
        assert main(args) == 0
        out = capsys.readouterr().out
        assert C not in out, out
        assert "bucket/warehouse" in out and "git.example.test/org/repo.git" in out


def test_a_bad_settings_error_shows_no_credential(monkeypatch, capsys):
    monkeypatch.setenv("SPEEDMATRIX_LEASE_TTL_S", HOSTILE["https userinfo"])
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert "SPEEDMATRIX_LEASE_TTL_S" in err and C not in err, err


def test_a_command_line_error_shows_no_credential(tmp_path, capsys):
    missing = tmp_path / HOSTILE["glpat"]
    assert main(["report", "--warehouse", str(missing), "--run-id", "r1"]) == 2
    err = capsys.readouterr().err
    assert "no warehouse at" in err and C not in err, err


def _a_bug_quoting_a_url(args) -> int:
    raise RuntimeError(f"GET {HOSTILE['s3 key:secret']} failed")


def register(sub, name: str) -> None:
    """This module stands in as a command whose body has a bug (see the test below)."""
    sub.add_parser(name).set_defaults(func=_a_bug_quoting_a_url)


def test_a_bugs_traceback_shows_no_credential(monkeypatch, capsys):
    from speedmatrix.cli import COMMANDS

    monkeypatch.setitem(COMMANDS, "buggy", (__name__, "a command with a bug"))
    assert main(["buggy"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "_a_bug_quoting_a_url" in err
    assert "RuntimeError: GET s3://" in err and C not in err, err


def test_logs_show_no_credential(caplog):
    log = logging.getLogger("speedmatrix.some.module")
    with caplog.at_level(logging.INFO):
        log.info("cloning %s", HOSTILE["token as user"])
        log.warning("wheel check %s failed", HOSTILE["presigned"])
        try:
            raise RuntimeError(f"GET {HOSTILE['s3 key:secret']} refused")
        except RuntimeError:
            log.exception("landing failed")
    assert len(caplog.records) == 3
    assert C not in caplog.text, caplog.text
    assert "cloning https://" in caplog.text and "RuntimeError" in caplog.text


def test_pages_show_no_credential():
    from speedmatrix.report.jinja import environment

    page = environment().from_string("<p>{{ value }}</p>").render(value=HOSTILE["presigned"])
    assert C not in page and "&lt;redacted&gt;" in page, page


def test_alerts_show_no_credential():
    from speedmatrix.flows import notify

    s = notify.RunSummary(
        run_id="r1",
        recipe_id=HOSTILE["https userinfo"],
        status="failed",
        reason=f"provisioning failed: pip could not reach {HOSTILE['presigned']}",
        bad_cells=[
            {
                "phase": "decode",
                "context_tokens": 8192,
                "concurrency": 4,
                "status": "failed",
                "error": HOSTILE["pypi"],
            }
        ],
    )
    for text in (notify.subject(s), notify.message_text(s), notify.message_html(s)):
        assert C not in text, text


def test_log_redaction_never_breaks_logging():
    """Airflow's structlog formatter remakes records with logging.makeLogRecord (a blank record
    first, its name None), and a bad format string is the handler's to report: neither may
    raise where the code logs."""
    remade = logging.makeLogRecord({"name": "speedmatrix.x", "msg": "plain", "args": None})
    assert remade.getMessage() == "plain"
    make = logging.getLogRecordFactory()
    bad = make("speedmatrix.x", logging.INFO, __file__, 1, "%d items", ("x",), None)
    assert bad.msg == "%d items" and bad.args == ("x",)  # left for the handler to report
    good = make("speedmatrix.x", logging.INFO, __file__, 1, "at %s", (HOSTILE["glpat"],), None)
    assert C not in good.getMessage()
