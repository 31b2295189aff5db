"""The `published` measurement profile's prompts and bodies (issue #35 part 3): the published
tool's definitions, read from llm_decode_bench.py, without a server (a decode cell's figures
from a scripted stream timeline)."""

from __future__ import annotations

import json

import pytest
from test_loadgen_stream import END, HEAD, chunked, run_feed, sse, usage_only

from speedmatrix.loadgen import DecodeConfig, PrefillConfig, published
from speedmatrix.loadgen import published_prompt as pp
from speedmatrix.loadgen.stats import median, rate_median
from speedmatrix.loadgen.stream import Window, _choice_text


def test_the_body_asks_what_the_tool_asks():
    """Chat messages, ignore_eos and max_tokens but no min_tokens, continuous usage, and no
    cache salt (the run's tag in the text keeps runs apart)."""
    msgs = pp.messages(pp.context_text("abc", 1024, 3.5))
    body = json.loads(pp.body("m", msgs, 4096, None))
    assert body["messages"] == msgs and body["stream"] is True
    assert body["ignore_eos"] is True and body["max_tokens"] == 4096
    assert "min_tokens" not in body and "cache_salt" not in body and "prompt" not in body
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert json.loads(pp.body("m", msgs, 1, {"temperature": 0}))["temperature"] == 0


def test_contexts_are_reached_by_characters():
    """context x chars-per-token characters, opening with the run's tag and the context; the
    probe is 8K, or the run's largest context when that is smaller (the tool's min)."""
    text = pp.context_text("run1", 65536, 3.7)
    assert len(text) == int(65536 * 3.7)
    assert text.startswith("[BENCH_run1_CTX_65536] ")
    assert pp.context_text("run2", 65536, 3.7) != text  # another run, another prompt
    assert pp.probe_context(262144) == 8192 and pp.probe_context(2048) == 2048
    first = pp.messages(text)[0]["content"]
    assert text in first and pp.messages(text)[-1]["role"] == "user"


@pytest.mark.parametrize(
    ("choice", "text"),
    [
        ({"text": "a"}, "a"),
        ({"delta": {"content": "b"}}, "b"),
        ({"delta": {"reasoning_content": "c"}}, "c"),
        ({"delta": {"role": "assistant"}}, None),  # a role chunk carries no token
    ],
)
def test_chat_chunks_carry_their_text(choice, text):
    assert _choice_text(choice) == text


def test_the_profile_is_checked_and_the_warm_up_is_its_own():
    cfg = DecodeConfig(base_url="http://x", model="m", context=8192)
    assert cfg.measurement_profile == "default"
    cfg.validate()
    with pytest.raises(ValueError, match="measurement_profile"):
        PrefillConfig(base_url="http://x", model="m", context=8, measurement_profile="x").validate()
    with pytest.raises(ValueError, match="global warm-up"):
        PrefillConfig(
            base_url="http://x", model="m", context=8, global_warmup_context=8192
        ).validate()


def _request(monkeypatch, window, arrivals, max_tokens, done=True):
    """One request fed through the stream parser: `arrivals` is [(t, usage tokens so far)],
    the response head arriving with the first; it ends with usage and [DONE] at the last
    arrival when `done`, else the connection drops (a stream cut while it waits)."""
    t0 = arrivals[0][0]
    reads = [(t0, HEAD + chunked(sse(0, text="")))]
    reads += [
        (t, chunked(sse(n, finish="length" if n == max_tokens else None))) for t, n in arrivals if n
    ]
    if done:
        last = arrivals[-1][0]
        reads.append((last, chunked(usage_only(max_tokens)) + chunked(b"data: [DONE]\n\n") + END))
    return run_feed(reads, max_tokens, window=window, monkeypatch=monkeypatch)


def test_a_window_ending_in_a_restarts_first_token_wait_is_measured_to_the_last_token(
    monkeypatch,
):
    """C=1, window (2, 12] s. Request 0 (the ramp) has 5 tokens 0.25 s apart, 0.5-1.5 s, all
    before the window; request 1 has 49 tokens 0.125 s apart, 2.5-8.5 s, all inside it;
    request 2 starts at 8.5 s and is still waiting for its first token when the window ends.

    The tool (llm_decode_bench.py) divides the window's 49 usage tokens by the time from the
    window's start to the last of them, 8.5 - 2 = 6.5 s (its usage_measure_end, recorded as
    "Measured for"): 7.538 tok/s, per request the same (total / C), and its time between
    tokens is the median over every request, the ramp's too: (0.25 + 0.125) / 2 = 187.5 ms.
    Our default divides by the 10 s window (4.9 tok/s) and takes the in-window requests'
    intervals only: 125 ms, 8.0 tok/s per request."""
    window = Window()
    window.ws, window.we = 2.0, 12.0
    ramp = _request(monkeypatch, window, [(0.5 + 0.25 * k, k + 1) for k in range(5)], 5)
    inside = _request(monkeypatch, window, [(2.5 + 0.125 * k, k + 1) for k in range(49)], 49)
    waiting = _request(monkeypatch, window, [(9.0, 0)], 4096, done=False)
    reqs = [ramp, inside, waiting]
    assert [r.w_tokens for r in reqs] == [0, 49, 0] and waiting.first_at is None

    tool = published.decode_figures(reqs, window, 1)
    assert tool["output_tokens"] == 49
    assert tool["measured_s"] == pytest.approx(6.5)
    assert tool["total_tok_s"] == pytest.approx(49 / 6.5)  # 7.538
    assert tool["per_request_tok_s"] == pytest.approx(49 / 6.5)
    assert tool["tbt_ms"] == pytest.approx(187.5)

    # the default profile's rules on the same timeline (loadgen/decode.py)
    window_s = window.we - window.ws
    tbts = [x for x in (r.window_tbt() for r in reqs if r.w_tokens > 0) if x]
    assert sum(r.w_tokens for r in reqs) / window_s == pytest.approx(4.9)
    assert 1000 * median(tbts) == pytest.approx(125.0)
    assert rate_median(tbts) == pytest.approx(8.0)


