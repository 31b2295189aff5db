"""Which cells a matrix run measures, and which it records as over capacity without running.

Pure functions over plain values (no Airflow, no I/O) so that the capacity rule, the labels that
become Airflow map indexes and the "impossible matrix" checks are tested in microseconds, and so
that `resolve` can reject a bad conf before anything touches a host.

The capacity rule (docs/measurement.md): vLLM allocates KV cache in whole blocks and keeps one block
back, so C requests of ctx + max_out tokens fit only when
``C x ceil((ctx + max_out) / block_size) <= num_blocks - 1``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from speedmatrix.errors import InputError
from speedmatrix.records import (
    DEFAULT_MEASUREMENT_PROFILE,
    DEFAULT_WORKLOAD,
    MEASUREMENT_PROFILES,
    PROMPT_MODES,
    WORKLOADS,
    cell_name,
    cell_sort_key,
    context_label,
    empty_cell,
    parse_cell,
    parse_concurrency,
    parse_context,
)

MAX_REPEATS = 10
"""Upper bound of the `repeats` option: each pass costs a whole matrix's worth of windows."""


MAX_CELLS = 256
"""The most cells one run may measure (prefill contexts + contexts x concurrencies). The largest
published matrix has 55 (7 prefills, 6 contexts x 8 concurrencies); each cell costs a window of
tens of seconds and a task, so 4,999 levels is a mistake, not a plan."""
MAX_CONCURRENCY = 4096
"""The most requests in flight one cell may ask for: 16x vLLM's default max_num_seqs (256) and
far past the published pages' 128; a load generator of 10^15 streams would never start."""
MAX_CONTEXT_TOKENS = 16 * 1024 * 1024
"""The longest context (tokens) a cell may ask for: 16M, past every served model's length."""


class PlanError(InputError):
    """The requested matrix cannot be run (empty, non-positive, longer than the model allows)."""


@dataclass(frozen=True)
class KvCapacity:
    """The server's KV cache, as read from `vllm:cache_config_info` (or the start-up log)."""

    num_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise PlanError(f"KV capacity must be positive, got {self}")

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size


def _tokens(value: int | str, name: str) -> int:
    """`records.parse_context`, its error as a PlanError (the matrix's fault) naming the list."""
    try:
        return parse_context(value)
    except ValueError as exc:
        raise PlanError(f"{name}: {exc}") from None


def _count(value: int | str, name: str = "concurrencies") -> int:
    """`records.parse_concurrency`, its error as a PlanError (the matrix's fault)."""
    try:
        return parse_concurrency(value)
    except ValueError as exc:
        raise PlanError(f"{name}: {exc}") from None


def cell_label(context_tokens: int, concurrency: int) -> str:
    """`64K x 16`: the readable Airflow map index of a decode cell."""
    return f"{context_label(context_tokens)} x {concurrency}"


def blocks_needed(context_tokens: int, max_output_tokens: int, block_size: int) -> int:
    """Whole KV blocks one request of this context and output length occupies at its end."""
    return math.ceil((context_tokens + max_output_tokens) / block_size)


def fits(
    context_tokens: int, concurrency: int, max_output_tokens: int, capacity: KvCapacity
) -> bool:
    """True when C requests of ctx + max_out fit in the KV cache (one block kept back)."""
    need = concurrency * blocks_needed(context_tokens, max_output_tokens, capacity.block_size)
    return need <= capacity.num_blocks - 1


ADAPTIVE_MIN_S = 5.0
"""An adaptive decode window's least length by default (seconds): ten checkpoint batches of
half a second, long enough for a batch-means interval (loadgen/adaptive.py). Measured on the
reference twin's 8K-64K matrix (benchmarks/README.md, adaptive windows): with 5 s the whole
matrix held the host 42% of the fixed 30 s windows' time, every decode rate within 0.4% of
the fixed window's; with 10 s, 55%."""

