"""Warehouse benchmark (issue #32): a synthetic warehouse of Delta tables, built in minutes by
writing many runs per commit (``--runs-per-day`` runs of each of 20 recipes for three years;
10 gives the issue's 220,000 runs), then what a fleet does to it: landing one run on top, the
analysts' questions through ``speedmatrix query``'s views warm and cold, pandas / Polars /
DuckDB reading one recipe's cells for a year, ``speedmatrix query "select 1"`` as a process,
the file count, and maintenance. ``old`` measures the older hand-written layout beside it, with
the code of the commit before issue #32 (extracted from git into a temporary directory).
``writers`` is N processes landing runs into ``s3://`` (moto's server) at once for D seconds.

    uv run python benchmarks/warehouse_bench.py generate --root /tmp/whd --runs-per-day 10
    uv run python benchmarks/warehouse_bench.py measure  --root /tmp/whd --json new.json
    uv run python benchmarks/warehouse_bench.py old --commit cc02ac6 --days 274 --json old.json
    uv run python benchmarks/warehouse_bench.py site --root /tmp/whd --out /tmp/site-bench
    uv run python benchmarks/warehouse_bench.py writers --writers 32 --seconds 600 --json w.json

Not a test: the figures go to benchmarks/README.md. The generator writes what landings and a
daily maintenance would leave: one file per table per recipe and month (each commit holds a
recipe's three years); "measure" then lands runs one by one on top, as the fleet does
between two maintenances. "Cold" is a fresh process (imports excluded, said where not);
"warm" is the median of repeats in the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "plugins"))

from speedmatrix.records import empty_cell  # noqa: E402
from speedmatrix.store import warehouse as W  # noqa: E402

RECIPES = [f"bench/hw{i // 5}/model-{i:02d}" for i in range(20)]
START = dt.date(2023, 1, 1)
DAYS = 1096  # three years
PREFILL = [8, 16, 32, 64, 128, 251, 256]
CONTEXTS = [8, 16, 32, 64, 128, 251]
CONCURRENCIES = [1, 2, 4, 8, 16, 32, 64, 128]
REQUESTS_PER_RUN = 16  # a few request rows per run (the queries do not read them)

# The three questions of warehouse/README.md, through the views (speedmatrix query)
QUERIES = {
    "q1_cell_trend": """
        -- one cell of one recipe across a year of nightly runs
        SELECT r.started_at, r.engine_version, r.engine_commit,
               c.total_tok_s, c.per_request_tok_s, c.ttft_ms, c.tbt_ms
        FROM cells c
        JOIN runs r USING (run_id)
        WHERE c.recipe_id = 'bench/hw1/model-07' AND r.recipe_id = 'bench/hw1/model-07'
          AND c.run_month BETWEEN '2025-01' AND '2025-12'
          AND r.run_month BETWEEN '2025-01' AND '2025-12'
          AND r.trigger = 'nightly'
          AND c.phase = 'decode' AND c.context_label = '32K' AND c.concurrency = 4
        ORDER BY r.started_at
    """,
    "q2_run_matrix": """
        -- one run's whole matrix
        SELECT phase, context_label, concurrency, status, total_tok_s, per_request_tok_s,
               ttft_ms, tbt_ms
        FROM cells
        WHERE run_id = 'nightly-bench-hw2-model-12-2024-06-15'
        ORDER BY phase DESC, context_tokens, concurrency
    """,
    "q3_one_date": """
        -- every recipe on one date
        SELECT r.recipe_id, r.engine_version, c.context_label, c.concurrency, c.total_tok_s
        FROM cells c
        JOIN runs r USING (run_id)
        WHERE c.run_month = '2025-03' AND r.run_month = '2025-03'
          AND c.run_date = DATE '2025-03-14' AND r.run_date = DATE '2025-03-14'
          AND c.phase = 'decode' AND c.status = 'valid'
        ORDER BY r.recipe_id, c.context_tokens, c.concurrency
    """,
}


def run_id_of(recipe: str, day: dt.date) -> str:
    return f"nightly-{recipe.replace('/', '-')}-{day.isoformat()}"


def template(recipe_index: int) -> tuple[dict, list[dict], list[dict]]:
    """One run of a recipe (the reference page's shape: 7 prefill + 48 decode cells)."""
    rng = np.random.default_rng(recipe_index)
    speed = 30 + 40 * rng.random()
    cells = []
    for k in PREFILL:
        cells.append(
            empty_cell(
                phase="prefill",
                context_tokens=k * 1024,
                context_label=f"{k}K",
                concurrency=1,
                status="valid",
                total_tok_s=6000.0 - 10 * k,
                ttft_ms=k * 1024 / (6000.0 - 10 * k) * 1000,
                completed_requests=1,
                max_output_tokens=1,
            )
        )
    for k in CONTEXTS:
        for c in CONCURRENCIES:
            over = c * (k + 4) > 300
            per = speed * (1 - 0.05 * np.log2(c)) * (1 - k / 1000)
            cells.append(
                empty_cell(
                    phase="decode",
                    context_tokens=k * 1024,
                    context_label=f"{k}K",
                    concurrency=c,
                    status="over_capacity" if over else "valid",
                    total_tok_s=None if over else per * c,
                    per_request_tok_s=None if over else per,
                    ttft_ms=None if over else 80.0 + k * 5,
                    tbt_ms=None if over else 1000 / per,
                    avg_active_requests=None if over else float(c),
                    completed_requests=None if over else 0,
                    output_tokens=None if over else int(per * c * 30),
                    measured_s=None if over else 30.0,
                    max_output_tokens=4096,
                    window_s=30.0,
                    prompt_mode="distinct",
                )
            )
    requests = [
        {
            "phase": "decode",
            "context_tokens": 8192,
            "concurrency": 16,
            "request_index": i,
            "stream": i,
            "prompt_tokens": 8192,
            "output_tokens": 1500,
            "window_tokens": 1500,
            "ttft_ms": 400.0,
            "tbt_ms": 20.0,
            "chunks": 200,
            "finished": False,
        }
        for i in range(REQUESTS_PER_RUN)
    ]
    run = {
        "run_id": "template",
        "recipe_id": RECIPES[recipe_index],
        "trigger": "nightly",
        "status": "success",
        "hardware_type": "Discrete GPU",
        "hardware_gpu": "RTX PRO 6000 Blackwell Server Edition",
        "hardware_gpu_count": 8,
        "hardware_vram_gb": 96.0,
        "hardware_os": "linux",
        "engine": "vllm",
        "engine_version": "0.1.dev1+g9fedd24fa",
        "engine_commit": "9fedd24fa864",
        "quantization": "NVFP4",
        "served_model": f"model-{recipe_index:02d}",
        "bench_tool": "speedmatrix",
        "window_s": 30.0,
        "max_output_tokens": 4096,
        "host": "bench",
    }
    return run, cells, requests


def _day_tables(base: dict, recipe: str, days: list[dt.date], per_day: int, rng) -> dict:
    """``per_day`` runs of ``recipe`` on each of ``days``, as the three tables (columns set
    vectorised: 220,000 runs are built in minutes, not by 220,000 build_tables calls)."""
    import pyarrow.compute as pc

    run_ids, run_days = [], []
    for day in days:
        for k in range(per_day):
            run_ids.append(run_id_of(recipe, day) + (f"-{k}" if k else ""))
            run_days.append(day)
    n_runs = len(run_ids)
    out = {}
    for table in ("runs", "cells", "requests"):
        t = base[table]
        per = t.num_rows
        t = t.take(pa.array(np.tile(np.arange(per), n_runs)))

        def put(t, name, arr):
            return t.set_column(t.schema.get_field_index(name), t.schema.field(name), arr)

        t = put(t, "run_id", pa.array(np.repeat(np.array(run_ids, dtype=object), per), pa.string()))
        dates = np.repeat(np.array(run_days, dtype="datetime64[D]"), per)
        t = put(t, "run_date", pa.array(dates, pa.date32()))
        months = np.repeat(np.array([f"{d:%Y-%m}" for d in run_days], dtype=object), per)
        t = put(t, "run_month", pa.array(months, pa.string()))
        if table == "runs":
            starts = dates.astype("datetime64[us]") + np.timedelta64(2, "h")
            starts = starts + (np.arange(n_runs) % 1440).astype("timedelta64[m]")
            ts = t.schema.field("started_at").type
            t = put(t, "started_at", pa.array(starts, pa.timestamp("us")).cast(ts))
            t = put(
                t,
                "finished_at",
                pa.array(starts + np.timedelta64(1, "h"), pa.timestamp("us")).cast(ts),
            )
            t = put(t, "engine_commit", pa.array([f"{i:012x}" for i in range(n_runs)]))
        if table == "cells":
            jitter = pa.array(np.repeat(1 + 0.02 * rng.standard_normal(n_runs), per))
            for col in ("total_tok_s", "per_request_tok_s"):
                t = put(t, col, pc.multiply(t.column(col), jitter))
        out[table] = t
    return out


def _generate_recipe(args: tuple[str, int, int]) -> int:
    """One recipe's three years, one commit per table (a file per month: partitioned)."""
    root, recipe_index, per_day = args
    wh = W.Warehouse(root)
    run, cells, requests = template(recipe_index)
    recipe = RECIPES[recipe_index]
    base = wh.build_tables(
        dict(run, started_at=dt.datetime(2023, 1, 1, 2, tzinfo=dt.UTC)), cells, requests
    )
    rng = np.random.default_rng(1000 + recipe_index)
    days = [START + dt.timedelta(days=d) for d in range(DAYS)]
    tables = _day_tables(base, recipe, days, per_day, rng)
    for table in ("cells", "requests", "runs"):  # runs last, as a landing
        W.replace_rows(
            wh.table_uri(table), tables[table], f"recipe_id = {W.sql_literal(recipe)}", wh.root
        )
    return len(days) * per_day


def generate(root: str, workers: int, per_day: int) -> None:
    t0 = time.perf_counter()
    # one recipe at a time per worker: the commits of two workers race (retried), which is fine
    with ProcessPoolExecutor(max_workers=workers) as pool:
        runs = sum(pool.map(_generate_recipe, [(root, i, per_day) for i in range(len(RECIPES))]))
    elapsed = time.perf_counter() - t0
    print(f"generated {runs} runs in {elapsed:.0f} s", file=sys.stderr)


def count_files(root: str) -> dict[str, int]:
    """Data files of each table's current version (what readers open) and on disk."""
    from deltalake import DeltaTable

    out = {}
    for table in W.view_tables():
        path = os.path.join(root, table)
        if not os.path.isdir(path):
            continue
        disk = sum(
            f.endswith(".parquet")
            for dirpath, _dirs, files in os.walk(path)
            if "_delta_log" not in dirpath
            for f in files
        )
        out[table] = {"current": len(DeltaTable(path).file_uris()), "on_disk": disk}
    return out


# The issue's questions (through `speedmatrix query`'s views)
LATEST_DECODE = """
    -- latest decode per context (and concurrency) for one recipe
    SELECT c.context_label, c.concurrency, c.total_tok_s, c.per_request_tok_s
    FROM cells c
    WHERE c.recipe_id = 'bench/hw1/model-07' AND c.phase = 'decode'
      AND c.run_id = (SELECT run_id FROM runs WHERE recipe_id = 'bench/hw1/model-07'
                      ORDER BY started_at DESC LIMIT 1)
    ORDER BY c.context_tokens, c.concurrency
"""
FLEET = """
    -- fleet-wide history: every recipe's monthly mean decode throughput, all runs
    SELECT r.recipe_id, r.run_month, count(DISTINCT r.run_id) AS runs, avg(c.total_tok_s) AS tok_s
    FROM runs r JOIN cells c USING (run_id)
    WHERE c.phase = 'decode' AND c.status = 'valid'
    GROUP BY ALL ORDER BY 1, 2
"""
QUERIES["latest_decode"] = LATEST_DECODE
QUERIES["fleet_history"] = FLEET

READERS = {
    "pandas": """
from deltalake import DeltaTable
df = DeltaTable(f"{root}/cells").to_pandas(filters=[("recipe_id", "=", "bench/hw1/model-07"),
    ("run_month", ">=", "2025-01"), ("run_month", "<=", "2025-12")])
""",
    "polars": """
import polars as pl
df = pl.scan_delta(f"{root}/cells").filter((pl.col("recipe_id") == "bench/hw1/model-07")
    & pl.col("run_month").is_between(pl.lit("2025-01"), pl.lit("2025-12"))).collect()
""",
    "duckdb": """
import duckdb
from deltalake import DeltaTable
con = duckdb.connect()
con.register("cells", DeltaTable(f"{root}/cells").to_pyarrow_dataset())
df = con.execute("SELECT * FROM cells WHERE recipe_id = 'bench/hw1/model-07' AND run_month BETWEEN '2025-01' AND '2025-12'").df()
""",
}


def _in_fresh_process(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1]}
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _cold_query(root: str, name: str) -> dict:
    """In a fresh process (imports done first, not timed): the first query (cold: opening the
    tables and defining the views included), then the median of 5 more (warm)."""
    code = f"""
import json, statistics, sys, time
sys.path.insert(0, {str(HERE)!r})
from warehouse_bench import QUERIES
sql = QUERIES[{name!r}]
import duckdb, pandas, pyarrow.dataset, deltalake
from speedmatrix.store.warehouse import Warehouse
t = time.perf_counter()
wh = Warehouse({root!r})
df = wh.query(sql)
cold = time.perf_counter() - t
warm = []
for _ in range(5):
    t = time.perf_counter(); wh.query(sql); warm.append(time.perf_counter() - t)
print("RESULT " + json.dumps({{"rows": len(df), "cold_s": round(cold, 3),
    "warm_s": round(statistics.median(warm), 3), "warm_max_s": round(max(warm), 3)}}), flush=True)
"""
    result = _in_fresh_process(code)
    print(f"query {name:20} {result}", file=sys.stderr, flush=True)
    return result


