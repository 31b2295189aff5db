"""Real alert receivers on loopback for the notification tests: an SMTP server (aiosmtpd) and
a chat-webhook catcher (http.server), and the deployment environment that points a run at
them (as an operator would: an Airflow connection for SMTP in AIRFLOW_CONN_*, the webhook URL
in the environment; never the run's conf)."""

from __future__ import annotations

import email
import email.policy
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from aiosmtpd.controller import Controller

MAIL_TO = "perf-team@example.test"
MAIL_FROM = "speedmatrix@example.test"


class _Inbox:
    def __init__(self) -> None:
        self.messages: list[email.message.EmailMessage] = []
        self.envelopes: list[tuple[str, list[str]]] = []

    async def handle_DATA(self, server, session, envelope):  # aiosmtpd's handler hook
        self.envelopes.append((envelope.mail_from, list(envelope.rcpt_tos)))
        self.messages.append(
            email.message_from_bytes(envelope.content, policy=email.policy.default)
        )
        return "250 OK"


@dataclass
class Catchers:
    smtp_port: int
    webhook_url: str
    inbox: _Inbox
    posts: list[dict] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        conn = {
            "conn_type": "smtp",
            "host": "127.0.0.1",
            "port": self.smtp_port,
            "extra": {"from_email": MAIL_FROM, "disable_tls": True, "disable_ssl": True},
        }
        return {
            "AIRFLOW_CONN_SMTP_SPEEDMATRIX_TEST": json.dumps(conn),
            "SPEEDMATRIX_NOTIFY_SMTP_CONN_ID": "smtp_speedmatrix_test",
            "SPEEDMATRIX_NOTIFY_EMAIL_TO": MAIL_TO,
            "SPEEDMATRIX_NOTIFY_WEBHOOK_URL": self.webhook_url,
            "SPEEDMATRIX_REPORT_BASE_URL": "https://perf.example.test/artifacts",
        }

    def mail_bodies(self) -> list[str]:
        out = []
        for m in self.inbox.messages:
            part = m.get_body(preferencelist=("html", "plain"))
            out.append(part.get_content() if part is not None else "")
        return out

    def clear(self) -> None:
        self.inbox.messages.clear()
        self.inbox.envelopes.clear()
        self.posts.clear()


def start_catchers() -> tuple[Catchers, callable]:
    """Start both receivers; returns them and a stop function."""
    import socket

    with socket.socket() as sock:  # aiosmtpd's start() connects to the port it is given
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    inbox = _Inbox()
    smtp = Controller(inbox, hostname="127.0.0.1", port=free)
    smtp.start()
    posts: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            posts.append(
                {
                    "path": self.path,
                    "content_type": self.headers.get("Content-Type"),
                    "json": json.loads(body),
                }
            )
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    catchers = Catchers(
        smtp_port=free,
        webhook_url=f"http://127.0.0.1:{http.server_address[1]}/services/T0/B0/secret",
        inbox=inbox,
        posts=posts,
    )

    def stop() -> None:
        http.shutdown()
        http.server_close()
        smtp.stop()

    return catchers, stop
