"""Fit a simulator profile to a published Speed test matrix report.

The report is parsed with the ingest code (``speedmatrix.report.parse``). Then:

- KV capacity: the statuses pin it down. A valid decode cell needs C x ceil((ctx+max_out)/block)
  <= blocks - 1, an over-capacity cell needs more; vLLM also refuses to start unless one
  max-model-len sequence fits. The profile takes the middle of the feasible interval (an error
  when the statuses contradict each other). The block size is not in the report: 16 (vLLM's
  default) unless told otherwise.
- Decode: a physical model, step = base + per_seq x (B - 1) + per_kv_token x (KV tokens held),
  fitted by least squares on relative error, then a correction factor per published cell
  (interpolated between cells in log2 space) so that every cell matches.
- First-token latency: the published TTFT of a decode cell (prompt cached) minus what the
  engine needs for the first step becomes the front end's delay at (context, requests held).
- Prefill: the cumulative prefill time P(n) at each prefill context is the published TTFT minus
  the front end's delay at that context.

The corrections are refined by predicting every cell through ``predict`` (the engine model in
simulated time) until the predictions agree with the report; ``compare`` reports the residual
per cell and metric. numpy is imported here only, never on the serve path.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from speedmatrix.sim.predict import over_capacity, predict_decode, predict_prefill
from speedmatrix.sim.profile import Profile

METRICS = ("total_tok_s", "per_request_tok_s", "ttft_ms", "tbt_ms")


class CalibrationError(ValueError):
    """The report cannot be fitted (contradicting statuses, no valid cells...)."""


@dataclass
class Mismatch:
    phase: str
    context_tokens: int
    concurrency: int
    metric: str
    published: Any
    predicted: Any
    rel_error: float | None

    def __str__(self) -> str:
        err = "n/a" if self.rel_error is None else f"{self.rel_error:+.2%}"
        return (
            f"{self.phase} ctx={self.context_tokens} C={self.concurrency} {self.metric}: "
            f"published {self.published} predicted {self.predicted} ({err})"
        )


def _blocks_needed(cell: dict[str, Any], max_out: int, block_size: int) -> int:
    return cell["concurrency"] * -(-(cell["context_tokens"] + max_out) // block_size)


def fit_kv_blocks(
    cells: list[dict[str, Any]], max_out: int, block_size: int, max_model_len: int | None
) -> int:
    """num_gpu_blocks in the middle of the interval the statuses allow."""
    decode = [c for c in cells if c["phase"] == "decode"]
    valid = [_blocks_needed(c, max_out, block_size) for c in decode if c["status"] == "valid"]
    over = [
        _blocks_needed(c, max_out, block_size) for c in decode if c["status"] == "over_capacity"
    ]
    lo = (max(valid) + 1) if valid else 2
    if max_model_len:
        lo = max(lo, -(-max_model_len // block_size) + 1)
    hi = min(over) if over else 2 * lo
    if lo > hi:
        raise CalibrationError(
            f"KV capacity: valid cells need >= {lo} blocks of {block_size} tokens but "
            f"over-capacity cells say < {hi + 1}: the statuses contradict each other"
        )
    return (lo + hi) // 2


def _fit_decode(cells: list[dict[str, Any]]) -> tuple[float, float, float]:
    import numpy as np

    rows, target = [], []
    for c in cells:
        tbt = c["tbt_ms"] / 1000.0
        b = c["concurrency"]
        kv = b * (c["context_tokens"] + (c["output_tokens"] or 0) / (2 * b))
        rows.append([1.0 / tbt, (b - 1) / tbt, kv / tbt])
        target.append(1.0)
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(target), rcond=None)
    base, per_seq, per_kv = (float(x) for x in coef)
    if per_seq < 0 or per_kv < 0:  # keep the model physical; the corrections do the rest
        per_seq, per_kv = max(per_seq, 0.0), max(per_kv, 0.0)
    return max(base, 1e-4), per_seq, per_kv


def _max_model_len(run: dict[str, Any]) -> int | None:
    if run.get("max_model_len"):
        return int(run["max_model_len"])
    m = re.search(r"--max-model-len[ =](\d+)", run.get("launch_command") or "")
    return int(m.group(1)) if m else None


def calibrate(
    text: str,
    *,
    source: str | None = None,
    block_size: int = 16,
    name: str | None = None,
    iterations: int = 12,
    tolerance: float = 0.005,
) -> Profile:
    """A profile that reproduces the report's matrix (see the module docstring)."""
    from speedmatrix.report.parse import parse_report

    parsed = parse_report(text, source)
    run, cells = parsed.run, parsed.cells
    max_out = int(run.get("max_output_tokens") or 4096)
    window = float(run.get("measure_s") or 30.0)
    prefill = [c for c in cells if c["phase"] == "prefill" and c["status"] == "valid"]
    decode = [c for c in cells if c["phase"] == "decode" and c["status"] == "valid"]
    if not prefill or not decode:
        raise CalibrationError("the report needs valid prefill and decode cells to calibrate")
    mml = _max_model_len(run)
    blocks = fit_kv_blocks(cells, max_out, block_size, mml)
    # The server's own max-model-len, as vLLM was launched (the plan sends the largest prefill
    # as max_model_len - 1, since vLLM refuses a prompt of max_model_len tokens); without a
    # launch command, the largest published context is the least the server admitted.
    sim_mml = mml or max(c["context_tokens"] for c in cells)
    base, per_seq, per_kv = _fit_decode(decode)

    correction = {(c["context_tokens"], c["concurrency"]): 1.0 for c in decode}
    delay_ms = {
        (c["context_tokens"], c["concurrency"]): max(c["ttft_ms"] - c["tbt_ms"], 0.0)
        for c in decode
    }
    pf = {c["context_tokens"]: c["ttft_ms"] / 1000.0 for c in prefill}
    decode_by_key = {(c["context_tokens"], c["concurrency"]): c for c in decode}
    desc = (
        f"Calibrated by `speedmatrix sim calibrate` from {source or 'a published report'}. "
        f"KV blocks fitted from the Over-capacity boundary (block size {block_size} assumed); "
        f"max_model_len {sim_mml} = "
        f"{'the launch command' if mml else 'the largest published context'}'s."
    )

    def build() -> Profile:
        points = sorted(pf.items())
        mono, last = [], 0.0
        for n, t in points:
            last = max(t, last + 1e-6)
            mono.append((n, last))
        return Profile(
            name=name or (run.get("served_model") or "calibrated"),
            description=desc,
            calibrated=True,
            source=source,
            served_model_name=run.get("served_model") or "sim-model",
            model=run.get("model") or run.get("served_model") or "sim/model",
            version=run.get("engine_version") or "0.0.0+sim",
            max_model_len=sim_mml,
            max_num_seqs=max(256, max(c["concurrency"] for c in cells)),
            max_num_batched_tokens=8192,
            vocab_size=163840,
            block_size=block_size,
            num_gpu_blocks=blocks,
            prefill_points=mono,
            decode_base_s=base,
            decode_per_seq_s=per_seq,
            decode_per_kv_token_s=per_kv,
            decode_correction=[(k[0], k[1], f) for k, f in sorted(correction.items())],
            # Any forward pass reads all the weights: a step of a few prefill tokens costs about
            # what a one-sequence decode step does (this also keeps TTFT insensitive to how a
            # client spaces its first requests by a few milliseconds).
            min_step_s=base,
            first_token_delay_ms=[(k[0], k[1], ms) for k, ms in sorted(delay_ms.items())],
        )

    profile = build()
    log: list[float] = []
    for _ in range(iterations):
        worst = 0.0
        for (ctx, b), c in decode_by_key.items():
            pred = predict_decode(profile, ctx, b, window_s=window, max_output=max_out)
            correction[(ctx, b)] *= c["tbt_ms"] / pred["tbt_ms"]
            delay_ms[(ctx, b)] = max(delay_ms[(ctx, b)] + c["ttft_ms"] - pred["ttft_ms"], 0.0)
            worst = max(worst, abs(pred["tbt_ms"] / c["tbt_ms"] - 1))
            worst = max(worst, abs(pred["ttft_ms"] / c["ttft_ms"] - 1))
        profile = build()
        for c in prefill:
            pred = predict_prefill(profile, c["context_tokens"])
            pf[c["context_tokens"]] += (c["ttft_ms"] - pred["ttft_ms"]) / 1000.0
            worst = max(worst, abs(pred["ttft_ms"] / c["ttft_ms"] - 1))
        profile = build()
        log.append(worst)
        if worst < tolerance:
            break
    profile.raw = {"calibration_worst_error_by_iteration": log}
    return profile


