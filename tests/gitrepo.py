"""A git command for tests that build small local repositories (a stand-in upstream)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git(cwd: Path, *args: str) -> str:
    """Run git in ``cwd`` with a throw-away identity; its stdout, stripped."""
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def upstream_with_pr(tmp_path: Path, changed: str) -> tuple[Path, str, str]:
    """A local 'upstream': main, and a pull ref ``refs/pull/7/head`` changing ``changed``;
    main moves on after the PR branched. Returns (repo, merge base, PR head)."""
    up = tmp_path / "upstream"
    up.mkdir()
    git(up, "init", "-q", "-b", "main")
    (up / "setup.py").write_text("# base\n")
    git(up, "add", ".")
    git(up, "commit", "-qm", "base")
    base = git(up, "rev-parse", "HEAD")
    git(up, "checkout", "-qb", "feature")
    (up / changed).parent.mkdir(parents=True, exist_ok=True)
    (up / changed).write_text("change\n")
    git(up, "add", ".")
    git(up, "commit", "-qm", "pr")
    head = git(up, "rev-parse", "HEAD")
    git(up, "update-ref", "refs/pull/7/head", head)
    git(up, "checkout", "-q", "main")
    (up / "README").write_text("main moved on\n")
    git(up, "add", ".")
    git(up, "commit", "-qm", "main")
    return up, base, head
