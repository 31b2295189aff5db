"""The decode workload (issue 15, docs/measurement.md rule 11): the article conversation as exact
token ids, rendered by the server's chat template; and the copy check.

The prompts are built against the simulator (its /tokenize renders `messages` with its own
template, exact to the token) and against the ideal server (another template and tokenizer).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from loadgen_ideal import ideal_server

from speedmatrix.loadgen import CellNotAttempted, DecodeConfig, run_decode
from speedmatrix.loadgen.article import (
    ACK,
    INSTRUCTION,
    document_sentences,
    split_renders,
)
from speedmatrix.loadgen.control import ControlClient
from speedmatrix.loadgen.prompts import BodyBuilder, PromptSet, build_prompts
from speedmatrix.loadgen.stats import COPY_NGRAM, CopyCheck, word_ngrams
from speedmatrix.records import CELL_FIELDS, REQUEST_FIELDS, RUN_FIELDS, WORKLOADS
from speedmatrix.sim.runner import run_in_thread

PROFILE = "include/sim-profiles/synthetic-specdec-not-calibrated.yaml"
MODEL = "sim-specdec"


def _build(url: str, context: int, prompts: int, workload: str = "article", shared=False):
    async def go() -> PromptSet:
        async with ControlClient(url, None) as ctl:
            return await build_prompts(ctl, MODEL, context, "wltag", prompts, shared, workload)

    return asyncio.run(go())


def _detokenize(url: str, ids: list[int]) -> str:
    req = urllib.request.Request(
        url + "/detokenize",
        json.dumps({"tokens": ids}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)["prompt"]


@pytest.fixture(scope="module")
def sim_url():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with run_in_thread(str(root / PROFILE)) as url:
        yield url


def test_the_workload_is_declared_in_every_table() -> None:
    assert WORKLOADS == ("article", "continuation")
    for fields in (CELL_FIELDS, REQUEST_FIELDS, RUN_FIELDS):
        assert "workload" in [f.name for f in fields]
    assert "copy_share" in [f.name for f in CELL_FIELDS]
    assert DecodeConfig(base_url="http://h", model="m", context=8).workload == "article"


@pytest.mark.parametrize("context", [300, 4096, 70_000])
def test_article_prompts_are_exact_distinct_and_end_with_the_instruction(sim_url, context):
    ps = _build(sim_url, context, 3)
    prompts = [ps.ids(i) for i in range(3)]
    assert [len(p) for p in prompts] == [context] * 3
    assert len({tuple(p) for p in prompts}) == 3  # distinct per stream
    # the server counts exactly those ids: /tokenize of the rendered text is not needed, the
    # ids are sent as they are; the text reads as the conversation, instruction last
    text = _detokenize(sim_url, prompts[1])
    assert text.startswith(f"<|user|> [speedmatrix run wltag, context {context}, stream 1]")
    assert "Here is a reference document about lighthouses." in text
    assert document_sentences()[0] in text
    # the instruction and the generation prompt are the very end, after the assistant's reply
    # (the simulator's tokenizer decodes a few colliding ids to another word: compare words)
    tail = text[text.index("<|assistant|> I have read") :]
    assert tail.split()[-5:] == ["mathematics.", "Do", "not", "summarize.", "<|assistant|>"]
    assert len(tail.split()) == len(f"<|assistant|> {ACK}\n<|user|> {INSTRUCTION}\n".split()) + 1
    # one document-and-tail body shared by every stream whose header has the same length
    parts = [BodyBuilder(MODEL, ps, None, None).parts(i, 64) for i in range(3)]
    assert parts[0][1] is parts[2][1]


def test_the_conversation_is_what_the_template_renders(sim_url):
    """With a document that fits exactly, the spliced ids equal the server's own render."""
    from speedmatrix.loadgen import article

    ps = _build(sim_url, 4096, 1)
    body = ps.ids(0)

    async def render_whole() -> list[int]:
        async with ControlClient(sim_url, None) as ctl:
            header = "[speedmatrix run wltag, context 4096, stream 0]\n\n"
            passes = article.document_paragraph() * 40
            return await article.render(ctl, MODEL, header + article.INTRO + passes)

    whole = asyncio.run(render_whole())
    n = len(ps.headers[0])
    assert whole[:n] == body[:n]
    assert whole[-len(ps.suffix) :] == body[-len(ps.suffix) :]
    # the document in between is the one the server would render, cut to fit
    assert body[n : n + 500] == whole[n : n + 500]


