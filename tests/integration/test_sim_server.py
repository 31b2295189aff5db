"""The simulator over real HTTP on loopback: vLLM's surface, faults, ground truth, time scale."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import yaml

from speedmatrix.sim.runner import run_in_thread

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
KEY = "sim-test-key"
MODEL = "sim-test"

PROFILE = {
    "name": "http-test",
    "served_model_name": MODEL,
    "version": "0.32.0+sim",
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 1024,
    "vocab_size": 5000,
    "kv": {"block_size": 16, "num_gpu_blocks": 1025},
    "prefill": {"points": [[1024, 0.02], [2048, 0.05]]},
    "decode": {"base_s": 0.004, "per_seq_s": 0.0002, "per_kv_token_s": 0.0, "min_step_s": 0.001},
}
STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.fixture(scope="module")
def sim():
    with run_in_thread(PROFILE, api_key=KEY) as url:
        yield url


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def body(**kw) -> dict:
    base = {"model": MODEL, "prompt": list(range(1000, 1100)), "max_tokens": 8}
    base.update(kw)
    return base


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


def sse(resp: requests.Response) -> list:
    """The data payloads of an SSE stream: dicts, and the literal "[DONE]"."""
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            payload = line[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def post(url: str, path: str, data: dict, headers: dict | None = None, **kw) -> requests.Response:
    return requests.post(
        url + path, json=data, headers={**auth(), **(headers or {})}, timeout=30, **kw
    )


def test_open_endpoints_and_auth(sim):
    health = requests.get(sim + "/health", timeout=5)
    assert health.status_code == 200 and health.headers["X-Sim-Time-Scale"] == "1"
    assert requests.get(sim + "/version", timeout=5).json() == {"version": "0.32.0+sim"}
    assert requests.get(sim + "/metrics", timeout=5).status_code == 200
    r = requests.get(sim + "/v1/models", timeout=5)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    bad = requests.get(sim + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=5)
    assert bad.status_code == 401
    models = requests.get(sim + "/v1/models", headers=auth(), timeout=5).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 2048
    noauth = requests.post(sim + "/v1/completions", json=body(), timeout=5)
    assert noauth.status_code == 401


def test_tokenize_is_deterministic_and_open(sim):
    text = "The quick brown fox jumps over the lazy dog. " * 5
    a = requests.post(sim + "/tokenize", json={"prompt": text}, timeout=5).json()
    b = requests.post(sim + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=5).json()
    assert (
        a["tokens"] == b["tokens"] and a["count"] == len(a["tokens"]) == 46
    )  # 45 words + trailing space
    assert a["max_model_len"] == 2048
    assert all(1000 <= t < 5000 for t in a["tokens"])
    assert a["tokens"][9:18] == a["tokens"][18:27]  # same pieces, same ids
    back = requests.post(sim + "/detokenize", json={"tokens": a["tokens"]}, timeout=5).json()
    assert back["prompt"] == text


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        (body(prompt=[1000, 5000]), 400, "prompt"),  # id == vocab size: out of vocabulary
        (body(prompt=[-1]), 400, "prompt"),
        (body(prompt=list(range(1000, 3049))), 400, "input_tokens"),  # 2049 > max-model-len
        (body(prompt=list(range(1000, 3048))), 400, "max_tokens"),  # 2048: no room for output
        (body(model="other"), 404, "model"),
        (body(stream_options={"include_usage": True}), 400, "stream_options"),
        (body(prompt=[]), 400, None),
    ],
)
def test_errors_are_shaped_like_vllm(sim, payload, status, param):
    r = post(sim, "/v1/completions", payload)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param and err["message"]
    assert err["type"] == ("BadRequestError" if status == 400 else "NotFoundError")


MAX_0 = "max_tokens must be at least 1, got 0."


@pytest.mark.parametrize(
    ("path", "payload", "status", "param", "message"),
    [
        ("/v1/completions", body(max_tokens=0), 400, "max_tokens", MAX_0),
        ("/v1/chat/completions", chat_body(max_tokens=0), 400, "max_tokens", MAX_0),
        (
            "/v1/chat/completions",
            chat_body(model="other"),
            404,
            "model",
            "The model `other` does not exist.",
        ),
        (
            "/v1/completions",
            body(min_tokens=-1),
            400,
            None,
            "min_tokens must be greater than or equal to 0, got -1.",
        ),
        (
            "/v1/completions",
            body(min_tokens=9),
            400,
            None,
            "min_tokens must be less than or equal to max_tokens=8, got 9.",
        ),
    ],
)
def test_error_messages_are_vllms(sim, path, payload, status, param, message):
    r = post(sim, path, payload)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param
    assert err["type"] == ("BadRequestError" if status == 400 else "NotFoundError")
    # Newer vLLM may append " (parameter=..., value=...)" to the text: the start is the contract.
    assert err["message"].startswith(message)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("field", "value"),
    [("stream", "maybe"), ("stream", 2), ("ignore_eos", "nope"), ("ignore_eos", None)],
)
def test_non_boolean_flags_are_a_400_from_request_validation(sim, path, field, value):
    payload = (body if path == "/v1/completions" else chat_body)(**{field: value})
    r = post(sim, path, payload)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    # vLLM's RequestValidationError handler: the HTTP phrase as type, no param.
    assert err["type"] == "Bad Request" and err["code"] == 400 and err["param"] is None
    assert f"'loc': ('body', '{field}')" in err["message"]
    assert "Input should be a valid boolean" in err["message"]


def test_stream_chunks_usage_and_ground_truth(sim):
    payload = body(max_tokens=12, min_tokens=12, ignore_eos=True, **STREAM)
    r = post(sim, "/v1/completions", payload, stream=True, headers={"X-Request-Id": "gt-1"})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "gt-1"
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    usage_only = [e for e in events[:-1] if not e["choices"]]
    assert len(usage_only) == 1 and events[-2] is usage_only[0]
    assert usage_only[0]["usage"] == {
        "prompt_tokens": 100,
        "total_tokens": 112,
        "completion_tokens": 12,
    }
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] >= 1
    for c in chunks:
        assert c["id"] == "cmpl-gt-1" and c["object"] == "text_completion" and c["model"] == MODEL
        assert c["usage"]["prompt_tokens"] == 100
        assert set(c["choices"][0]) == {
            *("index", "text", "logprobs", "finish_reason", "stop_reason"),
            *("prompt_token_ids", "token_ids"),  # null, as vLLM 0.32 sends them
        }
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "length"
    ]
    gt = requests.get(sim + "/sim/requests/cmpl-gt-1", timeout=5).json()
    assert gt["output_tokens"] == 12 and len(gt["token_times"]) == 12
    assert gt["finish_reason"] == "length" and gt["prompt_tokens"] == 100
    assert sum(n for _, n in gt["chunks"]) == 12
    assert gt["token_times"] == sorted(gt["token_times"])


def test_request_ids_are_reusable_once_finished_not_while_running(sim):
    first = post(sim, "/v1/completions", body(max_tokens=2), headers={"X-Request-Id": "again"})
    second = post(sim, "/v1/completions", body(max_tokens=3), headers={"X-Request-Id": "again"})
    assert first.status_code == second.status_code == 200
    gt = requests.get(sim + "/sim/requests/cmpl-again", timeout=5).json()
    assert gt["output_tokens"] == 3  # ground truth of the latest request with that id
    payload = body(max_tokens=1000, **STREAM)
    running = post(sim, "/v1/completions", payload, stream=True, headers={"X-Request-Id": "busy"})
    lines = running.iter_lines()  # keep the generator: dropping it closes the connection
    next(lines)
    clash = post(sim, "/v1/completions", body(), headers={"X-Request-Id": "busy"})
    assert clash.status_code == 400 and "already running" in clash.json()["error"]["message"]
    running.close()


def test_stream_without_usage_options_has_no_usage(sim):
    r = post(sim, "/v1/completions", body(max_tokens=3, stream=True), stream=True)
    events = sse(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]).count(" ") == 3


def test_chat_stream_starts_with_a_role_only_chunk(sim):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    events = sse(post(sim, "/v1/chat/completions", {**payload, **STREAM}, stream=True))
    first = events[0]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"]["completion_tokens"] == 0
    content = [e for e in events[1:-1] if e["choices"]]
    assert content[-1]["usage"]["completion_tokens"] == 5
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    whole = post(sim, "/v1/chat/completions", payload).json()
    assert whole["choices"][0]["message"]["role"] == "assistant"
    assert whole["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "status", "message"),
    [
        (2047, 1, 200, None),  # prompt + max_tokens == max_model_len: admitted
        (2048, 1, 400, MAX_0),  # clamped to 0 room, as vLLM 0.32's get_max_tokens does
        (
            2049,
            1,
            400,
            "This model's maximum context length is 2048 tokens. However, your "
            "prompt contains at least 2049 input tokens, which exceeds this limit even without any "
            "output tokens.",
        ),
        (
            2050,
            1,
            400,
            "This model's maximum context length is 2048 tokens. However, your "
            "prompt contains 2050 input tokens, which exceeds",
        ),
    ],
)
def test_max_model_len_boundary_is_vllms(sim, prompt_len, max_tokens, status, message):
    """vLLM refuses a prompt of max_model_len tokens (no room for one output token) and more;
    one token less with max_tokens=1 is the largest prefill it serves."""
    payload = body(prompt=list(range(1000, 1000 + prompt_len)), max_tokens=max_tokens)
    r = post(sim, "/v1/completions", payload)
    assert r.status_code == status, r.text
    if message is None:
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_len, 1)
    else:
        assert r.json()["error"]["message"].startswith(message)


def test_output_past_max_model_len_is_silently_shortened(sim):
    payload = body(prompt=list(range(1000, 3040)), max_tokens=20, ignore_eos=True)
    r = post(sim, "/v1/completions", payload)
    assert r.status_code == 200
    out = r.json()
    assert out["usage"]["completion_tokens"] == 8  # 2048 - 2040
    assert out["choices"][0]["finish_reason"] == "length"
    # max_tokens is clamped to that room before min_tokens is checked against it (vLLM 0.32's
    # get_max_tokens, then SamplingParams): a load generator's min_tokens = max_tokens past
    # max-model-len is refused, not shortened
    r = post(sim, "/v1/completions", {**payload, "min_tokens": 20})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "min_tokens must be less than or equal to max_tokens=8, got 20."
    )


def metric(url: str, name: str, label: str = "") -> float:
    """The first sample of `name` whose line holds `label` (e.g. 'finished_reason="stop"')."""
    for line in requests.get(url + "/metrics", timeout=5).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {label} not in /metrics")


def test_metrics_names_and_counters(sim):
    text = requests.get(sim + "/metrics", timeout=5).text
    for name in (
        "vllm:cache_config_info",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
    ):
        assert f"\n{name}{{" in text, name
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'num_gpu_blocks="1025"' in info and 'block_size="16"' in info
    assert 'kv_cache_size_tokens="16400"' in info
    before = metric(sim, "vllm:generation_tokens_total")
    post(sim, "/v1/completions", body(max_tokens=7))
    assert metric(sim, "vllm:generation_tokens_total") == before + 7


def test_string_prompt_counts_what_tokenize_counts(sim):
    text = "A string prompt is tokenized by the server, as vLLM does: count it once. " * 3
    count = requests.post(sim + "/tokenize", json={"prompt": text}, timeout=5).json()["count"]
    before = metric(sim, "vllm:prompt_tokens_total")
    out = post(sim, "/v1/completions", body(prompt=text, max_tokens=2)).json()
    assert out["usage"] == {
        "prompt_tokens": count,
        "total_tokens": count + 2,
        "completion_tokens": 2,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert metric(sim, "vllm:prompt_tokens_total") == before + count
    listed = post(sim, "/v1/completions", body(prompt=[text], max_tokens=2)).json()
    assert listed["usage"]["prompt_tokens"] == count  # a one-element list is the same prompt


def test_metric_values_follow_vllm_semantics():
    prompt = list(range(1000, 2000))
    with run_in_thread(PROFILE) as url:
        assert metric(url, "vllm:kv_cache_usage_perc") == 0.0
        payload = body(prompt=prompt, max_tokens=1000, min_tokens=1000, ignore_eos=True, **STREAM)
        r = post(url, "/v1/completions", payload, stream=True, headers={"X-Request-Id": "kv"})
        lines = r.iter_lines()
        next(line for line in lines if line.startswith(b"data: {"))  # running: ~4 s to go
        # A fraction (not percent) of the 1,024 usable blocks, in whole blocks: between what
        # the prompt and its first token hold (ceil(1001 / 16)) and prompt + all output.
        blocks = metric(url, "vllm:kv_cache_usage_perc") * 1024
        assert blocks == int(blocks) and 63 <= blocks <= 125
        r.close()  # the disconnect aborts the request and frees its blocks
        deadline = time.time() + 10
        while time.time() < deadline:
            if requests.get(url + "/sim/requests/cmpl-kv", timeout=5).json()["state"] == "finished":
                break
            time.sleep(0.02)
        assert metric(url, "vllm:kv_cache_usage_perc") == 0.0
        post(url, "/v1/completions", body(prompt=prompt, max_tokens=1))  # the same prompt again
        # vLLM counts every prompt token, cached or not, in both; hits are whole blocks < 1000.
        assert metric(url, "vllm:prompt_tokens_total") == 2000
        assert metric(url, "vllm:prefix_cache_queries_total") == 2000
        assert metric(url, "vllm:prefix_cache_hits_total") == (999 // 16) * 16


def test_preemptions_when_the_kv_cache_is_too_small_for_the_load():
    # 32 usable blocks (512 tokens); two requests growing to 64 + 300 tokens (23 blocks) each:
    # the one admitted last is preempted, waits, is recomputed and still delivers every token.
    small = {**PROFILE, "kv": {"block_size": 16, "num_gpu_blocks": 33}}
    payloads = [
        body(prompt=list(range(1000 + 64 * i, 1064 + 64 * i)), max_tokens=300, ignore_eos=True)
        for i in range(2)
    ]
    with run_in_thread(small) as url:
        assert metric(url, "vllm:num_preemptions_total") == 0
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda p: post(url, "/v1/completions", p).json(), payloads))
        truth = requests.get(url + "/sim/requests", timeout=5).json()
        preemptions = metric(url, "vllm:num_preemptions_total")
        assert [o["usage"]["completion_tokens"] for o in outs] == [300, 300]
        assert preemptions >= 1 and preemptions == sum(r["preemptions"] for r in truth)
        assert metric(url, "vllm:prompt_tokens_total") == 128  # once a request, not per recompute
        assert metric(url, "vllm:kv_cache_usage_perc") == 0.0


EOS_PROFILE = {**PROFILE, "name": "http-test-eos", "natural_stop_tokens": 5}


@pytest.fixture(scope="module")
def eos_sim():
    with run_in_thread(EOS_PROFILE, api_key=KEY) as url:
        yield url


@pytest.mark.parametrize(
    ("fields", "tokens", "reason"),
    [
        ({}, 5, "stop"),  # the model's own EOS
        ({"min_tokens": 3}, 5, "stop"),  # already past min_tokens: no effect
        ({"min_tokens": 8}, 9, "stop"),  # EOS masked while < 8 are out: the 9th may be EOS
        ({"min_tokens": 19}, 20, "length"),  # the first EOS allowed is the 20th: max_tokens wins
        ({"ignore_eos": True}, 20, "length"),
        ({"ignore_eos": True, "min_tokens": 3}, 20, "length"),
        ({"ignore_eos": "true"}, 20, "length"),  # pydantic's lax boolean, as vLLM parses it
        ({"ignore_eos": 0}, 5, "stop"),
    ],
)
def test_natural_stop_min_tokens_and_ignore_eos(eos_sim, fields, tokens, reason):
    out = post(eos_sim, "/v1/completions", body(max_tokens=20, **fields)).json()
    assert out["usage"]["completion_tokens"] == tokens
    assert out["choices"][0]["finish_reason"] == reason


def test_natural_stop_in_a_stream_and_in_the_metrics(eos_sim):
    stops = metric(eos_sim, "vllm:request_success_total", 'finished_reason="stop"')
    payload = body(max_tokens=20, min_tokens=2, **STREAM)
    r = post(eos_sim, "/v1/completions", payload, stream=True, headers={"X-Request-Id": "eos"})
    events = sse(r)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "stop"
    ]
    assert chunks[-1]["usage"]["completion_tokens"] == events[-2]["usage"]["completion_tokens"] == 5
    gt = requests.get(eos_sim + "/sim/requests/cmpl-eos", timeout=5).json()
    assert gt["finish_reason"] == "stop" and gt["output_tokens"] == 5
    after = metric(eos_sim, "vllm:request_success_total", 'finished_reason="stop"')
    assert after == stops + 1


def test_prefix_cache_over_http_and_cache_salt(sim):
    prompt = list(range(2000, 2500))
    hits0 = metric(sim, "vllm:prefix_cache_hits_total")
    post(sim, "/v1/completions", body(prompt=prompt, max_tokens=1))
    post(sim, "/v1/completions", body(prompt=prompt, max_tokens=1))
    hits1 = metric(sim, "vllm:prefix_cache_hits_total")
    assert hits1 - hits0 == (499 // 16) * 16
    post(sim, "/v1/completions", body(prompt=prompt, max_tokens=1, cache_salt="run-2"))
    assert metric(sim, "vllm:prefix_cache_hits_total") == hits1


def test_client_disconnect_aborts_the_request(sim):
    payload = body(max_tokens=1500, prompt=list(range(1000, 1010)), **STREAM)
    r = post(sim, "/v1/completions", payload, stream=True, headers={"X-Request-Id": "gone"})
    lines = r.iter_lines()
    for _ in range(6):
        next(lines)
    r.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        gt = requests.get(sim + "/sim/requests/cmpl-gone", timeout=5).json()
        if gt["state"] == "finished":
            break
        time.sleep(0.05)
    assert gt["finish_reason"] == "abort" and gt["output_tokens"] < 1500
    state = requests.get(sim + "/sim/state", timeout=5).json()
    assert state["running"] == 0 and state["kv_free_blocks"] == 1024


def test_faults_500_short_output_disconnect_queue_and_dead_engine():
    with run_in_thread(PROFILE, faults={"http_500_every": 2}) as url:
        codes = [post(url, "/v1/completions", body()).status_code for _ in range(4)]
        assert codes == [200, 500, 200, 500]
        err = post(url, "/v1/completions", body()).json()  # 5th: fine
        assert "error" not in err
        r = requests.post(url + "/sim/faults", json={"short_output_every": 1}, timeout=5)
        assert r.status_code == 200 and r.json()["http_500_every"] == 0
        out = post(url, "/v1/completions", body(max_tokens=50, min_tokens=50, ignore_eos=True))
        assert out.json()["usage"]["completion_tokens"] == 4
        assert out.json()["choices"][0]["finish_reason"] == "length"
        bad = requests.post(url + "/sim/faults", json={"nonsense": 1}, timeout=5)
        assert bad.status_code == 400 and "unknown faults" in bad.json()["error"]["message"]

        url.call(lambda s: s.set_faults({"disconnect_every": 1, "disconnect_after_tokens": 3}))
        r = post(url, "/v1/completions", body(max_tokens=50, **STREAM), stream=True)
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            sse(r)
        url.call(lambda s: s.set_faults({"max_running": 1}))
        streams = [
            post(url, "/v1/completions", body(max_tokens=400, **STREAM), stream=True)
            for _ in range(3)
        ]
        deadline = time.time() + 10
        while metric(url, "vllm:num_requests_waiting") < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert metric(url, "vllm:num_requests_waiting") == 2
        assert metric(url, "vllm:num_requests_running") == 1
        for s in streams:
            s.close()
        url.call(lambda s: s.set_faults({"engine_dead": True}))
        assert requests.get(url + "/health", timeout=5).status_code == 503
        dead = post(url, "/v1/completions", body())
        assert dead.status_code == 500 and dead.json()["error"]["type"] == "EngineDeadError"
        # A whole (non-streamed) response still waiting when the engine dies gets a 500 too.
        url.call(lambda s: s.set_faults({}))
        # The engine dies once the server says the request is running (not after a fixed
        # sleep, which did not prove the request was there yet: issue #33).
        with ThreadPoolExecutor(1) as pool:
            late_id = {"X-Request-Id": "late"}
            waiting = pool.submit(
                post, url, "/v1/completions", body(max_tokens=1000), headers=late_id
            )
            deadline = time.time() + 10
            seen = None
            while time.time() < deadline and not waiting.done():
                got = requests.get(url + "/sim/requests/cmpl-late", timeout=5)
                seen = got.json().get("state") if got.status_code == 200 else None
                if seen == "running":
                    break
                time.sleep(0.02)
            assert seen == "running", seen
            url.call(lambda s: s.set_faults({"engine_dead": True}))
            late = waiting.result(timeout=20)
        assert late.status_code == 500 and late.json()["error"]["type"] == "EngineDeadError"
        gt = requests.get(url + "/sim/requests/cmpl-late", timeout=5).json()
        assert gt["output_tokens"] < 1000, gt  # it was cut by the engine's death


def test_spec_decode_chunks_carry_several_tokens():
    with run_in_thread("synthetic-specdec-not-calibrated") as url:
        payload = {
            "model": "sim-specdec",
            "prompt": list(range(1000, 1300)),
            "max_tokens": 200,
            "min_tokens": 200,
            "ignore_eos": True,
            **STREAM,
        }
        events = sse(requests.post(url + "/v1/completions", json=payload, timeout=30, stream=True))
        counts = [e["usage"]["completion_tokens"] for e in events[:-1] if e["choices"]]
        deltas = [b - a for a, b in zip([0, *counts], counts, strict=False)]
        assert sum(deltas) == 200 and max(deltas) > 1
        drafts = metric(url, "vllm:spec_decode_num_drafts_total")
        accepted = metric(url, "vllm:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and accepted > 0
        assert metric(url, "vllm:spec_decode_num_draft_tokens_total") == 7 * drafts
        # generation = 1 token from prefill + (1 + accepted) per draft, except that the last
        # step is cut at max_tokens (accepted drafts beyond it are counted, not emitted).
        generated = metric(url, "vllm:generation_tokens_total")
        assert generated == 200
        assert 1 + drafts + accepted - 7 <= generated <= 1 + drafts + accepted


def test_time_scale_wall_times_are_simulated_times_divided_by_the_scale():
    scale = 10.0
    t_before = time.time()
    with run_in_thread(PROFILE, time_scale=scale) as url:
        # 1,900 tokens x 4 ms = 7.6 s simulated = 0.76 s wall: long against client jitter
        # (this shared 2-core machine is often saturated by other work).
        payload = body(max_tokens=1900, min_tokens=1900, ignore_eos=True, **STREAM)
        t0 = time.perf_counter()
        r = post(url, "/v1/completions", payload, stream=True, headers={"X-Request-Id": "ts"})
        stamps = []
        for line in r.iter_lines():
            if line.startswith(b"data: {") and b'"choices":[{' in line:
                stamps.append(time.perf_counter())
        gt = requests.get(url + "/sim/requests/cmpl-ts", timeout=5).json()
        assert r.headers["X-Sim-Time-Scale"] == "10"
        created = requests.post(url + "/v1/completions", json=body(max_tokens=1), timeout=5)
        t_after = time.time()
    # `created` is on the simulated clock: the start's Unix time + simulated seconds, which ran
    # 10x the wall clock. It is past the last token's simulated time (>= 7.6 s after the start;
    # an unscaled clock would read ~1 s), and no further than the scaled wall time allows.
    stamp = created.json()["created"]
    assert int(t_before + gt["token_times"][-1]) <= stamp <= t_after + (t_after - t_before) * scale
    sim_span = gt["token_times"][-1] - gt["token_times"][0]
    wall_span = stamps[-1] - stamps[0]
    assert wall_span * scale == pytest.approx(sim_span, rel=0.15)
    assert gt["tbt_s"] == pytest.approx(PROFILE["decode"]["base_s"], rel=0.01)
    # The client's first token comes after the simulated one (causality) and, scaled, within
    # 250 ms of wall clock of it (the client's own delays are multiplied by the scale too).
    client_ttft = (stamps[0] - t0) * scale
    assert gt["ttft_s"] - 0.01 * scale <= client_ttft <= gt["ttft_s"] + 0.25 * scale


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sim_serve_subprocess_starts_answers_health_and_stops_on_sigterm():
    port = _free_port()
    profile = REPO / "include" / "sim-profiles" / "kimi-k2.7-nvfp4-rtxpro6k-x8.yaml"
    cmd = [sys.executable, "-m", "speedmatrix", "sim", "serve", "--profile", str(profile)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    t0 = time.perf_counter()
    env = {**os.environ, "VLLM_API_KEY": KEY}  # read as vLLM reads it: not in the process list
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        up = None
        while time.perf_counter() - t0 < 20 and proc.poll() is None:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    up = time.perf_counter() - t0
                    break
            except requests.ConnectionError:
                time.sleep(0.02)
        assert up is not None, proc.stderr.read().decode() if proc.poll() is not None else "no"
        print(f"sim serve answered /health after {up:.2f} s")
        models = requests.get(f"http://127.0.0.1:{port}/v1/models", headers=auth(), timeout=5)
        assert models.json()["data"][0]["id"] == "Kimi-K2.7-Code-NVFP4"
        assert requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 401
        assert KEY.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        err = proc.stderr.read().decode()
        kv = yaml.safe_load(profile.read_text())["kv"]
        tokens = kv["num_gpu_blocks"] * kv["block_size"]  # the calibrated profile's KV cache
        assert f"GPU KV cache size: {tokens:,} tokens" in err and KEY not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_server_that_fell_behind_coalesces_tokens_into_chunks():
    with run_in_thread(PROFILE) as url:
        payload = body(max_tokens=400, min_tokens=400, ignore_eos=True, **STREAM)
        r = post(url, "/v1/completions", payload, stream=True, headers={"X-Request-Id": "co"})
        lines = r.iter_lines()
        first = [next(lines) for _ in range(10)]
        url.call(lambda s: time.sleep(0.2))  # the server's loop stalls for 200 ms (50 steps)
        counts = [
            json.loads(line[6:])["usage"]["completion_tokens"]
            for line in [*first, *lines]
            if line.startswith(b"data: {") and b'"choices":[{' in line
        ]
        gt = requests.get(url + "/sim/requests/cmpl-co", timeout=5).json()
    deltas = [b - a for a, b in itertools.pairwise(counts)]
    assert max(deltas) >= 10  # one chunk carried the tokens of many steps
    assert counts[-1] == 400 and sum(n for _, n in gt["chunks"]) == 400
    steps = gt["token_times"]
    assert len(set(steps)) == 400  # ...while every token kept its own step time


def test_io_lag_probe_times_stamped_datagrams_from_loopback():
    """The benchmark's outside-event lag: each 8-byte CLOCK_MONOTONIC stamp sent to UDP
    <host>:<port> becomes one sample (sent-to-read), anything else is not a sample."""
    from urllib.parse import urlparse

    with run_in_thread(PROFILE) as url:
        port = urlparse(url).port
        requests.get(url + "/sim/state?reset_lag=1", timeout=10)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(5):
                s.sendto(time.monotonic_ns().to_bytes(8, "big"), ("127.0.0.1", port))
            s.sendto(b"not a stamp", ("127.0.0.1", port))
            old = time.monotonic_ns() - 2_000_000_000  # stamped two seconds ago
            s.sendto(old.to_bytes(8, "big"), ("127.0.0.1", port))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            lag = requests.get(url + "/sim/state", timeout=10).json()["loop_io_lag"]
            if lag["samples"] >= 6:
                break
            time.sleep(0.05)
        assert lag["samples"] == 6  # the malformed datagram is no sample
        assert lag["max_ms"] >= 2000.0  # the old stamp reads as (at least) two seconds late
        assert 0.0 <= lag["p50_ms"] < lag["max_ms"]


# What GuideLLM 0.8 (its OpenAI HTTP backend, chat completions) and `vllm bench serve
# --backend openai-chat` send, written out here (issue #34 item 10): the prompt as a list of
# content parts, max_completion_tokens, streamed usage. vLLM accepts both; so must the sim.
PROMPT = "Write a long article about lighthouses."
GUIDELLM_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 12,
    "max_completion_tokens": 12,
    "stop": None,
    "ignore_eos": True,
}
VLLM_BENCH_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    "temperature": 0.0,
    "max_completion_tokens": 12,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}


@pytest.mark.parametrize("payload", [GUIDELLM_CHAT, VLLM_BENCH_CHAT], ids=["guidellm", "vllm"])
def test_benchmark_tools_chat_requests_with_content_parts(sim, payload) -> None:
    resp = requests.post(f"{sim}/v1/chat/completions", json=payload, headers=auth(), timeout=30)
    assert resp.status_code == 200, resp.text
    events = sse(resp)
    assert events[-1] == "[DONE]"
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
    )
    usage = events[-2]["usage"]
    assert text and usage["completion_tokens"] == 12
    # the same prompt as a plain string: the same prompt tokens (parts are joined, not dropped)
    plain = {**payload, "messages": [{"role": "user", "content": PROMPT}], "stream": False}
    plain.pop("stream_options")
    same = requests.post(f"{sim}/v1/chat/completions", json=plain, headers=auth(), timeout=30)
    assert same.json()["usage"]["prompt_tokens"] == usage["prompt_tokens"]


@pytest.mark.parametrize(
    ("content", "status", "says"),
    [
        ([{"type": "text", "text": "a"}, "b", {"type": "input_text", "input_text": "c"}], 200, ""),
        ([{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}], 400, "text-only"),
        ([{"type": "text"}], 400, "without text"),
        (7, 400, "string or a list of parts"),
    ],
)
def test_content_parts_the_text_only_model_reads_or_refuses(sim, content, status, says) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    resp = requests.post(f"{sim}/v1/chat/completions", json=payload, headers=auth(), timeout=30)
    assert resp.status_code == status, resp.text
    if status != 200:
        assert says in resp.json()["error"]["message"]


def test_the_simulators_own_parsing_stays_out_of_its_modelled_time_on_a_loaded_host(tmp_path):
    """Issue #43: the server stamped a request's arrival before parsing and tokenizing its chat
    text, so its own CPU leaked into the modelled time (537-697 ms of front end where 189-210 ms
    were modelled, on a loaded host). Here the server shares one core with a busy process (a
    deterministic load: the scheduler halves its share) and gets a 64K-word chat prompt, whose
    tokenizing costs it 100+ ms of wall time, against a modelled front-end delay of 20 ms: the
    TTFT the simulator records is the model's (sim.predict_prefill on the same profile and
    prompt length), within one engine step (a first token waits for the step under way)."""
    from speedmatrix.sim.predict import predict_prefill
    from speedmatrix.sim.profile import Profile

    data = {
        **PROFILE,
        "max_model_len": 70000,
        "vocab_size": 163840,
        "kv": {"block_size": 16, "num_gpu_blocks": 5000},
        "prefill": {"points": [[1024, 0.01], [65536, 0.4]]},
        "frontend": {
            "first_token_delay_ms": [
                {"context": 1024, "requests": 1, "ms": 5.0},
                {"context": 65536, "requests": 1, "ms": 20.0},
            ]
        },
    }
    path = tmp_path / "loaded.yaml"
    path.write_text(yaml.safe_dump(data))
    profile = Profile.from_dict(data)
    core = {min(os.sched_getaffinity(0))}
    port = _free_port()
    cmd = [sys.executable, "-m", "speedmatrix", "sim", "serve", "--profile", str(path)]
    server = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    url = f"http://127.0.0.1:{port}"
    try:
        os.sched_setaffinity(server.pid, core)
        os.sched_setaffinity(busy.pid, core)
        deadline = time.monotonic() + 60
        while True:  # wait for the server to answer (a condition, polled)
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, "no server"
                time.sleep(0.05)
        text = " ".join(f"w{i % 997}" for i in range(65000))
        resp = requests.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                  "max_tokens": 2, "ignore_eos": True},
            headers={"X-Request-Id": "loaded"}, timeout=120,
        )  # fmt: skip
        assert resp.status_code == 200, resp.text
        plen = resp.json()["usage"]["prompt_tokens"]
        assert plen > 64000
        truth = requests.get(url + "/sim/requests/chatcmpl-loaded", timeout=10).json()
        modelled = predict_prefill(profile, plen)["ttft_ms"] / 1000.0
        step = max(profile.decode_base_s, profile.min_step_s)
        assert truth["ttft_s"] == pytest.approx(modelled, abs=step), (truth, modelled)
    finally:
        for proc in (busy, server):
            proc.kill()
            proc.wait(10)


def test_the_simulator_in_a_process_answers_then_leaves_no_process(tmp_path):
    """`run_in_process` (the one way tests and benchmarks start `sim serve` in a process of
    its own): the URL answers /health and serves the profile's model inside the block; after
    it, the process and its whole group are gone. A profile it cannot load fails at once with
    the server's own error, not after the start-up time-out."""
    from processes import group_running

    from speedmatrix.sim.runner import run_in_process

    profile = tmp_path / "http-test.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    with run_in_process(profile) as url:
        pgid = os.getpgid(url.proc.pid)
        assert pgid == url.proc.pid  # a session of its own: the stop reaches all it started
        assert requests.get(url + "/health", timeout=10).status_code == 200
        models = requests.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
    assert url.proc.poll() is not None
    assert group_running(pgid) == []

    missing = tmp_path / "no-such-profile.yaml"
    started = time.monotonic()
    with (
        pytest.raises(RuntimeError, match="did not start") as info,
        run_in_process(missing, start_timeout_s=120),
    ):
        pass
    assert "no-such-profile" in str(info.value)
    assert time.monotonic() - started < 60
