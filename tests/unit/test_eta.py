"""The run's time left (#44 item 10): estimated from what the remaining cells will cost (a
decode cell's warm-up grows with its context and concurrency, a prefill cell's time with its
context), within 20% of the real time left from the third cell on; checked with an injected
clock over a matrix whose cells cost what the simulator's do (prefill time superlinear in the
context; a decode cell's warm-up the prefill of every stream). The first prefill cell says it
is prefill; a decode cell's warm-up shows as warm-up, not 0 tok/s."""

from __future__ import annotations

import io

from speedmatrix.cli.run import Display

WINDOW = 5.0


# The published reference page's prefill TTFT (include/reference/…rtxpro6k-x8.txt) and its
# decode columns that fit the KV cache: what `make demo`'s simulator reproduces (8K-64K).
TTFT_S = {8192: 1.320, 16384: 2.679, 32768: 5.629, 65536: 12.459}
FITS = {8192: 16, 16384: 8, 32768: 4, 65536: 2}


def matrix() -> list[tuple[dict, dict, float]]:
    """(cell, record, seconds it takes) in plan.run_order's order: per context its prefill
    cell (cold: overhead and its prompt's prefill), then its decode cells C ascending, each
    warming the prompts the cells before it have not (C minus the previous C, one prefill's
    time each) before its window."""
    out = []
    for ctx, t in TTFT_S.items():
        label = f"{ctx // 1024}K"
        cell = {"phase": "prefill", "label": label, "context_tokens": ctx, "concurrency": 1}
        out.append((cell, {"status": "valid", "ttft_ms": t * 1000, "total_tok_s": ctx / t},
                    2.0 + 2 * t))  # fmt: skip
        before = 1
        for c in (1, 2, 4, 8, 16):
            if c > FITS[ctx]:
                break
            warm = max(0, c - before) * t
            before = max(before, c)
            cell = {"phase": "decode", "label": f"{label} x {c}", "context_tokens": ctx,
                    "concurrency": c}  # fmt: skip
            out.append((cell, {"status": "valid", "warmup_s": warm, "total_tok_s": 50.0 * c},
                        1.5 + WINDOW + warm))  # fmt: skip
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_eta_is_within_20_percent_from_the_third_cell_on():
    clock = Clock()
    show = Display({"matrix": {"window_s": WINDOW}}, out=io.StringIO(), clock=clock)
    cells = matrix()
    show.cells = [c for c, _r, _t in cells]
    misses = []
    for i, (cell, record, took) in enumerate(cells):
        cell = dict(cell)  # the task's copy of the cell (XCom), not the plan's object
        show.cell_started(cell)
        for part in (0.0, 0.5):  # at the start of the cell and half-way through it
            clock.now += took * part
            real = sum(t for _c, _r, t in cells[i:]) - took * (0.5 if part else 0.0)
            if i >= 2:
                eta = show.eta_s()
                if abs(eta - real) > 0.2 * real:
                    misses.append(
                        f"cell {i + 1} ({cell['label']}) +{part}: {eta:.0f} s vs {real:.0f} s"
                    )
        clock.now += took * 0.5
        show.cell_done(cell, record)
    assert not misses, misses


def test_the_first_prefill_cell_is_labelled_prefill():
    show = Display({"matrix": {"window_s": WINDOW}}, out=(out := io.StringIO()), clock=Clock())
    cell, record, _took = matrix()[0]
    show.cells = [cell]
    show.cell_started(cell)
    show.cell_done(cell, record)
    assert out.getvalue().startswith("[1/1] prefill 8K: ")


def test_a_warming_decode_cell_shows_warm_up_not_zero_tok_s():
    from speedmatrix.cli.run import rate_text

    assert rate_text("decode", None) == "warm-up" and rate_text("decode", 0.0) == "warm-up"
    assert rate_text("decode", 1234.4) == "1,234 tok/s"
    assert rate_text("prefill", 0.0) == "0 tok/s"
