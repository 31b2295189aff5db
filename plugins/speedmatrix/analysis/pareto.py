"""The Pareto view of a model: which configuration serves N users at M
tok/s each with the most throughput per GPU.

Every decode cell of a series (a recipe on its hardware and host, or one engine commit of it)
is a point: x = per-request tok/s (what one user sees), y = total tok/s per GPU (what the
hardware yields; gpu_count from the run, as its recipe declared it). A point is on the
frontier when no other point of the same context is at least as good on both axes and better
on one. Contexts are never mixed: a 256K cell is slower than an 8K one by nature, so the view
is one frontier per context length.

Points and frontier are computed here; report.pareto draws and lays them out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from speedmatrix.analysis.cost import Prices, cost_per_million
from speedmatrix.commits import shown_commit
from speedmatrix.records import cell_name, parse_context


def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


@dataclass(frozen=True)
class Series:
    """One line of the view: the run it is drawn from and how it is named."""

    key: str
    label: str
    run: Mapping[str, Any]


@dataclass
class Point:
    series: str
    run_id: str
    context_label: str
    context_tokens: int
    concurrency: int
    per_request_tok_s: float
    tok_s_per_gpu: float
    total_tok_s: float
    gpu_count: int
    cost_per_m: float | None = None
    frontier: bool = False

    @property
    def cell(self) -> str:
        return cell_name("decode", self.context_label, self.concurrency)


def model_of(run: Mapping[str, Any]) -> str | None:
    """The model a run served, as the view groups runs: the model id, else its served name."""
    for key in ("model", "served_model"):
        value = run.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _under_served_name(run: Mapping[str, Any]) -> str | None:
    """The served name a run recorded as its model (a `run --base-url` landed before it read
    the model id from the server: model = served_model), else None."""
    model, served = run.get("model"), run.get("served_model")
    if isinstance(served, str) and served and model in (None, "", served):
        return served
    return None


def model_ids(runs: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Served name -> model id, as the warehouse tells it: from the runs that recorded both
    (a recipe run, or a `run --base-url` since it reads /v1/models' root). A served name
    recorded under two model ids names neither: it is left out, never guessed."""
    seen: dict[str, set[str]] = {}
    for r in runs:
        model, served = r.get("model"), r.get("served_model")
        if isinstance(model, str) and model and isinstance(served, str) and served != model:
            seen.setdefault(served, set()).add(model)
    return {served: next(iter(ids)) for served, ids in seen.items() if len(ids) == 1}


def with_model_ids(
    runs: Iterable[Mapping[str, Any]], ids: Mapping[str, str] | None = None
) -> list[Mapping[str, Any]]:
    """The runs, each one landed under its served name given its model id where `ids`
    (default: :func:`model_ids` of these runs) names it, so the views (the site's, the Pareto
    view, ``report --versus``) group a run landed before the fix with its model's other runs.
    Only the copy the views read changes: the warehouse's rows keep what was recorded."""
    runs = list(runs)
    ids = model_ids(runs) if ids is None else ids
    out: list[Mapping[str, Any]] = []
    for r in runs:
        served = _under_served_name(r)
        out.append({**r, "model": ids[served]} if served in ids else r)
    return out


def gpu_text(run: Mapping[str, Any]) -> str:
    gpu = run.get("hardware_gpu") or "hardware not known"
    count = _num(run.get("hardware_gpu_count"))
    return f"{gpu} ×{int(count)}" if count else str(gpu)


def choose_series(
    runs: Iterable[Mapping[str, Any]], model: str, *, by_commit: bool = False
) -> list[Series]:
    """The series of `model`: for each recipe x host its latest successful run, or with
    `by_commit` the latest successful run of each engine commit of it; in recipe order."""
    latest: dict[tuple, Mapping[str, Any]] = {}
    for r in runs:
        if r.get("status") != "success" or model_of(r) != model:
            continue
        commit = str(r.get("engine_commit") or r.get("engine_version") or "")
        key = (str(r.get("recipe_id") or ""), str(r.get("host") or ""))
        if by_commit:
            key = (*key, commit)
        prev = latest.get(key)
        if prev is None or str(r.get("started_at")) >= str(prev.get("started_at")):
            latest[key] = r
    out = []
    for key in sorted(latest):
        r = latest[key]
        label = f"{key[0] or 'no recipe'} · {gpu_text(r)}"
        if key[1] not in ("", "local"):
            label += f" @ {key[1]}"
        if by_commit:
            label += f" · {shown_commit(key[2]) or key[2][:12] or 'unknown commit'}"
        out.append(Series(key="|".join(key), label=label, run=r))
    return out


def points_of(
    series: Series, cells: Iterable[Mapping[str, Any]], prices: Prices | None = None
) -> list[Point]:
    """The valid decode cells of the series' run as points; none without a GPU count (tok/s
    per GPU would be made up)."""
    gpus = _num(series.run.get("hardware_gpu_count"))
    if not gpus or gpus <= 0:
        return []
    price = prices.for_run(series.run) if prices is not None else None
    out = []
    for c in cells:
        if c.get("phase") != "decode" or c.get("status") != "valid":
            continue
        total, per = _num(c.get("total_tok_s")), _num(c.get("per_request_tok_s"))
        if total is None or per is None or total <= 0 or per <= 0:
            continue
        label = str(c.get("context_label") or "")
        tokens = int(c.get("context_tokens") or parse_context(label))
        out.append(
            Point(
                series=series.key,
                run_id=str(series.run.get("run_id")),
                context_label=label,
                context_tokens=tokens,
                concurrency=int(c.get("concurrency") or 0),
                per_request_tok_s=per,
                tok_s_per_gpu=total / gpus,
                total_tok_s=total,
                gpu_count=int(gpus),
                cost_per_m=cost_per_million(total, gpus, price),
            )
        )
    return out


def mark_frontier(points: Sequence[Point]) -> list[Point]:
    """Set `frontier` on the points no other point of their context dominates; returns each
    context's frontier, by per-request tok/s ascending (the order a line joins them)."""
    out: list[Point] = []
    for label in contexts(points):
        group = [p for p in points if p.context_label == label]
        for p in group:
            p.frontier = not any(
                q is not p
                and q.per_request_tok_s >= p.per_request_tok_s
                and q.tok_s_per_gpu >= p.tok_s_per_gpu
                and (q.per_request_tok_s > p.per_request_tok_s or q.tok_s_per_gpu > p.tok_s_per_gpu)
                for q in group
            )
        out += sorted((p for p in group if p.frontier), key=lambda p: p.per_request_tok_s)
    return out


def contexts(points: Iterable[Point]) -> list[str]:
    """The context labels of `points`, shortest first."""
    seen: dict[str, int] = {}
    for p in points:
        seen.setdefault(p.context_label, p.context_tokens)
    return sorted(seen, key=lambda k: seen[k])
