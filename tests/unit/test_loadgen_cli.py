"""The command line: output files, exit codes, the API key from the environment, help, zipapp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loadgen_ideal import ideal_server

from speedmatrix.loadgen import zipapp
from speedmatrix.loadgen.cli import parse_tokens
from speedmatrix.loadgen.prometheus import parse_metrics
from speedmatrix.loadgen.prompts import PromptSet, header_text
from speedmatrix.loadgen.stats import is_repetition_loop, median, percentile, rate_median
from speedmatrix.records import CELL_FIELDS, REQUEST_FIELDS

pytestmark = pytest.mark.timing  # run alone: see pyproject's markers

CELL_KEYS = sorted(f.name for f in CELL_FIELDS)
REQUEST_KEYS = sorted(f.name for f in REQUEST_FIELDS)


def speedmatrix(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speedmatrix", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_decode_writes_the_cell_and_request_rows(tmp_path: Path) -> None:
    out, rows = tmp_path / "cell.json", tmp_path / "rows.jsonl"
    with ideal_server(api_key="k3y", ttft_s=0.01, interval_s=0.01) as url:
        proc = speedmatrix(
            "loadgen", "decode", "--base-url", url, "--model", "ideal", "--context", "2K",
            "--concurrency", "3", "--window-s", "1.5", "--max-output", "50",
            "--api-key-env", "MY_KEY", "--json", str(out), "--requests", str(rows),
            env={"MY_KEY": "k3y"},
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "k3y" not in proc.stdout + proc.stderr
    assert proc.stderr == ""  # not a terminal: quiet
    cell = json.loads(out.read_text())
    assert sorted(cell) == CELL_KEYS
    assert cell["status"] == "valid", cell["error"]
    assert cell["context_tokens"] == 2048 and cell["concurrency"] == 3
    lines = [json.loads(line) for line in rows.read_text().splitlines()]
    assert lines and all(sorted(r) == REQUEST_KEYS for r in lines)
    assert sum(r["window_tokens"] for r in lines) == cell["output_tokens"]


def test_prefill_prints_the_record_without_json_flag() -> None:
    with ideal_server(ttft_s=0.01) as url:
        proc = speedmatrix(
            "loadgen", "prefill", "--base-url", url + "/v1", "--model", "ideal", "--context", "1000"
        )
    assert proc.returncode == 0, proc.stderr
    cell = json.loads(proc.stdout)
    assert cell["phase"] == "prefill" and cell["status"] == "valid"
    assert cell["context_tokens"] == 1000


def test_failed_cell_still_exits_zero_with_its_record(tmp_path: Path) -> None:
    out = tmp_path / "cell.json"
    with ideal_server(ttft_s=0.01, interval_s=0.005, http_500_every=3) as url:
        proc = speedmatrix(
            "loadgen", "decode", "--base-url", url, "--model", "ideal", "--context", "512",
            "--concurrency", "2", "--window-s", "1", "--max-output", "20", "--json", str(out),
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cell = json.loads(out.read_text())
    assert cell["status"] == "failed" and "HTTP 500" in cell["error"]


def test_unreachable_server_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "cell.json"
    proc = speedmatrix(
        "loadgen", "decode", "--base-url", "http://127.0.0.1:9", "--model", "m",
        "--context", "1K", "--concurrency", "1", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 3
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "not attempted" in proc.stderr and "unreachable" in proc.stderr
    assert not out.exists()


def test_bad_arguments_exit_2() -> None:
    proc = speedmatrix(
        "loadgen", "decode", "--base-url", "http://x", "--model", "m", "--context", "1K",
        "--concurrency", "0",
    )  # fmt: skip
    assert proc.returncode == 2
    assert "concurrency" in proc.stderr
    proc = speedmatrix("loadgen", "decode", "--model", "m")
    assert proc.returncode == 2
    proc = speedmatrix(
        "loadgen", "decode", "--base-url", "http://x", "--model", "m", "--context", "1K",
        "-c", "1", "--min-window-readings", "0",
    )  # fmt: skip
    assert proc.returncode == 2 and "--min-window-readings: must be at least 1" in proc.stderr


def test_the_active_request_limits_reach_the_config() -> None:
    import argparse

    from speedmatrix.loadgen import cli

    parser = argparse.ArgumentParser()
    cli.add_parsers(parser.add_subparsers())
    args = parser.parse_args(
        ["decode", "--base-url", "http://x", "--model", "m", "--context", "1K", "-c", "2",
         "--min-window-readings", "40", "--max-active-deviation", "0.2"]
    )  # fmt: skip
    cfg = cli.build_config(args)
    assert (cfg.min_window_readings, cfg.max_active_deviation) == (40, 0.2)
    defaults = cli.build_config(parser.parse_args(["decode", "--base-url", "h", "--model", "m",
                                                   "--context", "8", "-c", "1"]))  # fmt: skip
    assert (defaults.min_window_readings, defaults.max_active_deviation) == (20, 0.10)


def test_the_workload_and_the_copy_check_reach_the_config() -> None:
    import argparse

    from speedmatrix.loadgen import cli

    parser = argparse.ArgumentParser()
    cli.add_parsers(parser.add_subparsers())
    base = ["--base-url", "http://x", "--model", "m", "--context", "1K"]
    cfg = cli.build_config(parser.parse_args(["decode", *base, "-c", "2"]))
    assert (cfg.workload, cfg.copy_check, cfg.max_copy_share) == ("article", True, 0.2)
    cfg = cli.build_config(
        parser.parse_args(["decode", *base, "-c", "2", "--workload", "continuation",
                           "--no-copy-check", "--max-copy-share", "0.5"])
    )  # fmt: skip
    assert (cfg.workload, cfg.copy_check, cfg.max_copy_share) == ("continuation", False, 0.5)
    pre = cli.build_config(parser.parse_args(["prefill", *base, "--workload", "continuation"]))
    assert pre.workload == "continuation"
    with pytest.raises(SystemExit):
        parser.parse_args(["decode", *base, "-c", "2", "--workload", "poetry"])


def test_decode_help_explains_every_option() -> None:
    proc = speedmatrix("loadgen", "decode", "--help")
    assert proc.returncode == 0
    text = proc.stdout
    for option in (
        "--base-url", "--model", "--api-key-env", "--context", "--concurrency", "--window-s",
        "--max-output", "--prompt-mode", "--json", "--requests", "--run-tag", "--no-warm",
        "--first-token-timeout", "--stall-timeout", "--connect-timeout", "--token-tolerance",
        "--max-loop-lag-ms", "--max-client-cpu", "--progress", "--extra-body",
        "--metrics-interval", "--min-window-readings", "--max-active-deviation",
    ):  # fmt: skip
        assert option in text, option
    # every option has a help text (argparse prints bare options without one on their own)
    import argparse

    from speedmatrix.loadgen import cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.add_parsers(sub)
    decode = sub.choices["decode"]
    missing = [a.option_strings for a in decode._actions if a.option_strings and not a.help]
    assert missing == []


def test_zipapp_runs_a_cell_standalone(tmp_path: Path) -> None:
    pyz = zipapp.build(tmp_path / "loadgen.pyz")
    out = tmp_path / "cell.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with ideal_server(ttft_s=0.01, interval_s=0.01) as url:
        proc = subprocess.run(
            [sys.executable, "-I", str(pyz), "decode", "--base-url", url, "--model", "ideal",
             "--context", "1024", "--concurrency", "2", "--window-s", "1", "--max-output", "30",
             "--json", str(out)],
            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cell = json.loads(out.read_text())
    assert cell["status"] == "valid", cell["error"]
    import zipfile

    names = set(zipfile.ZipFile(pyz).namelist())
    assert "speedmatrix/records.py" in names and "speedmatrix/loadgen/corpus.txt" in names
    assert not any(n.startswith("speedmatrix/") and n.count("/") == 1 and n not in (
        "speedmatrix/",
        "speedmatrix/__init__.py", "speedmatrix/records.py", "speedmatrix/errors.py",
        "speedmatrix/renames.py")
        for n in names)  # fmt: skip


def test_the_package_imports_nothing_but_records_and_errors_from_speedmatrix() -> None:
    root = Path(zipapp.__file__).parent
    for path in root.glob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("import speedmatrix", "from speedmatrix")):
                ok = (
                    line.startswith(
                        (
                            "from speedmatrix.records import",
                            "from speedmatrix.loadgen",
                            "from speedmatrix.renames import",
                        )
                    )
                    or line == "from speedmatrix.errors import InputError"
                    or line
                    in (
                        "from speedmatrix import records",
                        "from speedmatrix import errors, records",
                        "from speedmatrix import errors, records, renames",
                    )
                )
                assert ok, (path.name, line)


@pytest.mark.parametrize(
    ("text", "tokens"), [("8192", 8192), ("8K", 8192), ("512k", 524288), ("1,000", 1000)]
)
def test_token_counts(text: str, tokens: int) -> None:
    assert parse_tokens(text) == tokens


def test_prometheus_text_is_summed_over_labels() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'vllm:generation_tokens_total{model_name="m, with comma"} 1.5e3\n'
        "process_cpu_seconds_total 12\n"
    )
    values = parse_metrics(text)
    assert values["vllm:num_requests_running"] == 5.0
    assert values["vllm:generation_tokens_total"] == 1500.0
    assert values["process_cpu_seconds_total"] == 12.0


def test_prompts_are_exact_and_never_prefixes_of_each_other() -> None:
    corpus = list(range(100, 137))
    ps = PromptSet(1000, [[1, 5, 6], [1, 5, 7, 8]], corpus)
    a, b = ps.ids(0), ps.ids(1)
    assert len(a) == len(b) == 1000
    assert a[:3] == [1, 5, 6] and a[3:40] == corpus
    head, tail = ps.json_parts(1)
    assert json.loads(b"[" + head + b"," + tail + b"]") == b
    # an article's end (reply, instruction, generation prompt) closes every prompt, exactly
    art = PromptSet(1000, [[1, 5, 6], [1, 5, 7, 8]], corpus, suffix=[9, 9, 2])
    for i in range(2):
        ids = art.ids(i)
        assert len(ids) == 1000 and ids[-3:] == [9, 9, 2]
        head, tail = art.json_parts(i)
        assert json.loads(b"[" + head + b"," + tail + b"]") == ids
    assert header_text("t", 8192, 0) != header_text("t", 16384, 0)  # contexts never share
    assert header_text("t", 8192, 0) != header_text("t", 8192, 1)  # nor streams


def test_percentiles_and_repetition_loops() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert is_repetition_loop("intro text " + "the cat sat. " * 60)
    assert not is_repetition_loop(" ".join(f"word{i * 7919 % 1000}" for i in range(200)))
    assert not is_repetition_loop("short")


def test_the_per_request_rate_is_the_reciprocal_of_the_median_interval() -> None:
    """Two intervals 1.9x apart (a long request and a few tokens of the next, at C = 1): the
    midpoint of their rates is 11% above 1 / the midpoint interval, out of the cells suite's
    10%; 1 / the midpoint is also a median of the rates (between the middle two)."""
    tbts = [0.004, 0.0076]
    rate = rate_median(tbts)
    assert rate == pytest.approx(1 / 0.0058)
    assert 1 / 0.0076 <= rate <= 1 / 0.004
    assert rate * median(tbts) == pytest.approx(1.0)
    assert rate_median([0.01, 0.02, 0.04]) == pytest.approx(50.0)  # odd: the plain median
    assert rate_median([]) is None


def _on_a_terminal(*args: str) -> tuple[int, str]:
    """Run `speedmatrix …` with its stdout on a pseudo-terminal (as a person at a shell)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "speedmatrix", *args],
        stdout=slave,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "COLUMNS": "200"},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    rc = proc.wait(120)
    os.close(master)
    return rc, b"".join(chunks).decode().replace("\r\n", "\n")


