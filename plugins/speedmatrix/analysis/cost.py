"""Cost per million output tokens, from the deployment's price per GPU-hour.

Why the deployment's: a price is a fact of where the hardware runs (a cloud list price, an
internal rate), not of a run; a run's conf never sets one (the same rule as secrets and
trusted URLs). The deployment names a file in ``SPEEDMATRIX_GPU_PRICES`` (YAML or JSON)::

    currency: USD            # optional, default USD: only a label
    per_gpu_hour:            # GPU model, as the runs table's hardware_gpu names it
      RTX PRO 6000 Blackwell Server Edition: 1.85
      H200 SXM: 3.60

Without the variable, or for hardware the file does not price, there is no cost: no column,
no number, never a made-up default. A file that cannot be read or holds a price that is not
a positive number is a deployment error: PriceError names it (the pages log it once and show
no cost rather than a wrong one).

Read with limits, as any file a deployment names: at most MAX_PRICES_BYTES, YAML without
aliases (an alias bomb of a few hundred bytes expands to gigabytes), a price finite, positive
and at most MAX_PRICE, the currency a short label.

cost per 1M output tokens = price per GPU-hour x GPUs / (3600 s x total output tok/s) x 1e6
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from speedmatrix.errors import InputError
from speedmatrix.settings import Settings, settings

PRICES_ENV = "SPEEDMATRIX_GPU_PRICES"
MAX_PRICES_BYTES = 64 * 1024
"""A prices file is a few lines per GPU model; past this it is not one."""
MAX_PRICE = 1000.0
"""The most a GPU-hour may cost (in the file's currency): list prices are a few units; a
price of 1e300 printed 400-digit costs."""
MAX_COST = 1e9
"""The largest cost per million tokens a page prints: past it, a figure is no cost."""
_CURRENCY = re.compile(r"[^\W\d]{1,8}|[$€£¥]")


class PriceError(InputError):
    """The deployment's price file cannot be used (unreadable, not a mapping, a bad price)."""


def _key(gpu: Any) -> str:
    return " ".join(str(gpu).split()).casefold()


@dataclass(frozen=True)
class Prices:
    """Prices per GPU-hour by GPU model (matched without regard to case or spacing)."""

    per_gpu_hour: Mapping[str, float] = field(default_factory=dict)
    currency: str = "USD"
    source: str = ""

    def _table(self) -> dict[str, float]:
        return {_key(k): v for k, v in self.per_gpu_hour.items()}

    def for_gpu(self, gpu: Any) -> float | None:
        if gpu is None or (isinstance(gpu, float) and math.isnan(gpu)):
            return None
        return self._table().get(_key(gpu))

    def for_run(self, run: Mapping[str, Any]) -> float | None:
        """The price per GPU-hour of the run's hardware (hardware_gpu), or None."""
        return self.for_gpu(run.get("hardware_gpu"))

    def digest(self) -> str:
        """What a page's cost was computed from: a site page is rendered again when it changes."""
        body = json.dumps([self.currency, sorted(self._table().items())])
        return hashlib.sha1(body.encode()).hexdigest()[:12]


def _read_yaml(path: str) -> Any:
    """The file's YAML, read with limits: its size, and no aliases (a reference to an anchor
    is refused where it is met, before anything is expanded)."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(f"an alias (*name) at {mark}: aliases are not allowed here")
            return super().compose_node(parent, index)

    try:
        with open(path, "rb") as fh:
            body = fh.read(MAX_PRICES_BYTES + 1)
        if len(body) > MAX_PRICES_BYTES:
            raise PriceError(
                f"{PRICES_ENV}={path}: larger than {MAX_PRICES_BYTES // 1024} KiB: "
                "not a prices file"
            )
        return yaml.load(body.decode("utf-8"), Loader=NoAliases)  # a SafeLoader
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PriceError(f"{PRICES_ENV}={path}: cannot be read: {first}") from None


def load_prices(environ: Mapping[str, str] | None = None) -> Prices | None:
    """The deployment's prices (``SPEEDMATRIX_GPU_PRICES``), or None when it sets none."""
    s = settings() if environ is None else Settings.from_env(environ)
    if s.gpu_prices is None:
        return None
    path = str(s.gpu_prices)
    data = _read_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("per_gpu_hour"), dict):
        raise PriceError(f"{PRICES_ENV}={path}: needs a mapping per_gpu_hour: {{GPU: price}}")
    prices: dict[str, float] = {}
    for gpu, price in data["per_gpu_hour"].items():
        ok = isinstance(price, int | float) and not isinstance(price, bool)
        if not ok or not math.isfinite(price) or not 0 < price <= MAX_PRICE:
            raise PriceError(
                f"{PRICES_ENV}={path}: price of {str(gpu)[:60]!r} must be > 0 and at most "
                f"{MAX_PRICE:g} per GPU-hour, got {str(price)[:40]}"
            )
        prices[str(gpu)] = float(price)
    currency = data.get("currency") or "USD"
    if not isinstance(currency, str) or not _CURRENCY.fullmatch(currency):
        raise PriceError(
            f"{PRICES_ENV}={path}: currency must be a short label (USD, EUR, $), "
            f"got {str(currency)[:40]!r}"
        )
    return Prices(per_gpu_hour=prices, currency=currency, source=path)


def cost_per_million(
    total_tok_s: Any, gpu_count: Any, price_per_gpu_hour: float | None
) -> float | None:
    """Cost of a million output tokens at `total_tok_s` on `gpu_count` GPUs; None without a
    price, a GPU count or a throughput (a cell that did not measure has no cost)."""
    try:
        tok_s, gpus = float(total_tok_s), float(gpu_count)
    except (TypeError, ValueError):
        return None
    if price_per_gpu_hour is None or not (tok_s > 0 and gpus > 0) or math.isnan(tok_s):
        return None
    return price_per_gpu_hour * gpus / (3600.0 * tok_s) * 1e6


def fmt_cost(value: float | None, currency: str = "USD") -> str:
    """``$1.23`` (USD) or ``1.23 EUR``; ``—`` for none, and for a figure that is not a cost
    (not finite, negative, past MAX_COST)."""
    if value is None or not math.isfinite(value) or not 0 <= value <= MAX_COST:
        return "—"
    digits = 2 if value >= 0.1 else 3
    return f"${value:,.{digits}f}" if currency == "USD" else f"{value:,.{digits}f} {currency}"
