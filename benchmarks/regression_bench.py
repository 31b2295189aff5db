"""How long the `regressions` task takes on a reference-sized matrix, and how much noise the
comparison sees per cell.

Builds a history in a temporary warehouse: N runs of the reference matrix (the calibrated
simulator profile's predictions for every cell, 7 prefill + 48 decode contexts x concurrencies,
with seeded per-run variation of 0.6% and synthetic per-stream request rows), the last one with
one cell 10% slower; then times `comparison_for_run` and `judge_regressions` on the last run.

Run: `uv run python benchmarks/regression_bench.py [--runs 20]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta

import numpy as np

from speedmatrix.analysis.compare import comparison_for_run, judge_regressions
from speedmatrix.analysis.verdict import RegressionError
from speedmatrix.sim.predict import predict_matrix
from speedmatrix.sim.profile import load_profile
from speedmatrix.store.warehouse import Warehouse

RECIPE = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
K = 1024
PREFILL = [8 * K, 16 * K, 32 * K, 64 * K, 128 * K, 251 * K, 256 * K]
CONTEXTS = [8 * K, 16 * K, 32 * K, 64 * K, 128 * K, 251 * K]
CONCURRENCIES = [1, 2, 4, 8, 16, 32, 64, 128]
PLANTED = (64 * K, 2)


def synth_run(base_cells, i, rng, planted):
    factor = 1.0 + rng.normal(0, 0.006)
    cells, requests = [], []
    for c in base_cells:
        c = dict(c)
        if c["status"] == "valid":
            f = factor * (
                0.9 if planted and (c["context_tokens"], c["concurrency"]) == PLANTED else 1
            )
            c["total_tok_s"] *= f
            if c["phase"] == "decode":
                c["tbt_ms"] /= f
                c["per_request_tok_s"] *= f
                conc = c["concurrency"]
                per_stream = c["total_tok_s"] * c["measured_s"] / conc
                for s in range(conc):
                    requests.append(
                        {
                            "phase": "decode",
                            "context_tokens": c["context_tokens"],
                            "concurrency": conc,
                            "request_index": s,
                            "stream": s,
                            "window_tokens": int(per_stream * (1 + rng.normal(0, 0.01))),
                            "tbt_ms": c["tbt_ms"] * (1 + rng.normal(0, 0.01)),
                            "ttft_ms": c["ttft_ms"],
                        }
                    )
                c["output_tokens"] = int(c["total_tok_s"] * c["measured_s"])
        cells.append(c)
    run = {
        "run_id": f"bench-{i:03d}",
        "recipe_id": RECIPE,
        "trigger": "nightly",
        "status": "success",
        "host": "local",
        "engine_commit": f"{i // 2:040x}",  # pairs of runs per commit: between-run noise
        "started_at": datetime(2026, 11, 1, tzinfo=UTC) + timedelta(days=i),
    }
    return run, cells, requests


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    prof = load_profile("kimi-k2.7-nvfp4-rtxpro6k-x8")
    t = time.perf_counter()
    base = predict_matrix(
        prof, prefill_contexts=PREFILL, contexts=CONTEXTS, concurrencies=CONCURRENCIES
    )
    print(f"predicted the reference matrix in {time.perf_counter() - t:.1f} s")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as root:
        wh = Warehouse(root)
        n_req = 0
        for i in range(args.runs):
            run, cells, reqs = synth_run(base, i, rng, planted=i == args.runs - 1)
            n_req += len(reqs)
            wh.land_run(run, cells, reqs)
        last = f"bench-{args.runs - 1:03d}"
        print(f"landed {args.runs} runs ({len(base)} cells, {n_req // args.runs} requests each)")
        times = []
        for _ in range(3):
            t = time.perf_counter()
            result = comparison_for_run(wh, last)
            times.append(time.perf_counter() - t)
        flagged = sorted(
            {
                (r["context_label"], r["concurrency"])
                for r in result.rows
                if r["verdict"] == "regression"
            }
        )
        noise = [
            r["noise_pct"] for r in result.rows if r["metric"] == "total_tok_s" and r["noise_pct"]
        ]
        print(f"comparison_for_run: median {statistics.median(times):.2f} s over 3")
        print(f"comparison rows: {len(result.rows)}; regressions in cells: {flagged}")
        print(
            f"decode total tok/s noise: median ±{statistics.median(noise):.2f}%, "
            f"max ±{max(noise):.2f}%"
        )
        t = time.perf_counter()
        try:
            judge_regressions(wh, last)
        except RegressionError as exc:
            print(f"judge_regressions (lands tables + charts): {time.perf_counter() - t:.2f} s")
            print(str(exc).splitlines()[0])
        wh.close()


if __name__ == "__main__":
    main()