def _reader(root: str, name: str) -> dict:
    code = f"""
import json, statistics, time
root = {root!r}
import pandas, polars, duckdb, deltalake, pyarrow.dataset
times = []
for _ in range(4):
    t = time.perf_counter()
    exec({READERS[name]!r})
    times.append(time.perf_counter() - t)
print("RESULT " + json.dumps({{"rows": len(df), "first_s": round(times[0], 3),
    "warm_s": round(statistics.median(times[1:]), 3)}}), flush=True)
"""
    result = _in_fresh_process(code)
    print(f"reader {name:8} {result}", file=sys.stderr, flush=True)
    return result


def _process_start() -> dict:
    """`speedmatrix query "select 1"` as a process, wall clock (imports included)."""
    times = []
    for _ in range(3):
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "speedmatrix", "query", "select 1"],
            check=True,
            capture_output=True,
            env=dict(os.environ, SPEEDMATRIX_WAREHOUSE="/nonexistent-wh"),
        )
        times.append(time.perf_counter() - t)
    return {"median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3)}


def measure(root: str, landings: int = 5) -> dict:
    wh = W.Warehouse(root)
    runs = int(wh.query("SELECT count(*) AS n FROM runs")["n"][0])
    results: dict = {
        "runs": runs,
        "files_before": count_files(root),
        "load_average": os.getloadavg(),
    }
    run, cells, requests = template(3 % len(RECIPES))
    wh.build_tables(dict(run, run_id="warmup"), cells, requests)  # imports warmed
    day = START + dt.timedelta(days=DAYS)
    results["land_new_run_s"] = _time_landings(
        wh,
        run,
        cells,
        requests,
        [f"bench-land-{i}" for i in range(landings)],
        dt.datetime(day.year, day.month, day.day, 3, tzinfo=dt.UTC),
    )
    print("land_run, new run:", results["land_new_run_s"], file=sys.stderr, flush=True)
    results["land_again_same_run_s"] = _time_landings(
        wh,
        run,
        cells,
        requests,
        ["bench-land-0" for _ in range(3)],
        dt.datetime(day.year, day.month, day.day, 3, tzinfo=dt.UTC),
    )
    t = time.perf_counter()
    wh.read_run(run_id_of(RECIPES[-1], START + dt.timedelta(days=DAYS // 2)))
    results["read_run_s"] = round(time.perf_counter() - t, 3)
    results["queries"] = {name: _cold_query(root, name) for name in QUERIES}
    results["readers_one_recipe_one_year"] = {name: _reader(root, name) for name in READERS}
    results["process_select_1"] = _process_start()
    print("process select 1:", results["process_select_1"], file=sys.stderr, flush=True)
    from speedmatrix.store.maintain import maintain

    t = time.perf_counter()
    report = maintain(wh, retention_hours=0, force=True)  # a scratch warehouse: no writer
    results["maintain"] = {"seconds": round(time.perf_counter() - t, 1), "tables": report}
    results["files_after_maintenance"] = count_files(root)
    results["queries_after_maintenance"] = {
        name: _cold_query(root, name) for name in ("latest_decode", "fleet_history")
    }
    for i in range(landings):
        wh.delete_run(f"bench-land-{i}")
    results["load_average_after"] = os.getloadavg()
    return results


def _time_landings(wh, run, cells, requests, run_ids, started_at) -> dict:
    """Land `run` under each id in turn: the median and the longest landing, in seconds."""
    timings = []
    for run_id in run_ids:
        t = time.perf_counter()
        wh.land_run(dict(run, run_id=run_id, started_at=started_at), cells, requests)
        timings.append(time.perf_counter() - t)
    return {"median": round(statistics.median(timings), 3), "max": round(max(timings), 3)}


def measure_s3(days: int, per_day: int, landings: int = 5) -> dict:
    """Landing one run on the S3-compatible server (moto's, on loopback, started here as the
    tests start it) on top of ``days`` x ``per_day`` runs of 20 recipes."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from s3server import running_s3_server

    global DAYS
    with running_s3_server() as server:
        os.environ.update(server.env())
        root = f"s3://{server.new_bucket()}/wh"
        DAYS = days
        t = time.perf_counter()
        for i in range(len(RECIPES)):
            _generate_recipe((root, i, per_day))
        results: dict = {
            "runs": days * per_day * len(RECIPES),
            "generate_s": round(time.perf_counter() - t, 1),
        }
        wh = W.Warehouse(root)
        run, cells, requests = template(3)
        results["land_new_run_s"] = _time_landings(
            wh,
            run,
            cells,
            requests,
            [f"bench-s3-{i}" for i in range(landings)],
            dt.datetime(2026, 1, 2, 3, tzinfo=dt.UTC),
        )
        t = time.perf_counter()
        wh.query(LATEST_DECODE)
        results["latest_decode_first_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        wh.query(LATEST_DECODE)
        results["latest_decode_warm_s"] = round(time.perf_counter() - t, 3)
    return results


def measure_old(commit: str, days: int, root: str) -> dict:
    """The older layout with the code of ``commit`` (before issue #32): its own generator
    (``days`` days of 20 recipes, one run each) and measure, in a subprocess over an
    extracted copy of that commit's plugins/ and benchmarks/."""
    import tarfile
    import tempfile

    tree = Path(tempfile.mkdtemp(prefix="wh-bench-old-"))
    archive = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", commit, "plugins", "benchmarks"],
        check=True,
        capture_output=True,
    ).stdout
    import io

    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    code = f"""
import json, sys, time
sys.path.insert(0, {str(tree / "plugins")!r}); sys.path.insert(0, {str(tree / "benchmarks")!r})
import warehouse_bench as b
b.DAYS = {days}
t = time.perf_counter()
b.generate({root!r}, 2)
gen = time.perf_counter() - t
r = b.measure({root!r})
r["generate_s"] = round(gen, 1)
print("RESULT " + json.dumps(r, default=str), flush=True)
"""
    env = dict(os.environ, PYTHONPATH=str(tree / "plugins"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-2000:]}
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _du(path: Path) -> tuple[int, int]:
    """(bytes, files) under path."""
    size = files = 0
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            size += os.path.getsize(os.path.join(dirpath, n))
            files += 1
    return size, files


def measure_site(root: str, out: str, run_pages: int) -> dict:
    """`speedmatrix site` over the big warehouse (issue #18): the index and every recipe's
    trend page cold (no run page), `run_pages` run pages (the time and size of one, to
    extrapolate the full first build), a rebuild with nothing changed, and the DAG's case: one
    run landed, then the refresh. Each build is timed in this process (imports warmed first)."""
    import shutil

    from speedmatrix.report.site import build_site

    site = Path(out)
    shutil.rmtree(site, ignore_errors=True)
    wh = W.Warehouse(root)
    results: dict = {"load_average": os.getloadavg()}
    runs = int(wh.query("SELECT count(*) AS n FROM runs")["n"][0])
    results["runs"] = runs

    def timed(label: str, **kw) -> dict:
        t = time.perf_counter()
        r = build_site(wh, site, **kw)
        fig = {
            "wall_s": round(time.perf_counter() - t, 2),
            "run_pages_written": r.run_pages_written,
            "run_pages_s": round(r.run_pages_seconds, 2),
            "recipe_pages_written": r.recipe_pages_written,
            "failed": len(r.failed),
        }
        print(f"site {label:24} {fig}", file=sys.stderr, flush=True)
        return fig

    results["cold_index_and_trends"] = timed("cold, no run page", max_run_pages=0)
    size, files = _du(site)
    results["cold_index_and_trends"] |= {"bytes": size, "files": files}
    results["run_pages"] = timed(f"{run_pages} run pages", max_run_pages=run_pages)
    page_bytes, page_files = _du(site / "runs")
    per_page_s = results["run_pages"]["run_pages_s"] / max(1, run_pages)
    results["run_page"] = {
        "seconds": round(per_page_s, 3),
        "bytes": page_bytes // max(1, page_files),
    }
    results["rebuild_nothing_changed"] = timed("nothing changed", max_run_pages=0)
    run, cells, requests = template(0)
    day = START + dt.timedelta(days=DAYS)
    new = dict(
        run,
        run_id="bench-site-new-run",
        recipe_id=RECIPES[0],
        started_at=dt.datetime(day.year, day.month, day.day, 3, tzinfo=dt.UTC),
    )
    wh.land_run(new, cells, requests)
    try:
        results["refresh_after_one_run"] = timed("one run landed", max_run_pages=1)
    finally:
        wh.delete_run("bench-site-new-run")
    total, _total_files = _du(site)
    results["site_bytes_now"] = total
    results["extrapolated_full_first_build"] = {
        "seconds": round(results["cold_index_and_trends"]["wall_s"] + runs * per_page_s),
        "bytes": results["cold_index_and_trends"]["bytes"] + runs * results["run_page"]["bytes"],
    }
    results["load_average_after"] = os.getloadavg()
    return results


# ---- many writers on s3:// at once (the "32 concurrent writers for 10 minutes") -----


def writer_requests(n: int) -> list[dict]:
    """``n`` request rows spread over the decode cells a run measured (a few hundred: a run's
    request table), each (phase, context, concurrency, request_index) once."""
    rows = []
    cells = [(k, c) for k in CONTEXTS for c in CONCURRENCIES if c * (k + 4) <= 300]
    for i in range(n):
        k, c = cells[i % len(cells)]
        rows.append(
            {
                "phase": "decode",
                "context_tokens": k * 1024,
                "concurrency": c,
                "request_index": i // len(cells),
                "stream": (i // len(cells)) % c,
                "prompt_tokens": k * 1024,
                "output_tokens": 1500,
                "window_tokens": 1500,
                "ttft_ms": 80.0 + k * 5 + i % 7,
                "tbt_ms": 20.0,
                "chunks": 200,
                "finished": False,
            }
        )
    return rows


def writer_main(args: argparse.Namespace) -> int:
    """One writer process of ``writers``: lands runs back to back (recipes taken in turn from
    the first ``--recipes``, so writers contend on the same tables and partitions) until the
    end time the parent writes into ``<dir>/go``; one JSON line per landing in
    ``<dir>/w<N>.jsonl`` (flushed: what a killed writer did is kept)."""
    from speedmatrix.store import delta as D

    retries = 0
    is_conflict = D.is_conflict

    def counting(exc: BaseException) -> bool:  # with_retries asks this once per lost commit
        nonlocal retries
        lost = is_conflict(exc)
        retries += lost
        return lost

    D.is_conflict = counting
    parent = os.getppid()
    work = Path(args.dir)
    wh = W.Warehouse(args.root)
    templates = [template(r) for r in range(args.recipes)]
    requests = writer_requests(args.requests)
    wh.build_tables(dict(templates[0][0], run_id="warmup"), templates[0][1], requests)
    (work / f"w{args.index}.ready").touch()
    go = work / "go"
    deadline = time.time() + 900  # the parent never said go: stop anyway
    while not go.exists():
        if time.time() > deadline or os.getppid() != parent:
            return 1
        time.sleep(0.05)  # waiting for the parent's start signal
    end = float(go.read_text())
    day = dt.date(2026, 3, 1)
    with open(work / f"w{args.index}.jsonl", "a") as log:
        i = 0
        while time.time() < end and os.getppid() == parent:
            r = (args.index + i) % args.recipes
            run, cells, _reqs = templates[r]
            run_id = f"writers-w{args.index:02d}-{i:05d}"
            started = dt.datetime(day.year, day.month, 1 + i % 28, 3, tzinfo=dt.UTC)
            retries = 0
            t0 = time.monotonic()
            rec = {"writer": args.index, "run_id": run_id, "recipe_id": RECIPES[r]}
            rec["start"] = time.time()
            log.write(json.dumps(dict(rec, state="started")) + "\n")
            log.flush()
            try:
                wh.land_run(dict(run, run_id=run_id, started_at=started), cells, requests)
                rec |= {"ok": True, "error": None}
            except Exception as exc:
                rec |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            rec |= {"seconds": round(time.monotonic() - t0, 3), "retries": retries}
            log.write(json.dumps(dict(rec, state="done")) + "\n")
            log.flush()
            i += 1
    return 0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(float(np.percentile(values, q)), 3)


def check_landed(root: str, ok: set[str], n_cells: int, n_requests: int) -> dict:
    """From a fresh reader: every landing reported ok is listed in ``runs`` once, with all its
    cells and requests, and no table holds a row twice; runs listed but not reported ok (a
    writer stopped after its ``runs`` commit) are counted and held whole too."""
    wh = W.Warehouse(root)
    runs = wh.query("SELECT run_id, count(*) AS n FROM runs GROUP BY 1")
    listed = set(runs["run_id"])
    out: dict = {
        "runs_listed": len(listed),
        "listed_twice": sorted(runs.loc[runs["n"] > 1, "run_id"])[:20],
        "ok_missing": sorted(ok - listed)[:20],
        "ok_missing_count": len(ok - listed),
        "listed_not_reported_ok": sorted(listed - ok)[:20],
    }
    for table, per_run, key in (
        ("cells", n_cells, "phase, context_tokens, concurrency"),
        ("requests", n_requests, "phase, context_tokens, concurrency, request_index"),
    ):
        dup = wh.query(f"SELECT run_id, {key} FROM {table} GROUP BY ALL HAVING count(*) > 1")
        counts = wh.query(
            f"SELECT r.run_id, count(t.run_id) AS n FROM runs r LEFT JOIN {table} t "
            "USING (run_id) GROUP BY 1"
        )
        half = counts[counts["n"] != per_run]
        orphans = wh.query(
            f"SELECT count(DISTINCT run_id) AS n FROM {table} WHERE run_id NOT IN "
            "(SELECT run_id FROM runs)"
        )
        out[table] = {
            "rows": int(wh.query(f"SELECT count(*) AS n FROM {table}")["n"][0]),
            "duplicate_rows": len(dup),
            "runs_not_whole": half.head(20).to_dict("records"),
            "runs_not_whole_count": len(half),
            "unlisted_run_ids_with_rows": int(orphans["n"][0]),  # failed/killed landings
        }
    out["ok"] = not (
        out["listed_twice"]
        or out["ok_missing_count"]
        or any(
            out[t]["duplicate_rows"] or out[t]["runs_not_whole_count"]
            for t in ("cells", "requests")
        )
    )
    return out


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> int:
    """SIGTERM then SIGKILL to each writer's process group (each has a session of its own);
    returns how many were still running."""
    import signal

    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return len(alive)


def _group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def measure_writers(
    writers: int,
    seconds: float,
    recipes: int,
    n_requests: int,
    drain_s: float,
    ready_s: float,
    work_dir: str | None = None,
) -> dict:
    """``writers`` processes landing runs back to back into one ``s3://`` warehouse on moto's
    server (loopback, started as the tests start it) for ``seconds``; then the check."""
    import signal
    import tempfile

    sys.path.insert(0, str(HERE.parent / "tests"))
    from s3server import running_s3_server

    def terminated(signum, _frame):  # SIGTERM/SIGHUP: unwind, so the finally blocks run
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGHUP, terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even if inherited ignored
    if work_dir:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="wh-writers-", dir=work_dir))
    n_cells = len(template(0)[1])
    results: dict = {
        "writers": writers,
        "seconds": seconds,
        "recipes": recipes,
        "cells_per_run": n_cells,
        "requests_per_run": n_requests,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "work_dir": str(work),
    }
    procs: list[subprocess.Popen] = []
    with running_s3_server() as server:
        results["moto_pid"] = server.pid
        os.environ.update(server.env())
        root = f"s3://{server.new_bucket()}/wh"
        results["root"] = root
        try:
            for w in range(writers):
                cmd = [sys.executable, str(Path(__file__).resolve()), "writer", "--root", root]
                cmd += ["--dir", str(work), "--index", str(w), "--recipes", str(recipes)]
                cmd += ["--requests", str(n_requests)]
                with open(work / f"w{w}.stderr", "wb") as err:
                    procs.append(
                        subprocess.Popen(
                            cmd, stdout=err, stderr=subprocess.STDOUT, start_new_session=True
                        )
                    )
            t = time.monotonic()
            while sum((work / f"w{w}.ready").exists() for w in range(writers)) < writers:
                if time.monotonic() - t > ready_s or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"writers not ready in {ready_s} s; see {work}/*.stderr")
                time.sleep(0.1)  # waiting for every writer's imports
            results["writers_ready_s"] = round(time.monotonic() - t, 1)
            end = time.time() + seconds
            (work / "go.tmp").write_text(repr(end))
            (work / "go.tmp").rename(work / "go")
            print(f"{writers} writers landing for {seconds:.0f} s into {root}", file=sys.stderr)
            while time.time() < end + drain_s and any(p.poll() is None for p in procs):
                time.sleep(0.5)  # the writers stop by themselves at `end`; this bounds the drain
            results["drain_s"] = round(max(0.0, time.time() - end), 1)
        finally:
            results["writers_killed_in_drain"] = _stop(procs)
        records: dict[str, dict] = {}
        for w in range(writers):
            path = work / f"w{w}.jsonl"
            for line in path.read_text().splitlines() if path.exists() else []:
                rec = json.loads(line)
                records[rec["run_id"]] = rec  # "done" replaces "started"
        done = [r for r in records.values() if r["state"] == "done"]
        landed = [r for r in done if r["ok"]]
        failed = [r for r in done if not r["ok"]]
        secs = [r["seconds"] for r in landed]
        errors: dict[str, int] = {}
        for r in failed:
            first = r["error"].splitlines()[0][:300]
            errors[first] = errors.get(first, 0) + 1
        results |= {
            "attempted": len(records),
            "landed": len(landed),
            "refused_or_failed": len(failed),
            "unfinished_at_stop": len(records) - len(done),
            "landed_share": round(len(landed) / len(records), 4) if records else None,
            "landing_s": {
                "median": _percentile(secs, 50),
                "p90": _percentile(secs, 90),
                "max": round(max(secs), 3) if secs else None,
            },
            "retries": {
                "total": sum(r["retries"] for r in done),
                "landings_with_retries": sum(r["retries"] > 0 for r in done),
                "max": max((r["retries"] for r in done), default=0),
                "note": "store/delta.py with_retries' own retries (lost commits); delta-rs "
                "retries inside each attempt are not counted",
            },
            "per_writer_landed": [sum(r["writer"] == w for r in landed) for w in range(writers)],
            "errors": errors,
        }
        t = time.monotonic()
        results["check"] = check_landed(root, {r["run_id"] for r in landed}, n_cells, n_requests)
        results["check"]["seconds"] = round(time.monotonic() - t, 1)
        results["load_average_after"] = os.getloadavg()
    results["writers_all_exited"] = all(p.poll() is not None for p in procs)
    results["moto_stopped"] = _group_gone(results["moto_pid"])
    return results


def print_writers_summary(r: dict) -> None:
    c = r["check"]
    s = r["landing_s"]
    print(
        f"writers {r['writers']} x {r['seconds']:.0f} s on moto s3 ({r['recipes']} shared "
        f"recipes, {r['cells_per_run']} cells + {r['requests_per_run']} requests a run)\n"
        f"  attempted {r['attempted']}, landed {r['landed']}, refused/failed "
        f"{r['refused_or_failed']}, unfinished at stop {r['unfinished_at_stop']}\n"
        f"  landing s: median {s['median']}, p90 {s['p90']}, max {s['max']}; "
        f"retries {r['retries']['total']} over {r['retries']['landings_with_retries']} landings\n"
        f"  check: {'OK' if c['ok'] else 'FAILED'} ({c['runs_listed']} runs listed, "
        f"{c['ok_missing_count']} ok landings missing, {len(c['listed_twice'])} listed twice, "
        f"not whole: cells {c['cells']['runs_not_whole_count']}, requests "
        f"{c['requests']['runs_not_whole_count']}; duplicate rows: cells "
        f"{c['cells']['duplicate_rows']}, requests {c['requests']['duplicate_rows']})\n"
        f"  writers all exited: {r['writers_all_exited']}; moto stopped: {r['moto_stopped']}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--root", required=True)
    g.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    g.add_argument("--runs-per-day", type=int, default=1, help="per recipe (10: 220,000 runs)")
    m = sub.add_parser("measure")
    m.add_argument("--root", required=True)
    m.add_argument("--json", help="also write the figures here")
    o = sub.add_parser("old", help="the older layout, with the code of a commit before #32")
    o.add_argument("--commit", default="cc02ac6")
    o.add_argument("--days", type=int, default=274)
    o.add_argument("--root", required=True, help="where to build the older warehouse")
    o.add_argument("--json", help="also write the figures here")
    s3 = sub.add_parser("s3", help="landing on moto's S3-compatible server (loopback)")
    s3.add_argument("--days", type=int, default=30)
    s3.add_argument("--runs-per-day", type=int, default=1)
    s3.add_argument("--json", help="also write the figures here")
    wr = sub.add_parser("writers", help="N writer processes landing into s3:// for D seconds")
    wr.add_argument("--writers", type=int, default=32)
    wr.add_argument("--seconds", type=float, default=600)
    wr.add_argument("--recipes", type=int, default=4, help="shared by the writers, in turn")
    wr.add_argument("--requests", type=int, default=300, help="request rows per run")
    wr.add_argument("--drain", type=float, default=300, help="most seconds past the end")
    wr.add_argument("--ready", type=float, default=600, help="most seconds for imports")
    wr.add_argument("--dir", help="where the writers' logs go (a new folder in it)")
    wr.add_argument("--json", help="also write the figures here")
    one = sub.add_parser("writer", help="one writer of `writers` (started by it)")
    one.add_argument("--root", required=True)
    one.add_argument("--dir", required=True)
    one.add_argument("--index", type=int, required=True)
    one.add_argument("--recipes", type=int, default=4)
    one.add_argument("--requests", type=int, default=300)
    s = sub.add_parser("site", help="time and size of `speedmatrix site` over the warehouse")
    s.add_argument("--root", required=True)
    s.add_argument("--out", required=True, help="site directory (emptied first)")
    s.add_argument("--run-pages", type=int, default=40, help="run pages to time")
    s.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.cmd == "generate":
        generate(args.root, args.workers, args.runs_per_day)
        return 0
    if args.cmd == "writer":
        return writer_main(args)
    if args.cmd == "site":
        results = measure_site(args.root, args.out, args.run_pages)
    elif args.cmd == "writers":
        results = measure_writers(
            args.writers,
            args.seconds,
            args.recipes,
            args.requests,
            args.drain,
            args.ready,
            args.dir,
        )
    elif args.cmd == "s3":
        results = measure_s3(args.days, args.runs_per_day)
    elif args.cmd == "old":
        results = measure_old(args.commit, args.days, args.root)
    else:
        results = measure(args.root)
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.cmd == "writers":
        print_writers_summary(results)
        return 0 if results["check"]["ok"] and results["refused_or_failed"] == 0 else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
