"""Which commit a ref names (the wheel check is `speedmatrix.upstream.wheels`, the one rule).

One job: resolving before planning. A short sha or ``main`` goes to GitHub's API (or the
caller's ``resolver``); a PR's head is asked of the git repository the host will fetch from
(``git ls-remote``), so the head planned is the head the host gets. Every URL is read at call
time, so tests point them at loopback and a deployment at its mirrors.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

from speedmatrix.engine.provision.contract import ProvisionError
from speedmatrix.settings import child_environ, settings

DEFAULT_REPO_URL = "https://github.com/vllm-project/vllm.git"


DEFAULT_GITHUB_REPO = "vllm-project/vllm"


ENV_REPO_URL = "SPEEDMATRIX_VLLM_REPO_URL"


_HEX40 = re.compile(r"^[0-9a-f]{40}$")


def resolve_commit(
    ref: str, resolver: Callable[[str], str] | None = None, repo: str = DEFAULT_GITHUB_REPO
) -> str:
    """A 40-hex commit for ``ref`` (a short sha or ``main``), through GitHub's API by default."""
    if _HEX40.match(ref):
        return ref
    if resolver is None:
        from speedmatrix.upstream.github import GitHubClient
        from speedmatrix.upstream.schedule import github_api_url

        def resolver(r: str) -> str:
            return GitHubClient(base_url=github_api_url()).head_commit(repo, r).sha

    sha = resolver(ref).strip().lower()
    if not _HEX40.match(sha):
        raise ProvisionError(f"cannot resolve {ref!r} to a 40-hex commit (got {sha!r})")
    return sha


def resolve_pr_head(
    number: str, repo_url: str, resolver: Callable[[str], str] | None = None, timeout_s: float = 60
) -> str:
    """The 40-hex commit pull request ``number`` points at now.

    Planned, not left to the host: the head goes into the install hash (a PR that got new
    commits is rebuilt, not reused) and the host checks it fetched exactly that commit. By
    default it is asked of ``repo_url`` itself (``git ls-remote``), the repository the host
    fetches from; ``resolver`` (given ``"pr/<N>"``) replaces that, as for commits.
    """
    if resolver is not None:
        sha = resolver(f"pr/{number}").strip().lower()
    else:
        sha = _ls_remote(repo_url, f"refs/pull/{number}/head", timeout_s)
    if not _HEX40.match(sha):
        raise ProvisionError(f"cannot resolve pr/{number} to a 40-hex head commit (got {sha!r})")
    return sha


def _ls_remote(repo_url: str, ref: str, timeout_s: float) -> str:
    """The commit ``ref`` names in ``repo_url`` (never prompting for credentials)."""
    try:
        res = subprocess.run(
            ["git", "ls-remote", "--", repo_url, ref],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_environ(GIT_TERMINAL_PROMPT="0"),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProvisionError(f"cannot ask {repo_url} for {ref}: {exc}") from exc
    if res.returncode != 0:
        raise ProvisionError(f"git ls-remote {repo_url} {ref} failed: {res.stderr.strip()[-500:]}")
    for line in res.stdout.splitlines():
        sha, _, name = line.partition("\t")
        if name.strip() == ref:
            return sha.strip().lower()
    raise ProvisionError(f"{repo_url} has no {ref}: is there such a pull request?")


def repo_url_for(repo_url: str | None = None) -> str:
    """The vLLM git repository: the argument, else ``$SPEEDMATRIX_VLLM_REPO_URL``, else
    GitHub's. Read at call time, so a deployment points its hosts at a mirror without code."""
    return repo_url or settings().vllm_repo_url or DEFAULT_REPO_URL
