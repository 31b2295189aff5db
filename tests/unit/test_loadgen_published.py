"""The `published` measurement profile's prompts and bodies (issue #35 part 3): the published
tool's definitions, read from llm_decode_bench.py, without a server."""

from __future__ import annotations

import json

import pytest

from speedmatrix.loadgen import DecodeConfig, PrefillConfig
from speedmatrix.loadgen import published_prompt as pp
from speedmatrix.loadgen.stream import _choice_text


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
