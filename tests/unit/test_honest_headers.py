"""Honest headers (issue #34 item 4): a simulated run and a run on hardware not known say so
in the page's title, the Hardware and Run sections (Markdown and HTML) and the site's hardware
column, while a real run's Markdown stays the published page."""

from __future__ import annotations

from pathlib import Path

import pytest

from speedmatrix.published.parse import parse_report
from speedmatrix.report.render import render_html, render_markdown
from speedmatrix.report.site_text import gpu

REFERENCE = next((Path(__file__).resolve().parents[2] / "include" / "reference").glob("*.txt"))


@pytest.fixture(scope="module")
def page():
    report = parse_report(REFERENCE.read_text(encoding="utf-8"), source=str(REFERENCE))
    return report.run, report.cells


def test_a_simulated_run_says_so(page) -> None:
    run, cells = page
    sim = {**run, "sim_profile": "kimi-k2.7-nvfp4-rtxpro6k-x8"}
    md = render_markdown(sim, cells)
    said = "simulated engine (profile kimi-k2.7-nvfp4-rtxpro6k-x8)"
    title = md.split("\n")[2]
    assert said in title and "RTX PRO 6000" in title, title
    run_section = md.split("## Run", 1)[1].split("##", 1)[0]
    assert f"- Measured on: {said}" in run_section
    assert said in render_html(sim, cells)
    assert gpu(sim).startswith(said)


def test_hardware_not_known_is_said_plainly(page) -> None:
    run, cells = page
    ext = {**run, "hardware_gpu": "unknown", "hardware_gpu_count": 0, "hardware_vram_gb": 0,
           "hardware_type": "unknown"}  # fmt: skip
    md = render_markdown(ext, cells)
    assert "on hardware not known" in md.split("\n")[2]
    assert "unknown 0GB" not in md and "- GPU: hardware not known" in md
    assert "- VRAM: hardware not known" in md
    assert "- Measured on: hardware not known" in md.split("## Run", 1)[1]
    assert "on hardware not known" in render_html(ext, cells)
    assert gpu(ext) == "hardware not known"


def test_a_real_run_keeps_the_published_labels(page) -> None:
    run, cells = page
    md = render_markdown(run, cells)
    assert "Measured on" not in md and "simulated" not in md
    assert (
        md.split("\n")[2]
        == "**Kimi-K2.7-Code-NVFP4 on RTX PRO 6000 Blackwell Server Edition 96GB ×8**"
    )


def test_the_simulated_run_page_says_so_in_chromium(page, browser, tmp_path) -> None:
    run, cells = page
    sim = {**run, "sim_profile": "kimi-k2.7-nvfp4-rtxpro6k-x8", "run_id": "sim-run"}
    path = tmp_path / "report.html"
    path.write_text(render_html(sim, cells), encoding="utf-8")
    loaded = browser.open_page(path)
    assert loaded.console == []
    assert "simulated engine (profile kimi-k2.7-nvfp4-rtxpro6k-x8)" in loaded.dom
