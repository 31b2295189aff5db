"""Warehouse benchmark: a synthetic warehouse of three years of nightly runs for 20 recipes
(~22,000 runs, ~1.2 million cells), then: landing one run with ``Warehouse.land_run`` on top
of it, and the three analyst queries of ``warehouse/README.md``, cold and warm, with DuckDB.

    uv run python benchmarks/warehouse_bench.py generate --root /tmp/wh-bench   # once (minutes)
    uv run python benchmarks/warehouse_bench.py measure  --root /tmp/wh-bench   # the figures
    uv run python benchmarks/warehouse_bench.py site --root /tmp/wh-bench --out /tmp/site-bench

Not a test: the figures go to benchmarks/README.md. The generator writes the Parquet files
directly (same schemas, same paths, same writer as land_run) with pyarrow, in bulk and in
parallel, instead of calling land_run 22,000 times; land_run itself is timed on top of the big
warehouse. "Cold" is a fresh process and a fresh DuckDB connection (the OS page cache is not
dropped: that needs privileges a CI runner does not have); "warm" is the median of repeats on
the same connection.
"""

from __future__ import annotations

import argparse
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

# The three questions of warehouse/README.md, through the views (speedmatrix query, or plain
# DuckDB with the README's CREATE VIEWs) ...
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
# ... and as narrow globs (plain DuckDB, the README's second form).
NARROW = {
    "q1_cell_trend": """
        SELECT r.started_at, r.engine_version, r.engine_commit,
               c.total_tok_s, c.per_request_tok_s, c.ttft_ms, c.tbt_ms
        FROM read_parquet('{root}/cells/recipe_id=bench%2Fhw1%2Fmodel-07/run_month=2025-*/*.parquet',
                          hive_partitioning = true) c
        JOIN read_parquet('{root}/runs/recipe_id=bench%2Fhw1%2Fmodel-07/run_month=2025-*/*.parquet',
                          hive_partitioning = true) r USING (run_id)
        WHERE r.trigger = 'nightly'
          AND c.phase = 'decode' AND c.context_label = '32K' AND c.concurrency = 4
        ORDER BY r.started_at
    """,
    "q2_run_matrix": """
        SELECT phase, context_label, concurrency, status, total_tok_s, per_request_tok_s,
               ttft_ms, tbt_ms
        FROM read_parquet('{root}/cells/*/*/*_nightly-bench-hw2-model-12-2024-06-15.parquet',
                          hive_partitioning = true)
        ORDER BY phase DESC, context_tokens, concurrency
    """,
    "q3_one_date": """
        SELECT r.recipe_id, r.engine_version, c.context_label, c.concurrency, c.total_tok_s
        FROM read_parquet('{root}/cells/*/run_month=2025-03/2025-03-14_*.parquet',
                          hive_partitioning = true) c
        JOIN read_parquet('{root}/runs/*/run_month=2025-03/2025-03-14_*.parquet',
                          hive_partitioning = true) r USING (run_id)
        WHERE c.phase = 'decode' AND c.status = 'valid'
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
        "measure_s": 30.0,
        "max_output_tokens": 4096,
        "host": "bench",
    }
    return run, cells, requests


def _generate_recipe(args: tuple[str, int]) -> int:
    root, recipe_index = args
    wh = W.Warehouse(root)
    run, cells, requests = template(recipe_index)
    recipe = RECIPES[recipe_index]
    base = wh.build_tables(
        dict(run, started_at=dt.datetime(2023, 1, 1, 2, tzinfo=dt.UTC)), cells, requests
    )
    rng = np.random.default_rng(1000 + recipe_index)
    n_files = 0
    for d in range(DAYS):
        day = START + dt.timedelta(days=d)
        rid = run_id_of(recipe, day)
        started = dt.datetime(day.year, day.month, day.day, 2, 0, tzinfo=dt.UTC)
        jitter = 1 + 0.02 * rng.standard_normal()
        for table in W.TABLES:
            t = base[table]
            n = t.num_rows

            def put(t, name, arr):
                return t.set_column(t.schema.get_field_index(name), t.schema.field(name), arr)

            if table == "runs":
                t = put(t, "run_id", pa.array([rid]))
                t = put(t, "started_at", pa.array([started], t.schema.field("started_at").type))
                t = put(
                    t,
                    "finished_at",
                    pa.array([started + dt.timedelta(hours=1)], t.schema.field("finished_at").type),
                )
                t = put(t, "engine_commit", pa.array([f"{d:012x}"]))
            else:
                t = put(t, "run_id", pa.array([rid] * n))
            if table == "cells":
                for col in ("total_tok_s", "per_request_tok_s"):
                    t = put(t, col, pa.compute.multiply(t.column(col), jitter))
            t = put(t, "run_date", pa.array([day] * n, pa.date32()))
            t = put(t, "run_month", pa.array([W.run_month_of(day)] * n))
            path = wh.file_path(table, rid, recipe, day)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            W.write_parquet(W.without_partition_columns(t), path, wh.fs)
            n_files += 1
    return n_files


def generate(root: str, workers: int) -> None:
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        files = sum(pool.map(_generate_recipe, [(root, i) for i in range(len(RECIPES))]))
    elapsed = time.perf_counter() - t0
    print(f"generated {files} files ({len(RECIPES) * DAYS} runs) in {elapsed:.0f} s")


def count_files(root: str) -> dict[str, int]:
    out = {}
    for table in W.TABLES:
        n = 0
        for _dirpath, _dirs, files in os.walk(os.path.join(root, table)):
            n += sum(f.endswith(".parquet") for f in files)
        out[table] = n
    return out


PLAIN_VIEWS = """
CREATE VIEW runs AS SELECT * FROM read_parquet('{root}/runs/*/*/*.parquet',
    hive_partitioning = true, hive_types = {{'recipe_id': VARCHAR, 'run_month': VARCHAR}});
CREATE VIEW cells AS SELECT * FROM read_parquet('{root}/cells/*/*/*.parquet',
    hive_partitioning = true, hive_types = {{'recipe_id': VARCHAR, 'run_month': VARCHAR}});
"""


def _cold_query(root: str, name: str, mode: str) -> dict:
    """In a fresh process: time the first run of the query (cold: includes opening the
    connection and defining the views), then the median of 5 more on the same connection (warm).

    mode ``plain``: plain DuckDB with the README's view definitions (no speedmatrix);
    ``narrow``: plain DuckDB, the README's narrow globs (no views);
    ``dataset`` / ``glob``: ``Warehouse(root, views=mode).query``."""
    code = f"""
import json, statistics, sys, time
sys.path.insert(0, {str(HERE)!r})
from warehouse_bench import NARROW, QUERIES, PLAIN_VIEWS
sql = (NARROW if {mode!r} == "narrow" else QUERIES)[{name!r}].replace("{{root}}", {root!r})
mode = {mode!r}
import duckdb, pandas, pyarrow.dataset  # imports are not the query's time
from speedmatrix.store.warehouse import Warehouse
t = time.perf_counter()
if mode in ("plain", "narrow"):
    con = duckdb.connect()
    con.execute("SET enable_progress_bar = false")  # it writes to stdout
    con.execute(PLAIN_VIEWS.format(root={root!r}))
    run = lambda: con.execute(sql).df()
else:
    wh = Warehouse({root!r}, views=mode)
    run = lambda: wh.query(sql)
df = run()
cold = time.perf_counter() - t
warm = []
for _ in range(5):
    t = time.perf_counter(); run(); warm.append(time.perf_counter() - t)
print("RESULT " + json.dumps({{"rows": len(df), "cold_s": round(cold, 3), "warm_s": round(statistics.median(warm), 3),
                   "warm_max_s": round(max(warm), 3)}}), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1]}
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    print(f"{mode:8} {name:20} {result}", file=sys.stderr, flush=True)
    return result


