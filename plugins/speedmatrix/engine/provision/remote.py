"""Running one provisioning attempt detached on the host, and the short probes around it.

One job: the host side's moving parts as seen from here. An attempt runs in its own session
(``setsid``), so a long quiet install never meets an SSH timeout; this side polls with short
idempotent commands (an SSH drop between polls costs nothing), probes the env's lock
(``flock``; the kernel drops it when its holder dies) and reads the marker and the log's tail.
"""

from __future__ import annotations

import json
import shlex
import time

from speedmatrix.engine.hosts import Host
from speedmatrix.engine.provision.contract import MARKER, ProvisionError


def read_marker(host: Host, env_dir: str) -> dict | None:
    """The marker's content, or None when it is missing or unreadable."""
    return read_json(host, f"cat {shlex.quote(env_dir + '/' + MARKER)} 2>/dev/null")


def read_json(host: Host, cmd: str) -> dict | None:
    """The JSON object ``cmd`` prints on the host, or None (failed, not JSON, not an object)."""
    res = host.run(cmd, timeout_s=60, idempotent=True, stream=False)
    if res.rc != 0:
        return None
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def start_attempt(host: Host, attempt: str, wrapper: str, body: str) -> None:
    """Start the wrapper detached on the host in its own session (process group id in
    ``$ATTEMPT/pid``). The env values are written into the 0700 script, not onto a command
    line."""
    host.put_text(body, f"{attempt}/body.sh", mode=0o700)
    host.put_text(wrapper, f"{attempt}/wrapper.sh", mode=0o700)
    inner = f"echo $$ > {shlex.quote(attempt + '/pid')}; exec bash {shlex.quote(attempt + '/wrapper.sh')}"
    host.run(
        f"(cd {shlex.quote(attempt)} && exec setsid bash -c {shlex.quote(inner)}) "
        f"> {shlex.quote(attempt + '/out')} 2>&1 < /dev/null &",
        timeout_s=60,
        check=True,
    )


def wait_attempt(
    host: Host, attempt: str, log_path: str, deadline: float, timeout_s: float, poll_s: float
) -> int:
    """Wait for a detached attempt's exit code, until ``deadline`` (``time.monotonic()``; the
    end of the provisioning's ``timeout_s``, which the error names).

    Polling uses short idempotent commands, so an SSH drop between polls costs nothing; the
    attempt itself never depends on the connection. On timeout its group is killed.
    """
    rc_path, pid_path = f"{attempt}/rc", f"{attempt}/pid"
    poll = (
        f"if [ -s {shlex.quote(rc_path)} ]; then echo rc=$(cat {shlex.quote(rc_path)}); "
        f"elif [ -s {shlex.quote(pid_path)} ] && kill -0 $(cat {shlex.quote(pid_path)}) 2>/dev/null; then echo running; "
        f"elif [ -s {shlex.quote(pid_path)} ]; then sleep 1; [ -s {shlex.quote(rc_path)} ] && echo rc=$(cat {shlex.quote(rc_path)}) || echo dead; "
        f"else echo starting; fi"
    )
    while True:
        state = host.run(poll, timeout_s=60, idempotent=True, stream=False).stdout.strip()
        if state.startswith("rc="):
            return int(state[3:])
        if state == "dead":
            raise ProvisionError(
                f"the provisioning on {host.name} died without an exit code (killed?)",
                log_tail(host, log_path),
                log_path,
            )
        if time.monotonic() > deadline:
            # TERM, up to 5 s for the group to go (checked every 0.1 s, not slept through),
            # then KILL to whatever is left
            host.run(
                f'g=$(cat {shlex.quote(pid_path)}); kill -TERM -- "-$g" 2>/dev/null; '
                'for _ in $(seq 50); do kill -0 -- "-$g" 2>/dev/null || break; sleep 0.1; done; '
                'kill -KILL -- "-$g" 2>/dev/null; true',
                timeout_s=60,
                idempotent=True,
            )
            raise ProvisionError(
                f"the provisioning on {host.name} did not finish within {timeout_s:g} s (killed)",
                log_tail(host, log_path),
                log_path,
            )
        time.sleep(poll_s)


def lock_held(host: Host, state_dir: str) -> bool:
    """True while a provisioning of this env runs on the host (it holds ``<state>/lock``;
    the kernel drops the lock when its holder dies, so a dead one never blocks)."""
    lock = shlex.quote(state_dir + "/lock")
    res = host.run(
        f"if [ ! -e {lock} ] || flock -n {lock} true; then echo free; else echo held; fi",
        timeout_s=60,
        idempotent=True,
        stream=False,
    )
    return res.stdout.strip() == "held"


def wait_lock_free(
    host: Host, state_dir: str, env_dir: str, deadline: float, timeout_s: float, poll_s: float
) -> None:
    """Wait for the provisioning that holds the env's lock to end (it is not ours to kill)."""
    while lock_held(host, state_dir):
        if time.monotonic() > deadline:
            log_path = f"{state_dir}/provision.log"
            raise ProvisionError(
                f"another provisioning of {env_dir} on {host.name} still held its lock after "
                f"{timeout_s:g} s",
                log_tail(host, log_path),
                log_path,
            )
        time.sleep(poll_s)


def log_tail(host: Host, path: str, lines: int = 40) -> str:
    res = host.run(
        f"tail -n {lines} {shlex.quote(path)}", timeout_s=60, idempotent=True, stream=False
    )
    return res.stdout.rstrip()
