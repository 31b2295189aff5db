"""A fake GitHub REST API on 127.0.0.1 serving recorded /commits answers (tests only).

It replays tests/fixtures/github/commits_main.json (the shape of
`GET /repos/vllm-project/vllm/commits`, newest first) as a branch whose head the test moves
(`fake.head = n` shows the oldest n commits), with GitHub's ETag / If-None-Match semantics
and rate-limit headers, and failure modes a test can switch on: "ratelimit" (403 with
X-RateLimit-Remaining: 0), "secondary" (429 with Retry-After), "5xx" (502), "timeout" (the
answer comes after `delay_s`), "garbage" (200 with HTML). `barrier` makes the first N
/commits requests wait for each other, so N polls provably read the same state at once.
Nothing is fetched from GitHub.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

FIXTURE = Path(__file__).parent / "fixtures" / "github" / "commits_main.json"
REPO = "vllm-project/vllm"


def load_history() -> list[dict]:
    """The fixture's commits, oldest first."""
    return list(reversed(json.loads(FIXTURE.read_text())))


@dataclass
class Request:
    path: str
    query: dict
    headers: dict
    status: int


@dataclass
class FakeGitHub:
    history: list[dict] = field(default_factory=load_history)
    head: int = 1  # how many commits of `history` the branch has
    mode: str = "ok"
    delay_s: float = 0.0
    token: str | None = None  # when set, requests must carry "Bearer <token>"
    barrier: threading.Barrier | None = None
    requests: list[Request] = field(default_factory=list)
    wheels: set[str] = field(default_factory=set)  # shas whose wheel index page exists
    tags: dict[str, str] = field(default_factory=dict)  # tag -> sha (GET /commits/<tag>)
    base_url: str = ""
    _server: ThreadingHTTPServer | None = None

    # -- what the branch looks like now
    def page(self, per_page: int) -> list[dict]:
        return list(reversed(self.history[: self.head]))[:per_page]

    def sha(self, i: int) -> str:
        """The sha of the i-th commit, oldest first (0-based)."""
        return self.history[i]["sha"]

    def commits_requests(self) -> list[Request]:
        return [r for r in self.requests if r.path.endswith("/commits")]

    # -- lifecycle
    def start(self) -> FakeGitHub:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(head_only=True)

            def do_GET(self) -> None:
                self._serve(head_only=False)

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                fake.requests.append(
                    Request(self._path, self._query, dict(self.headers.items()), status)
                )
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body and self.command != "HEAD":
                    self.wfile.write(body)

            def _serve(self, head_only: bool) -> None:
                url = urlparse(self.path)
                self._path, self._query = url.path, parse_qs(url.query)
                limits = {
                    "X-RateLimit-Limit": "5000" if fake.token else "60",
                    "X-RateLimit-Remaining": "4990",
                    "X-RateLimit-Reset": str(int(time.time()) + 3600),
                    "X-RateLimit-Resource": "core",
                    "Content-Type": "application/json; charset=utf-8",
                }
                if url.path.startswith("/wheels/"):
                    sha = url.path.split("/")[2]
                    # a PEP 503 page listing the commit's wheel, as the real index serves it
                    page = f'<a href="vllm-0.1.dev1+g{sha[:9]}-cp38-abi3-linux_x86_64.whl">w</a>'
                    found = sha in fake.wheels
                    self._send(200 if found else 404, page.encode() if found else b"", {})
                    return
                if fake.token and self.headers.get("Authorization") != f"Bearer {fake.token}":
                    body = {"message": "Bad credentials", "status": "401"}
                    self._send(401, json.dumps(body).encode(), limits)
                    return
                if fake.barrier is not None and url.path.endswith("/commits"):
                    fake.barrier.wait(timeout=120)
                if fake.mode == "timeout":
                    time.sleep(fake.delay_s)
                if fake.mode == "ratelimit":
                    limits.update({"X-RateLimit-Remaining": "0"})
                    body = {
                        "message": "API rate limit exceeded for 127.0.0.1. (But here's the good "
                        "news: Authenticated requests get a higher rate limit.)",
                        "documentation_url": "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api",
                    }
                    self._send(403, json.dumps(body).encode(), limits)
                    return
                if fake.mode == "secondary":
                    body = {"message": "You have exceeded a secondary rate limit."}
                    self._send(429, json.dumps(body).encode(), {**limits, "Retry-After": "60"})
                    return
                if fake.mode == "5xx":
                    self._send(502, b'{"message": "Server Error"}', limits)
                    return
                if fake.mode == "garbage":
                    self._send(200, b"<html>captive portal</html>", {"Content-Type": "text/html"})
                    return
                prefix = f"/repos/{REPO}/commits"
                compare = f"/repos/{REPO}/compare/"
                if url.path.startswith(compare):  # base...head: commits after base, oldest first
                    base, _, head = url.path[len(compare) :].partition("...")
                    shas = [c["sha"] for c in fake.history[: fake.head]]
                    if base not in shas or head not in shas:
                        self._send(404, b'{"message": "Not Found"}', limits)
                        return
                    commits = fake.history[shas.index(base) + 1 : shas.index(head) + 1]
                    body = json.dumps({"status": "ahead", "commits": commits}).encode()
                elif url.path == prefix:
                    per_page = int(self._query.get("per_page", ["30"])[0])
                    body = json.dumps(fake.page(per_page), indent=1).encode()
                elif url.path.startswith(prefix + "/"):
                    ref = url.path[len(prefix) + 1 :]
                    known = {c["sha"]: c for c in fake.history[: fake.head]}
                    commit = fake.history[fake.head - 1] if ref == "main" else known.get(ref)
                    # as GitHub: a tag, or a prefix of one commit only (7+ hex digits)
                    ref = fake.tags.get(ref, ref)
                    matches = [
                        c for sha, c in known.items() if len(ref) >= 7 and sha.startswith(ref)
                    ]
                    commit = commit or (matches[0] if len(matches) == 1 else None)
                    if commit is None:
                        body = json.dumps({"message": "No commit found for SHA: " + ref})
                        self._send(422, body.encode(), limits)
                        return
                    body = json.dumps(commit, indent=1).encode()
                else:
                    self._send(404, b'{"message": "Not Found"}', limits)
                    return
                etag = 'W/"' + hashlib.sha256(body).hexdigest()[:40] + '"'
                if self.headers.get("If-None-Match") == etag:
                    self._send(304, b"", {**limits, "ETag": etag})
                    return
                self._send(200, body, {**limits, "ETag": etag})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
