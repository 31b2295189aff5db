"""Change points over a 60-night history (issue 40, item 8): one 3% step and a creep of five
2% steps, each to be found and placed within one commit of the truth.

The histories are measured, not drawn: every night is the simulator (the calibrated reference
profile, on a thread of this process) with its step times scaled by that night's slowdown, and
the night's figure is what the load generator measures of it: the 8K prefill cell (prompt
tok/s, the median of its cold prompts) and the 8K x 4 decode cell (total tok/s, a short
window). So the noise the detector must see through is the simulator's and this host's own (a
shared machine: the wall-clock jitter of a busy host, magnified by the time scale). Each night
is a new engine commit (a main branch's nightly); the history goes through the pipeline's own
trend (analysis.trend: comparability, each run's verdict against the one before, the change
points by Apache Otava, analysis.changepoints).

Truth: night 15 is 3% slower than night 14 (and stays so); nights 35, 38, 41, 44 and 47 are
each 2% slower than the night before (a creep, -9.6% in all). A step is *found* when a change
point lies within one night (one commit) of it; the creep is found when its first step is;
each of its five steps is also reported on its own.

Run: `uv run python benchmarks/changepoint_bench.py [--nights 60] [--histories 2]
[--time-scale 5] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import statistics
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from speedmatrix.analysis.changepoints import change_points
from speedmatrix.analysis.trend import trend
from speedmatrix.loadgen import DecodeConfig, PrefillConfig, run_decode, run_prefill
from speedmatrix.sim.runner import run_in_thread

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "include" / "sim-profiles" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"
MODEL = "Kimi-K2.7-Code-NVFP4"
STEP_NIGHT, STEP = 15, 0.03
CREEP_NIGHTS, CREEP = (35, 38, 41, 44, 47), 0.02
T0 = datetime(2026, 10, 1, tzinfo=UTC)


def throughput_factor(night: int) -> float:
    """The engine's throughput on `night` relative to night 0 (the truth)."""
    f = 1.0 - STEP if night >= STEP_NIGHT else 1.0
    for n in CREEP_NIGHTS:
        if night >= n:
            f *= 1.0 - CREEP
    return f


def scaled_profile(base: dict[str, Any], factor: float) -> dict[str, Any]:
    """The profile with every step time divided by `factor` (a throughput factor): prefill's
    cumulative times and the decode step model (its floor too)."""
    p = copy.deepcopy(base)
    p["prefill"]["points"] = [[t, s / factor] for t, s in p["prefill"]["points"]]
    for key in ("base_s", "per_seq_s", "per_kv_token_s", "min_step_s"):
        if key in p["decode"]:
            p["decode"][key] = p["decode"][key] / factor
    return p


def measure_night(base: dict[str, Any], night: int, time_scale: float, tag: str) -> dict:
    """The night's two cells, measured on a simulator of that night's engine."""
    common = {"model": MODEL, "time_scale": time_scale, "progress": False}
    with run_in_thread(scaled_profile(base, throughput_factor(night)), time_scale=time_scale) as u:
        pre, _ = asyncio.run(
            run_prefill(PrefillConfig(base_url=u, context=8192, run_tag=f"{tag}n{night}", **common))
        )
        dec, _ = asyncio.run(
            run_decode(
                DecodeConfig(
                    base_url=u,
                    context=8192,
                    concurrency=4,
                    window_s=10.0,
                    max_output_tokens=512,
                    run_tag=f"{tag}n{night}",
                    max_loop_lag_ms=50.0,
                    max_client_cpu_pct=100.0,
                    token_tolerance=0.03,
                    **common,
                )
            )
        )
    return {"prefill": pre, "decode": dec}


def history_tables(nights: list[dict]) -> tuple[list[dict], list[dict]]:
    runs, cells = [], []
    for i, measured in enumerate(nights):
        rid = f"night{i:02d}"
        runs.append(
            {
                "run_id": rid,
                "recipe_id": "sim/bench",
                "host": "local",
                "status": "success",
                "engine_commit": f"{i:02d}" + "0" * 38,
                "started_at": T0 + timedelta(days=i),
            }
        )
        for cell in measured.values():
            cells.append({**cell, "run_id": rid})
    return runs, cells


def judge(runs: list[dict], cells: list[dict], cell: str) -> dict[str, Any]:
    pts = trend(runs, cells, recipe="sim/bench", cell=cell)
    found = change_points(pts, higher_is_better=True)
    at = [int(cp.run_id[-2:]) for cp in found]
    values = [v for v in pts["value"] if v == v and v is not None]
    flat = values[:STEP_NIGHT]
    rel = [abs(b / a - 1) for a, b in itertools.pairwise(flat)]

    def near(n: int) -> int | None:
        hits = [a for a in at if abs(a - n) <= 1]
        return hits[0] if hits else None

    truth = [STEP_NIGHT, *CREEP_NIGHTS]
    return {
        "cell": cell,
        "valid_nights": len(values),
        "night_to_night_median_pct": 100 * statistics.median(rel) if rel else None,
        "change_points": [
            {"night": n, "change_pct": round(cp.change_pct, 2), "pvalue": cp.pvalue}
            for n, cp in zip(at, found, strict=True)
        ],
        "step_found_at": near(STEP_NIGHT),
        "creep_found_at": near(CREEP_NIGHTS[0]),
        "creep_steps_found": [n for n in CREEP_NIGHTS if near(n) is not None],
        "false_change_points": [a for a in at if all(abs(a - n) > 1 for n in truth)],
        "verdicts_regression": int((pts["verdict"] == "regression").sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nights", type=int, default=60)
    ap.add_argument("--histories", type=int, default=2, help="independent measured histories")
    ap.add_argument("--time-scale", type=float, default=5.0)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    base = yaml.safe_load(PROFILE.read_text())
    out = []
    for h in range(args.histories):
        t0 = time.perf_counter()
        nights = [measure_night(base, n, args.time_scale, f"h{h}") for n in range(args.nights)]
        wall = time.perf_counter() - t0
        runs, cells = history_tables(nights)
        for cell in ("prefill 8K", "8Kx4"):
            got = judge(runs, cells, cell)
            got.update(history=h, measure_s=round(wall, 1))
            out.append(got)
            print(json.dumps(got))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
