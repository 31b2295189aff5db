"""The run page's colours, one place for the HTML tables and the SVG charts.

Why these: the page must read for a reader with red-green colour blindness, and a colour must
mean one thing. Two scales, each stated on the page (``CHANGE_LEGEND``, ``THROUGHPUT_LEGEND``):

- change against the baseline: diverging around zero, orange = worse, purple = better
  (ColorBrewer PuOr, colour-blind safe), an unchanged 0.0% a neutral grey (never a yellow that
  reads as a warning), full colour at ±``CHANGE_FULL_PCT`` and beyond. Direction-aware:
  callers pass the change with "better" positive (a lower TTFT is better);
- absolute throughput: one hue (ColorBrewer Blues), light = slower, dark = faster. It only
  says how fast a cell is; low concurrency is slower by nature and is not "bad", so no red.

Text on a coloured cell is black or white, whichever contrasts more (WCAG luminance); pure
black, because with a softer dark grey the mid tones (luminance ~0.2) reach 4.5:1 with neither.
"""

from __future__ import annotations

import itertools

CHANGE_FULL_PCT = 20.0
NEUTRAL = "#f7f7f7"
EMPTY = "#ffffff"
_CHANGE_STOPS = (
    (-1.0, (0xE6, 0x61, 0x01)),
    (-0.5, (0xFD, 0xB8, 0x63)),
    (0.0, (0xF7, 0xF7, 0xF7)),
    (0.5, (0xB2, 0xAB, 0xD2)),
    (1.0, (0x5E, 0x3C, 0x99)),
)
_THROUGHPUT_STOPS = (
    (0.0, (0xEF, 0xF3, 0xFF)),
    (0.5, (0x6B, 0xAE, 0xD6)),
    (1.0, (0x21, 0x71, 0xB5)),
)
WORSE, BETTER = "#e66101", "#5e3c99"
TEXT_DARK, TEXT_LIGHT = "#000000", "#ffffff"

CHANGE_LEGEND = (
    "Change against the baseline: orange = worse, purple = better, grey = unchanged (0.0%); "
    f"full colour at ±{CHANGE_FULL_PCT:g}% and beyond. For TTFT and time between tokens lower "
    "is better, so a lower latency is purple too. Orange/purple reads with red-green colour "
    "blindness."
)
THROUGHPUT_LEGEND = (
    "Colour: total tok/s in one hue, light = slowest to dark blue = fastest among this run's "
    "valid cells. It says how fast a cell is, not whether it is good: compare with the "
    "baseline for that."
)


def _hex(rgb: tuple[float, float, float]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*(round(c) for c in rgb))


def _interpolate(stops: tuple, x: float) -> str:
    x = min(stops[-1][0], max(stops[0][0], x))
    for (x0, c0), (x1, c1) in itertools.pairwise(stops):
        if x <= x1:
            t = (x - x0) / (x1 - x0) if x1 > x0 else 0.0
            return _hex(tuple(a + (b - a) * t for a, b in zip(c0, c1, strict=True)))
    return _hex(stops[-1][1])


def change_colour(better_pct: float | None) -> str:
    """The diverging colour of a change in percent, "better" positive; None: no colour."""
    if better_pct is None:
        return EMPTY
    return _interpolate(_CHANGE_STOPS, better_pct / CHANGE_FULL_PCT)


def throughput_colour(fraction: float | None) -> str:
    """The one-hue colour of a throughput, 0 = this run's slowest, 1 = its fastest."""
    if fraction is None:
        return EMPTY
    return _interpolate(_THROUGHPUT_STOPS, fraction)


def luminance(colour: str) -> float:
    """WCAG relative luminance of ``#rrggbb``."""
    rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two colours (1 to 21)."""
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_colour(background: str) -> str:
    """Black or white text, whichever contrasts more with `background`."""
    dark, light = contrast(background, TEXT_DARK), contrast(background, TEXT_LIGHT)
    return TEXT_DARK if dark >= light else TEXT_LIGHT


# Categorical series (the Pareto view's recipes / hardware / commits): Okabe-Ito's
# colour-blind-safe set, each with its own marker too, so two series differ in shape as well as
# colour; the frontier is black. Cycles after eight series.
SERIES_COLOURS = (
    "#0072b2",
    "#e69f00",
    "#009e73",
    "#cc79a7",
    "#56b4e9",
    "#d55e00",
    "#999999",
    "#f0e442",
)
SERIES_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
FRONTIER = "#000000"


def series_style(index: int) -> tuple[str, str]:
    """(colour, matplotlib marker) of the index-th series."""
    return (
        SERIES_COLOURS[index % len(SERIES_COLOURS)],
        SERIES_MARKERS[index % len(SERIES_MARKERS)],
    )
