"""Stopping a server: TERM to its group, KILL what outlives the grace, then verify.

One job: the stop, idempotent and safe after PID reuse (a group that is no longer ours is
never signalled). It verifies that no process of the group is left and, on GPU hosts, that
nvidia-smi lists no compute process of ours; it removes the server's key and its machine-wide
registry entry when they are still this server's.
"""

from __future__ import annotations

import logging
import shlex
import time

from speedmatrix.engine.hosts import Host
from speedmatrix.engine.vllm_server.contract import ServerError, ServerHandle
from speedmatrix.engine.vllm_server.gpus import describe_gpu_apps, gpu_compute_apps
from speedmatrix.engine.vllm_server.registry import group_pids, server_state

log = logging.getLogger("speedmatrix.server")

STOP_POLL_S = 0.1
"""Between checks that the group is gone. The host's lease is held until the stop is verified,
so each sleep past the exit is host time lost: the simulator exits 12 ms after SIGTERM, and a
0.5 s poll would keep the host up to 0.5 s more; a check is one `ps`-like command (a few ms
locally, one SSH command on a remote host, over its open connection)."""


def stop_server(
    handle: ServerHandle,
    *,
    host: Host | None = None,
    grace_s: float = 30.0,
    gpu_wait_s: float = 15.0,
) -> dict:
    """TERM the group, wait up to ``grace_s``, KILL the rest, verify nothing is left.

    Then, on a GPU host, ask nvidia-smi whether a process of ours (one seen in the group) still
    holds a GPU, for up to ``gpu_wait_s`` (the driver releases a killed process's context a
    moment after it exits). On a host without nvidia-smi that check is skipped; when nvidia-smi
    is there but fails, the result's ``gpu_check`` says so and a warning is logged (the GPUs
    could not be verified, which is not the same as verified free).

    Idempotent: a group already gone is fine. A PID that now belongs to another process (see
    the package docstring: PID reuse) is never signalled: ``gone`` says why the server is gone.
    Returns what happened (``killed`` and ``term_survivors`` tell that SIGTERM was not enough);
    raises ServerError when a process of the group survives SIGKILL or a GPU compute process of
    ours remains.
    """
    host = host or handle.get_host()
    pg = int(handle.pid)
    state = server_state(host, handle)
    gone = state.partition(": ")[2] if state.startswith("gone") else None
    before = [] if gone else group_pids(host, pg)
    ours = set() if gone else {*before, pg}
    outcome: dict = {
        "pid": pg,
        "was_running": bool(before),
        "gone": gone,
        "killed": False,
        "term_survivors": [],
        "left": [],
        "gpu_check": "",
        "gpu_left": [],
    }
    if gone:
        log.warning(
            "%s: server group %d is gone, %s; not signalled (nothing of that PID is ours)",
            host.name,
            pg,
            gone,
        )
    if before:
        host.run(f"kill -TERM -- -{pg} 2>/dev/null; true", timeout_s=30, idempotent=True)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_pids(host, pg):
            time.sleep(STOP_POLL_S)
        survivors = group_pids(host, pg)
        if survivors:
            ours.update(survivors)
            log.warning(
                "%s: server group %d still had PIDs %s %g s after SIGTERM: sending SIGKILL",
                host.name,
                pg,
                survivors,
                grace_s,
            )
            host.run(f"kill -KILL -- -{pg} 2>/dev/null; true", timeout_s=30, idempotent=True)
            outcome["killed"] = True
            outcome["term_survivors"] = survivors
            for _ in range(int(10 / STOP_POLL_S)):
                if not group_pids(host, pg):
                    break
                time.sleep(STOP_POLL_S)
    left = group_pids(host, pg) if not gone else []
    outcome["left"] = left

    gpu_left: list[dict] = []
    deadline = time.monotonic() + gpu_wait_s
    while True:
        status, apps = gpu_compute_apps(host)
        gpu_left = [a for a in apps if a["pid"] in ours]
        if status != "ok" or not gpu_left or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if status == "absent":
        outcome["gpu_check"] = "skipped: no nvidia-smi on the host"
    elif status != "ok":
        outcome["gpu_check"] = status
        log.warning(
            "%s: could not check the GPUs after stopping server group %d (%s): "
            "a GPU compute process of ours may remain",
            host.name,
            pg,
            status,
        )
    else:
        outcome["gpu_check"] = "ok" if not gpu_left else "GPU compute processes of ours remain"
    outcome["gpu_left"] = [a["pid"] for a in gpu_left]

    # Only this server's key: a run dir whose pid file names another PID belongs to a newer
    # server on the same port (started after this one died), which still needs its key.
    host.run(
        f"p=$(cat {shlex.quote(handle.run_dir + '/pid')} 2>/dev/null); "
        f'if [ -z "$p" ] || [ "$p" = {pg} ]; then rm -f {shlex.quote(handle.run_dir + "/secrets.env")}; fi',
        timeout_s=30,
        idempotent=True,
    )
    if handle.record and not left:
        # the machine-wide entry, when it still names this server (and is ours to remove)
        host.run(
            f'if [ "$(head -n 1 {shlex.quote(handle.record)} 2>/dev/null)" = {pg} ]; then '
            f"rm -f {shlex.quote(handle.record)}; fi; true",
            timeout_s=30,
            idempotent=True,
            stream=False,
        )
    if left:
        raise ServerError(f"server group {pg} on {host.name} survived SIGKILL: PIDs {left}")
    if gpu_left:
        shown = describe_gpu_apps(gpu_left)
        raise ServerError(
            f"server group {pg} on {host.name} is stopped, but nvidia-smi still lists GPU "
            f"compute processes of ours {gpu_wait_s:g} s later: {shown}; their GPU memory is "
            "not free for the next server"
        )
    log.info("%s: server group %d stopped (%s)", host.name, pg, outcome)
    return outcome