ADAPTIVE_TARGET_PCT = 1.0
"""An adaptive window's target half-width (%) when none is derived (adaptive_target_pct)."""


def adaptive_target_pct(regression_threshold_pct: float) -> float:
    """How tight an adaptive window's throughput interval must be: a third of the smallest
    change the verdict calls (the recipe's regression threshold). Independent errors add in
    quadrature, so the window's own interval then widens a comparison's by at most
    sqrt(1 + 1/9) - 1 = 5%, below what the noise model can tell apart; a tighter window costs
    host time and buys the verdict nothing. Floored at 0.25% (a threshold of 0 would never
    stop: the window runs to its cap)."""
    return max(0.25, float(regression_threshold_pct) / 3.0)


@dataclass(frozen=True)
class MatrixSpec:
    """The matrix a run asks for, after conf overrides; checked by `check_matrix`."""

    prefill_contexts: tuple[int, ...]
    contexts: tuple[int, ...]
    concurrencies: tuple[int, ...]
    max_output_tokens: int
    window_s: float
    prompt_mode: str = "distinct"
    workload: str = DEFAULT_WORKLOAD
    # whose definitions measure the run (records.MEASUREMENT_PROFILES)
    measurement_profile: str = DEFAULT_MEASUREMENT_PROFILE
    # adaptive windows (loadgen/adaptive.py): window_s is each decode window's cap, and a
    # window may stop after adaptive_min_s (at most window_s) once its figures are tight
    adaptive: bool = False
    adaptive_min_s: float = ADAPTIVE_MIN_S
    adaptive_target_pct: float = ADAPTIVE_TARGET_PCT
    # a manual KV cache size in tokens, in place of what the server reports, for servers whose
    # /metrics cannot tell their real capacity (context parallelism, DCP): `kv_capacity`
    kv_budget: int | None = None
    # burst sizes (loadgen/burst.py): for each decode context and each N here, a burst cell of
    # N requests sent at once and measured to completion; empty: none
    burst: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        *,
        prefill_contexts: Iterable[int | str],
        contexts: Iterable[int | str],
        concurrencies: Iterable[int | str],
        max_output_tokens: int,
        window_s: float,
        prompt_mode: str = "distinct",
        workload: str = DEFAULT_WORKLOAD,
        measurement_profile: str = DEFAULT_MEASUREMENT_PROFILE,
        adaptive: bool = False,
        adaptive_min_s: float = ADAPTIVE_MIN_S,
        adaptive_target_pct: float = ADAPTIVE_TARGET_PCT,
        kv_budget: int | str | None = None,
        burst: Iterable[int | str] = (),
    ) -> MatrixSpec:
        return cls(
            prefill_contexts=tuple(_tokens(c, "prefill_contexts") for c in prefill_contexts),
            contexts=tuple(_tokens(c, "contexts") for c in contexts),
            concurrencies=tuple(_count(c) for c in concurrencies),
            max_output_tokens=int(max_output_tokens),
            window_s=float(window_s),
            prompt_mode=prompt_mode,
            workload=workload,
            measurement_profile=measurement_profile,
            adaptive=bool(adaptive),
            adaptive_min_s=float(adaptive_min_s),
            adaptive_target_pct=float(adaptive_target_pct),
            kv_budget=None if kv_budget is None else _tokens(kv_budget, "kv_budget"),
            burst=tuple(_count(n, "burst") for n in burst),
        )


