"""The run page's "Change against baseline" table shows, beside every change a verdict judges,
the interval it was judged with (#40 item 7): the change ± its noise band, as the summary and
`speedmatrix compare` print it; "unknown" where the comparison had no noise for the figure
(never ±0.0%); in the HTML page, the Markdown report and `speedmatrix report --format md`."""

from __future__ import annotations

import copy
import os
import re
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

from speedmatrix.analysis.noise import NoiseModel
from speedmatrix.analysis.verdict import compare_runs
from speedmatrix.cli import main
from speedmatrix.report.render import render_html, render_markdown

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_compare_warehouse import three_runs  # noqa: E402
from test_warehouse import make_cells, make_run  # noqa: E402

INTERVAL = r"\[[+-]\d+\.\d%, [+-]\d+\.\d%\]"


def _judged():
    """A run whose 8Kx4 is 20% slower and whose 8Kx1 TTFT rose 40%, judged with a noise
    model that knows every figure but TTFT (no TTFT history on this host: unverified)."""
    base_run, base = make_run(run_id="base", day=13), make_cells()
    run, cells = make_run(run_id="new", day=14), copy.deepcopy(make_cells())
    cells[3].update(total_tok_s=cells[3]["total_tok_s"] * 0.8)
    cells[1].update(ttft_ms=cells[1]["ttft_ms"] * 1.4)
    rows = [
        {"recipe_id": run.get("recipe_id") or "", "host": run.get("host") or "",
         "phase": c["phase"], "context_tokens": c["context_tokens"],
         "concurrency": c["concurrency"], "metric": m, "rel_sd": 0.01, "dof": 9, "runs": 10,
         "engines": 10}
        for c in cells
        for m in ("total_tok_s", "per_request_tok_s", "tbt_ms")
    ]  # fmt: skip
    judged = compare_runs(run, cells, base_run, base, noise=NoiseModel(pd.DataFrame(rows)))
    return run, cells, base_run, base, judged


def _row(judged, conc, metric):
    return next(
        r
        for r in judged
        if r["phase"] == "decode" and r["concurrency"] == conc and r["metric"] == metric
    )


def _html_table(page: str) -> dict[str, list[str]]:
    """{"8Kx4": the texts of its cells} from the page's "Change against baseline" table."""
    at = page.index('<table class="comparison">')
    table = page[at : page.index("</table>", at)]
    out = {}
    for tr in re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]:
        texts = [
            re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", td)).strip()
            for td in re.findall(r"<td[^>]*>.*?</td>", tr, re.S)
        ]
        out[f"{texts[0]} {texts[1]}x{texts[2]}"] = texts
    return out


def _header(page: str) -> list[str]:
    at = page.index('<table class="comparison">')
    row = page[at : page.index("</tr>", at)]
    return [re.sub(r"<[^>]+>", "", th) for th in re.findall(r"<th[^>]*>.*?</th>", row)]


def test_html_comparison_table_shows_each_judged_changes_interval():
    run, cells, base_run, base, judged = _judged()
    page = render_html(run, cells, (base_run, base), comparison=judged)
    header = _header(page)
    table = _html_table(page)
    slow = table["Sustained decode 8Kx4"]
    total = _row(judged, 4, "total_tok_s")
    change, noise = total["change_pct"], total["noise_pct"]
    expect = f"[{change - noise:+.1f}%, {change + noise:+.1f}%]"
    # the throughput change, its verdict mark and, in the column beside it, its interval
    assert slow[header.index("Change")] == "▼ -20.0%"
    assert slow[header.index("Interval")] == expect
    # a figure the comparison had no noise for: its change, and "unknown" beside it
    ttft = table["Sustained decode 8Kx1"][header.index("TTFT")]
    assert re.fullmatch(r"\? \+40\.0% unknown", ttft), ttft
    assert _row(judged, 1, "ttft_ms")["verdict"] == "unverified"
    # every other judged figure of a decode cell carries its interval beside its change
    for col in ("Per request", "Time between tokens"):
        assert re.fullmatch(r"[+-]\d+\.\d% " + INTERVAL, slow[header.index(col)]), slow
    # no band of zero is shown for an unknown one
    assert "±0.0%" not in page and "[+40.0%, +40.0%]" not in page


