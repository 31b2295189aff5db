"""Is the server still up: GET /health, asked before and after each cell.

From this process when the server is on this machine; otherwise with the host's python on
the host, since a GPU host's port is not always reachable from the Airflow worker. The URL
and the python reach the host's shell quoted (shlex), the URL as an argument of a fixed
probe script, never as part of its source.
"""

from __future__ import annotations

import shlex
import urllib.error
import urllib.request

from speedmatrix.engine.hosts import Host

HEALTH_TIMEOUT_S = 10.0

_PROBE_PY = (
    "import sys, urllib.request as u\n"
    "try:\n r = u.urlopen(sys.argv[1], timeout=float(sys.argv[2]))\n print(r.status)\n"
    "except Exception as e:\n print(type(e).__name__, getattr(e, 'reason', e))"
)


def server_health(base_url: str, host: Host | None = None, python: str = "python3") -> str | None:
    """None when GET /health answers 200 within HEALTH_TIMEOUT_S, else why not (one line).

    `host` None: asked from this process; else asked on `host` with its `python`."""
    url = base_url.rstrip("/") + "/health"
    if host is None:
        try:
            with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as resp:
                return None if resp.status == 200 else f"/health answered {resp.status}"
        except urllib.error.HTTPError as exc:
            return f"/health answered {exc.code}"
        except OSError as exc:
            return f"/health unreachable: {getattr(exc, 'reason', exc)}"
    res = host.run(
        shlex.join([python, "-c", _PROBE_PY, url, str(HEALTH_TIMEOUT_S)]),
        timeout_s=HEALTH_TIMEOUT_S + 20,
        idempotent=True,
        stream=False,
    )
    answer = res.stdout.strip()
    return None if answer == "200" else f"/health: {answer or res.tail(3)}"
