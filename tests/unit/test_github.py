"""GitHubClient against a fake GitHub API on 127.0.0.1 (recorded /commits answers)."""

from __future__ import annotations

import time

import pytest
from github_fake import FakeGitHub

from speedmatrix.upstream.github import (
    Commit,
    GitHubClient,
    GitHubError,
    GitHubUnavailable,
    RateLimited,
)

REPO = "vllm-project/vllm"


@pytest.fixture
def fake():
    f = FakeGitHub(head=4).start()
    yield f
    f.stop()


def client(fake: FakeGitHub, **kw) -> GitHubClient:
    kw.setdefault("timeout_s", 2)
    kw.setdefault("retries", 0)
    return GitHubClient(base_url=fake.base_url, **kw)


def test_list_commits_newest_first_with_parsed_fields(fake):
    page = client(fake).list_commits(REPO, "main")
    assert [c.sha for c in page.commits] == [fake.sha(i) for i in (3, 2, 1, 0)]
    newest = page.commits[0]
    assert newest.title == "[Docs] Update the speculative decoding page (#30125)"
    assert "\n" not in newest.title
    assert newest.date == fake.history[3]["commit"]["committer"]["date"]
    assert newest.url == f"https://github.com/vllm-project/vllm/commit/{fake.sha(3)}"
    assert page.etag and not page.not_modified
    req = fake.commits_requests()[-1]
    assert req.query["sha"] == ["main"] and req.query["per_page"] == ["100"]
    assert req.headers["Accept"] == "application/vnd.github+json"
    assert "Authorization" not in req.headers


def test_etag_gives_not_modified_until_the_branch_moves(fake):
    gh = client(fake)
    first = gh.list_commits(REPO)
    again = gh.list_commits(REPO, etag=first.etag)
    assert again.not_modified and again.commits == [] and again.etag == first.etag
    assert fake.commits_requests()[-1].headers["If-None-Match"] == first.etag
    assert fake.commits_requests()[-1].status == 304
    fake.head = 5
    moved = gh.list_commits(REPO, etag=first.etag)
    assert not moved.not_modified and moved.commits[0].sha == fake.sha(4)
    assert moved.etag != first.etag


def test_token_is_sent_as_bearer(fake):
    fake.token = "ghp_test_token"
    assert client(fake, token="ghp_test_token").head_commit(REPO).sha == fake.sha(3)
    assert fake.requests[-1].headers["Authorization"] == "Bearer ghp_test_token"
    with pytest.raises(GitHubError, match=r"401.*Bad credentials") as exc:
        client(fake).head_commit(REPO)
    assert not isinstance(exc.value, GitHubUnavailable)  # needs a human, not a retry


def test_head_commit(fake):
    head = client(fake).head_commit(REPO, "main")
    assert isinstance(head, Commit) and head.sha == fake.sha(3)
    assert fake.requests[-1].path == f"/repos/{REPO}/commits/main"


def test_primary_rate_limit_raises_with_reset_time(fake):
    fake.mode = "ratelimit"
    with pytest.raises(RateLimited, match=r"rate limit.*HTTP 403") as exc:
        client(fake).list_commits(REPO)
    assert exc.value.reset_at is not None and exc.value.reset_at > time.time()
    assert isinstance(exc.value, GitHubUnavailable)


def test_secondary_rate_limit_429_with_retry_after(fake):
    fake.mode = "secondary"
    with pytest.raises(RateLimited, match="HTTP 429") as exc:
        client(fake, retries=2).list_commits(REPO)
    assert exc.value.reset_at is not None
    assert len(fake.requests) == 1  # a rate limit is never retried in a loop


def test_5xx_is_retried_then_unavailable(fake):
    fake.mode = "5xx"
    with pytest.raises(GitHubUnavailable, match="502"):
        client(fake, retries=2, backoff_s=0.01).list_commits(REPO)
    assert [r.status for r in fake.requests] == [502, 502, 502]


def test_timeout_is_unavailable(fake):
    fake.mode, fake.delay_s = "timeout", 1.5
    with pytest.raises(GitHubUnavailable, match=r"timed out|unreachable"):
        client(fake, timeout_s=0.3).list_commits(REPO)


