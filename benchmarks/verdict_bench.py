"""Verdicts on a loaded host (issue #40): false alarms on identical builds, detection of injected
decode and prefill slowdowns at the same engine commit and at a new one, a masked slowdown
followed by a further one, and the minimum detectable change per cell.

Two phases, so that the machine (shared) pays for the measurements once:

* ``measure``: the simulator (the calibrated Kimi profile) in a thread, measured by
  `speedmatrix run` in this process over HTTP (the simulator at 2x its real speed) with a small matrix (prefill 8K; decode 8K x 1
  and 8K x 4; 2 s windows, 256 output tokens) while one core is kept busy by a spinning child
  process (the loaded host). `--base` runs of the unchanged profile, then `--slowed` runs of each
  injected slowdown: a copy of the profile with its decode step times (base_s, per_seq_s,
  per_kv_token_s) or its prefill times scaled by 1 + s, for s in 3, 5, 10, 25, 50%. Every run
  lands in one warehouse (--warehouse).
* ``judge``: the measured runs are read back and judged by the pipeline's own functions
  (analysis.noise.NoiseModel.from_history with the history strictly before the candidate,
  analysis.baseline.baseline_cells, analysis.verdict.compare_runs with the requests' within-
  window intervals), in memory: each trial is a history of `--history` base runs in a seeded
  random order, then the candidate. Identical builds: a base run not in its history (a false
  alarm is any regression in the run's verdict). Detection: a slowed run after the history,
  labelled at the history's last commit (same commit) or at a new one; cells are trials (a
  decode slowdown is caught in a cell when any of its throughput figures regresses, a prefill
  one when its prefill tok/s does). Masked: the history, then a 10% slowed run (judged), then a
  25% slowed run (a further 14% slower than the one before it): the second must be caught too.

Run: `uv run python benchmarks/verdict_bench.py measure --warehouse /tmp/vb` then
`uv run python benchmarks/verdict_bench.py judge --warehouse /tmp/vb` (`--scale q75` or
`mad-small-sample`: the same trials under an alternative between-run scale). `calibrate`: the
false-alarm chance of one figure under the pipeline's band on simulated noise (normal and
heavy-tailed), and the factor that would give it the nominal 0.27%.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "include" / "sim-profiles" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"
MODEL = "Kimi-K2.7-Code-NVFP4"
MATRIX = ["--prefill-contexts", "8K", "--contexts", "8K", "--concurrencies", "1", "4"]
MATRIX += ["--window-s", "2", "--max-output-tokens", "256"]
TIME_SCALE = 2.0
"""The simulator runs twice as fast as the hardware it models (every run alike): half the
machine time, and the loaded host's jitter weighs twice as much against each step."""
SLOWDOWNS = (0.03, 0.05, 0.10, 0.25, 0.50)
DECODE_KEYS = ("base_s", "per_seq_s", "per_kv_token_s", "min_step_s")
THROUGHPUT = {"total_tok_s", "per_request_tok_s", "tbt_ms", "prefill_tok_s"}


def slowed_profile(kind: str, s: float) -> dict[str, Any]:
    """The profile with its decode step times or its prefill times scaled by 1 + s."""
    prof = yaml.safe_load(PROFILE.read_text())
    out = copy.deepcopy(prof)
    if kind == "decode":
        for k in DECODE_KEYS:
            if k in out["decode"]:
                out["decode"][k] = float(out["decode"][k]) * (1 + s)
    elif kind == "prefill":
        out["prefill"]["points"] = [[n, float(t) * (1 + s)] for n, t in out["prefill"]["points"]]
    out["name"] = f"{prof['name']}-{kind}-{int(s * 100)}"
    return out


