"""Start benchmarks/ideal_server.py as a separate process (its own GIL and event loop).

A helper module, not a test file: test_loadgen_*.py import `ideal_server` from here.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "benchmarks" / "ideal_server.py"


@contextlib.contextmanager
def ideal_server(**options: object) -> Iterator[str]:
    """Yield the base URL of a fresh ideal server configured with IdealConfig fields."""
    argv = [sys.executable, str(SERVER), "--port", "0"]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("READY "):
            proc.kill()
            raise RuntimeError(f"ideal server did not start: {line!r} {proc.stderr.read()!r}")  # type: ignore[union-attr]
        yield line.split()[1]
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def truth(base_url: str) -> dict:
    """What the server itself measured (per request TTFT / TBT, emission log)."""
    with urllib.request.urlopen(f"{base_url}/truth", timeout=10) as resp:
        return json.load(resp)
