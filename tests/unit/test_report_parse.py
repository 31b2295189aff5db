"""parse_report on the published reference page and on broken variants of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from speedmatrix.published.pagetext import ReportParseError
from speedmatrix.published.parse import parse_report
from speedmatrix.records import CELL_FIELDS, RUN_FIELDS

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "include" / "reference" / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt"


@pytest.fixture(scope="module")
def text() -> str:
    return REFERENCE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def parsed(text):
    return parse_report(text, source=REFERENCE.name)


def table_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Latencies are medians"))
    return [ln for ln in lines[start + 2 :] if ln.startswith("| ")]


def test_run_fields(parsed):
    run = parsed.run
    assert set(run) == {f.name for f in RUN_FIELDS}
    assert run["run_id"] == parsed.run_id
    assert parsed.run_id.startswith("ingest-")
    expected = {
        "trigger": "ingest",
        "status": "success",
        "recipe_id": "published/rtx-pro-6000-blackwell-server-edition-x8/kimi-k2.7-code-nvfp4",
        "started_at": None,
        "hardware_type": "Discrete GPU",
        "hardware_gpu": "RTX PRO 6000 Blackwell Server Edition",
        "hardware_gpu_count": 8,
        "hardware_vram_gb": 96.0,
        "hardware_os": "linux",
        "engine": "vllm",
        "engine_version": "0.1.dev1+g9fedd24fa",
        "engine_commit": "9fedd24fa864",
        "engine_repository": "github.com/vllm-project/vllm",
        "quantization": "NVFP4",
        "backend": "cuda",
        "build": "cuda-13.2",
        "served_model": "Kimi-K2.7-Code-NVFP4",
        "model": "nvidia/Kimi-K2.7-Code-NVFP4",
        "model_revision": "main",
        "bench_tool": "llm-inference-bench",
        "bench_tool_version": "0.7.9",
        "decode_test": "Fixed duration",
        "prefill_mode": "Measured during decode warm-up",
        "window_s": 30.0,
        "max_output_tokens": 4096,
        "max_model_len": 262144,
        "source": REFERENCE.name,
    }
    assert {k: run[k] for k in expected} == expected
    assert run["launch_command"].startswith('env VLLM_USE_V2_MODEL_RUNNER=1 "$HOME/env_rtxpro6k')
    assert "--api-key <redacted>" in run["launch_command"]
    assert run["launch_command"].endswith("--moe-backend flashinfer_cutlass")


def test_cells(parsed, text):
    cells = parsed.cells
    assert len(cells) == len(table_lines(text)) == 7 + 6 * 8
    assert all(set(c) == {f.name for f in CELL_FIELDS} for c in cells)
    prefill = [c for c in cells if c["phase"] == "prefill"]
    assert [c["context_label"] for c in prefill] == [
        "8K",
        "16K",
        "32K",
        "64K",
        "128K",
        "251K",
        "256K",
    ]
    assert prefill[0]["context_tokens"] == 8 * 1024
    assert prefill[5]["context_tokens"] == 252430  # what 3,300.0 x 76,494 ms implies (#35)
    assert (prefill[0]["total_tok_s"], prefill[0]["ttft_ms"]) == (6206.0, 1320.0)
    assert prefill[0]["completed_requests"] == 1
    assert prefill[0]["output_tokens"] is None and prefill[0]["measured_s"] is None
    d = next(c for c in cells if c["phase"] == "decode" and c["context_label"] == "251K")
    assert d["concurrency"] == 1 and d["status"] == "valid"
    assert (d["total_tok_s"], d["per_request_tok_s"], d["ttft_ms"], d["tbt_ms"]) == (
        35.7,
        35.8,
        1508.0,
        28.0,
    )
    assert (d["avg_active_requests"], d["completed_requests"], d["output_tokens"]) == (1.0, 0, 1071)
    assert d["measured_s"] == 30.0 and d["window_s"] == 30.0 and d["max_output_tokens"] == 4096
    over = [c for c in cells if c["status"] == "over_capacity"]
    assert len(over) == 48 - 16
    assert all(c["total_tok_s"] is None and c["ttft_ms"] is None for c in over)
    assert {c["metric_version"] for c in cells} == {0}


def test_run_id_stable_and_content_derived(text, parsed):
    again = parse_report(text, source="elsewhere/other-name.txt")
    assert again.run_id == parsed.run_id
    changed = text.replace(
        "| 8K | 1 | Valid | 54.9 | 54.9 | 87 ms |", "| 8K | 1 | Valid | 54.9 | 54.8 | 87 ms |"
    )
    assert changed != text
    assert parse_report(changed).run_id != parsed.run_id


def test_reconstructed_comment_and_glued_heading(text):
    lines = text.splitlines()
    i = lines.index("Launch command")
    lines.insert(i + 1, "# Reconstructed from the engine log and the recipe")
    j = lines.index("Prefill")
    lines[j - 1] = lines[j - 1] + " --enable-prefix-caching" + "Prefill"
    del lines[j]
    glued = "\n".join(lines)
    p = parse_report(glued)
    assert p.run["launch_command"].endswith("--enable-prefix-caching")
    assert "Reconstructed" not in p.run["launch_command"]
    assert p.launch_comment.startswith("# Reconstructed")
    assert len(p.cells) == 55


def test_glued_header_section_heading(text):
    glued = text.replace("- linux\nEngine\n", "- linuxEngine\n")
    assert glued != text
    p = parse_report(glued)
    assert p.run["hardware_os"] == "linux" and p.run["engine"] == "vllm"


def test_k_quantities_parse():
    from speedmatrix.published import formats as F

    assert F.parse_number("17.7K") == 17700.0
    assert F.parse_number("18K") == 18000.0
    assert F.parse_number("6,206.0") == 6206.0
    assert F.parse_number("—") is None
    assert F.parse_ms("1,320 ms") == 1320.0
    assert F.parse_seconds("30.0 s") == 30.0
    assert F.fmt_rate(17700.0) == "17.7K"
    assert F.fmt_rate(18000.0) == "18K"
    assert F.fmt_rate(6206.0) == "6,206.0"
    assert F.fmt_ms(1320.0) == "1,320 ms"
    assert F.fmt_int(1647) == "1,647"


# ---- broken pages: a clear error naming the line ----------------------------------------------


def line_of(text: str, needle: str) -> int:
    return next(i + 1 for i, ln in enumerate(text.splitlines()) if needle in ln)


@pytest.mark.parametrize("keep_fraction", [0.1, 0.35, 0.6, 0.8, 0.95])
def test_truncated(text, keep_fraction):
    cut = text[: int(len(text) * keep_fraction)]
    with pytest.raises(ReportParseError) as err:
        parse_report(cut, source="cut.txt")
    assert err.value.line is not None
    assert str(err.value).startswith(f"cut.txt:{err.value.line}: ")


def test_truncated_between_rows(text):
    lines = text.splitlines()
    last_row = max(i for i, ln in enumerate(lines) if ln.startswith("| Sustained decode | 128K"))
    cut = "\n".join(lines[: last_row + 1]) + "\n"
    with pytest.raises(ReportParseError, match="251K x 1 has no row"):
        parse_report(cut)


def test_mangled_row(text):
    bad_row = "| Sustained decode | 16K | 4 | Valid | 155.5 | 38.9 | 290 ms | 25.7 ms | 4.0 | 0 | 4,664 | 30.0 s |"
    assert bad_row in text
    mangled = text.replace(bad_row, bad_row.replace("| 290 ms | 25.7 ms |", "| 290 ms 25.7 ms |"))
    with pytest.raises(ReportParseError) as err:
        parse_report(mangled)
    assert err.value.line == line_of(text, bad_row)
    assert "11 cells, expected 12" in str(err.value)
    garbled = text.replace(bad_row, bad_row.replace("| 4,664 |", "| 4,6x4 |"))
    with pytest.raises(ReportParseError) as err:
        parse_report(garbled)
    assert err.value.line == line_of(text, bad_row)
    assert "Output tokens" in str(err.value)


def test_row_contradicting_the_matrix(text):
    row = "| Sustained decode | 8K | 2 | Valid | 98.0 | 48.6 | 399 ms |"
    with pytest.raises(ReportParseError, match="8K x 2") as err:
        parse_report(text.replace(row, row.replace("98.0", "89.0")))
    assert err.value.line == line_of(text, "| 8K | 54.987 ms TTFT")


@pytest.mark.parametrize("label", ["GPU count", "Version", "Served model", "Max output"])
def test_missing_header_field(text, label):
    lines = text.splitlines()
    i = lines.index(f"- {label}")
    del lines[i : i + 2]
    with pytest.raises(ReportParseError, match=f"missing header field '{label}'") as err:
        parse_report("\n".join(lines))
    assert err.value.line is not None


def test_not_a_report():
    with pytest.raises(ReportParseError, match=":1: expected the title"):
        parse_report("hello\nworld\n", source="x.txt")
    with pytest.raises(ReportParseError, match="empty"):
        parse_report("")


def test_k_values_and_other_roundings_round_trip(text, parsed):
    """Pages for faster hardware write 17.7K / 18K; summaries may round to whole numbers."""
    from speedmatrix.report.render import render_markdown

    row = "| Prefill | 8K | 1 | Valid | 6,206.0 | — | 1,320 ms |"
    faster = text.replace(row, row.replace("6,206.0", "17.7K")).replace(
        "8K context6,2061,320 ms TTFT", "8K context17.7K1,320 ms TTFT"
    )
    p = parse_report(faster)
    assert p.cells[0]["total_tok_s"] == 17700.0
    md = render_markdown(p.run, p.cells)
    assert "| Prefill | 8K | 1 | Valid | 17.7K | — | 1,320 ms |" in md
    assert parse_report(md).cells == p.cells
    whole = text.replace("8K context6,2061,320 ms TTFT", "8K context 6206 · 1,320 ms TTFT")
    assert parse_report(whole).cells == parsed.cells
    dashed = text.replace("6 contexts (8K–251K)", "6 contexts (8K-251K)")
    assert parse_report(dashed).cells == parsed.cells
    with pytest.raises(ReportParseError, match="disagrees"):
        parse_report(text.replace("8K context6,2061,320 ms TTFT", "8K context6,3061,320 ms TTFT"))