def _busy_core() -> subprocess.Popen[bytes]:
    """One core kept busy: the loaded host."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _matrix(args: argparse.Namespace) -> list[str]:
    """MATRIX, with --window-s (the fixed window, or the adaptive cap) and --adaptive (issue
    #45: the same benchmark with adaptive windows, whose false alarms and detection must not
    change)."""
    out = [*MATRIX]
    if args.window_s is not None:
        out[out.index("--window-s") + 1] = str(args.window_s)
    if args.adaptive:
        out += ["--adaptive", "--adaptive-min-s", str(args.adaptive_min_s)]
    return out


def measure(args: argparse.Namespace) -> None:
    from speedmatrix.cli import main as cli
    from speedmatrix.sim.runner import run_in_thread

    os.environ.pop("SPEEDMATRIX_API_KEY", None)
    # a lease directory of its own: the machine-wide one is shared with other runs and tests
    os.environ["SPEEDMATRIX_LEASE_DIR"] = tempfile.mkdtemp(prefix="verdict-bench-lease-")
    plan: list[tuple[str, float, int]] = [("base", 0.0, i) for i in range(args.base)]
    plan += [
        (k, s, i) for k in ("decode", "prefill") for s in SLOWDOWNS for i in range(args.slowed)
    ]
    if args.masked:
        plan += [("decode", 0.10, args.slowed + i) for i in range(args.masked)]
        plan += [("decode", 0.25, args.slowed + i) for i in range(args.masked)]
    random.Random(0).shuffle(plan)  # slow drift of the host spreads over every kind
    Path(args.warehouse).mkdir(parents=True, exist_ok=True)
    busy = _busy_core()
    labels: dict[str, dict[str, Any]] = {}
    try:
        for n, (kind, s, i) in enumerate(plan):
            prof = (
                yaml.safe_load(PROFILE.read_text()) if kind == "base" else slowed_profile(kind, s)
            )
            t0 = time.monotonic()
            with run_in_thread(prof, time_scale=TIME_SCALE) as url:
                rc = cli(
                    ["run", "--base-url", url, "--model", MODEL, *_matrix(args),
                     "--warehouse", args.warehouse, "--engine-ref", f"{n + 1:040x}"]
                )  # fmt: skip
            print(f"[{n + 1}/{len(plan)}] {kind} {s:.0%} #{i}: rc {rc}, "
                  f"{time.monotonic() - t0:.1f} s", flush=True)  # fmt: skip
            labels[f"{n + 1:040x}"] = {"kind": kind, "slowdown": s, "index": i}
    finally:
        busy.kill()
        busy.wait()
    Path(args.warehouse, "bench-labels.json").write_text(json.dumps(labels, indent=1))


# ------------------------------------------------------------------------------------ judge


def _load(root: str) -> tuple[dict[str, Any], dict[str, list], dict[str, list], dict]:
    from speedmatrix.store.warehouse import Warehouse

    labels = json.loads(Path(root, "bench-labels.json").read_text())
    wh = Warehouse(root)
    runs = wh.query("SELECT * FROM runs").to_dict("records")
    out_runs, cells, requests = {}, {}, {}
    for r in runs:
        label = labels.get(str(r.get("engine_commit"))) or labels.get(str(r.get("engine_ref")))
        if label is None or r.get("status") not in ("success", "partial"):
            continue
        _, c, q = wh.read_run(r["run_id"])
        out_runs[r["run_id"]] = {**r, **label}
        cells[r["run_id"]], requests[r["run_id"]] = c, q
    wh.close()
    return out_runs, cells, requests, labels


def judge_one(
    history: list[str],
    candidate: str,
    runs: dict[str, Any],
    cells: dict[str, list],
    requests: dict[str, list],
    *,
    same_commit: bool,
    extra: list[str] = (),
) -> list[dict[str, Any]]:
    """The candidate's verdict rows after `history` (oldest first) and `extra` runs, as
    `comparison_for_run` makes them: noise from the history strictly before it, each cell
    against its latest earlier comparable cell."""
    from speedmatrix.analysis.baseline import baseline_cells, recipe_threshold
    from speedmatrix.analysis.noise import NoiseModel
    from speedmatrix.analysis.verdict import compare_runs

    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    order = [*history, *extra, candidate]
    placed, all_cells = {}, []
    for i, rid in enumerate(order):
        commit = "a" * 40 if (same_commit or rid != candidate) else "b" * 40
        r = {**runs[rid], "run_id": f"t{i}", "started_at": t0 + timedelta(days=i)}
        r.update(engine_commit=commit, trigger="nightly", recipe_id="bench/verdict", host="local")
        placed[rid] = r
        all_cells += [{**c, "run_id": r["run_id"]} for c in cells[rid]]
    run = placed[candidate]
    hist_runs = pd.DataFrame(list(placed.values()))
    hist_cells = pd.DataFrame(all_cells)
    noise = NoiseModel.from_history(hist_runs, hist_cells, before=run)
    own = [c for c in all_cells if c["run_id"] == run["run_id"]]
    b_cells, b_runs = baseline_cells(hist_runs, hist_cells, run, own)
    by_new_id = {placed[k]["run_id"]: k for k in placed}
    b_requests = []
    for c in b_cells:
        src = by_new_id[c["run_id"]]
        b_requests += [
            q for q in requests[src]
            if (q["phase"], q["context_tokens"], q["concurrency"])
            == (c["phase"], c["context_tokens"], c["concurrency"])
        ]  # fmt: skip
    latest = placed[order[-2]]
    return compare_runs(
        run, own, latest, b_cells,
        requests=requests[candidate], baseline_requests=b_requests,
        noise=noise, threshold=recipe_threshold(None), baseline_runs=b_runs,
    )  # fmt: skip


def _cell(r: dict[str, Any]) -> str:
    return f"{r['phase']} {r.get('context_label')}x{r['concurrency']}"


# --------------------------------------------------------------------- scale alternatives

SMALL_SAMPLE_K = {2: 12.87, 3: 16.86, 4: 8.48, 5: 8.85, 6: 6.43, 7: 6.64, 8: 5.49, 9: 5.65}
"""The band's factor (in place of 3) that gives a figure a 0.27% false-alarm chance on normal
noise when its sd is the MAD scale of `dof` consecutive differences (`calibrate` prints them)."""


def _q75_scale(diffs: Any) -> float:
    """Like noise.robust_rel_sd, from the 75th percentile of |differences| (sees more of the
    tail; one outlier run, two large differences of nine, still cannot move it)."""
    import math

    import numpy as np
    from scipy import stats

    d = np.abs(np.asarray(diffs, dtype=float))
    q = np.quantile(d, 0.75) / stats.halfnorm.ppf(0.75) if d.size else math.nan
    return float(q / math.sqrt(2))


def use_scale(name: str) -> None:
    """Judge with an alternative between-run scale (in this process only): `mad` the
    pipeline's; `q75`; `mad-small-sample`, the MAD scale times SMALL_SAMPLE_K[dof] / 3."""
    from speedmatrix.analysis import noise

    if name == "q75":
        noise.robust_rel_sd = _q75_scale
    elif name == "mad-small-sample":
        lookup = noise.NoiseModel.lookup_dof

        def widened(self: Any, *key: Any) -> tuple[float | None, str, int]:
            sd, source, dof = lookup(self, *key)
            k = SMALL_SAMPLE_K.get(dof, 5.0 if dof < 20 else 4.0)
            return (None if sd is None else sd * k / 3.0), source, dof

        noise.NoiseModel.lookup_dof = widened  # type: ignore[method-assign]


