"""The deployment's GPU prices file is read with limits (issue #42 item 10).

A YAML alias bomb in the file grew the process to 5.2 GB (a MemoryError in fmt_cost) and a
price of 1.0e+300 printed 400-digit costs. The file is read with a size cap and no aliases;
prices are finite, positive and bounded, the currency a short label; a bad file means no
cost on the pages, said once.
"""

from __future__ import annotations

import logging
import tracemalloc

import pytest

from speedmatrix.analysis.cost import (
    MAX_PRICE,
    MAX_PRICES_BYTES,
    PRICES_ENV,
    PriceError,
    fmt_cost,
    load_prices,
)
from speedmatrix.report import page


def _bomb(levels: int) -> str:
    """The billion laughs: each level is a list of ten aliases of the one before."""
    lines = ['a0: &a0 ["lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    lines.append("per_gpu_hour: {H200: 3.5}")
    lines.append(f"currency: *a{levels}")
    return "\n".join(lines) + "\n"


def load(tmp_path, text: str):
    path = tmp_path / "prices.yaml"
    path.write_text(text, encoding="utf-8")
    return load_prices({PRICES_ENV: str(path)})


def test_an_alias_bomb_is_refused_before_it_grows(tmp_path):
    tracemalloc.start()
    try:
        with pytest.raises(PriceError, match="alias"):
            load(tmp_path, _bomb(6))  # 10^6 strings once expanded (fits this test's budget)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 * 2**20, peak


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("per_gpu_hour: {H200: 1.0e+300}", "at most"),
        (f"per_gpu_hour: {{H200: {MAX_PRICE * 2}}}", "at most"),
        ("per_gpu_hour: {H200: .nan}", "H200"),
        ("per_gpu_hour: {H200: .inf}", "H200"),
        ("per_gpu_hour: {H200: 0}", "H200"),
        ("per_gpu_hour: {H200: 2}\ncurrency: [USD]", "currency"),
        ("per_gpu_hour: {H200: 2}\ncurrency: " + "X" * 200, "currency"),
        ('per_gpu_hour: {H200: 2}\ncurrency: "US\\nD"', "currency"),
        ("per_gpu_hour: {H200: 2}\n# " + "x" * MAX_PRICES_BYTES, "larger than"),
    ],
)
def test_a_price_file_out_of_bounds_is_refused(tmp_path, text, message):
    with pytest.raises(PriceError, match=message):
        load(tmp_path, text)


def test_a_sane_file_still_loads(tmp_path):
    prices = load(tmp_path, "currency: EUR\nper_gpu_hour: {H200 SXM: 3.6, RTX: 1}\n")
    assert prices.for_gpu("h200  sxm") == 3.6 and prices.currency == "EUR"
    assert fmt_cost(1.234, "EUR") == "1.23 EUR"


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300, -1.0])
def test_a_cost_out_of_bounds_prints_as_none(value):
    assert fmt_cost(value) == "—"


def test_a_bad_file_means_no_cost_said_once(tmp_path, monkeypatch, caplog):
    path = tmp_path / "prices.yaml"
    path.write_text("per_gpu_hour: {H200: 1.0e+300}", encoding="utf-8")
    monkeypatch.setenv(PRICES_ENV, str(path))
    with caplog.at_level(logging.WARNING):
        assert [page.deployment_prices() for _ in range(5)] == [None] * 5
    said = [r for r in caplog.records if "no cost" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    # a changed file is read again (and said again when it is still bad)
    path.write_text("per_gpu_hour: {H200: 2.5}", encoding="utf-8")
    assert page.deployment_prices().for_gpu("H200") == 2.5