def test_the_tools_interval_divides_by_the_usage_tokens_less_one(monkeypatch):
    """A first arrival carrying 3 tokens (a speculative step), then 1 token every 0.5 s to 6:
    the tool's (2.5 - 1.0) / (6 - 1) = 0.3 s, where our default's whole-request interval
    counts the tokens after the first arrival, 1.5 / 3 = 0.5 s."""
    req = _request(monkeypatch, Window(), [(1.0, 3), (1.5, 4), (2.0, 5), (2.5, 6)], 6)
    assert published.request_tbt(req) == pytest.approx(0.3)
    assert req.tbt() == pytest.approx(0.5)
    single = _request(monkeypatch, Window(), [(1.0, 4)], 4)  # one arrival: no interval
    assert published.request_tbt(single) is None


def test_a_published_cell_records_what_every_cell_records_and_a_saturated_client_invalidates_it(
    monkeypatch,
):
    """Rule 8 says every cell (issue #43): a published decode cell records the client's CPU,
    its event-loop lag and TTFT / time-between-tokens p90 and p99 as a default one does, and a
    saturated client makes it invalid (a safeguard that changes no figure). C=2, window
    (2, 12] s, two requests of 41 tokens, 0.25 s apart, over the whole window."""
    window = Window()
    window.ws, window.we = 2.0, 12.0
    reqs = [
        _request(monkeypatch, window, [(1.9 + 0.25 * k + 0.01 * s, k + 1) for k in range(41)], 41)
        for s in range(2)
    ]
    for r in reqs:
        r.sent_at = 1.0  # the feed sends at t=0, which the cell reads as no send time
    cfg = DecodeConfig(base_url="http://x", model="m", context=8192, concurrency=2)
    cell = published._PublishedDecode(cfg, None, [])  # type: ignore[arg-type]
    cell.window, cell.requests = window, reqs
    cell.monitor.lags = [0.001] * 100
    cell.monitor.cpu_s, cell.monitor.wall_s = 0.2, 10.0
    record, _ = cell._finish()
    assert record["status"] == "valid", record["error"]
    for key in ("ttft_p90_ms", "ttft_p99_ms", "tbt_p90_ms", "tbt_p99_ms"):
        assert record[key] is not None and record[key] >= record[key.replace("_p90", "").replace(
            "_p99", "")], key  # fmt: skip
    assert record["tbt_p99_ms"] == pytest.approx(250.0)
    assert record["client_cpu_pct"] == pytest.approx(2.0)
    assert record["loop_lag_p99_ms"] == pytest.approx(1.0)

    cell = published._PublishedDecode(cfg, None, [])  # type: ignore[arg-type]
    cell.window, cell.requests = window, reqs
    cell.monitor.lags = [0.001] * 80 + [0.030] * 20  # p90 above the 10 ms bound
    cell.monitor.cpu_s, cell.monitor.wall_s = 9.5, 10.0
    record, _ = cell._finish()
    assert record["status"] == "invalid"
    assert "event-loop lag p90" in record["error"] and "95% CPU" in record["error"]


def test_time_to_the_second_token_is_recorded_per_cell(monkeypatch):
    """Issue #43 item 10: beside TTFT, each decode cell records the median time from a
    request's first token arrival to its second (the tool's time to second token: the first
    decode step, apart from the prefill). A first arrival of 3 tokens (a speculative step)
    then one every 0.25 s: 0.25 s; a request whose tokens came in one arrival has none."""
    req = _request(monkeypatch, Window(), [(1.0, 3), (1.25, 4), (1.5, 5)], 5)
    assert req.ttst() == pytest.approx(0.25)
    assert _request(monkeypatch, Window(), [(1.0, 4)], 4).ttst() is None

    window = Window()
    window.ws, window.we = 2.0, 12.0
    reqs = [
        _request(monkeypatch, window, [(1.9, 1), *((2.0 + 0.1 * s + 0.25 * k, k + 2)
                 for k in range(40))], 41)
        for s in range(3)
    ]  # fmt: skip
    for r in reqs:
        r.sent_at = 1.0
    cfg = DecodeConfig(base_url="http://x", model="m", context=8192, concurrency=3)
    cell = published._PublishedDecode(cfg, None, [])  # type: ignore[arg-type]
    cell.window, cell.requests = window, reqs
    record, _ = cell._finish()
    assert record["ttst_ms"] == pytest.approx(200.0)  # 0.1, 0.2, 0.3 s: the median
