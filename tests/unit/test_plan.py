"""The capacity rule, readable labels and impossible-matrix checks (speedmatrix.plan)."""

from __future__ import annotations

import pytest

from speedmatrix.plan import (
    KvCapacity,
    MatrixSpec,
    PlanError,
    blocks_needed,
    cell_label,
    check_matrix,
    fits,
    matrix_problems,
    ordered_cells,
    plan_matrix,
    repeat_keys,
    task_cells,
)
from speedmatrix.records import CELL_FIELDS

K = 1024
# The published Kimi report's matrix; its over-capacity pattern is reproduced by any KV cache of
# 4081..4224 blocks of 64 tokens (251K x 1 needs 4080 blocks, 128K x 2 needs 4224).
REF_CONTEXTS = [8 * K, 16 * K, 32 * K, 64 * K, 128 * K, 251 * K]
REF_CONC = [1, 2, 4, 8, 16, 32, 64, 128]
REF_RUNNABLE = {8 * K: 16, 16 * K: 8, 32 * K: 4, 64 * K: 2, 128 * K: 1, 251 * K: 1}


def ref_spec(**over) -> MatrixSpec:
    values = dict(
        prefill_contexts=[*REF_CONTEXTS, 256 * K],
        contexts=REF_CONTEXTS,
        concurrencies=REF_CONC,
        max_output_tokens=4096,
        window_s=30,
    )
    values.update(over)
    return MatrixSpec.build(**values)


def test_blocks_are_whole_and_one_is_kept_back():
    cap = KvCapacity(num_blocks=11, block_size=16)
    assert blocks_needed(100, 60, 16) == 10
    assert blocks_needed(100, 61, 16) == 11
    assert fits(100, 1, 60, cap)  # 10 blocks <= 11 - 1
    assert not fits(100, 1, 61, cap)  # 11 blocks > 10
    assert not fits(100, 2, 60, cap)


@pytest.mark.parametrize("num_blocks", [4081, 4150, 4224])
def test_reference_report_over_capacity_pattern(num_blocks):
    plan = plan_matrix(ref_spec(prefill_contexts=REF_CONTEXTS), KvCapacity(num_blocks, 64))
    runnable = {(c["context_tokens"], c["concurrency"]) for c in plan.decode}
    expected = {(ctx, c) for ctx, top in REF_RUNNABLE.items() for c in REF_CONC if c <= top}
    assert runnable == expected
    assert len(plan.decode) == 16
    assert len(plan.over_capacity) == 6 * 8 - 16
    assert sorted(c["context_tokens"] for c in plan.prefill) == REF_CONTEXTS


def prefills_needed(order: list[dict], capacity: KvCapacity) -> list[tuple[int, int]]:
    """The prompts a host prefills running `order`, with an LRU prefix cache of the KV
    capacity: a cell needs its prompts (prefill: stream 0's; decode: streams 0..C-1, the same
    bytes in every cell of a context and pass) and, while it runs, room for its outputs, which
    evict the least recently used prompts it does not hold. Each (context, stream) prefilled
    is listed once per prefill, so a prompt prefilled twice shows twice."""
    tokens = capacity.tokens
    cache: dict[tuple[int, int, int], int] = {}  # LRU order: oldest first
    prefilled = []
    for cell in order:
        ctx, streams = int(cell["context_tokens"]), int(cell["concurrency"])
        held = [(cell["repeat"], ctx, i) for i in range(streams)]
        for key in held:
            if key in cache:
                cache[key] = cache.pop(key)  # touched: most recently used
            else:
                prefilled.append(key)
                cache[key] = ctx
        room = tokens - streams * int(cell["max_output_tokens"])
        for key in list(cache):
            if sum(cache.values()) <= room:
                break
            if key not in held:
                del cache[key]
    return prefilled


@pytest.mark.parametrize("num_blocks", [4081, 4150, 4224])
def test_run_order_prefills_every_prompt_once(num_blocks):
    """Issue #19's warm-up floor: run in `order`, the reference matrix prefills each distinct
    prompt exactly once, the prefill cells' prompts included (stream 0 of each context is
    prefilled by its prefill cell, cold, and reused by the context's decode cells). Prefill
    cells first and then the decode cells (the order before issue #19) prefilled stream 0 of
    every context but the last prefilled again: its cache holds one large context."""
    capacity = KvCapacity(num_blocks, 64)
    plan = plan_matrix(ref_spec(), capacity)
    assert sorted(map(id, plan.order)) == sorted(map(id, [*plan.prefill, *plan.decode]))
    prefilled = prefills_needed(plan.order, capacity)
    assert len(prefilled) == len(set(prefilled))
    # the distinct prompts: C_max per decode context, plus the 256K prefill's own where it fits
    own = [c for c in plan.prefill if c["context_tokens"] not in REF_CONTEXTS]
    assert len(own) == (num_blocks > 4096)
    assert len(prefilled) == sum(REF_RUNNABLE.values()) + len(own)