def kv_capacity(spec: MatrixSpec, reported: KvCapacity) -> KvCapacity:
    """The capacity the over-capacity rule uses: the run's manual budget (tokens, in the
    server's block size, as many whole blocks as it holds) when it has one, else the server's
    own. Why: a server sharding its KV cache (context parallelism, DCP) reports one rank's
    blocks, so its real capacity is only known to the person who launched it."""
    if spec.kv_budget is None:
        return reported
    return KvCapacity(max(spec.kv_budget // reported.block_size, 1), reported.block_size)


def matrix_size_problems(spec: MatrixSpec) -> list[str]:
    """The bounds of a matrix (cells per run, each value), as readable sentences: the one rule
    for a conf, `speedmatrix run` and a recipe alike."""
    problems: list[str] = []
    cells = len(spec.prefill_contexts) + len(spec.contexts) * (
        len(spec.concurrencies) + len(spec.burst)
    )
    if cells > MAX_CELLS:
        bursts = f" + {len(spec.burst)} burst sizes" if spec.burst else ""
        problems.append(
            f"{cells} cells ({len(spec.prefill_contexts)} prefill + {len(spec.contexts)} "
            f"contexts x ({len(spec.concurrencies)} concurrencies{bursts})): a run measures "
            f"at most {MAX_CELLS} cells"
        )
    for name, values, most in (
        ("prefill_contexts", spec.prefill_contexts, MAX_CONTEXT_TOKENS),
        ("contexts", spec.contexts, MAX_CONTEXT_TOKENS),
        ("concurrencies", spec.concurrencies, MAX_CONCURRENCY),
        ("burst", spec.burst, MAX_CONCURRENCY),
    ):
        big = [v for v in values if v > most]
        if big:
            problems.append(f"{name} must be at most {most}, got {big[:10]}")
    return problems


def matrix_problems(spec: MatrixSpec, max_model_len: int | None = None) -> list[str]:
    """Every reason this matrix cannot run, as readable sentences (empty list: it can)."""
    problems: list[str] = []
    if not spec.contexts and not spec.prefill_contexts:
        problems.append("the matrix is empty: no contexts and no prefill_contexts")
    if spec.contexts and not spec.concurrencies:
        problems.append("contexts are given but concurrencies is empty")
    if spec.burst and not spec.contexts:
        problems.append("burst sizes need decode contexts: a burst is run at each of them")
    problems += matrix_size_problems(spec)
    for name, values in (
        ("prefill_contexts", spec.prefill_contexts),
        ("contexts", spec.contexts),
        ("concurrencies", spec.concurrencies),
        ("burst", spec.burst),
    ):
        bad = [v for v in values if v < 1]
        if bad:
            problems.append(f"{name} must be positive, got {bad[:10]}")
        dupes = sorted(v for v, n in Counter(values).items() if n > 1)
        if dupes:
            problems.append(f"{name} has duplicates: {dupes[:10]}")
    if spec.kv_budget is not None and spec.kv_budget < 1:
        problems.append(f"kv_budget must be positive, got {spec.kv_budget}")
    if spec.max_output_tokens < 1:
        problems.append(f"max_output_tokens must be >= 1, got {spec.max_output_tokens}")
    if spec.contexts and spec.window_s <= 0:
        problems.append(f"window_s must be > 0, got {spec.window_s:g}")
    if spec.prompt_mode not in PROMPT_MODES:
        problems.append(
            f"prompt_mode must be one of {list(PROMPT_MODES)}, got {spec.prompt_mode!r}"
        )
    if spec.workload not in WORKLOADS:
        problems.append(f"workload must be one of {list(WORKLOADS)}, got {spec.workload!r}")
    if spec.measurement_profile not in MEASUREMENT_PROFILES:
        problems.append(
            f"measurement profile must be one of {list(MEASUREMENT_PROFILES)}, "
            f"got {spec.measurement_profile!r}"
        )
    if spec.burst and spec.measurement_profile == "published":
        problems.append(
            "burst cells are measured by our definitions only (profile default), not the "
            "published profile"
        )
    if spec.adaptive and spec.measurement_profile == "published":
        problems.append("adaptive windows are not the published tool's: its windows are fixed")
    if spec.adaptive and not spec.adaptive_min_s > 0:
        problems.append(f"adaptive_min_s must be > 0, got {spec.adaptive_min_s:g}")
    if max_model_len:
        out = spec.max_output_tokens
        too_long = [c for c in spec.contexts if not fits_model(c, out, max_model_len)]
        if too_long:
            problems.append(
                f"decode contexts {[context_label(c) for c in too_long]} + max_output_tokens "
                f"{out} exceed the model's max_model_len {max_model_len}"
            )
        too_long = [c for c in spec.prefill_contexts if not fits_model(c, 1, max_model_len)]
        if too_long:
            problems.append(
                f"prefill contexts {[context_label(c) for c in too_long]} exceed the model's "
                f"max_model_len {max_model_len}"
            )
    return problems


def sent_context(context: int, max_tokens: int, max_model_len: int | None) -> int:
    """The prompt length a cell sends for `context` when it asks for `max_tokens` output tokens.

    vLLM (0.32, `InputProcessor._validate_prompt_len` and `TokenizeParams._token_len_check`)
    refuses a prompt of max_model_len tokens or more with a 400, and silently shortens the
    output of a shorter prompt to max_model_len - prompt. So a prefill at the model's full
    length (256K = 262,144 on a 262,144 server) is always refused, and a decode context whose
    prompt + max_output_tokens passes max_model_len would end its requests early. Such a
    context is sent as max_model_len - max_tokens tokens: it keeps its label (labels round to
    the nearest K, see `context_label`; `matrix_problems` refuses a context that would not),
    and its record holds the exact count the server confirmed. The published tool did the
    same in its own way: its 256K prompt was 257.5K tokens (3,253 tok/s x 79.160 s)."""
    if not max_model_len:
        return context
    return min(context, max_model_len - max_tokens)


def fits_model(context: int, max_tokens: int, max_model_len: int) -> bool:
    """Can `context` be sent under its label (`sent_context`) with max_tokens of output?"""
    sent = sent_context(context, max_tokens, max_model_len)
    return sent >= 1 and context_label(sent) == context_label(context)


def fit_matrix(spec: MatrixSpec, max_model_len: int | None) -> MatrixSpec:
    """The matrix as it is sent: every context through `sent_context` (prefill with its one
    output token, decode with max_output_tokens). The one place a context is fitted."""
    return replace(
        spec,
        prefill_contexts=tuple(sent_context(c, 1, max_model_len) for c in spec.prefill_contexts),
        contexts=tuple(
            sent_context(c, spec.max_output_tokens, max_model_len) for c in spec.contexts
        ),
    )


def check_matrix(spec: MatrixSpec, max_model_len: int | None = None) -> None:
    """Raise PlanError naming every problem at once (a conf is fixed in one go, not five)."""
    problems = matrix_problems(spec, max_model_len)
    if problems:
        raise PlanError("impossible matrix: " + "; ".join(problems))


@dataclass
class Plan:
    """Planned cells: small dicts (XCom- and map-friendly) plus the over-capacity records.

    `prefill` are the prefill cells, `decode` the sustained-decode and burst cells (a burst
    is a decode-side cell: its own phase, run by the `decode` task); `order` is every cell to
    run, in the order the host runs them (`run_order`), which the DAG's two mapped tasks
    split between them (`task_cells`)."""

    prefill: list[dict] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    over_capacity: list[dict] = field(default_factory=list)
    order: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[dict]]:
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "over_capacity": self.over_capacity,
            "order": self.order,
        }


