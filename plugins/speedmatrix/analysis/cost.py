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
a positive number is a deployment error: PriceError names it (the pages log it and show no
cost rather than a wrong one).

cost per 1M output tokens = price per GPU-hour x GPUs / (3600 s x total output tok/s) x 1e6
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from speedmatrix.errors import InputError
from speedmatrix.settings import Settings, settings

PRICES_ENV = "SPEEDMATRIX_GPU_PRICES"


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


def load_prices(environ: Mapping[str, str] | None = None) -> Prices | None:
    """The deployment's prices (``SPEEDMATRIX_GPU_PRICES``), or None when it sets none."""
    import yaml

    s = settings() if environ is None else Settings.from_env(environ)
    if s.gpu_prices is None:
        return None
    path = str(s.gpu_prices)
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as exc:
        raise PriceError(f"{PRICES_ENV}={path}: cannot be read: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("per_gpu_hour"), dict):
        raise PriceError(f"{PRICES_ENV}={path}: needs a mapping per_gpu_hour: {{GPU: price}}")
    prices: dict[str, float] = {}
    for gpu, price in data["per_gpu_hour"].items():
        ok = isinstance(price, int | float) and not isinstance(price, bool)
        if not ok or not math.isfinite(price) or price <= 0:
            raise PriceError(f"{PRICES_ENV}={path}: price of {gpu!r} must be > 0, got {price!r}")
        prices[str(gpu)] = float(price)
    currency = str(data.get("currency") or "USD")
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
    """``$1.23`` (USD) or ``1.23 EUR``; ``—`` for none."""
    if value is None:
        return "—"
    digits = 2 if value >= 0.1 else 3
    return f"${value:,.{digits}f}" if currency == "USD" else f"{value:,.{digits}f} {currency}"
