"""Concurrent writers and killed writers at the scale the suite ran before issue #41: what
tests/unit/test_warehouse_concurrency.py and tests/integration/test_warehouse_s3.py now prove
with 4 writers x 3 landings and 2 kills, here with their own writer scripts at full size.

    uv run python benchmarks/warehouse_contention_bench.py local --writers 6 --landings 40
    uv run python benchmarks/warehouse_contention_bench.py s3 --writers 8 --landings 10
    uv run python benchmarks/warehouse_contention_bench.py kills --rounds 4
    uv run python benchmarks/warehouse_contention_bench.py all --json out.json

``local``: processes started together land into one local warehouse, each reading its run back
after every landing and querying for runs not whole every eighth; ``s3``: processes started
together land into one ``s3://`` warehouse on moto's server (loopback, as the tests start it),
the last landing of each re-landing its first run; ``kills``: a writer re-landing two runs on
``s3://`` SIGKILLed at a random moment after a step of a re-landing (the test's
``KILL_AFTER``, in turn), the warehouse checked and landed into after each. Each reports what landed, the checks (every run whole, none lost or twice), how
many commits were retried after overlapping another writer's (delta-rs's ``num_retries`` in
the logs plus store/delta.py's logged retries), the wall time and the CPU-seconds of this
process and its children (writers and moto's server). Not a test: exit 1 when a check fails;
the figures go to benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path[:0] = [str(HERE.parent / "plugins"), str(TESTS), str(TESTS / "unit")]
sys.path.insert(0, str(TESTS / "integration"))

from contention import delta_retries  # noqa: E402
from processes import run_scripts  # noqa: E402
from s3server import running_s3_server  # noqa: E402

from speedmatrix.store.warehouse import Warehouse  # noqa: E402


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _measured(what: Callable[[], dict]) -> dict:
    """``what()``'s figures with its wall time and the CPU-seconds of this process and every
    child it reaped (writers, and moto's server, which running_s3_server waits for)."""
    wall, cpu = time.monotonic(), _cpu_s()
    try:
        out = what()
    except AssertionError as failed:  # a check of the tests' own helpers failed
        out = {"ok": False, "failed": traceback.format_exception_only(failed)[-1][:2000]}
    out["wall_s"] = round(time.monotonic() - wall, 1)
    out["cpu_s"] = round(_cpu_s() - cpu, 1)
    out["load_average_after"] = [round(x, 1) for x in os.getloadavg()]
    return out


def _moto_cpu_s(pid: int) -> float:
    """moto's server's own CPU-seconds so far, from /proc (it is still running)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_local(writers: int, landings: int) -> dict:
    from test_warehouse_concurrency import WORKER

    root = tempfile.mkdtemp(prefix="wh-contention-")
    scripts = [
        WORKER.format(
            tests=str(TESTS),
            unit=str(TESTS / "unit"),
            root=root,
            prefix=f"w{w}",
            runs=landings,
            check_every=8,
        )
        for w in range(writers)
    ]
    reports = run_scripts(scripts, timeout_s=3600)
    wh = Warehouse(root)
    counts = wh.query("SELECT run_id, count(*) AS n FROM runs GROUP BY run_id")
    cells = wh.query("SELECT run_id, count(*) AS n FROM cells GROUP BY run_id")
    expected = {f"w{w}-r{i}" for w in range(writers) for i in range(landings)}
    errors = [e for r in reports for e in r["errors"]]
    bad_views = [v for r in reports for v in r["bad_views"]]
    out = {
        "writers": writers,
        "landings_each": landings,
        "errors": len(errors),
        "first_error": errors[0][-1500:] if errors else None,
        "reader_saw_not_whole": len(bad_views),
        "runs_listed": len(counts),
        "all_listed_once": set(counts["run_id"]) == expected and set(counts["n"]) == {1},
        "cells_whole": len(cells) == len(expected) and set(cells["n"]) == {5},
        "delta_rs_retries": delta_retries(wh),
        "store_retries": sum(len(r["lost"]) for r in reports),
    }
    out["ok"] = not errors and not bad_views and out["all_listed_once"] and out["cells_whole"]
    return out


def bench_s3(writers: int, landings: int) -> dict:
    from test_warehouse_s3 import UNIT, WRITER, assert_whole

    with running_s3_server() as server:
        os.environ.update(server.env())
        root = f"s3://{server.new_bucket()}/warehouse"
        scripts = [
            WRITER.format(tests=str(TESTS), unit=UNIT, root=root, prefix=f"w{w}", landings=landings)
            for w in range(writers)
        ]
        reports = run_scripts(scripts, timeout_s=3600)
        wh = Warehouse(root)
        errors = [e for r in reports for e in r["errors"]]
        seconds = sorted(s for r in reports for s in r["seconds"])
        out = {
            "writers": writers,
            "landings_each": landings,
            "landed": sum(len(r["landed"]) for r in reports),
            "failed": len(errors),
            "first_error": errors[0][-1500:] if errors else None,
            "landing_s": {
                "median": round(seconds[len(seconds) // 2], 2),
                "max": round(seconds[-1], 2),
            },
            "delta_rs_retries": delta_retries(wh),
            "store_retries": sum(len(r["lost"]) for r in reports),
        }
        listed = assert_whole(wh)
        want = {f"w{w}-r{i}" for w in range(writers) for i in range(landings - 1)}
        out["all_listed_once_and_whole"] = listed == want
        out["moto_cpu_s"] = round(_moto_cpu_s(server.pid), 1)
    out["ok"] = not errors and out["all_listed_once_and_whole"]
    return out


def bench_kills(rounds: int, seed: int) -> dict:
    from test_warehouse_s3 import kill_mid_landing

    rng = random.Random(seed)
    with running_s3_server() as server:
        os.environ.update(server.env())
        root = f"s3://{server.new_bucket()}/warehouse"
        kills = [kill_mid_landing(root, n, rng) for n in range(rounds)]
        out = {
            "rounds": rounds,
            "killed_after": [k["after"] for k in kills],
            "kill_moments_s": [round(k["moment_s"], 2) for k in kills],
            "next_two_landings_s": [round(k["next_two_s"], 2) for k in kills],
            "moto_cpu_s": round(_moto_cpu_s(server.pid), 1),
            "ok": True,  # kill_mid_landing asserts every check; a failure lands in _measured
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["local", "s3", "kills", "all"])
    parser.add_argument("--writers", type=int, help="local: 6, s3: 8")
    parser.add_argument("--landings", type=int, help="each writer's; local: 40, s3: 10")
    parser.add_argument("--rounds", type=int, default=4, help="kills")
    parser.add_argument("--seed", type=int, default=32, help="kills: the random moments")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)

    def terminated(signum, _frame):  # SIGTERM/SIGHUP: unwind, so writers and moto are stopped
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGHUP, terminated)
    results: dict = {"cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    if args.mode in ("local", "all"):
        results["local"] = _measured(lambda: bench_local(args.writers or 6, args.landings or 40))
    if args.mode in ("s3", "all"):
        results["s3"] = _measured(lambda: bench_s3(args.writers or 8, args.landings or 10))
    if args.mode in ("kills", "all"):
        results["kills"] = _measured(lambda: bench_kills(args.rounds, args.seed))
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    modes = [m for m in ("local", "s3", "kills") if m in results]
    return 0 if all(results[m]["ok"] for m in modes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