def _planned(spec: MatrixSpec, phase: str, context: int, concurrency: int) -> dict:
    label = context_label(context) if phase == "prefill" else cell_label(context, concurrency)
    return {
        "phase": phase,
        "context_tokens": context,
        "concurrency": concurrency,
        "label": f"burst {label}" if phase == "burst" else label,
        "max_output_tokens": 1 if phase == "prefill" else spec.max_output_tokens,
        "window_s": spec.window_s if phase == "decode" else None,
        "prompt_mode": None if phase == "prefill" else spec.prompt_mode,
        "workload": spec.workload,
        "measurement_profile": spec.measurement_profile,
        "repeat": 0,
        **(_adaptive(spec) if phase == "decode" and spec.adaptive else {}),
    }


def _adaptive(spec: MatrixSpec) -> dict[str, object]:
    """An adaptive decode cell's settings: its minimum, never past its cap."""
    return {
        "adaptive": True,
        "adaptive_min_s": min(spec.adaptive_min_s, spec.window_s),
        "adaptive_target_pct": spec.adaptive_target_pct,
    }


def check_repeats(repeats: object) -> int:
    """`repeats` as an int in 1..MAX_REPEATS (None -> 1); PlanError otherwise."""
    if repeats is None:
        return 1
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise PlanError(f"repeats must be an integer 1..{MAX_REPEATS}, got {repeats!r}")
    if not 1 <= repeats <= MAX_REPEATS:
        raise PlanError(f"repeats must be 1..{MAX_REPEATS}, got {repeats}")
    return repeats


