"""Default against published measurement profile, cell by cell (issue #35 part 3).

Why: a user comparing our numbers with a published page needs to know what changes when the
same server is measured by the published tool's definitions (`--profile published`) rather
than ours. Each engine gets the same cells twice, a run of each profile (own run tag, cells in
the pipeline's run order, the published run's first cell doing the tool's global warm-up);
per cell: TTFT, total tok/s, per-request tok/s, time between tokens and prompt tokens.

    uv run python benchmarks/profile_bench.py --engine sim        # calibrated simulator
    SPEEDMATRIX_TEST_HOME=/work/sm-test-home \\
        uv run python benchmarks/profile_bench.py --engine vllm   # real vLLM on this CPU

Prints one JSON object per engine (the cells of both profiles and their differences) and a
Markdown table; `--out F` also writes the JSON. Short windows: the CPU is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from speedmatrix.loadgen import DecodeConfig, PrefillConfig, run_cell
from speedmatrix.records import cell_name, context_label

ROOT = Path(__file__).resolve().parents[1]
SIM_PROFILE = ROOT / "include" / "sim-profiles" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"
FIGURES = ("ttft_ms", "total_tok_s", "per_request_tok_s", "tbt_ms", "context_tokens")

ENGINES: dict[str, dict[str, Any]] = {
    # the reference page's simulator: its contexts, 10 s windows, in real time (a faster
    # clock multiplies the client's own costs, connect and body building, into the figures)
    "sim": {
        "prefill": [8192, 65536, 131072],
        "decode": [(8192, 1), (8192, 4), (8192, 16), (65536, 2), (131072, 1)],
        "window_s": 10.0,
        "max_output": 4096,
        "time_scale": 1.0,
    },
    # the tiny model (max-model-len 2,048): short requests restart inside a 4 s window
    "vllm": {
        "prefill": [512, 1536],
        "decode": [(512, 1), (512, 4), (1536, 2)],
        "window_s": 4.0,
        "max_output": 256,
        "time_scale": 1.0,
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def sim_server(time_scale: float) -> Iterator[tuple[str, str, str | None]]:
    """(base url, model, api key) of `speedmatrix sim serve` on the reference profile, started
    and stopped as the simulator's integration tests do (one helper, theirs)."""
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    from test_loadgen_sim import sim

    with sim(SIM_PROFILE, time_scale) as url:
        yield url, "Kimi-K2.7-Code-NVFP4", None


@contextlib.contextmanager
def vllm_server(home: str) -> Iterator[tuple[str, str, str | None]]:
    """Real vLLM on this CPU (the integration tests' recipe and env), started and stopped."""
    from speedmatrix.engine.hosts import get_host
    from speedmatrix.engine.provision import provision
    from speedmatrix.engine.vllm_server import start_server, stop_server
    from speedmatrix.recipes import load_recipe

    host = get_host("local", env={"HOME": home})
    recipe = load_recipe("cpu/tiny/llama-tiny")
    env = provision(recipe, host=host, poll_s=2)
    key = "bench-" + os.urandom(4).hex()
    handle = start_server(recipe, env, host, port=_free_port(), api_key=key)
    try:
        yield handle.base_url, recipe.model.served_name, key
    finally:
        stop_server(handle, host=host)