def test_article_prompts_on_another_template_and_tokenizer():
    """The ideal server renders `role: content` lines and tokenizes words: still exact."""
    with ideal_server() as url:

        async def go() -> PromptSet:
            async with ControlClient(url, None) as ctl:
                return await build_prompts(ctl, "ideal", 2048, "t", 4, False, "article")

        ps = asyncio.run(go())
    assert {len(ps.ids(i)) for i in range(4)} == {2048}
    assert len({tuple(ps.ids(i)) for i in range(4)}) == 4


def test_shared_and_continuation_prompts(sim_url):
    shared = _build(sim_url, 2048, 8, shared=True)
    assert len(shared.headers) == 1 and len(shared.ids(0)) == 2048
    cont = _build(sim_url, 2048, 2, workload="continuation")
    assert cont.suffix == [] and {len(cont.ids(i)) for i in range(2)} == {2048}
    assert "<|user|>" not in _detokenize(sim_url, cont.ids(0))


def test_a_context_too_short_for_the_conversation_is_not_attempted(sim_url):
    with pytest.raises(CellNotAttempted, match="too short for the article conversation"):
        _build(sim_url, 32, 1)


def test_split_renders_finds_the_document_slot():
    frame = split_renders([1, 2, 3, 10, 11, 7, 8], [1, 2, 3, 12, 7, 8])
    assert (frame.head, frame.tail) == ([1, 2, 3], [7, 8])
    with pytest.raises(CellNotAttempted):
        split_renders([1, 2, 3], [1, 2, 3])


def test_copy_check_tells_a_copy_from_fresh_prose():
    prompt = " ".join(document_sentences())
    check = CopyCheck(prompt)
    copied = " ".join(document_sentences()[3:9])
    fresh = (
        "Counting began with tally marks cut into bone, and the first written numerals "
        "appeared in Mesopotamia on clay tablets; the Babylonians worked in base sixty, "
        "which is why an hour still has sixty minutes. Egyptian scribes measured fields "
        "after every flood of the Nile and wrote fractions as sums of unit parts."
    )
    assert check.share([copied]) == 1.0
    assert check.share([fresh]) == 0.0
    # pooled over outputs: one echo among four fresh outputs of the same length
    assert check.share([fresh, fresh, fresh, copied]) == pytest.approx(
        len(word_ngrams(copied)) / (3 * len(word_ngrams(fresh)) + len(word_ngrams(copied)))
    )
    # case, punctuation and spacing do not hide a copy; too short an output says nothing
    assert check.share([copied.upper().replace(" ", "  ")]) == 1.0
    assert check.share(["a few words"]) is None
    assert COPY_NGRAM == 8


def test_an_echoing_server_makes_the_cell_invalid_and_a_normal_one_is_valid():
    """The simulator's echo fault: every output is its own prompt, word for word."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for faults, status in (({}, "valid"), ({"echo_every": 1}, "invalid")):
        with run_in_thread(str(root / PROFILE), faults=faults) as url:
            cfg = DecodeConfig(
                base_url=url, model=MODEL, context=1024, concurrency=2, window_s=2.0,
                max_output_tokens=200, max_loop_lag_ms=50.0, max_client_cpu_pct=100.0,
                token_tolerance=0.05,
            )  # fmt: skip
            cell, rows = asyncio.run(run_decode(cfg))
        assert cell["workload"] == "article" and {r["workload"] for r in rows} == {"article"}
        assert {r["prompt_tokens"] for r in rows if r["prompt_tokens"]} == {1024}
        if status == "valid":
            assert cell["copy_share"] == 0.0
            assert "copy" not in (cell["error"] or ""), cell["error"]
        else:
            assert cell["status"] == "invalid"
            assert cell["copy_share"] > 0.5
            assert "outputs copy their prompt" in cell["error"]