def _rel(pub: Any, pred: Any) -> float | None:
    if pub is None or pred is None or pub == 0:
        return None
    return pred / pub - 1.0


def compare(
    profile: Profile, text: str, *, source: str | None = None
) -> tuple[list[dict[str, Any]], list[Mismatch]]:
    """Predict every cell of the report; return the rows (published, predicted, error)."""
    from speedmatrix.report.parse import parse_report

    parsed = parse_report(text, source)
    max_out = int(parsed.run.get("max_output_tokens") or 4096)
    window = float(parsed.run.get("measure_s") or 30.0)
    rows: list[dict[str, Any]] = []
    for cell in parsed.cells:
        ctx, b = cell["context_tokens"], cell["concurrency"]
        if cell["phase"] == "prefill":
            pred = predict_prefill(profile, ctx)
        else:
            pred = predict_decode(profile, ctx, b, window_s=window, max_output=max_out)
        for metric in ("status", *METRICS):
            pub, got = cell.get(metric), pred.get(metric)
            err = None if metric == "status" else _rel(pub, got)
            rows.append(
                Mismatch(cell["phase"], ctx, b, metric, pub, got, err).__dict__
                | {"ok": (pub == got) if metric == "status" else _close(pub, got)}
            )
    bad = [Mismatch(**{k: v for k, v in r.items() if k != "ok"}) for r in rows if not r["ok"]]
    return rows, bad


def _close(pub: Any, pred: Any, tol: float = 0.05) -> bool:
    if pub is None:
        return True  # not published for this cell (e.g. per-request tok/s of a prefill)
    if pred is None:
        return False
    return math.isclose(pred, pub, rel_tol=tol)


def over_capacity_for(profile: Profile, context: int, concurrency: int, max_out: int) -> bool:
    """Re-exported for callers that only import calibrate."""
    return over_capacity(profile, context, concurrency, max_out)
