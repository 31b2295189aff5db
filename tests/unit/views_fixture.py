"""A warehouse of one model on two configurations (and another model), built from records
(no matrix is run): what the Pareto view, the cost column and the comparison page are tested
on (#34 items 11-13)."""

from __future__ import annotations

import datetime as dt

import factories

from speedmatrix.store.warehouse import Warehouse

MODEL = "moonshotai/Kimi-K2.7"
RTX, H200 = "sim/kimi-rtx-x8", "sim/kimi-h200-x4"
RTX_GPU, H200_GPU = "RTX PRO 6000 Blackwell Server Edition", "H200 SXM"
CONCURRENCIES = (1, 2, 4, 8)
CONTEXTS = ((8192, "8K"), (65536, "64K"))


def run_row(run_id: str, recipe: str, gpu: str, gpus: int, day: int, commit: str, model=MODEL):
    return factories.run_row(
        run_id,
        recipe_id=recipe,
        trigger="nightly",
        started_at=dt.datetime(2026, 11, day, 2, 0, tzinfo=dt.UTC),
        finished_at=dt.datetime(2026, 11, day, 2, 40, tzinfo=dt.UTC),
        engine_version="0.32.0",
        engine_commit=commit,
        hardware_gpu=gpu,
        hardware_gpu_count=gpus,
        model=model,
        served_model=model.split("/")[-1],
        window_s=30.0,
        max_output_tokens=4096,
    )


def cells_for(per_request_1: float, decay: float, over: tuple = ()):
    """Decode cells whose per-request tok/s falls with concurrency (decay per doubling) and
    whose total grows: a real curve, so the frontier is not a single point. `over`: cells
    (tokens, concurrency) that are over capacity."""
    cells = [factories.prefill_cell(8192, total_tok_s=per_request_1 * 100, ttft_ms=1300.0)]
    for tokens, _label in CONTEXTS:
        slow = 0.7 if tokens > 8192 else 1.0
        for i, c in enumerate(CONCURRENCIES):
            if (tokens, c) in over:
                cells.append(factories.decode_cell(tokens, c, status="over_capacity"))
                continue
            per = per_request_1 * slow * decay**i
            cells.append(
                factories.decode_cell(
                    tokens,
                    c,
                    total_tok_s=per * c,
                    per_request_tok_s=per,
                    ttft_ms=90.0,
                    tbt_ms=1000.0 / per,
                    measured_s=30.0,
                )
            )
    return cells


def land_views(root) -> Warehouse:
    """rtx-1 (8 GPUs), h200-1 (4 GPUs, faster per GPU at high load), rtx-2 (a later commit of
    the RTX recipe, 10% faster), and one run of another model."""
    wh = Warehouse(str(root))
    wh.land_run(run_row("rtx-1", RTX, RTX_GPU, 8, 10, "a" * 40), cells_for(60.0, 0.85), [])
    wh.land_run(
        run_row("h200-1", H200, H200_GPU, 4, 11, "a" * 40),
        cells_for(50.0, 0.9, over={(65536, 8)}),
        [],
    )
    wh.land_run(run_row("rtx-2", RTX, RTX_GPU, 8, 12, "c" * 40), cells_for(66.0, 0.85), [])
    wh.land_run(
        run_row("other-1", "sim/other", H200_GPU, 8, 12, "a" * 40, model="org/Other"),
        cells_for(40.0, 0.9),
        [],
    )
    return wh


PRICES_YAML = f"""currency: USD
per_gpu_hour:
  {RTX_GPU.upper()}: 2.0
  "H200   SXM": 4.5
"""
