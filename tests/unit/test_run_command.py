"""`speedmatrix run`'s own rules (issue #18 item 5): the ref a server's version names, the ETA.
The command end to end is tests/integration/test_run_cli.py."""

from __future__ import annotations

import io

import pytest

from speedmatrix.cli.eta import DECODE_OVERHEAD_S, PREFILL_GUESS_S
from speedmatrix.cli.run import Display, ref_of


@pytest.mark.parametrize(
    ("version", "ref"),
    [
        ("0.1.dev1+g9fedd24fa", "9fedd24fa"),
        ("0.11.1.dev12+gabcdef1234.cu130", "abcdef1234"),
        ("0.29.0", "v0.29.0"),
        ("0.29.0rc1", "main"),
        (None, "main"),
    ],
)
def test_the_engine_ref_of_a_reported_version(version, ref) -> None:
    assert ref_of(version) == ref


def test_the_eta_uses_measured_cells_and_guesses_the_rest() -> None:
    """Guesses before a cell is measured, then what the cells done say (tests/unit/test_eta.py:
    the estimate over a whole matrix)."""
    now = [100.0]
    show = Display({"matrix": {"window_s": 10}}, out=io.StringIO(), clock=lambda: now[0])
    cells = [{"phase": "prefill", "label": "8K", "context_tokens": 8192}] + [
        {"phase": "decode", "label": "8K x 1", "context_tokens": 8192, "concurrency": 1}
    ] * 2
    show.cells = cells
    assert show.eta_s() == PREFILL_GUESS_S + 2 * (10 + DECODE_OVERHEAD_S)
    show.cell_started(cells[0])
    now[0] += 2.0
    show.cell_done(cells[0], {"status": "valid", "ttft_ms": 1500.0})
    show.cell_started(cells[1])
    now[0] += 30.0
    show.cell_done(cells[1], {"status": "valid", "warmup_s": 0.0})
    # one decode left: the measured decode cell's overhead (30 - 10 s window), not the guess
    assert show.eta_s() == 30.0
    show.cell_started(cells[2])
    now[0] += 12.0  # 12 s into the last cell
    assert show.eta_s() == 18.0


@pytest.mark.parametrize("length", [185, 240])
def test_a_ref_too_long_for_a_file_name_stops_the_run_before_it_measures(
    tmp_path, capsys, monkeypatch, length
) -> None:
    """Issue #33 item 1: `speedmatrix run … --engine-ref <185 characters>` measured the whole
    matrix, then poisoned the landing; with 240 the run was lost in validate. The command
    refuses it in resolve, naming the field and the limit: no lease, no server, no warehouse."""
    from speedmatrix.cli import main
    from speedmatrix.records import MAX_PATH_VALUE

    monkeypatch.setenv("SPEEDMATRIX_LEASE_DIR", str(tmp_path / "lease"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    ref = "v1.2.3-" + "a" * (length - 7)
    wh = tmp_path / "wh"
    rc = main(
        ["run", "sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "--engine-ref", ref, "--warehouse", str(wh)]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "engine_ref is too long" in err and f"the limit is {MAX_PATH_VALUE}" in err
    assert not wh.exists() and not (tmp_path / "lease").exists()
    assert not (tmp_path / "home").exists()
