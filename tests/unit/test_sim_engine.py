"""The engine model's scheduling rules, driven directly in simulated time (no HTTP)."""

from __future__ import annotations

import math

import pytest

from speedmatrix.sim.engine import RUNNING, WAITING, Engine, Request
from speedmatrix.sim.predict import make_prompt
from speedmatrix.sim.profile import Profile, ProfileError, load_profile


def small_profile(**overrides) -> Profile:
    data = {
        "name": "test-small",
        "served_model_name": "sim-test",
        "max_model_len": 4096,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "vocab_size": 5000,
        "kv": {"block_size": 16, "num_gpu_blocks": 101},  # 100 usable blocks = 1600 tokens
        "prefill": {"points": [[1024, 0.1], [4096, 0.5]]},
        "decode": {"base_s": 0.01, "per_seq_s": 0.001, "per_kv_token_s": 0.0, "min_step_s": 0.001},
    }
    for key, value in overrides.items():
        data[key] = value
    return Profile.from_dict(data)


def run_all(engine: Engine, reqs: list[Request], limit: float = 1e6) -> None:
    while not all(r.finished for r in reqs):
        t = engine.next_event_time()
        assert t is not None and t < limit, "engine stalled"
        engine.advance(t)


def prompt(n: int, tag: int) -> list[int]:
    return make_prompt(n, tag, 5000)


def test_single_request_timing_follows_the_profile():
    p = small_profile()
    e = Engine(p)
    r = e.add(Request("a", prompt(1000, 1), 10))
    run_all(e, [r])
    # Chunked prefill in 512-token chunks still costs exactly P(1000) (telescoping chunks).
    assert r.token_times[0] - r.arrival == pytest.approx(p.prefill_time(1000))
    assert e.counters.steps == 2 + 9  # two prefill chunks, then nine decode steps
    gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    assert all(g == pytest.approx(p.decode_step_time(1, 1001)) for g in gaps)
    assert r.out == 10 and r.finish_reason == "length"
    assert e.pool.free == e.pool.num_blocks  # everything released


def test_admission_waits_for_blocks_fcfs():
    p = small_profile(max_num_batched_tokens=4096)  # whole prompts in one step
    e = Engine(p)
    # 600-token prompts need 38 blocks each to start: two fit in 100, the third waits.
    reqs = [e.add(Request(f"r{i}", prompt(600, i), 4)) for i in range(3)]
    e.advance(e.next_event_time())  # first step
    assert [r.state for r in reqs] == [RUNNING, RUNNING, WAITING]
    run_all(e, reqs)
    third = reqs[2]
    assert third.first_scheduled >= min(reqs[0].finished_at, reqs[1].finished_at)
    assert all(r.out == 4 for r in reqs)


def test_max_running_cap_queues_requests():
    e = Engine(small_profile(), max_running=1)
    reqs = [e.add(Request(f"r{i}", prompt(50, i), 3)) for i in range(3)]
    e.advance(e.next_event_time())
    assert len(e.running) == 1 and len(e.waiting) == 2
    run_all(e, reqs)
    assert reqs[1].first_scheduled >= reqs[0].finished_at


def test_preemption_when_running_requests_outgrow_the_cache():
    p = small_profile()
    e = Engine(p)
    # Two 400-token prompts (25 blocks each) growing by 600 tokens need 2 x 63 > 100 blocks.
    reqs = [e.add(Request(f"r{i}", prompt(400, i), 600)) for i in range(2)]
    run_all(e, reqs)
    assert e.counters.preemptions >= 1
    assert reqs[1].preemptions >= 1 and reqs[0].preemptions == 0  # the latest admitted loses
    for r in reqs:
        assert r.out == 600 and len(r.token_times) == 600  # no token emitted twice or lost
        assert list(r.token_times) == sorted(r.token_times)
    assert e.pool.free == e.pool.num_blocks


