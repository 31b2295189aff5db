"""A prefill cell measured from several cold prompts (issue 40, item 3), against the simulator in
this process (its ground truth: every request's cached prompt tokens and its own TTFT).

One TTFT is one sample: a slow moment of the host reads as a slower engine and a verdict has no
spread to judge it against. The cell now sends `samples` cold prompts (default 3), each with a
fresh run tag, so the prefix cache never holds any of them, and records how many and how far
apart they were."""

from __future__ import annotations

import asyncio
import json
import statistics
import urllib.request
from pathlib import Path

import pytest

from speedmatrix.loadgen import PrefillConfig, run_prefill
from speedmatrix.records import CELL_FIELDS
from speedmatrix.sim.runner import run_in_thread

PROFILE = (
    Path(__file__).resolve().parents[2]
    / "include/sim-profiles/synthetic-specdec-not-calibrated.yaml"
)
MODEL = "sim-specdec"


@pytest.fixture(scope="module")
def sim_url():
    with run_in_thread(str(PROFILE)) as url:
        yield url


def _truth(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/sim/requests", timeout=30) as resp:
        return json.load(resp)


def _prefill(url: str, **kw) -> tuple[dict, list[dict]]:
    before = {r["id"] for r in _truth(url)}
    cell, rows = asyncio.run(run_prefill(PrefillConfig(base_url=url, model=MODEL, **kw)))
    sent = [r for r in _truth(url) if r["id"] not in before]
    return cell, rows, sent


def test_a_prefill_cell_is_three_cold_prompts_by_default(sim_url):
    cell, rows, sent = _prefill(sim_url, context=2048, run_tag="pfs")
    assert cell["status"] == "valid", cell["error"]
    assert len(sent) == 3 and len(rows) == 3
    assert [r["cached_tokens"] for r in sent] == [0, 0, 0]  # cold, every one
    assert all(r["prompt_tokens"] == 2048 for r in sent)
    assert cell["samples"] == 3 and cell["ttft_samples"] == 3
    ttfts = sorted(r["ttft_ms"] for r in rows)
    assert cell["ttft_ms"] == pytest.approx(statistics.median(ttfts))
    assert cell["total_tok_s"] == pytest.approx(2048 / (statistics.median(ttfts) / 1000))
    spread = (ttfts[-1] - ttfts[0]) / statistics.median(ttfts) * 100
    assert cell["ttft_spread_pct"] == pytest.approx(spread)
    assert sorted(r["request_index"] for r in rows) == [0, 1, 2]


def test_the_last_sample_is_the_runs_own_prompt_so_the_decode_finds_it_cached(sim_url):
    """The prefill warms stream 0's decode prompt (loadgen/prefill.py): the run's own tag goes
    last, after the fresh tags, so nothing sent after it can push it out of the cache."""
    first, _, sent = _prefill(sim_url, context=2048, run_tag="pfw", samples=3)
    assert first["status"] == "valid" and [r["cached_tokens"] for r in sent] == [0, 0, 0]
    again, _, resent = _prefill(sim_url, context=2048, run_tag="pfw", samples=1)
    assert resent[0]["cached_tokens"] > 0 and again["status"] == "invalid"  # warm: refused


def test_samples_is_a_setting_of_at_least_one(sim_url):
    cell, rows, sent = _prefill(sim_url, context=2048, run_tag="pf5", samples=5)
    assert cell["samples"] == 5 and len(sent) == len(rows) == 5 and cell["status"] == "valid"
    with pytest.raises(ValueError, match="samples"):
        PrefillConfig(base_url=sim_url, model=MODEL, context=2048, samples=0).validate()


def test_the_cell_record_carries_the_sample_count_and_spread():
    names = {f.name for f in CELL_FIELDS}
    assert {"samples", "ttft_samples", "ttft_spread_pct"} <= names


def _decode(url: str, **kw) -> tuple[dict, list[dict]]:
    from speedmatrix.loadgen import DecodeConfig, run_decode

    before = {r["id"] for r in _truth(url)}
    cfg = DecodeConfig(base_url=url, model=MODEL, context=2048, concurrency=1, window_s=2.0,
                       max_output_tokens=2048, max_loop_lag_ms=50.0, max_client_cpu_pct=100.0,
                       token_tolerance=0.03, **kw)  # fmt: skip
    cell, rows = asyncio.run(run_decode(cfg))
    sent = [r for r in _truth(url) if r["id"] not in before]
    return cell, rows, sent


def test_a_c1_decode_cells_ttft_is_several_samples(sim_url):
    """C=1: one long request fills the window, so its TTFT was one sample. Two more requests
    of the cell's (cached) prompt with max_tokens=1 follow the window: the TTFT is the median
    of three, and the cell says so."""
    cell, rows, sent = _decode(sim_url, run_tag="c1ttft")
    assert cell["status"] == "valid", cell["error"]
    window = [r for r in rows if r["ttft_ms"] is not None]
    probes = [r for r in sent if r["max_tokens"] == 1][1:]  # the first is the cache warm-up
    assert len(probes) == 2 and all(r["cached_tokens"] > 0 for r in probes)
    assert cell["ttft_samples"] == len(window) + 2 >= 3
    truth = sorted([*(r["ttft_ms"] for r in window), *(1000 * r["ttft_s"] for r in probes)])
    assert min(truth) * 0.9 <= cell["ttft_ms"] <= max(truth) * 1.1 + 5
    # the window's figures are the window's: the probes add no tokens and no completed request
    assert cell["output_tokens"] == sum(r["window_tokens"] or 0 for r in rows)
    none, nrows, nsent = _decode(sim_url, run_tag="c1none", ttft_probes=0)
    assert none["ttft_samples"] == len([r for r in nrows if r["ttft_ms"] is not None])
    assert [r["max_tokens"] for r in nsent].count(1) == 1  # the warm-up alone
