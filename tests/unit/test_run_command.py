"""`speedmatrix run`'s own rules (issue #18 item 5): the ref a server's version names, the ETA.
The command end to end is tests/integration/test_run_cli.py."""

from __future__ import annotations

import io

import pytest

from speedmatrix.cli.run import DECODE_OVERHEAD_S, PREFILL_GUESS_S, Display, ref_of


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
    show = Display({"matrix": {"window_s": 10}}, out=io.StringIO())
    cells = [{"phase": "prefill", "label": "8K"}] + [{"phase": "decode", "label": "8K x 1"}] * 2
    show.cells = cells
    assert show.eta_s() == PREFILL_GUESS_S + 2 * (10 + DECODE_OVERHEAD_S)
    show.took["prefill"].append(2.0)
    show.took["decode"].append(30.0)
    show.done = 2  # one decode left: the measured decode cell's time, not the guess
    assert show.eta_s() == 30.0
    show.started = 100.0  # 12 s into the last cell
    assert show.eta_s(now=112.0) == 18.0
