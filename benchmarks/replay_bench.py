"""Published pages replayed over HTTP, every cell: how far each measured figure lands from the page.

Why: the simulator is calibrated from published pages and the load generator measures it; a
replay of a whole page is their accuracy end to end. These ran in the suite as three tests
(118 s, 42 s and 40 s of its serial phase); the suite now keeps a sample of each
(tests/integration/test_loadgen_sim.py) and this benchmark replays every cell and reports the
distribution of errors, not only pass / fail:

- `reference`: every cell of the published reference matrix (include/reference) against its
  calibrated profile (decode at 5x time, prefills under 8 simulated seconds at 1x);
- `spec`: the synthetic speculative-decoding page's cells (tests/replay.py SPEC_REPLAY), 2x;
- `short`: the short-prompts page (issue #43) at implied and nominal lengths, 2x.

    uv run python benchmarks/replay_bench.py                 # all three
    uv run python benchmarks/replay_bench.py reference --out replay.json

What is compared and why is in tests/replay.py (one place for the suite and this). Prints a
Markdown table per replay (cell, figure, measured, page, % off) and a summary; exits 1 when a
figure is more than 5% off, as the tests did.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the replays are the suite's own (tests/replay.py)

from replay import (  # noqa: E402
    SHORT_PROMPT_REPLAY,
    SPEC_REPLAY,
    Row,
    problems,
    reference_replay,
    short_prompt_replay,
    spec_replay,
)


def _table(rows: list[Row]) -> str:
    lines = ["| cell | figure | measured | page | off |", "|---|---|---|---|---|"]
    for r in rows:
        if r["off_pct"] is None:
            lines.append(f"| {r['cell']} | {r['figure']} | {r['got']} | {r['want']} | |")
        else:
            mark = "" if r["ok"] else " **over 5%**"
            lines.append(
                f"| {r['cell']} | {r['figure']} | {r['got']:.2f} | {r['want']:.2f} "
                f"| {r['off_pct']:+.2f}%{mark} |"
            )
    return "\n".join(lines)


def _summary(rows: list[Row], wall_s: float) -> dict[str, Any]:
    offs = sorted(abs(r["off_pct"]) for r in rows if r["off_pct"] is not None)
    return {
        "cells": len({r["cell"] for r in rows}),
        "figures": len(offs),
        "max_abs_off_pct": round(offs[-1], 2) if offs else None,
        "median_abs_off_pct": round(offs[len(offs) // 2], 2) if offs else None,
        "problems": problems(rows),
        "wall_s": round(wall_s, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = ["reference", "spec", "short"]
    ap.add_argument("replays", nargs="*", help=f"any of {', '.join(names)} (default: all)")
    ap.add_argument("--out", type=Path, help="also write the rows and summaries as JSON")
    args = ap.parse_args()
    if unknown := set(args.replays) - set(names):
        ap.error(f"unknown replay: {', '.join(sorted(unknown))}")
    chosen = args.replays or names
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            t0 = time.monotonic()
            if name == "reference":
                rows = reference_replay()
            elif name == "spec":
                rows = spec_replay(SPEC_REPLAY, Path(tmp))
            else:
                rows = short_prompt_replay(SHORT_PROMPT_REPLAY, Path(tmp))
            summary = _summary(rows, time.monotonic() - t0)
            report[name] = {"summary": summary, "rows": rows}
            print(f"\n### {name}\n\n{_table(rows)}\n")
            print(json.dumps({name: summary}))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 1 if any(r["summary"]["problems"] for r in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