def test_run_order_interleaves_prefill_and_decode_per_context():
    plan = plan_matrix(ref_spec(), KvCapacity(4150, 64))
    order = [c["label"] for c in plan.order]
    assert order[:8] == ["256K", "8K", "8K x 1", "8K x 2", "8K x 4", "8K x 8", "8K x 16", "16K"]
    assert order[-4:] == ["128K", "128K x 1", "251K", "251K x 1"]
    # the phase lists keep the run order of their phase
    assert [c["label"] for c in plan.prefill] == ["256K", "8K", "16K", "32K", "64K", "128K", "251K"]
    assert [c["label"] for c in plan.decode][:2] == ["8K x 1", "8K x 2"]
    # the report still reads prefill by context, then decode by context and C
    report = [c["label"] for c in ordered_cells([*plan.decode, *plan.prefill])]
    assert report[:7] == ["8K", "16K", "32K", "64K", "128K", "251K", "256K"]
    assert report[7:9] == ["8K x 1", "8K x 2"]


def test_the_two_mapped_tasks_together_run_the_order():
    """`prefill` maps the prefill cells at the head of the order, `decode` the rest (later
    contexts' prefills labelled as such), so map index order across the two is the order."""
    planned = plan_matrix(ref_spec(), KvCapacity(4150, 64), repeats=2).as_dict()
    pre, dec = task_cells(planned, "prefill"), task_cells(planned, "decode")
    assert [c["label"] for c in pre] == ["256K", "8K"]
    assert [c["label"] for c in dec][:6] == [
        "8K x 1",
        "8K x 2",
        "8K x 4",
        "8K x 8",
        "8K x 16",
        "prefill 16K",
    ]
    strip = [{**c, "label": c["label"].removeprefix("prefill ")} for c in [*pre, *dec]]
    assert strip == planned["order"]
    assert dec[len(planned["order"]) // 2 - 2]["label"] == "prefill 256K #2"  # pass 2 starts
    # a plan made before `order` existed maps each phase's list
    old = {k: v for k, v in planned.items() if k != "order"}
    assert task_cells(old, "decode") == planned["decode"]
    with pytest.raises(ValueError):
        task_cells(planned, "validate")


def test_prefill_that_does_not_fit_is_over_capacity():
    plan = plan_matrix(ref_spec(contexts=[]), KvCapacity(4097, 64))  # 256K + 1 needs 4097
    assert [c["context_label"] for c in plan.over_capacity] == ["256K"]
    assert plan.over_capacity[0]["phase"] == "prefill"
    assert len(plan_matrix(ref_spec(contexts=[]), KvCapacity(4098, 64)).prefill) == 7


def test_capacity_boundaries_flip_the_pattern():
    assert len(plan_matrix(ref_spec(), KvCapacity(4080, 64)).decode) == 15  # 251K x 1 drops
    assert len(plan_matrix(ref_spec(), KvCapacity(4225, 64)).decode) == 17  # 128K x 2 fits


def test_over_capacity_cells_are_full_records_with_reason():
    plan = plan_matrix(ref_spec(), KvCapacity(4150, 64))
    cell = next(
        c for c in plan.over_capacity if c["context_label"] == "8K" and c["concurrency"] == 32
    )
    assert set(cell) == {f.name for f in CELL_FIELDS}
    assert cell["status"] == "over_capacity"
    assert cell["phase"] == "decode"
    assert cell["total_tok_s"] is None
    assert "6144 KV blocks > 4149" in cell["error"]


def test_labels_and_order():
    assert cell_label(64 * K, 16) == "64K x 16"
    assert cell_label(257024, 1) == "251K x 1"
    plan = plan_matrix(
        ref_spec(contexts=[64 * K, 8 * K], concurrencies=[2, 1], prefill_contexts=[16 * K, 8 * K]),
        KvCapacity(4150, 64),
    )
    assert [c["label"] for c in plan.decode] == ["8K x 1", "8K x 2", "64K x 1", "64K x 2"]
    assert [c["label"] for c in plan.prefill] == ["16K", "8K"]  # 16K: no decode cell of it
    assert plan.prefill[0]["max_output_tokens"] == 1
    assert plan.decode[0]["window_s"] == 30.0
    shuffled = [*plan.decode[::-1], *plan.prefill]
    assert [c["phase"] for c in ordered_cells(shuffled)][:2] == ["prefill", "prefill"]


def test_impossible_matrix_names_every_problem():
    spec = ref_spec(concurrencies=[0, 2, 2], max_output_tokens=0, prompt_mode="weird")
    with pytest.raises(PlanError) as err:
        check_matrix(spec)
    text = str(err.value)
    assert "concurrencies must be positive" in text
    assert "duplicates: [2]" in text
    assert "max_output_tokens" in text
    assert "prompt_mode" in text


def test_matrix_longer_than_model_is_rejected():
    check_matrix(ref_spec(), max_model_len=262144)  # 251K + 4096 and a 256K prefill fit
    with pytest.raises(PlanError, match=r"decode contexts \['251K'\].*max_model_len 260000") as err:
        check_matrix(ref_spec(), max_model_len=260000)
    assert "prefill contexts ['256K']" in str(err.value)


def test_empty_matrix_is_rejected():
    with pytest.raises(PlanError, match="empty"):
        check_matrix(ref_spec(prefill_contexts=[], contexts=[]))
    with pytest.raises(PlanError, match="concurrencies is empty"):
        check_matrix(ref_spec(concurrencies=[]))


def test_capacity_must_be_positive():
    with pytest.raises(PlanError):
        KvCapacity(0, 16)


def test_a_context_at_max_model_len_is_sent_so_that_vllm_admits_it():
    """vLLM 0.32 refuses a prompt of max_model_len tokens or more; the published matrices ask
    for a 256K prefill on a 262,144-token server. The plan sends it one token short (the
    output token's room), labelled 256K as published; decode contexts leave max_output room."""
    plan = plan_matrix(
        ref_spec(contexts=[128 * K, 256 * K], concurrencies=[1], max_output_tokens=256),
        KvCapacity(40_000, 16),
        max_model_len=262144,
    )
    prefill = {c["label"]: c["context_tokens"] for c in plan.prefill}
    assert prefill["256K"] == 262143  # + max_tokens 1 = max_model_len
    assert prefill["251K"] == 251 * K  # fits as asked: untouched
    decode = {c["label"]: c["context_tokens"] for c in plan.decode}
    assert decode["256K x 1"] == 262144 - 256
    assert decode["128K x 1"] == 128 * K
    every = [*plan.prefill, *plan.decode]
    assert all(c["context_tokens"] + c["max_output_tokens"] <= 262144 for c in every)


def test_fitting_never_changes_a_label():
    # 256K decode with 4,096 output tokens would go out as 252K: refused, not mislabelled
    with pytest.raises(PlanError, match=r"decode contexts \['256K'\]"):
        check_matrix(ref_spec(contexts=[256 * K]), max_model_len=262144)


def test_repeat_cells_name_a_fitted_context_by_its_label():
    plan = plan_matrix(
        ref_spec(contexts=[8 * K], concurrencies=[1]),
        KvCapacity(40_000, 16),
        max_model_len=262144,
        repeats=2,
        repeat_cells=["prefill 256K"],
    )
    repeats = [c for c in plan.prefill if c["repeat"]]
    assert [(c["label"], c["context_tokens"]) for c in repeats] == [("256K #2", 262143)]


def test_a_published_profile_run_warms_up_globally_before_its_first_cell():
    """Issue #35: the published tool warms the server once, before its first cell, ending
    with a short C=1 decode at the largest context that runs at C=1; the plan puts that on
    the run's first cell only, and every cell carries the run's measurement profile."""
    plan = plan_matrix(ref_spec(measurement_profile="published"), KvCapacity(4150, 64))
    first, *rest = plan.order
    c1 = [c["context_tokens"] for c in plan.decode if c["concurrency"] == 1]
    assert first["global_warmup_context"] == max(c1) == 251 * 1024
    assert not any("global_warmup_context" in c for c in rest)
    assert {c["measurement_profile"] for c in plan.order} == {"published"}
    default = plan_matrix(ref_spec(), KvCapacity(4150, 64))
    assert not any("global_warmup_context" in c for c in default.order)
    assert {c["measurement_profile"] for c in default.order} == {"default"}


def test_a_manual_kv_budget_is_the_capacity_the_rule_uses():
    """Issue #43 item 11: a budget in tokens (a label or a count, from the recipe, the conf or
    --kv-budget) replaces the server's reported blocks, in its block size: the reference
    matrix on a server reporting 64 blocks (nothing runs) with a budget of 4,100 blocks of 64
    tokens is the reference page's pattern; a recipe's matrix and the run's conf read it with
    the one context rule, and a bad one is named."""
    from speedmatrix.flows.runconf import conf_problems
    from speedmatrix.plan import kv_capacity
    from speedmatrix.recipes import Matrix

    tiny = KvCapacity(64, 64)
    assert kv_capacity(ref_spec(), tiny) is tiny
    spec = ref_spec(kv_budget=4100 * 64)
    assert kv_capacity(spec, tiny) == KvCapacity(4100, 64)
    runnable = {}
    for c in plan_matrix(spec, tiny).decode:
        runnable[c["context_tokens"]] = max(runnable.get(c["context_tokens"], 0), c["concurrency"])
    assert runnable == REF_RUNNABLE
    assert not plan_matrix(ref_spec(), tiny).decode
    assert ref_spec(kv_budget="960K").kv_budget == 960 * K
    assert Matrix(kv_budget="960K").kv_budget == 960 * K
    assert conf_problems({"kv_budget": "960K"}) == []
    assert any("kv_budget" in p for p in conf_problems({"kv_budget": [1]}))


def _burst_spec(**kw):
    values = dict(
        prefill_contexts=[8192],
        contexts=[8192, 16384],
        concurrencies=[1, 2],
        max_output_tokens=512,
        window_s=2,
        burst=[2, 4],
    )
    return MatrixSpec.build(**{**values, **kw})


def test_burst_cells_follow_each_contexts_decode_cells_and_the_capacity_rule():
    """Issue #43 item 12: a burst of N requests at once is a cell of its own (phase burst) per
    decode context and N, run after that context's decode cells (its prompts are theirs,
    already cached), by the decode task; over capacity by the same KV-block rule."""
    # 2,199 usable blocks: 8K x 4 needs 4 x 544 = 2,176, 16K x 2 2 x 1,056 = 2,112 (both
    # fit); 16K x 4 needs 4,224 (over)
    plan = plan_matrix(_burst_spec(), KvCapacity(2200, 16))
    order = [(c["phase"], c["context_tokens"], c["concurrency"]) for c in plan.order]
    assert order == [
        ("prefill", 8192, 1),
        ("decode", 8192, 1),
        ("decode", 8192, 2),
        ("burst", 8192, 2),
        ("burst", 8192, 4),
        ("decode", 16384, 1),
        ("decode", 16384, 2),
        ("burst", 16384, 2),
    ]
    burst = [c for c in plan.order if c["phase"] == "burst"]
    assert [c["label"] for c in burst] == ["burst 8K x 2", "burst 8K x 4", "burst 16K x 2"]
    assert all(c["window_s"] is None and c["max_output_tokens"] == 512 for c in burst)
    assert all(c["prompt_mode"] == "distinct" for c in burst)
    # the decode task runs them (the DAG's two mapped tasks stay)
    assert [c["phase"] for c in task_cells(plan.as_dict(), "decode")].count("burst") == 3
    over = [(c["phase"], c["context_tokens"], c["concurrency"]) for c in plan.over_capacity]
    assert over == [("burst", 16384, 4)]
    assert plan.over_capacity[0]["window_s"] is None
    assert "4 x ceil((16384 + 512) / 16) = 4224 KV blocks > 2199" in plan.over_capacity[0]["error"]
    # without burst sizes, no burst cells
    none = plan_matrix(_burst_spec(burst=[]), KvCapacity(2200, 16))
    assert not any(c["phase"] == "burst" for c in [*none.order, *none.over_capacity])


def test_burst_sizes_are_checked_with_the_matrix():
    problems = matrix_problems(_burst_spec(burst=[0, 2, 2]))
    assert "burst must be positive, got [0]" in problems
    assert "burst has duplicates: [2]" in problems
    assert "burst sizes need decode contexts" in "; ".join(
        matrix_problems(_burst_spec(contexts=[], concurrencies=[]))
    )
    assert matrix_problems(_burst_spec()) == []


def test_a_burst_cell_can_be_repeated_by_name():
    spec = _burst_spec()
    assert repeat_keys(spec, ["burst 8Kx4", "8Kx2"]) == [("decode", 8192, 2), ("burst", 8192, 4)]
    with pytest.raises(PlanError, match="'burst 8Kx8' names no cell"):
        repeat_keys(spec, ["burst 8Kx8"])
