"""The report: the published page back from the warehouse (Markdown row for row), HTML, baseline."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_inprocess import run_cli

from speedmatrix.published import formats as F
from speedmatrix.published.pagetext import HEADER_LABELS, SECTIONS
from speedmatrix.published.parse import parse_report
from speedmatrix.report.render import render_html, render_markdown
from speedmatrix.store.warehouse import Warehouse

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "include" / "reference" / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt"


def measurement_rows(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.match(r"^\| (Prefill|Sustained decode) \|", ln)]


@pytest.fixture(scope="module")
def landed(tmp_path_factory):
    """The reference page ingested with the real command into a fresh warehouse."""
    root = tmp_path_factory.mktemp("wh")
    out = run_cli("ingest", str(REFERENCE), env={"SPEEDMATRIX_WAREHOUSE": str(root)})
    assert out.returncode == 0, out.stderr
    return root, out.stdout.strip()


def report(root, *args, process: bool = False) -> subprocess.CompletedProcess:
    """`speedmatrix report *args` in this process (tests/cli_inprocess.py), or with
    ``process=True`` through its entry point (the round trip below: the command's one)."""
    if not process:
        return run_cli("report", *args, env={"SPEEDMATRIX_WAREHOUSE": str(root)})
    env = dict(os.environ, SPEEDMATRIX_WAREHOUSE=str(root))
    return subprocess.run(
        [sys.executable, "-m", "speedmatrix", "report", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )


def test_round_trip_row_for_row(landed, tmp_path):
    root, run_id = landed
    out = report(root, "--run-id", run_id, "--format", "md", process=True)
    assert out.returncode == 0, out.stderr
    page = out.stdout
    reference = REFERENCE.read_text(encoding="utf-8")
    want = measurement_rows(reference)
    got = measurement_rows(page)
    assert len(want) == 55
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g == w, f"row {i}"
    # the header row of the table too
    assert F.table_header() in page and F.table_header() in reference
    # ingesting the rendered page again gives the same rows, and the same run
    again = parse_report(page, source="rendered.md")
    first = parse_report(reference)
    assert again.cells == first.cells
    assert again.run_id == first.run_id == run_id
    assert {k: v for k, v in again.run.items() if k != "source"} == {
        k: v for k, v in first.run.items() if k != "source"
    }
    rendered = tmp_path / "rendered.md"
    rendered.write_text(page, encoding="utf-8")
    reingest = run_cli(
        "ingest", str(rendered), env={"SPEEDMATRIX_WAREHOUSE": str(tmp_path / "wh2")}
    )
    assert reingest.returncode == 0, reingest.stderr
    assert reingest.stdout.strip() == run_id
    _, cells, _ = Warehouse(tmp_path / "wh2").read_run(run_id)
    assert [F.table_row(c) for c in cells] == want


def test_sections_and_labels_in_order(landed):
    root, run_id = landed
    page = report(root, "--run-id", run_id).stdout
    headings = [ln[3:] for ln in page.splitlines() if ln.startswith("## ")]
    assert headings == list(SECTIONS)
    assert page.startswith("# Speed test matrix\n")
    reference = REFERENCE.read_text(encoding="utf-8")
    ref_lines = set(reference.splitlines())
    labels = [label for fields in HEADER_LABELS.values() for label, _ in fields]
    present = [label for label in labels if f"- {label}" in ref_lines]
    assert len(present) == 19
    for label in present:
        assert f"- {label}: " in page, label
    for line in (
        "**Kimi-K2.7-Code-NVFP4 on RTX PRO 6000 Blackwell Server Edition 96GB ×8**",
        "- VRAM: 768 GB (8 × 96 GB)",
        "- Benchmark tool: llm-inference-bench v0.7.9",
        "- Time per measurement: 30 s",
        "- Max output: 4,096 tokens",
        "| 8K context | 6,206 | 1,320 ms TTFT |",
        "| 251K | 35.7 · 1,508 ms TTFT | Over capacity |",
        "Over capacity: not run because this many requests at this context would exceed the "
        "server's KV cache.",
    ):
        assert line in page, line
    assert "6 contexts (8K–251K) × 8 concurrency levels (1–128)" in page


def test_report_to_file_and_errors(landed, tmp_path):
    root, run_id = landed
    out_file = tmp_path / "page.html"
    out = report(root, "--run-id", run_id, "--format", "html", "--out", str(out_file))
    assert out.returncode == 0 and out.stdout == "", out.stderr
    assert out_file.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    missing = report(root, "--run-id", "no-such-run")
    assert missing.returncode == 2 and missing.stdout == ""
    assert "no-such-run" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def test_html_is_one_self_contained_file():
    parsed = parse_report(REFERENCE.read_text(encoding="utf-8"))
    page = render_html(parsed.run, parsed.cells)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # nothing fetched from elsewhere: no external scripts, styles, images or fonts
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:|//)""", page)
    assert "<script" not in page and "@import" not in page
    assert page.count("<svg") == 4  # prefill tok/s, prefill TTFT, decode total, per request
    for title in ("Prefill: prompt tok/s", "Prefill: time to first token"):
        assert title in page
    # every measurement row is there, formatted as in the page
    table = page.split('<table class="all">', 1)[1].split("</table>", 1)[0]
    html_rows = [
        [re.sub(r"<[^>]+>", "", td) for td in re.findall(r"<td[^>]*>.*?</td>", tr)][
            : len(
                F.TABLE_COLUMNS
            )  # the published columns; the tails and reason follow
        ]
        for tr in re.findall(r"<tr class=[^>]*>(.*?)</tr>", table)
    ]
    want = [
        [c.strip() for c in row.strip("|").split("|")]
        for row in measurement_rows(REFERENCE.read_text(encoding="utf-8"))
    ]
    assert html_rows == want
    # the decode matrix is colour-scaled in one hue (palette.py): the fastest valid cell
    # dark blue with white text, the slowest the palest blue with dark text
    assert 'style="background: #2171b5; color: #ffffff"' in page
    assert 'style="background: #eff3ff; color: #000000"' in page
    for section in SECTIONS:
        assert re.search(rf"<h[23]>{re.escape(section)}</h[23]>", page), section


def test_baseline_comparison():
    parsed = parse_report(REFERENCE.read_text(encoding="utf-8"))
    faster = copy.deepcopy(parsed.cells)
    for c in faster:  # decode only: a prefill rate 10% up at the same TTFT is no possible page
        if c["total_tok_s"] is not None and c["phase"] == "decode":
            c["total_tok_s"] = round(c["total_tok_s"] * 1.10, 1)
    run = dict(parsed.run, run_id="faster")
    md = render_markdown(run, faster, baseline=(parsed.run, parsed.cells))
    assert f"## Change against baseline {parsed.run_id}" in md
    assert "| Sustained decode | 8K | 1 | Valid | 60.4 | 54.9 | +10.0% |" in md
    assert "| Sustained decode | 8K | 32 | Over capacity | — | — | — |" in md
    # the page above the comparison is still the published page: it parses
    assert parse_report(md).cells == faster
    html = render_html(run, faster, baseline=(parsed.run, parsed.cells))
    assert "Change against baseline" in html and "+10.0%" in html


def test_report_baseline_cli(landed, tmp_path):
    root, run_id = landed
    wh = Warehouse(root)
    run, cells, _ = wh.read_run(run_id)
    slower = [
        dict(
            c,
            run_id="slower",
            total_tok_s=None if c["total_tok_s"] is None else c["total_tok_s"] * 0.5,
        )
        for c in cells
    ]
    wh.land_run(dict(run, run_id="slower", trigger="manual"), slower, [])
    out = report(root, "--run-id", "slower", "--baseline", run_id)
    assert out.returncode == 0, out.stderr
    # judged against noise: no history, so unverified with its interval unknown
    assert "| Prefill | 8K | 1 | Valid | 3,103.0 | 6,206.0 | ? -50.0% | unknown |" in out.stdout


def test_pipeline_run_renders_and_parses_back():
    """A run of our own pipeline: exact token counts, failed / invalid cells, few header fields."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_warehouse import make_cells, make_run

    run = make_run(hardware_type="CPU", bench_tool="speedmatrix", bench_tool_version="0.1.0")
    cells = make_cells()
    cells[2].update(status="failed", error="stream disconnected", total_tok_s=None)
    cells[3].update(status="invalid", error="client loop lag 80 ms > 20 ms")
    md = render_markdown(run, cells)
    assert "| Sustained decode | 8K | 2 | Failed | — |" in md
    assert "| 8K | 50.0 · 87 ms TTFT | Failed | Invalid | Over capacity |" in md
    assert "- Benchmark tool: speedmatrix v0.1.0" in md
    back = parse_report(md)
    assert [F.table_row(c) for c in back.cells] == [F.table_row(c) for c in cells]
    assert [c["status"] for c in back.cells] == [c["status"] for c in cells]
    html = render_html(run, cells)
    assert "Failed" in html and "<svg" in html


def test_the_workload_in_the_run_section():
    """An article run's Markdown is the published page exactly (the published pages were
    measured with the article workload and do not name it); a continuation run says so in
    "Decode test" and ingests back as one; the HTML names the workload always."""
    first = parse_report(REFERENCE.read_text(encoding="utf-8"))
    assert first.run["workload"] == "article"
    assert {c["workload"] for c in first.cells} == {"article"}
    article_md = render_markdown(first.run, first.cells)
    assert "workload" not in article_md.lower()
    assert "- Decode test: Fixed duration\n" in article_md
    assert "<dt>Workload</dt><dd>article</dd>" in render_html(first.run, first.cells)

    run = dict(first.run, workload="continuation")
    cells = [dict(c, workload="continuation") for c in first.cells]
    md = render_markdown(run, cells)
    assert "- Decode test: Fixed duration (continuation workload)\n" in md
    assert md.replace(" (continuation workload)", "") == article_md
    back = parse_report(md, source="continuation.md")
    assert back.run["decode_test"] == "Fixed duration"
    assert back.run["workload"] == "continuation"
    assert {c["workload"] for c in back.cells} == {"continuation"}
    # a different workload is a different run; the article page keeps its id from before
    assert back.run_id != first.run_id
    assert "<dt>Workload</dt><dd>continuation</dd>" in render_html(run, cells)
    # a run landed before the workload was recorded: the Markdown as published, HTML a dash
    old = {k: v for k, v in first.run.items() if k != "workload"}
    assert render_markdown(old, first.cells) == article_md
    assert "<dt>Workload</dt><dd>—</dd>" in render_html(old, first.cells)


def test_prefill_summary_writes_large_rates_as_the_published_pages_do():
    """From 10,000 tok/s the published pages write `12.3K` (and `20K` for whole thousands), in
    the Prefill summary as in the matrix; below it `6,059`. The table keeps its own format, and
    the page parses back (the summary is cross-checked against the table)."""
    ref = Path(__file__).resolve().parents[2] / "include" / "reference"
    page = parse_report((ref / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt").read_text())
    cells = copy.deepcopy(page.cells)
    rates = {"8K": 12_345.0, "32K": 20_000.0, "64K": 104_400.0}
    for c in cells:
        if c["phase"] == "prefill" and c["context_label"] in rates:
            c["total_tok_s"] = rates[c["context_label"]]
    md = render_markdown(page.run, cells)
    prefill = md[md.index("## Prefill") : md.index("## Sustained decode")]
    assert "| 8K context | 12.3K | 1,320 ms TTFT |" in prefill
    assert "| 32K context | 20K | 5,629 ms TTFT |" in prefill
    assert "| 64K context | 104K | 12,459 ms TTFT |" in prefill
    assert "| 16K context | 6,059 | 2,679 ms TTFT |" in prefill  # below 10K: as before
    assert "| Prefill | 16K | 1 | Valid | 6,059.0 |" in md
    assert "| Prefill | 8K | 1 | Valid | 12.3K |" in md
    back = {c["context_label"]: c["total_tok_s"] for c in parse_report(md).cells[:7]}
    assert (back["8K"], back["32K"], back["64K"]) == (12_300.0, 20_000.0, 104_000.0)


def test_acceptance_length_matrix_in_html_only_when_speculating():
    """A speculating run shows each cell's mean acceptance length in the HTML; the Markdown page
    keeps the published format exactly (no new column); a run without it shows no matrix."""
    parsed = parse_report(REFERENCE.read_text(encoding="utf-8"))
    cells = copy.deepcopy(parsed.cells)
    plain = render_html(parsed.run, cells)
    assert "Speculative decoding" not in plain
    decode = [c for c in cells if c["phase"] == "decode" and c["status"] == "valid"]
    for i, c in enumerate(decode):
        c["spec_acceptance_length"] = 2.5 + 0.01 * i
    page = render_html(parsed.run, cells)
    assert "Speculative decoding" in page and 'class="matrix acceptance"' in page
    assert all(f"{2.5 + 0.01 * i:.2f}" in page for i in range(len(decode)))
    md = render_markdown(parsed.run, cells)
    assert md == render_markdown(parsed.run, parsed.cells)  # the acceptance changes no byte


def test_warm_up_stays_out_of_the_published_table():
    """warmup_s is in the cell record and the cells table, not in the page's All
    measurements table (issue #19: the published format is unchanged)."""
    from speedmatrix.records import empty_cell

    cell = empty_cell(
        phase="decode", context_tokens=8192, context_label="8K", concurrency=1, status="valid",
        total_tok_s=54.9, per_request_tok_s=54.9, ttft_ms=87.0, tbt_ms=18.2,
        output_tokens=1647, measured_s=30.0,
    )  # fmt: skip
    assert "warmup_s" in cell
    assert F.table_row({**cell, "warmup_s": 12.5}) == F.table_row(cell)
    assert "warm" not in F.table_header().lower()


def test_markup_from_an_ingested_page_is_text_in_html_and_the_markdown_says_it_is_verbatim():
    """Issue #33 item 8: an ingested page's fields may hold raw HTML. The HTML page escapes
    it; the Markdown is the published format, byte for byte (it parses back to the same run),
    so it keeps it, and the warehouse README says why it is not for untrusted pages."""
    parsed = parse_report(REFERENCE.read_text(encoding="utf-8"))
    hostile = "<script>alert(1)</script>"
    run = dict(parsed.run, served_model=hostile, engine_version=f"<img src=x onerror=a()>{hostile}")
    page = render_html(run, parsed.cells)
    assert "<script" not in page and "<img" not in page and "&lt;script&gt;" in page
    assert hostile in render_markdown(run, parsed.cells)
    readme = (ROOT / "warehouse" / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The Markdown page copies fields verbatim", 1)[1].split("\n## ")[0]
    assert "untrusted" in section and "--format html" in section and "round" in section


def test_a_published_profile_run_says_so_and_reads_back():
    """Issue #35: our run measured by the published tool's definitions names its profile on
    the page (Markdown: a note on the decode test; HTML: a row), and ingests back to it; a
    page the published tool made is that profile by its nature, its text unchanged."""
    parsed = parse_report(REFERENCE.read_text(encoding="utf-8"))
    assert parsed.run["measurement_profile"] == "published"
    assert {c["measurement_profile"] for c in parsed.cells} == {"published"}
    ours = dict(parsed.run, bench_tool="speedmatrix", bench_tool_version="0.1.0")
    for profile in ("default", "published"):
        run = dict(ours, measurement_profile=profile)
        md = render_markdown(run, parsed.cells)
        assert ("Fixed duration (published profile)" in md) is (profile == "published")
        back = parse_report(md)
        assert back.run["measurement_profile"] == profile
        assert back.run["decode_test"] == "Fixed duration"
        assert f"<dt>Measurement profile</dt><dd>{profile}</dd>" in render_html(run, parsed.cells)
    assert "(published profile)" not in render_markdown(parsed.run, parsed.cells)


def test_an_adaptive_runs_page_says_how_each_window_ended():
    """The run page of an adaptive run says how each window ended in the cell's note (a fixed
    run's says nothing of it)."""
    from speedmatrix.report.render import adaptive_run, extra_cells, window_text

    early = {"window_mode": "adaptive", "window_stop": "converged", "window_halfwidth_pct": 0.84,
             "adaptive_target_pct": 1.0}  # fmt: skip
    assert window_text(early) == "early: ±0.84% vs ±1.00%"
    assert window_text({**early, "window_stop": "cap_not_steady"}) == "to cap: not steady"
    assert window_text({**early, "window_stop": "cap_not_converged"}) == "to cap: ±0.84% vs ±1.00%"
    assert window_text({"window_mode": "fixed", "window_stop": "cap"}) == "fixed"
    assert adaptive_run([{"window_mode": "fixed"}, early]) and not adaptive_run([{}])
    assert extra_cells(early, window=True)[-1] == "window early: ±0.84% vs ±1.00%"
    bad = {**early, "window_stop": "cap_not_steady", "error": "requests queued"}
    assert extra_cells(bad, window=True)[-1] == "requests queued; window to cap: not steady"
    assert extra_cells(bad)[-1] == "requests queued"