def test_markdown_comparison_table_has_the_interval_column():
    run, cells, base_run, base, judged = _judged()
    md = render_markdown(run, cells, (base_run, base), comparison=judged)
    section = md[md.index("## Change against baseline") :]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cols = [c.strip() for c in ln.strip("|").split("|")]
        rows[f"{cols[0]} {cols[1]}x{cols[2]}"] = cols
    assert "Interval" in header and header.index("Interval") == header.index("Change") + 1
    total = _row(judged, 4, "total_tok_s")
    change, noise = total["change_pct"], total["noise_pct"]
    slow = rows["Sustained decode 8Kx4"]
    assert slow[header.index("Change")] == "▼ -20.0%"
    assert slow[header.index("Interval")] == f"[{change - noise:+.1f}%, {change + noise:+.1f}%]"
    assert rows["Sustained decode 8Kx1"][header.index("TTFT")] == "? +40.0% unknown"
    assert "±0.0%" not in md


def test_without_a_comparison_the_table_says_it_was_not_judged():
    run, cells, base_run, base, _ = _judged()
    md = render_markdown(run, cells, (base_run, base))
    section = md[md.index("## Change against baseline") :]
    assert "not judged against noise" in section
    assert "unknown" not in section and "▼" not in section


@pytest.fixture
def wh(tmp_path):
    yield from three_runs(tmp_path / "wh")


def test_pipeline_and_report_command_markdown_show_the_intervals(wh, tmp_path):
    """The `report` task's report.md and `speedmatrix report --format md --baseline` judge
    the run and show each change's interval in the comparison table."""
    from speedmatrix.flows import matrix

    matrix.report({"run_id": "r2", "warehouse": wh.root}, {})
    md = wh.read_artifact("r2", "report.md").decode()
    section = md[md.index("## Change against baseline") : md.index("## Comparison")]
    assert re.search(r"\| ▼ -\d+\.\d% \| " + INTERVAL + r" \|", section), section
    out = tmp_path / "r2.md"
    argv = ["report", "--run-id", "r2", "--format", "md", "--warehouse", wh.root]
    assert main([*argv, "--baseline", "r1", "--out", str(out)]) == 0
    cli = out.read_text(encoding="utf-8")
    table = cli[cli.index("## Change against baseline") :]
    assert re.search(r"\| ▼ -\d+\.\d% \| " + INTERVAL + r" \|", table), table


def test_comparison_table_fits_1280_px_in_chromium(tmp_path, browser):
    """The table with its intervals in a real browser, 1280 px wide: nothing wider than the
    window (a screenshot of it, without console errors, for the author: SPEEDMATRIX_SCREENSHOTS)."""
    run, cells, base_run, base, judged = _judged()
    page = render_html(run, cells, (base_run, base), comparison=judged)
    layout = browser.layout(page, tmp_path, "right:t('table.comparison').right,width")
    assert layout["right"] <= 1280 and layout["width"] <= 1280, layout
    if os.environ.get("SPEEDMATRIX_SCREENSHOTS"):
        at = page.index("<h2>Change against baseline")
        only = page[: page.index("<body>") + 6] + page[at:]
        (tmp_path / "table.html").write_text(only, encoding="utf-8")
        shot = browser.open_page(tmp_path / "table.html", screenshot=tmp_path / "t.png", height=700)
        assert shot.console == [], shot.console
        target = f"{os.environ['SPEEDMATRIX_SCREENSHOTS']}comparison-table.png"
        shutil.copyfile(shot.screenshot, target)
