"""The GPUs' compute processes as nvidia-smi lists them, and the one way we report them.

One job: asking the driver which processes hold a GPU. A start is refused while any does (a
benchmark beside them would share the GPUs); a stop checks that none of ours is left. A host
without nvidia-smi has no GPU to check; an nvidia-smi that fails is said so, never read as
"no GPU process".
"""

from __future__ import annotations

import logging

from speedmatrix.engine.hosts import Host
from speedmatrix.engine.vllm_server.contract import GpuBusy

log = logging.getLogger("speedmatrix.server")

_NO_NVIDIA_SMI = "speedmatrix:no-nvidia-smi"


# What stop_server asks the driver: one line per GPU compute process ("pid, name, memory").
GPU_APPS_QUERY = (
    "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader"
)


def describe_gpu_apps(apps: list[dict]) -> str:
    """``PID <pid> (<name>, <memory>)`` per process, comma-separated: how an error names the
    GPU compute processes :func:`gpu_compute_apps` found (a busy GPU, one of ours left)."""
    return ", ".join(f"PID {a['pid']} ({a['name']}, {a['memory']})" for a in apps)


def gpu_compute_apps(host: Host) -> tuple[str, list[dict]]:
    """The GPU compute processes nvidia-smi lists on the host, and how the question went.

    Returns ``("absent", [])`` on a host without nvidia-smi (a CPU host: nothing to check),
    ``("ok", apps)`` with one ``{"pid", "name", "memory"}`` per process, or
    ``("failed: <why>", [])`` when nvidia-smi is there but does not answer (driver gone, GPU
    fallen off the bus): the caller must not read that as "no GPU process left".
    """
    res = host.run(
        f"command -v nvidia-smi >/dev/null 2>&1 || {{ echo {_NO_NVIDIA_SMI}; exit 0; }}; "
        f"{GPU_APPS_QUERY}",
        timeout_s=60,
        idempotent=True,
        stream=False,
    )
    if res.rc == 0 and res.stdout.strip() == _NO_NVIDIA_SMI:
        return "absent", []
    if res.rc != 0:
        why = " ".join(res.tail(5).split())[:300] or "no output"
        return f"failed: nvidia-smi exited with code {res.rc}: {why}", []
    apps = []
    for line in res.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if parts and parts[0].isdigit():
            apps.append(
                {
                    "pid": int(parts[0]),
                    "name": parts[1] if len(parts) > 1 else "",
                    "memory": parts[2] if len(parts) > 2 else "",
                }
            )
    return "ok", apps


def check_gpus_free(host: Host) -> None:
    """Refuse a start while a GPU compute process runs (see the package docstring)."""
    status, apps = gpu_compute_apps(host)
    if status == "absent":
        log.info("%s: no nvidia-smi on the host: no GPU to check before the start", host.name)
    elif status != "ok":
        # No driver answering: no process can hold a GPU either; the engine's own start says
        # whether it gets one.
        log.warning("%s: could not check the GPUs before the start (%s)", host.name, status)
    elif apps:
        shown = describe_gpu_apps(apps)
        raise GpuBusy(
            f"the GPUs of {host.name} are busy: nvidia-smi lists compute processes that are "
            f"not of this run: {shown}; a benchmark beside them would share the GPUs. Nothing "
            "was started: stop them or wait for them, then run again"
        )
    else:
        log.info("%s: nvidia-smi lists no GPU compute process: the GPUs are free", host.name)