def repeat_keys(
    spec: MatrixSpec, repeat_cells: Sequence[str] | None
) -> list[tuple[str, int, int]] | None:
    """The cells of the matrix that `repeat_cells` names, as (phase, context_tokens,
    concurrency) in report order, without duplicates; None (every cell) when it is None.

    Checked against the matrix the run asks for, so a typo fails in `resolve` before a host is
    touched; whether a named cell fits the server's KV cache is only known at plan time."""
    if repeat_cells is None:
        return None
    if isinstance(repeat_cells, str) or not repeat_cells:
        raise PlanError(
            "repeat_cells must be a non-empty list of cells such as ['64Kx16', 'prefill 64K'] "
            "(null repeats every cell)"
        )
    keys: set[tuple[str, int, int]] = set()
    problems: list[str] = []
    for name in repeat_cells:
        try:
            phase, label, conc = parse_cell(name)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if phase == "prefill":
            hits = [c for c in spec.prefill_contexts if context_label(c) == label]
        else:
            sizes = spec.burst if phase == "burst" else spec.concurrencies
            hits = [c for c in spec.contexts if context_label(c) == label]
            hits = hits if conc in sizes else []
        if hits:
            keys.add((phase, hits[0], conc))
        else:
            problems.append(f"{name!r} names no cell of the matrix")
    if problems:
        matrix = (
            f"decode {[context_label(c) for c in spec.contexts]} x {list(spec.concurrencies)}, "
            f"prefill {[context_label(c) for c in spec.prefill_contexts]}"
        )
        raise PlanError("repeat_cells: " + "; ".join(problems) + f" (the matrix: {matrix})")
    return sorted(keys, key=cell_sort_key)


def _repeat(cell: dict, repeat: int) -> dict:
    return {**cell, "repeat": repeat, "label": f"{cell['label']} #{repeat + 1}"}


