"""What the tests ask of the machine's process table."""

from __future__ import annotations

import subprocess


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running. A zombie has exited (no memory, port or GPU left) and
    only awaits its reaper, which on this machine's init comes ~2 s late; the stop does not
    wait for it either (engine.vllm_server.registry.group_pids)."""
    out = subprocess.run(["ps", "-eo", "pid=,stat="], capture_output=True, text=True).stdout
    live = {int(pid) for pid, stat in (line.split() for line in out.splitlines()) if stat[0] != "Z"}
    return [p for p in pids if p in live]
