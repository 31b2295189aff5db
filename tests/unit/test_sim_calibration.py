"""The calibrated reference profile reproduces the published report (through the model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speedmatrix.cli import main
from speedmatrix.published.parse import parse_report
from speedmatrix.sim.calibrate import CalibrationError, compare, fit_kv_blocks
from speedmatrix.sim.predict import over_capacity, predict_decode
from speedmatrix.sim.profile import load_profile

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "include" / "reference" / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt"
PROFILE = REPO / "include" / "sim-profiles" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"


@pytest.fixture(scope="module")
def text() -> str:
    return REPORT.read_text(encoding="utf-8")


def test_shipped_profile_predicts_every_published_cell(text):
    profile = load_profile(PROFILE)
    assert profile.calibrated and profile.served_model_name == "Kimi-K2.7-Code-NVFP4"
    rows, bad = compare(profile, text)
    assert not bad, "\n".join(str(m) for m in bad)
    cells = parse_report(text).cells
    assert len([r for r in rows if r["metric"] == "status"]) == len(cells) == 55
    # Every numeric published figure was compared (none skipped as "missing").
    compared = [r for r in rows if r["metric"] != "status" and r["published"] is not None]
    assert len(compared) == 7 * 2 + 16 * 4  # 7 prefill cells, 16 valid decode cells
    assert all(abs(r["rel_error"]) <= 0.05 for r in compared)


def test_statuses_follow_the_block_rule(text):
    profile = load_profile(PROFILE)
    for cell in parse_report(text).cells:
        if cell["phase"] == "decode":
            oc = over_capacity(profile, cell["context_tokens"], cell["concurrency"], 4096)
            assert oc == (cell["status"] == "over_capacity"), cell


@pytest.fixture(scope="module")
def fitted_json(tmp_path_factory) -> Path:
    """One run of `speedmatrix sim calibrate REPORT --out X.json` (calibration takes seconds)."""
    out = tmp_path_factory.mktemp("cal") / "fitted.json"
    assert main(["sim", "calibrate", str(REPORT), "--out", str(out)]) == 0
    return out


def test_fresh_calibration_matches_the_shipped_profile(text, fitted_json):
    profile = load_profile(fitted_json)
    _, bad = compare(profile, text)
    assert not bad
    shipped = load_profile(PROFILE)
    assert profile.num_gpu_blocks == shipped.num_gpu_blocks
    assert profile.max_model_len == shipped.max_model_len == 262144  # the launch command's
    assert profile.decode_correction == shipped.decode_correction  # deterministic fit


def test_kv_fit_rejects_contradicting_statuses():
    cells = [
        {"phase": "decode", "context_tokens": 8192, "concurrency": 4, "status": "over_capacity"},
        {"phase": "decode", "context_tokens": 8192, "concurrency": 8, "status": "valid"},
    ]
    with pytest.raises(CalibrationError, match="contradict"):
        fit_kv_blocks(cells, 4096, 16, None)


def test_shared_and_distinct_prompts_agree_when_warmed():
    profile = load_profile(PROFILE)
    shared = predict_decode(profile, 8192, 4, window_s=5.0, prompt_mode="shared")
    distinct = predict_decode(profile, 8192, 4, window_s=5.0, prompt_mode="distinct")
    assert distinct["tbt_ms"] == pytest.approx(shared["tbt_ms"], rel=0.01)
    assert distinct["prompt_mode"] == "distinct"


def test_calibrate_cli_writes_the_format_of_the_extension(tmp_path, fitted_json):
    data = json.loads(fitted_json.read_text())  # .json out -> JSON; the shipped .yaml is YAML
    assert data["calibrated"] is True and data["served_model_name"] == "Kimi-K2.7-Code-NVFP4"
    assert PROFILE.read_text().startswith("# Simulator profile calibrated")
    assert main(["sim", "calibrate", str(REPORT), "--out", str(tmp_path / "x.txt")]) == 2


def test_calibration_is_not_a_lookup_table():
    """Between published cells the model interpolates physically: monotone in C and context."""
    profile = load_profile(PROFILE)
    tbt = [predict_decode(profile, 8192, c, window_s=3.0)["tbt_ms"] for c in (1, 3, 6, 12)]
    assert tbt == sorted(tbt)
    by_ctx = [predict_decode(profile, ctx, 1, window_s=3.0)["tbt_ms"] for ctx in (12000, 24000)]
    assert 18.2 < by_ctx[0] < by_ctx[1] < 20.5


def test_predict_cli_checks_a_profile_against_a_report(capsys):
    assert main(["sim", "predict", str(REPORT), "--profile", str(PROFILE)]) == 0
    out = capsys.readouterr().out
    assert "BAD" not in out and out.count("\n") == 55 + 7 * 2 + 16 * 4
    # With zero tolerance every residual (up to 1.8%) is flagged, and the exit code says so.
    assert main(["sim", "predict", str(REPORT), "--profile", str(PROFILE), "--tolerance", "0"]) == 1


def test_max_num_seqs_is_read_off_the_launch_command_or_the_active_requests_ceiling():
    """A page shows the server's max_num_seqs by its launch command's flag or by busy cells
    whose average active requests sit at one ceiling below their C (the rest of the streams
    wait); a page whose active requests follow C shows none (the twin runs every stream)."""
    from speedmatrix.sim.calibrate import fit_max_num_seqs

    def cell(c: int, active: float | None) -> dict:
        return {"concurrency": c, "avg_active_requests": active}

    following = [cell(1, 1.0), cell(32, 31.8), cell(64, 63.6), cell(128, 127.2)]
    capped = [cell(1, 1.0), cell(32, 31.8), cell(64, 63.9), cell(128, 64.0)]
    assert fit_max_num_seqs({}, following) is None
    assert fit_max_num_seqs({}, capped) == 64
    assert fit_max_num_seqs({}, [cell(8, None)]) is None  # no figure: nothing to read
    launch = {"launch_command": "vllm serve m --max-num-seqs 48 --port 8000"}
    assert fit_max_num_seqs(launch, following) == 48
    assert fit_max_num_seqs({"launch_command": "vllm serve m --max-num-seqs=96"}, []) == 96