def plan_matrix(
    spec: MatrixSpec,
    capacity: KvCapacity,
    max_model_len: int | None = None,
    *,
    repeats: int = 1,
    repeat_cells: Sequence[str] | None = None,
) -> Plan:
    """Prefill cells, runnable decode cells and the over-capacity cells as full records with
    status `over_capacity` (never sent), and `order`: every cell to run, in the order the host
    runs them (map index order under the scheduler, see `task_cells`; the report sorts for
    itself, see `ordered_cells`).

    The order puts warm-up at its floor: every distinct prompt prefilled once per
    pass. A decode cell pays, before its window, the prefill of each of its C prompts that is
    not already in the prefix cache (at 251K one prompt is 76 s on the reference host). Stream
    i's prompt is the same bytes in every cell of a context (prompts.header_text: run tag,
    context, stream; the same cache salt), and the prefill cell's prompt is stream 0's. So
    the cells run context by context (`run_order`): the context's prefill cell (cold, its
    measurement), then its decode cells C ascending, each reusing the previous cell's prompts
    and the prefill's, so a context's C_max prompts are prefilled once, one of them as the
    prefill cell. A cache that holds one large context keeps nothing longer than that, which
    is why prefill and decode interleave instead of all prefills first. Prefill contexts with
    no decode cell of the same sent prompt (256K beside a 251K decode) run first: their
    prompt serves no other cell.

    With `repeats` > 1 `order` continues with passes 1..repeats-1, each the chosen cells
    (`repeat_cells`, default all runnable ones) again in the same order, and so do the phase
    lists: a repeat is measured a whole pass after its primary rather than back to back, so
    the spread between them sees the drift of the run (warm-up, clocks, heat) that a
    between-run noise is for. Every planned cell carries `repeat` (0 = the primary, the one
    the `cells` table holds); a pass has its own run tag (flows.matrix.pass_run_tag), so its
    prompts are prefilled again, once.

    Contexts are planned as sent (`fit_matrix`): `context_tokens` of a planned cell is the
    prompt the load generator builds, which vLLM admits with the cell's max_tokens."""
    check_matrix(spec, max_model_len)
    capacity = kv_capacity(spec, capacity)
    repeats = check_repeats(repeats)
    chosen = repeat_keys(spec, repeat_cells)
    if chosen is not None:
        out = {"prefill": 1, "decode": spec.max_output_tokens, "burst": spec.max_output_tokens}
        chosen = [(ph, sent_context(c, out[ph], max_model_len), n) for ph, c, n in chosen]
    spec = fit_matrix(spec, max_model_len)
    plan = Plan()
    runnable = [
        (ctx, conc)
        for ctx in sorted(spec.contexts)
        for conc in sorted(spec.concurrencies)
        if fits(ctx, conc, spec.max_output_tokens, capacity)
    ]
    for ctx in sorted(spec.prefill_contexts):
        if fits(ctx, 1, 1, capacity):
            plan.prefill.append(_planned(spec, "prefill", ctx, 1))
        else:
            plan.over_capacity.append(_over_capacity(spec, "prefill", ctx, 1, capacity))
    plan.decode = [_planned(spec, "decode", ctx, conc) for ctx, conc in runnable]
    for ctx in sorted(spec.contexts):
        for conc in sorted(spec.concurrencies):
            if (ctx, conc) not in runnable:
                plan.over_capacity.append(_over_capacity(spec, "decode", ctx, conc, capacity))
    for ctx in sorted(spec.contexts):  # a burst holds its N requests' KV at once, as C streams
        for n in sorted(spec.burst):
            if fits(ctx, n, spec.max_output_tokens, capacity):
                plan.decode.append(_planned(spec, "burst", ctx, n))
            else:
                plan.over_capacity.append(_over_capacity(spec, "burst", ctx, n, capacity))
    plan.order = run_order(plan.prefill, plan.decode)
    if spec.measurement_profile == "published" and plan.order:
        # the published tool's global warm-up (a short request, a hidden 8K prefill, a short
        # C=1 decode at the largest runnable context) goes before the run's first cell
        c1 = [int(c["context_tokens"]) for c in plan.decode if int(c["concurrency"]) == 1]
        largest = max(c1 or [int(c["context_tokens"]) for c in plan.order])
        plan.order[0]["global_warmup_context"] = largest
    plan.prefill = [c for c in plan.order if c["phase"] == "prefill"]
    plan.decode = [c for c in plan.order if c["phase"] != "prefill"]
    if repeats > 1:
        _add_repeats(plan, repeats, chosen)
    return plan