def test_decode_on_a_terminal_ends_with_a_readable_summary_and_json_on_request(
    tmp_path: Path,
) -> None:
    out = tmp_path / "cell.json"
    cell_args = ["--model", "ideal", "--context", "2K", "--concurrency", "2",
                 "--window-s", "1", "--max-output", "50"]  # fmt: skip
    with ideal_server(ttft_s=0.01, interval_s=0.01) as url:
        rc, text = _on_a_terminal("loadgen", "decode", "--base-url", url, *cell_args,
                                  "--json", str(out))  # fmt: skip
        assert rc == 0, text
        # the person reads the figures; the pipeline's --json F file is unchanged
        assert text.startswith("decode 2K x 2: valid\n"), text
        for label in ("total:", "per request:", "TTFT:", "between tokens:", "window:"):
            assert f"\n  {label}" in text, text
        cell = json.loads(out.read_text())
        assert f"{cell['total_tok_s']:,.1f} tok/s" in text
        assert "p99" in text and "{" not in text
        rc, text = _on_a_terminal("loadgen", "decode", "--base-url", url, *cell_args, "--json")
    assert rc == 0, text
    assert sorted(json.loads(text)) == CELL_KEYS  # --json alone: the record on stdout


def test_the_summary_says_why_a_cell_is_not_valid() -> None:
    from speedmatrix.loadgen.cli import summary
    from speedmatrix.records import empty_cell

    text = summary(empty_cell(phase="prefill", context_tokens=8192, context_label="8K",
                              concurrency=1, status="failed", error="HTTP 500"))  # fmt: skip
    assert text.splitlines()[:2] == ["prefill 8K: failed", "  why:             HTTP 500"]
    assert "prompt:          -" in text  # nothing measured: no number made up


def test_burst_writes_its_cell_and_rows_with_the_latency_the_server_gives() -> None:
    """`loadgen burst` (issue #43 item 12) against a server of known timing (first token
    after 10 ms, then one every 10 ms): 3 requests at once of 50 tokens each complete in
    10 + 49 x 10 = 500 ms, so 50 / 0.5 = 100 tok/s per user end to end."""
    with ideal_server(ttft_s=0.01, interval_s=0.01) as url:
        proc = speedmatrix(
            "loadgen", "burst", "--base-url", url, "--model", "ideal", "--context", "2K",
            "--concurrency", "3", "--max-output", "50", "--json", "-",
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cell = json.loads(proc.stdout)
    assert sorted(cell) == CELL_KEYS
    assert cell["status"] == "valid", cell["error"]
    assert (cell["phase"], cell["concurrency"], cell["completed_requests"]) == ("burst", 3, 3)
    assert cell["output_tokens"] == 150
    assert cell["latency_ms"] == pytest.approx(500, rel=0.15)
    assert cell["e2e_per_request_tok_s"] == pytest.approx(100, rel=0.15)
    assert cell["tbt_ms"] == pytest.approx(10, rel=0.15)