def test_connection_refused_is_unavailable():
    gh = GitHubClient(base_url="http://127.0.0.1:9", timeout_s=1, retries=0)
    with pytest.raises(GitHubUnavailable, match="unreachable"):
        gh.list_commits(REPO)


def test_non_json_answer_is_an_error_not_a_transient(fake):
    fake.mode = "garbage"
    with pytest.raises(GitHubError, match="non-JSON") as exc:
        client(fake).list_commits(REPO)
    assert not isinstance(exc.value, GitHubUnavailable)


def test_unknown_repository_404_is_an_error(fake):
    with pytest.raises(GitHubError, match="404"):
        client(fake).list_commits("vllm-project/nope")


def test_malformed_commit_object_is_rejected():
    with pytest.raises(GitHubError, match="sha"):
        Commit.from_api({"sha": "not-a-sha"})
    with pytest.raises(GitHubError, match="commit object"):
        Commit.from_api(["x"])


# ---- the token goes only to the configured API host (issue #16 item 1) ---------------------


class _Recorder:
    """A loopback HTTP server that records each request's Authorization header; with
    `redirect_to`, answers every GET with a 302 there (path kept)."""

    def __init__(self, redirect_to: str | None = None):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                seen.append((self.path, self.headers.get("Authorization")))
                if redirect_to:
                    self.send_response(302)
                    self.send_header("Location", redirect_to + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = b'{"sha": "' + b"a" * 40 + b'"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("other_host", ["other port", "other name"])
def test_the_token_never_follows_a_redirect_to_another_origin(other_host):
    elsewhere = _Recorder()
    target = elsewhere.base_url
    if other_host == "other name":  # same port, another host name for the same loopback
        target = target.replace("127.0.0.1", "localhost")
    api = _Recorder(redirect_to=target)
    try:
        gh = GitHubClient(base_url=api.base_url, token="ghp_secret", timeout_s=2, retries=0)
        assert gh.head_commit(REPO, "main").sha == "a" * 40
        assert api.seen == [(f"/repos/{REPO}/commits/main", "Bearer ghp_secret")]
        assert elsewhere.seen == [(f"/repos/{REPO}/commits/main", None)]
    finally:
        api.stop()
        elsewhere.stop()


def test_the_token_is_attached_only_to_the_configured_origin():
    """Even a request the client is asked to make elsewhere (a `next` link, a bug) goes
    without the token: it is an attribute of the origin, not of the session."""
    elsewhere = _Recorder()
    try:
        gh = GitHubClient(
            base_url="http://127.0.0.1:9/api", token="ghp_secret", timeout_s=2, retries=0
        )
        assert "Authorization" not in gh.session.headers
        gh.session.get(elsewhere.base_url + "/x", timeout=2)
        assert elsewhere.seen == [("/x", None)]
    finally:
        elsewhere.stop()


def test_compare_lists_the_commits_between_oldest_first(fake):
    gh = client(fake)
    commits = gh.compare(REPO, fake.sha(0), fake.sha(3))
    assert [c.sha for c in commits] == [fake.sha(i) for i in (1, 2, 3)]
    assert commits[0].title and commits[0].date
    with pytest.raises(GitHubError, match="404"):
        gh.compare(REPO, fake.sha(0), "f" * 40)


def test_commits_between_goes_through_the_client(fake, monkeypatch):
    """analysis.bisection asked GitHub with a bare requests.get (no retries, no rate-limit
    handling, any JSON taken); it now asks the client, at the deployment's API."""
    from speedmatrix.upstream.github_commits import commits_between

    monkeypatch.setenv("SPEEDMATRIX_GITHUB_API_URL", fake.base_url)
    assert commits_between(REPO, fake.sha(0), fake.sha(2)) == [fake.sha(1), fake.sha(2)]
    assert fake.requests[-1].headers["User-Agent"] == "speedmatrix-commit-watch"
    fake.mode = "ratelimit"
    with pytest.raises(RateLimited):
        commits_between(REPO, fake.sha(0), fake.sha(2))