def run_order(prefill: Sequence[dict], decode: Sequence[dict]) -> list[dict]:
    """Prefill, decode and burst cells of one pass in the order that prefills each prompt once.

    First the prefill cells whose prompt no decode cell sends (their context has no runnable
    decode cell); then, context by context (ascending), the context's prefill cell, then its
    decode cells C ascending, then its burst cells N ascending (`plan_matrix` says why: a
    burst's request i sends the prompt of the decode cells' stream i)."""
    decode_contexts = sorted({int(c["context_tokens"]) for c in decode})
    by_context: dict[int, list[dict]] = {}
    for c in prefill:
        by_context.setdefault(int(c["context_tokens"]), []).append(c)
    order = [c for ctx in sorted(by_context) if ctx not in decode_contexts for c in by_context[ctx]]
    for ctx in decode_contexts:
        order += by_context.get(ctx, [])
        order += sorted(
            (c for c in decode if int(c["context_tokens"]) == ctx),
            key=lambda c: (c["phase"] == "burst", int(c["concurrency"])),
        )
    return order


def task_cells(planned: Mapping[str, Sequence[dict]], task: str) -> list[dict]:
    """The cells the DAG's mapped `prefill` or `decode` task runs, in map index order.

    The scheduler starts a mapped task's instances in map index order, the host measures one
    cell at a time (a host holds one run), and `decode` runs beside `prefill`, its first
    instance waiting for prefill's last cell (flows/turn.py), so the two lists together must
    be `order`: `prefill` takes the prefill cells at its head, `decode` all the
    rest, including the prefill cells of later contexts, labelled `prefill 16K` so that their
    map index says what they are. Both task ids stay (the DAG's contract); a plan without
    `order` (made before it existed) maps each phase's list as before."""
    if task not in ("prefill", "decode"):
        raise ValueError(f"no mapped cell task {task!r}")
    order = planned.get("order")
    if order is None:
        return list(planned[task])
    head = 0
    while head < len(order) and order[head]["phase"] == "prefill":
        head += 1
    if task == "prefill":
        return list(order[:head])
    return [
        {**c, "label": f"prefill {c['label']}"} if c["phase"] == "prefill" else c
        for c in order[head:]
    ]


def _add_repeats(plan: Plan, repeats: int, chosen: list[tuple[str, int, int]] | None) -> None:
    def key(c: dict) -> tuple[str, int, int]:
        return (c["phase"], c["context_tokens"], c["concurrency"])

    if chosen is not None:
        runnable = {key(c) for c in (*plan.prefill, *plan.decode)}
        over = [k for k in chosen if k not in runnable]
        if over:
            raise PlanError(
                f"repeat_cells: {', '.join(cell_name(*k) for k in over)} "
                f"{'is' if len(over) == 1 else 'are'} over capacity on this server (not run), "
                "so cannot be repeated"
            )
    picked = [c for c in plan.order if chosen is None or key(c) in chosen]
    passes = [_repeat(c, r) for r in range(1, repeats) for c in picked]
    plan.order.extend(passes)
    plan.prefill.extend(c for c in passes if c["phase"] == "prefill")
    plan.decode.extend(c for c in passes if c["phase"] != "prefill")


def _over_capacity(
    spec: MatrixSpec, phase: str, ctx: int, conc: int, capacity: KvCapacity
) -> dict[str, object]:
    out = 1 if phase == "prefill" else spec.max_output_tokens
    need = conc * blocks_needed(ctx, out, capacity.block_size)
    return empty_cell(
        phase=phase,
        context_tokens=ctx,
        context_label=context_label(ctx),
        concurrency=conc,
        status="over_capacity",
        error=(
            f"not run: {conc} x ceil(({ctx} + {out}) / {capacity.block_size}) = {need} KV blocks "
            f"> {capacity.num_blocks - 1} available"
        ),
        prompt_mode=None if phase == "prefill" else spec.prompt_mode,
        workload=spec.workload,
        measurement_profile=spec.measurement_profile,
        max_output_tokens=out,
        window_s=spec.window_s if phase == "decode" else None,
    )


def ordered_cells(cells: Sequence[dict]) -> list[dict]:
    """Cell records in the report's order (`records.cell_sort_key`)."""
    return sorted(cells, key=cell_sort_key)
