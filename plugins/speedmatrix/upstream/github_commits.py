"""The engine_commit of a run: speedmatrix.commits' rule, with GitHub asked for the full SHA.

Why GitHub: a server's version names only a prefix of its commit, and a release only a tag;
the deployment's GitHub API (upstream.schedule.github_api_url, never a run's conf) turns either
into the full SHA, so runs measured by different paths land one value. Best effort and
bounded: unreachable, rate-limited or ambiguous, the prefix stays (speedmatrix.commits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from speedmatrix.commits import canonical, known_commit, release_tag, same_commit

log = logging.getLogger("speedmatrix.commits")

LOOKUP_TIMEOUT_S = 10.0
DEFAULT_REPO = "vllm-project/vllm"


def github_lookup(repo: str) -> Callable[[str], str]:
    """GitHub's answer for a commit prefix or tag of `repo`: its full SHA."""
    from speedmatrix.upstream.github import GitHubClient
    from speedmatrix.upstream.schedule import github_api_url

    def lookup(name: str) -> str:
        client = GitHubClient(base_url=github_api_url(), timeout_s=LOOKUP_TIMEOUT_S, retries=0)
        return client.head_commit(repo, name).sha

    return lookup


def engine_commit(
    *,
    recorded: Any = None,
    ref: Any = None,
    version: Any = None,
    repository: Any = None,
    lookup: Callable[[str], str] | None = None,
    ask: bool = True,
) -> str | None:
    """The run's engine_commit: `recorded` is what provisioning resolved or the wheel's
    `__commit_id__` says, `ref` the engine ref, `version` the server's version string. With
    `ask` False (a simulated engine: its commit is made up, and nobody upstream knows it) the
    deployment's GitHub API is never asked for the full SHA."""
    from speedmatrix.upstream.github import github_repo

    name = known_commit(recorded, ref, version)
    if (name and len(name) == 40) or not ask:
        return canonical(name)
    ask = name or release_tag(ref, version)
    repo = github_repo(repository or f"github.com/{DEFAULT_REPO}")
    if ask and repo:
        try:
            sha = (lookup or github_lookup(repo))(ask).strip().lower()
        except Exception as exc:  # unreachable, rate limit, unknown: the prefix stays
            log.info("engine commit %s: GitHub could not tell the full SHA (%s)", ask, exc)
        else:
            if len(sha) == 40 and (name is None or same_commit(sha, name)):
                return sha
    return canonical(name)


def commits_between(repo: str, good: str, bad: str) -> list[str]:
    """Commits after `good` up to and including `bad`, oldest first, from GitHub's compare API
    through the project's client (upstream.github: retries, rate limits, checked shas). The
    API is the deployment's (`upstream.schedule.github_api_url`), never a conf's: its answer
    chooses what gets measured."""
    from speedmatrix.upstream.github import GitHubClient
    from speedmatrix.upstream.schedule import github_api_url

    return [c.sha for c in GitHubClient(github_api_url(), timeout_s=20).compare(repo, good, bad)]