def calibrate(args: argparse.Namespace) -> None:
    """The false-alarm chance of one figure under the pipeline's band (3 x sqrt 2 x the MAD
    scale of the history's consecutive differences, the candidate against the latest run),
    on simulated noise: normal, and heavy-tailed (a share of runs disturbed)."""
    import numpy as np

    from speedmatrix.analysis.noise import MAD_TO_SD

    rng = np.random.default_rng(0)
    n = args.samples

    def normal(shape: tuple[int, int]) -> Any:
        return rng.normal(0.0, 1.0, shape)

    def disturbed(p: float, w: float) -> Any:
        def draw(shape: tuple[int, int]) -> Any:
            return np.where(
                rng.random(shape) < p, rng.normal(0.0, w, shape), rng.normal(0.0, 1.0, shape)
            )

        return draw

    kinds = {
        "normal": normal,
        "10% of runs 4x": disturbed(0.1, 4),
        "15% of runs 6x": disturbed(0.15, 6),
    }
    print("differences  " + "  ".join(f"{k:>16}" for k in kinds) + "   factor for 0.27% (normal)")
    for dof in (3, 5, 7, 9):
        cols = []
        for draw in kinds.values():
            x = draw((n, dof + 2))  # dof + 1 history measurements, then the candidate
            sd = MAD_TO_SD * np.median(np.abs(np.diff(x[:, :-1], axis=1)), axis=1) / np.sqrt(2)
            ratio = np.abs(x[:, -1] - x[:, -2]) / (np.sqrt(2) * sd)
            cols.append(ratio)
        rates = "  ".join(f"{np.mean(r > 3):>16.2%}" for r in cols)
        print(f"{dof:>11}  {rates}   {np.quantile(cols[0], 1 - 0.0027):.1f}")