def run_profile(
    url: str,
    model: str,
    key: str | None,
    spec: dict[str, Any],
    profile: str,
    tag: str,
    prompt_mode: str = "distinct",
) -> dict[str, dict[str, Any]]:
    """Every cell of `spec` by one profile, in the pipeline's order (plan.run_order);
    `prompt_mode` of the default profile's decode cells (the published one always shares)."""
    contexts = sorted({*spec["prefill"], *(c for c, _ in spec["decode"])})
    largest = max(contexts)
    c1 = [c for c, n in spec["decode"] if n == 1]
    out: dict[str, dict[str, Any]] = {}
    first = True
    for ctx in contexts:
        cells: list[tuple[str, int]] = [("prefill", 1)] if ctx in spec["prefill"] else []
        cells += sorted(("decode", n) for c, n in spec["decode"] if c == ctx)
        for phase, n in cells:
            common: dict[str, Any] = {
                "base_url": url,
                "model": model,
                "context": ctx,
                "api_key": key,
                "run_tag": tag,
                "progress": False,
                "time_scale": spec["time_scale"],
                "measurement_profile": profile,
                "first_token_timeout_s": 300.0,
            }
            if profile == "published":
                common["largest_context"] = largest
                if first:
                    common["global_warmup_context"] = max(c1 or [largest])
            first = False
            if phase == "prefill":
                cfg: PrefillConfig | DecodeConfig = PrefillConfig(**common)
            else:
                cfg = DecodeConfig(
                    **common,
                    concurrency=n,
                    window_s=spec["window_s"],
                    max_output_tokens=spec["max_output"],
                    prompt_mode=prompt_mode,
                    keep_requests=False,
                )
            t = time.monotonic()
            cell, _ = run_cell(cfg)
            name = cell_name(phase, context_label(ctx), n)
            out[name] = {f: cell.get(f) for f in (*FIGURES, "status", "error")}
            out[name]["wall_s"] = round(time.monotonic() - t, 1)
            print(f"  {profile:9s} {prompt_mode:8s} {name:14s} {cell['status']} {cell.get('error') or ''}",
                  file=sys.stderr)  # fmt: skip
    return out


def differences(default: dict, published: dict) -> dict[str, dict[str, float | None]]:
    """published / default - 1 per cell and figure (None where either is missing)."""
    out: dict[str, dict[str, float | None]] = {}
    for name, a in default.items():
        b = published.get(name, {})
        out[name] = {
            f: (b[f] / a[f] - 1.0) if a.get(f) and b.get(f) is not None else None for f in FIGURES
        }
    return out


def table(result: dict) -> str:
    shared = result.get("default_shared")
    head = "| cell | figure | default | published | published vs default |"
    rule = "|---|---|---|---|---|"
    if shared:
        head += " default, shared prompt | shared vs default |"
        rule += "---|---|"
    lines = [head, rule]
    for name, diff in result["differences"].items():
        a, b = result["default"][name], result["published"][name]
        for f in FIGURES:
            if a.get(f) is None and b.get(f) is None:
                continue
            line = f"| {name} | {f} | {_num(a.get(f))} | {_num(b.get(f))} | {_pct(diff[f])} |"
            if shared:
                s = shared[name].get(f)
                line += f" {_num(s)} | {_pct(result['differences_shared_vs_default'][name][f])} |"
            lines.append(line)
    return "\n".join(lines)


def _pct(d: float | None) -> str:
    return "—" if d is None else f"{d:+.1%}"


def _num(v: Any) -> str:
    return "—" if v is None else f"{v:,.1f}" if isinstance(v, float) else f"{v:,}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("sim", "vllm"), required=True)
    ap.add_argument("--home", default=os.environ.get("SPEEDMATRIX_TEST_HOME"))
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument(
        "--shared-too",
        action="store_true",
        help="also measure the default profile with one shared prompt (default-shared): what "
        "prompt sharing alone changes, apart from the published profile's other definitions",
    )
    args = ap.parse_args()
    spec = ENGINES[args.engine]
    if args.engine == "vllm":
        if not args.home:
            ap.error("--engine vllm needs --home or SPEEDMATRIX_TEST_HOME (the provisioned env)")
        server = vllm_server(args.home)
    else:
        server = sim_server(spec["time_scale"])
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with server as (url, model, key):
        tag = os.urandom(3).hex()
        default = run_profile(url, model, key, spec, "default", f"bd{tag}")
        published = run_profile(url, model, key, spec, "published", f"bp{tag}")
        shared = (
            run_profile(url, model, key, spec, "default", f"bs{tag}", "shared")
            if args.shared_too
            else None
        )
    result = {
        "engine": args.engine,
        "measured_at": stamp,
        "spec": {k: v for k, v in spec.items()},
        "default": default,
        "published": published,
        "differences": differences(default, published),
    }
    if shared is not None:
        result["default_shared"] = shared
        result["differences_shared_vs_default"] = differences(default, shared)
        result["differences_published_vs_shared"] = differences(shared, published)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
