"""The deployment's schedule config (include/recipes/_schedule.yaml): nightly cron, commit
watch, and which GitHub API to ask.

One job: reading that file. It sits below flows/ (where the trigger DAGs use it) because the
engine (resolving a ref to a commit) and the analysis (the commits between two runs) need the
deployment's GitHub API too, and neither may import flows/ (the layer contract).
The API URL is always the deployment's, never a run's conf: the token of `github_default`
goes to that host, and its answers choose what gets benchmarked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from speedmatrix.settings import settings
from speedmatrix.upstream.github import DEFAULT_API_URL


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NightlyConfig(_Strict):
    cron: str = "0 2 * * *"


class CommitWatchConfig(_Strict):
    cron: str = "*/15 * * * *"
    max_commits_per_poll: int = Field(default=5, ge=1, le=100)
    wait_for_wheel: bool = False
    # None: the page provisioning installs from (upstream.wheels), variant included
    wheel_url: str | None = None
    wheel_max_wait_s: float = Field(default=21600, ge=0)


class GitHubConfig(_Strict):
    api_url: str = DEFAULT_API_URL
    repo: str = Field(default="vllm-project/vllm", pattern=r"^[\w.-]+/[\w.-]+$")
    branch: str = "main"
    conn_id: str | None = "github_default"
    timeout_s: float = Field(default=10, gt=0)
    retries: int = Field(default=2, ge=0, le=10)


class ScheduleConfig(_Strict):
    nightly: NightlyConfig = NightlyConfig()
    commit_watch: CommitWatchConfig = CommitWatchConfig()
    github: GitHubConfig = GitHubConfig()


def schedule_config_path() -> Path:
    """`$SPEEDMATRIX_SCHEDULE`, else `_schedule.yaml` beside the recipes (the `schedule`
    setting)."""
    return settings().schedule


def load_schedule_config(path: str | os.PathLike[str] | None = None) -> ScheduleConfig:
    """Read the schedule config; a missing file means the defaults (02:00 UTC nightly).

    `$SPEEDMATRIX_GITHUB_API_URL` overrides github.api_url (GitHub Enterprise, tests).
    """
    p = Path(path) if path else schedule_config_path()
    data: dict[str, Any] = {}
    if p.is_file():
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{p}: expected a mapping at the top level")
        data = loaded
    cfg = ScheduleConfig.model_validate(data)
    env_url = settings().github_api_url
    if env_url:
        cfg = cfg.model_copy(update={"github": cfg.github.model_copy(update={"api_url": env_url})})
    return cfg


def github_api_url() -> str:
    """The GitHub API base of this deployment: `$SPEEDMATRIX_GITHUB_API_URL`, else
    github.api_url of the schedule config, else GitHub's. Never a run's conf: the token of
    `github_default` goes to this host, and its answers choose what gets benchmarked."""
    return load_schedule_config().github.api_url
