"""What provisioning promises, and the names its Python side and its host scripts share.

One job: the contract. The result and errors every caller sees, and the names both sides of
an attempt agree on (the marker's file name and format, ``<state>`` file names, the attempt's
exit codes), kept in one place so the shell scripts (:mod:`.scripts`, :mod:`.plan`) and the
Python that reads their outcome (:mod:`.orchestrate`) cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MARKER = ".speedmatrix-provisioned.json"


MARKER_FORMAT = 1


SHIPPED = "shipped.json"  # in <state>: digests of the zipapp and include/ as last shipped


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


RC_REASONS = {
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
