"""A small GitHub REST client for the trigger DAGs: commits on a branch and its head.

Why a client of our own (on `requests`) rather than PyGithub or the GitHub provider: the
watch needs exactly two endpoints, conditional requests (ETag / If-None-Match, whose 304
answers do not count against the rate limit) and a precise split of failures into
"try again at the next poll" (rate limit, 5xx, timeouts: `GitHubUnavailable`) and
"misconfigured, tell a human" (401/404/garbage: `GitHubError`). The base URL is a parameter,
so tests and GitHub Enterprise work the same way; callers take it from the deployment
(`upstream.schedule.github_api_url`), never from a run's conf, and the token is bound to that base's
origin (`OriginToken`): it is never sent anywhere else, not on a redirect, not to any other URL.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from requests.auth import AuthBase
from urllib3.util.retry import Retry

DEFAULT_API_URL = "https://api.github.com"
SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_USER_AGENT = "speedmatrix-commit-watch"


class GitHubError(RuntimeError):
    """The API answered something this client cannot use (auth, not found, bad shape).

    Not retried by the poll: it needs a human (token, repository name, base URL).
    """


class GitHubUnavailable(GitHubError):
    """A transient failure: 5xx, timeout, connection refused. The next poll tries again."""


class RateLimited(GitHubUnavailable):
    """GitHub's primary or secondary rate limit; `reset_at` is epoch seconds when known."""

    def __init__(self, message: str, reset_at: float | None = None) -> None:
        super().__init__(message)
        self.reset_at = reset_at


@dataclass(frozen=True)
class Commit:
    """One commit of the branch, as much as the triggers need."""

    sha: str
    date: str | None = None  # committer date, ISO 8601 as GitHub sends it
    title: str = ""
    url: str | None = None

    @classmethod
    def from_api(cls, item: Any) -> Commit:
        """Build from one element of /commits (or the /commits/{ref} object)."""
        if not isinstance(item, dict) or not isinstance(item.get("sha"), str):
            raise GitHubError(f"unexpected commit object from the API: {str(item)[:200]!r}")
        sha = item["sha"].lower()
        if not SHA_RE.match(sha):
            raise GitHubError(f"unexpected commit sha from the API: {sha[:60]!r}")
        inner = item.get("commit") or {}
        committer = inner.get("committer") or {}
        message = inner.get("message") or ""
        return cls(
            sha=sha,
            date=committer.get("date"),
            title=message.splitlines()[0][:200] if message else "",
            url=item.get("html_url"),
        )


@dataclass(frozen=True)
class CommitPage:
    """One answer of /commits: newest first; `not_modified` when the ETag still matched."""

    commits: list[Commit] = field(default_factory=list)
    etag: str | None = None
    not_modified: bool = False


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, the default port filled in: what a token is bound to."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port or default


class OriginToken(AuthBase):
    """``Authorization: Bearer <token>`` on requests to one origin only.

    Not a session header: a session header goes with every request of the session, to any
    URL. requests applies this per request it prepares and does not re-apply it on a
    redirect (and strips the header when a redirect changes the host), so the token reaches
    the configured API and nothing else."""

    def __init__(self, token: str, base_url: str) -> None:
        self._token = token
        self._origin = origin(base_url)

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        if origin(r.url or "") == self._origin:
            r.headers["Authorization"] = f"Bearer {self._token}"
        else:
            r.headers.pop("Authorization", None)
        return r