def test_prefix_cache_hits_whole_blocks_and_salt_separates():
    p = small_profile()
    e = Engine(p)
    base = prompt(1000, 7)
    first = e.add(Request("a", base, 1))
    run_all(e, [first])
    again = e.add(Request("b", list(base), 1))
    run_all(e, [again])
    salted = e.add(Request("c", list(base), 1, salt="other"))
    run_all(e, [salted])
    assert first.cached_tokens == 0
    assert again.cached_tokens == (999 // 16) * 16  # whole blocks, at least one token recomputed
    assert salted.cached_tokens == 0
    ttft = [r.token_times[0] - r.arrival for r in (first, again, salted)]
    tail = p.prefill_time(1000) - p.prefill_time(again.cached_tokens)
    assert ttft[1] == pytest.approx(max(tail, p.min_step_s))  # a step never beats the floor
    assert ttft[1] < ttft[0] / 20
    assert ttft[2] == pytest.approx(ttft[0])
    assert e.counters.prefix_hits == again.cached_tokens
    assert e.counters.prefix_queries == 3000


def test_evicted_cache_blocks_are_not_hits():
    e = Engine(small_profile())
    a = e.add(Request("a", prompt(1500, 1), 1))
    run_all(e, [a])
    b = e.add(Request("b", prompt(1500, 2), 1))  # reuses (evicts) almost every free block
    run_all(e, [b])
    a2 = e.add(Request("a2", prompt(1500, 1), 1))
    run_all(e, [a2])
    assert a2.cached_tokens < 1500 - 16 * 40


def test_abort_frees_blocks_and_stops_emission():
    e = Engine(small_profile())
    r = e.add(Request("a", prompt(500, 1), 1000))
    for _ in range(5):
        e.advance(e.next_event_time())
    emitted = r.out
    e.abort("a")
    assert r.finished and r.finish_reason == "abort"
    assert e.pool.free == e.pool.num_blocks
    assert e.next_event_time() is None or not e.running
    assert r.out == emitted


def test_frontend_delay_depends_on_requests_held():
    p = small_profile(
        frontend={
            "first_token_delay_ms": [
                {"context": 100, "requests": 1, "ms": 10},
                {"context": 100, "requests": 4, "ms": 40},
            ]
        }
    )
    e = Engine(p)
    solo = e.add(Request("solo", prompt(100, 1), 1))
    run_all(e, [solo])
    assert solo.ready - solo.arrival == pytest.approx(0.010)
    burst = [e.add(Request(f"b{i}", prompt(100, 10 + i), 1)) for i in range(4)]
    run_all(e, burst)
    assert all(r.ready - r.arrival == pytest.approx(0.040) for r in burst)


def test_speculative_decoding_emits_several_tokens_per_step():
    p = load_profile("synthetic-specdec-not-calibrated")
    assert not p.calibrated
    e = Engine(p)
    reqs = [e.add(Request(f"s{i}", make_prompt(256, i, p.vocab_size), 200)) for i in range(4)]
    run_all(e, reqs)
    k = p.spec_decode.num_speculative_tokens
    c = e.counters
    for r in reqs:
        per_step = [n for _, n in r.steps]
        assert sum(per_step) == r.out == 200 == len(r.token_times)
        assert max(per_step) <= k + 1 and max(per_step) > 1
        assert per_step[0] == 1  # the prefill step samples one token
    # Every decode step is one draft of k tokens; accepted tokens are what went beyond 1/step.
    assert c.spec_draft_tokens == k * c.spec_drafts
    assert c.spec_accepted == sum(sum(r.accepted) for r in reqs)
    assert sum(c.spec_accepted_per_pos) == c.spec_accepted
    assert c.generation_tokens == 800
    mean_len = 1 + c.spec_accepted / c.spec_drafts
    expected = 1 + sum(math.prod(p.spec_decode.acceptance[: i + 1]) for i in range(k))
    assert mean_len == pytest.approx(expected, rel=0.15)


def test_profile_validation_names_the_problem():
    with pytest.raises(ProfileError, match=r"prefill\.points"):
        Profile.from_dict({"prefill": {"points": [[1024, -1]]}})
    with pytest.raises(ProfileError, match="acceptance"):
        Profile.from_dict({"spec_decode": {"num_speculative_tokens": 2, "acceptance": [0.5]}})


def test_faults_from_a_profile_and_validation():
    from speedmatrix.sim.faults import Faults
    from speedmatrix.sim.server import SimServer

    prof = Profile.from_dict({"name": "f", "faults": {"max_running": 2, "http_500_every": 3}})
    server = SimServer(prof)
    assert server.faults.max_running == 2 and server.engine.max_running == 2
    assert [server.faults.hits(3, i) for i in range(1, 7)] == [False, False, True] * 2
    with pytest.raises(ValueError, match="unknown faults"):
        Faults.coerce({"explode": True})
    with pytest.raises(ValueError, match="non-negative"):
        Faults.coerce({"http_500_every": -1})


def test_finished_requests_keep_timings_not_prompts():
    e = Engine(small_profile(), keep_finished=2)
    reqs = [e.add(Request(f"r{i}", prompt(300, i), 2)) for i in range(3)]
    run_all(e, reqs)
    assert all(r.prompt == [] and r.hashes is None for r in reqs)
    assert reqs[2].ground_truth()["prompt_tokens"] == 300
    assert e.get("r0") is None and e.get("r2") is reqs[2]  # only the last 2 are kept