def measure(root: str) -> dict:
    results: dict = {"files_before": count_files(root)}
    wh = W.Warehouse(root)
    run, cells, requests = template(3 % len(RECIPES))
    # warm up imports (pandas, pyarrow compute) so the figure is landing, not import time
    wh.build_tables(dict(run, run_id="warmup"), cells, requests)
    timings = []
    day = START + dt.timedelta(days=DAYS)
    for i in range(5):
        r = dict(
            run,
            run_id=f"bench-land-{i}",
            started_at=dt.datetime(day.year, day.month, day.day, 3, tzinfo=dt.UTC),
        )
        t = time.perf_counter()
        wh.land_run(r, cells, requests)
        timings.append(time.perf_counter() - t)
    results["land_new_run_s"] = {"median": statistics.median(timings), "max": max(timings)}
    print("land_run, new run:", results["land_new_run_s"], file=sys.stderr, flush=True)
    timings = []
    for _ in range(5):
        r = dict(
            run,
            run_id="bench-land-0",
            started_at=dt.datetime(day.year, day.month, day.day, 3, tzinfo=dt.UTC),
        )
        t = time.perf_counter()
        wh.land_run(r, cells, requests)
        timings.append(time.perf_counter() - t)
    results["land_again_same_run_s"] = {"median": statistics.median(timings), "max": max(timings)}
    after = count_files(root)
    results["files_after"] = after
    results["files_added_per_run"] = {
        t: (after[t] - results["files_before"][t]) / 5 for t in W.TABLES
    }
    recipe = RECIPES[-1]
    mid = START + dt.timedelta(days=DAYS // 2)
    wh.read_run(run_id_of(recipe, mid))  # warm the directory cache
    t = time.perf_counter()
    wh.read_run(run_id_of(recipe, mid + dt.timedelta(days=1)))
    results["read_run_s"] = time.perf_counter() - t
    t = time.perf_counter()
    wh.read_run(run_id_of(recipe, mid + dt.timedelta(days=2)), recipe_id=recipe)
    results["read_run_with_recipe_s"] = time.perf_counter() - t
    results["load_average"] = os.getloadavg()
    for i in range(5):
        wh.delete_run(f"bench-land-{i}")
    results["queries"] = {
        mode: {name: _cold_query(root, name, mode) for name in QUERIES}
        for mode in ("dataset", "glob", "plain", "narrow")
    }
    results["load_average_after"] = os.getloadavg()
    return results


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--root", required=True)
    g.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    m = sub.add_parser("measure")
    m.add_argument("--root", required=True)
    m.add_argument("--json", help="also write the figures here")
    s = sub.add_parser("site", help="time and size of `speedmatrix site` over the warehouse")
    s.add_argument("--root", required=True)
    s.add_argument("--out", required=True, help="site directory (emptied first)")
    s.add_argument("--run-pages", type=int, default=40, help="run pages to time")
    s.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.cmd == "generate":
        generate(args.root, args.workers)
    elif args.cmd == "site":
        text = json.dumps(measure_site(args.root, args.out, args.run_pages), indent=2)
        print(text)
        if args.json:
            Path(args.json).write_text(text + "\n")
    else:
        results = measure(args.root)
        text = json.dumps(results, indent=2)
        print(text)
        if args.json:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