class GitHubClient:
    """GET-only client for one API base URL, with a token when given.

    Transient 5xx answers and connection errors are retried a few times with backoff inside
    one call (`retries`); what is still failing after that raises `GitHubUnavailable`.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_API_URL,
        token: str | None = None,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        session: requests.Session | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = session or requests.Session()
        retry = Retry(
            total=retries,
            connect=retries,
            read=retries,
            status=retries,
            backoff_factor=backoff_s,
            status_forcelist=(500, 502, 503, 504),
            allowed_methods=frozenset({"GET", "HEAD"}),
            raise_on_status=False,
            respect_retry_after_header=False,  # rate limits are handled below, never slept on
        )
        adapter = HTTPAdapter(max_retries=retry)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.session.headers.update(
            {
                "Accept": "application/vnd.github+json",
                "X-GitHub-Api-Version": "2022-11-28",
                "User-Agent": _USER_AGENT,
            }
        )
        if token:
            self.session.auth = OriginToken(token, self.base_url)

    def _get(self, path: str, params: dict[str, Any] | None, etag: str | None) -> requests.Response:
        headers = {"If-None-Match": etag} if etag else {}
        url = f"{self.base_url}{path}"
        try:
            resp = self.session.get(url, params=params, headers=headers, timeout=self.timeout_s)
        except requests.Timeout as exc:
            raise GitHubUnavailable(
                f"GitHub API timed out after {self.timeout_s:g}s: {url}"
            ) from exc
        except requests.RequestException as exc:  # connection refused, retries exhausted, ...
            raise GitHubUnavailable(f"GitHub API unreachable: {url}: {exc}") from exc
        _raise_for_status(resp)
        return resp

    def list_commits(
        self, repo: str, branch: str = "main", per_page: int = 100, etag: str | None = None
    ) -> CommitPage:
        """The newest `per_page` commits of `branch`, newest first (GitHub's order).

        With `etag`, an unchanged branch answers 304 and costs no rate limit.
        """
        resp = self._get(
            f"/repos/{repo}/commits", {"sha": branch, "per_page": min(per_page, 100)}, etag
        )
        if resp.status_code == 304:
            return CommitPage(commits=[], etag=etag, not_modified=True)
        data = _json(resp)
        if not isinstance(data, list):
            raise GitHubError(
                f"expected a list of commits from {resp.url}, got {type(data).__name__}"
            )
        return CommitPage(commits=[Commit.from_api(c) for c in data], etag=resp.headers.get("ETag"))

    def compare(self, repo: str, base: str, head: str) -> list[Commit]:
        """Commits after `base` up to and including `head`, oldest first (the compare API;
        GitHub lists up to 250, enough for the ranges a nightly can open)."""
        resp = self._get(f"/repos/{repo}/compare/{base}...{head}", None, None)
        data = _json(resp)
        commits = data.get("commits") if isinstance(data, dict) else None
        if not isinstance(commits, list):
            raise GitHubError(f"expected a compare object with commits from {resp.url}")
        return [Commit.from_api(c) for c in commits]

    def head_commit(self, repo: str, branch: str = "main") -> Commit:
        """The commit `branch` points at now."""
        resp = self._get(f"/repos/{repo}/commits/{branch}", None, None)
        return Commit.from_api(_json(resp))


def github_repo(url: Any) -> str | None:
    """`owner/name` of a github.com repository URL (`https://github.com/o/n.git` -> `o/n`),
    None for anything else: the repositories whose commits and compare pages we can name."""
    text = str(url or "")
    if "github.com/" not in text:
        return None
    return text.split("github.com/", 1)[1].removesuffix(".git").strip("/") or None


def _json(resp: requests.Response) -> Any:
    try:
        return resp.json()
    except ValueError as exc:
        raise GitHubError(f"GitHub API answered non-JSON from {resp.url}") from exc


def _raise_for_status(resp: requests.Response) -> None:
    """Map an HTTP answer to the client's exceptions; 2xx and 304 pass."""
    code = resp.status_code
    if code < 300 or code == 304:
        return
    headers = resp.headers
    if code in (403, 429) and (
        headers.get("X-RateLimit-Remaining") == "0" or "Retry-After" in headers or code == 429
    ):
        reset_at = _reset_at(headers)
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(reset_at)) if reset_at else "unknown"
        raise RateLimited(f"GitHub API rate limit hit (HTTP {code}); resets at {when}", reset_at)
    if code >= 500:
        raise GitHubUnavailable(f"GitHub API answered HTTP {code} for {resp.url}")
    detail = ""
    try:
        detail = str(resp.json().get("message", ""))[:200]
    except (ValueError, AttributeError):
        detail = resp.text[:200]
    raise GitHubError(f"GitHub API answered HTTP {code} for {resp.url}: {detail}")


def _reset_at(headers: Any) -> float | None:
    """Epoch seconds when the limit resets: X-RateLimit-Reset, else now + Retry-After."""
    try:
        if "X-RateLimit-Reset" in headers:
            return float(headers["X-RateLimit-Reset"])
        if "Retry-After" in headers:
            return time.time() + float(headers["Retry-After"])
    except ValueError:
        return None
    return None