def judge(args: argparse.Namespace) -> None:
    use_scale(args.scale)
    runs, cells, requests, _ = _load(args.warehouse)
    base = sorted(k for k, r in runs.items() if r["kind"] == "base")
    rng = random.Random(1)
    print(f"runs: {len(base)} base, {len(runs) - len(base)} slowed; history {args.history} runs")
    # false alarms: identical builds
    alarms, trials, figures, bands = 0, 0, defaultdict(int), defaultdict(list)
    unverified = 0
    for _ in range(args.trials):
        pick = rng.sample(base, args.history + 1)
        rows = judge_one(pick[:-1], pick[-1], runs, cells, requests, same_commit=True)
        trials += 1
        bad = [r for r in rows if r["verdict"] == "regression"]
        alarms += bool(bad)
        unverified += any(r["verdict"] == "unverified" for r in rows)
        for r in bad:
            figures[f"{_cell(r)} {r['metric']}"] += 1
        for r in rows:
            if r.get("noise_pct") is not None and r["metric"] in (
                "total_tok_s",
                "prefill_tok_s",
                "ttft_ms",
                "tbt_ms",
            ):
                bands[f"{_cell(r)} {r['metric']}"].append(max(r["noise_pct"], r["threshold_pct"]))
    print(f"\nidentical builds: {alarms} of {trials} run verdicts with a regression "
          f"({100 * alarms / trials:.1f}%); runs with an unverified figure: {unverified}")  # fmt: skip
    for k, n in sorted(figures.items()):
        print(f"  false alarm on {k}: {n}")
    print("\nminimum detectable change per figure (the band a change must leave: the larger of "
          "the threshold and the noise; median [min, max] over the trials):")  # fmt: skip
    for k, v in sorted(bands.items()):
        s = pd.Series(v)
        print(f"  {k}: {s.median():.1f}% [{s.min():.1f}%, {s.max():.1f}%]")
    # detection
    print("\ndetection (cells as trials: a cell is caught when a throughput figure regressed):")
    print("  kind     slowdown  same commit      new commit")
    for kind in ("decode", "prefill"):
        for s in SLOWDOWNS:
            slowed = sorted(k for k, r in runs.items() if r["kind"] == kind and r["slowdown"] == s)
            res = {}
            for same in (True, False):
                caught = total = 0
                for rid in slowed:
                    for _ in range(args.detect_trials):
                        hist = rng.sample(base, args.history)
                        rows = judge_one(hist, rid, runs, cells, requests, same_commit=same)
                        for cell in {_cell(r) for r in rows if r["phase"] == kind}:
                            figs = [
                                r for r in rows if _cell(r) == cell and r["metric"] in THROUGHPUT
                            ]
                            if not figs:
                                continue
                            total += 1
                            caught += any(r["verdict"] == "regression" for r in figs)
                res[same] = (caught, total)
            fmt = [
                f"{c}/{t} ({100 * c / t:.0f}%)" if t else "—" for c, t in (res[True], res[False])
            ]
            print(f"  {kind:8} {s:>7.0%}   {fmt[0]:15}  {fmt[1]}")
    # masked slowdown followed by a further one
    ten = sorted(k for k, r in runs.items() if r["kind"] == "decode" and r["slowdown"] == 0.10)
    quarter = sorted(k for k, r in runs.items() if r["kind"] == "decode" and r["slowdown"] == 0.25)
    first = second = n = 0
    for a in ten:
        for b in quarter:
            hist = rng.sample(base, args.history)
            rows1 = judge_one(hist, a, runs, cells, requests, same_commit=False)
            rows2 = judge_one(hist, b, runs, cells, requests, same_commit=False, extra=[a])
            n += 1
            first += any(r["verdict"] == "regression" and r["phase"] == "decode" for r in rows1)
            second += any(r["verdict"] == "regression" and r["phase"] == "decode" for r in rows2)
    print(f"\nmasked: 10% slower then a further 14% (25% in all): first caught {first}/{n}, "
          f"the further one caught {second}/{n}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--warehouse", default=tempfile.mkdtemp(prefix="verdict-bench-"))
    m.add_argument("--base", type=int, default=16)
    m.add_argument("--slowed", type=int, default=1)
    m.add_argument("--masked", type=int, default=1)
    m.add_argument("--window-s", type=float, help="decode window (adaptive: its cap); default 2")
    m.add_argument("--adaptive", action="store_true", help="adaptive windows (issue #45)")
    m.add_argument("--adaptive-min-s", type=float, default=3.0, help="adaptive: least window")
    j = sub.add_parser("judge")
    j.add_argument("--warehouse", required=True)
    j.add_argument("--history", type=int, default=8)
    j.add_argument("--trials", type=int, default=60)
    j.add_argument("--detect-trials", type=int, default=3)
    j.add_argument(
        "--scale",
        choices=("mad", "q75", "mad-small-sample"),
        default="mad",
        help="the between-run scale: the pipeline's (mad) or an alternative weighed against it",
    )
    c = sub.add_parser("calibrate")
    c.add_argument("--samples", type=int, default=400_000)
    args = ap.parse_args()
    {"measure": measure, "judge": judge, "calibrate": calibrate}[args.cmd](args)


if __name__ == "__main__":
    main()
