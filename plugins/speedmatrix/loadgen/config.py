"""What one cell is asked to measure, and the limits that decide its status.

Plain dataclasses so the Airflow tasks and tests build them directly and call
`asyncio.run(run_decode(cfg))` without a subprocess. The command line is the same fields:
loadgen/cli.py's flag table adds a flag per field, takes its default from here, and writes a
config back as argv (`config_to_argv`, how a remote host's cell is configured). The fields with
no flag are the in-process ones (cli.IN_PROCESS_ONLY).
"""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

from speedmatrix.errors import InputError
from speedmatrix.records import (
    ACTIVE_TOLERANCE,
    DEFAULT_MEASUREMENT_PROFILE,
    DEFAULT_WORKLOAD,
    MEASUREMENT_PROFILES,
    PROMPT_MODES,
    WORKLOADS,
)
from speedmatrix.renames import note


def new_run_tag() -> str:
    """Short unique tag that starts every prompt and salts the prefix cache."""
    return secrets.token_hex(4)


@dataclass
class CellConfig:
    base_url: str
    model: str
    context: int
    api_key: str | None = None
    run_tag: str = field(default_factory=new_run_tag)
    cache_salt: bool = True
    # what the prompts say (docs/measurement.md rule 11): article (a chat conversation asking for a
    # new article, the published pages' workload) or continuation (raw repeated prose)
    workload: str = DEFAULT_WORKLOAD
    # whose definitions measure the cell (records.MEASUREMENT_PROFILES): ours, or the
    # published tool's (loadgen/published.py)
    measurement_profile: str = DEFAULT_MEASUREMENT_PROFILE
    # `published` only: before this cell, the tool's global warm-up (a short request, a hidden
    # 8K prefill, a short C=1 decode at this context: the run's largest); None: none
    global_warmup_context: int | None = None
    # `published` only: the run's largest context; the chars-per-token probe is min(8K, it)
    # as the tool's is (None: this cell's context, or the global warm-up's when larger)
    largest_context: int | None = None
    extra_body: dict[str, Any] | None = None
    # per-phase timeouts (docs/measurement.md rule 9)
    connect_timeout_s: float = 10.0
    first_token_timeout_s: float = 60.0
    first_token_s_per_1k: float = 1.0
    stall_timeout_s: float = 60.0
    idle_timeout_s: float = 60.0
    progress: bool | None = None  # None: on when stderr is a terminal
    # A simulator running `time_scale` times faster than the wall clock: durations asked for
    # and reported are simulated seconds (wall x time_scale), rates per simulated second.
    time_scale: float = 1.0
    # Called with the window's (start, end) on the perf_counter clock (CLOCK_MONOTONIC on
    # Linux, shared by processes), so a caller can line the window up with server-side logs.
    on_window: Callable[[float, float], None] | None = None

    def validate(self) -> None:
        if not self.base_url:
            raise InputError("base_url is required")
        if not self.model:
            raise InputError("model is required")
        if self.context < 2:
            raise InputError(f"context must be at least 2 tokens, got {self.context}")
        for name in ("connect_timeout_s", "first_token_timeout_s", "stall_timeout_s", "time_scale"):
            if getattr(self, name) <= 0:
                raise InputError(f"{name} must be positive")
        if self.measurement_profile not in MEASUREMENT_PROFILES:
            raise InputError(
                f"measurement_profile must be one of {MEASUREMENT_PROFILES}, "
                f"got {self.measurement_profile!r}"
            )
        if self.global_warmup_context is not None and self.measurement_profile != "published":
            raise InputError("the global warm-up is the published profile's")
        if self.workload not in WORKLOADS:
            raise InputError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if not self.run_tag or any(c in self.run_tag for c in "@/\\\0") or len(self.run_tag) > 64:
            raise InputError("run_tag must be 1-64 characters without @ / \\")

    def first_token_timeout(self, queued_prompts: int = 1) -> float:
        """Grows with the context (and with prompts prefilled ahead of this one)."""
        per_prompt = self.first_token_s_per_1k * self.context / 1024.0
        return self.first_token_timeout_s + per_prompt * max(1, queued_prompts)

    @property
    def salt(self) -> str | None:
        return f"speedmatrix-{self.run_tag}" if self.cache_salt else None


PREFILL_SAMPLES = 3
"""Cold prompts a prefill cell measures by default: one TTFT is one draw of the host's moment,
and a verdict needs a spread to judge a change against (the published tool's
standalone prefill repeats its cold prompts too)."""


@dataclass
class PrefillConfig(CellConfig):
    """`samples` cold requests of `context` tokens with max_tokens=1, one after the other."""

    samples: int = PREFILL_SAMPLES

    def validate(self) -> None:
        super().validate()
        if isinstance(self.samples, bool) or not isinstance(self.samples, int):
            raise InputError(f"samples must be an integer, got {self.samples!r}")
        if not 1 <= self.samples <= 20:
            raise InputError(f"samples must be 1..20, got {self.samples}")


def _check_load(cfg: DecodeConfig | BurstConfig) -> None:
    """The load a decode or burst cell asks for: requests, output length, prompt mode."""
    if cfg.concurrency < 1:
        raise InputError(f"concurrency must be at least 1, got {cfg.concurrency}")
    if cfg.max_output_tokens < 2:
        raise InputError("max_output_tokens must be at least 2 (one interval)")
    if cfg.prompt_mode not in PROMPT_MODES:
        raise InputError(f"prompt_mode must be one of {PROMPT_MODES}, got {cfg.prompt_mode!r}")


@dataclass
class DecodeConfig(CellConfig):
    concurrency: int = 1
    window_s: float = 30.0
    max_output_tokens: int = 4096
    prompt_mode: str = "distinct"
    warm_cache: bool = True
    # C=1 only: requests of the cell's prompt with max_tokens=1 after the window, each a TTFT
    # sample beside the window's (one long request fills a C=1 window)
    ttft_probes: int = 2
    # validity limits (docs/measurement.md rules 6-8)
    token_tolerance: float = 0.01
    max_loop_lag_ms: float = 10.0
    max_client_cpu_pct: float = 90.0
    # how often /metrics is read during the window, at most (min_window_readings below)
    metrics_interval_s: float = 0.5
    # a single client stall, or the two /metrics readings' round trips, longer than this share
    # of the window make the cell invalid (the stamps, or the cross-check, cannot be trusted)
    max_blind_fraction: float = 0.10
    # the server's average running requests may differ from C by this share (the cells
    # suite's bound): further off, the cell did not hold C streams
    max_active_deviation: float = ACTIVE_TOLERANCE
    # A decode window gets at least this many /metrics readings (the interval shrinks for
    # short windows): at C = 1 the running gauge reads 0 or 1, and with the 7 readings a 4 s
    # window gets at 0.5 s one reading taken as a request turns over (seen: 0.857, real vLLM)
    # put the average 14% under C. One /metrics costs vLLM ~8-9 ms (measured on this CPU).
    min_window_readings: int = 20
    repetition_check: bool = True
    max_loop_fraction: float = 0.25
    # The copy check (docs/measurement.md rule 11): outputs whose word 8-grams are found in their
    # own prompt more than this share of the time are copying it (stats.CopyCheck), and a
    # speculative decoder accepts copied tokens almost for free: the cell is invalid.
    copy_check: bool = True
    max_copy_share: float = 0.2
    keep_requests: bool = True
    # Adaptive windows (loadgen/adaptive.py): stop once total tok/s's 95% interval is within
    # `adaptive_target_pct` of it, after `adaptive_min_s`, window_s being the cap; a window
    # that trends, queues or preempts runs to the cap. Checkpoints every `window_check_s`
    # (simulated seconds on a simulator), in fixed windows too: every cell records its interval.
    adaptive: bool = False
    adaptive_target_pct: float = 1.0
    adaptive_min_s: float = 5.0
    window_check_s: float = 0.25
    # the old name of window_s (speedmatrix.renames): still read, with a DeprecationWarning
    duration_s: InitVar[float | None] = None

    def __post_init__(self, duration_s: float | None) -> None:
        if duration_s is not None:
            warnings.warn(
                note("DecodeConfig(duration_s=...)", "window_s"), DeprecationWarning, stacklevel=3
            )
            self.window_s = duration_s

    def validate(self) -> None:
        super().validate()
        if self.adaptive:
            if self.measurement_profile == "published":
                raise ValueError(
                    "adaptive windows are not the published tool's: its window is fixed "
                    "(measurement profile 'published')"
                )
            if not self.adaptive_target_pct > 0:
                raise ValueError("adaptive_target_pct must be positive")
            if not 0 < self.adaptive_min_s <= self.window_s:
                raise ValueError(
                    f"adaptive_min_s ({self.adaptive_min_s:g}) must be positive and at most the "
                    f"window's cap, window_s ({self.window_s:g})"
                )
        if not self.window_check_s > 0:
            raise ValueError("window_check_s must be positive")
        _check_load(self)
        if self.window_s <= 0:
            raise InputError(f"window_s must be positive, got {self.window_s}")
        if not 0 < self.max_copy_share <= 1:
            raise InputError("max_copy_share must be in (0, 1]")
        if self.min_window_readings < 1:
            raise InputError("min_window_readings must be at least 1")
        if not 0 <= self.ttft_probes <= 20:
            raise InputError(f"ttft_probes must be 0..20, got {self.ttft_probes}")


@dataclass
class BurstConfig(CellConfig):
    """`concurrency` requests sent at once and measured to their completion (loadgen/burst.py):
    the published tool's request-count ("Burst / E2E") mode with as many requests as it keeps
    in flight. No window: the burst's time runs from its first request sent to its last token."""

    concurrency: int = 1
    max_output_tokens: int = 4096
    prompt_mode: str = "distinct"
    warm_cache: bool = True
    # the longest the burst may run, first request sent to last token (seconds, simulated on a
    # simulator); past it every request still running is cut and the cell fails
    max_burst_s: float = 3600.0
    # validity limits (docs/measurement.md rules 6-8), as a decode cell's
    token_tolerance: float = 0.01
    max_loop_lag_ms: float = 10.0
    max_client_cpu_pct: float = 90.0
    keep_requests: bool = True

    def validate(self) -> None:
        super().validate()
        _check_load(self)
        if self.max_burst_s <= 0:
            raise InputError(f"max_burst_s must be positive, got {self.max_burst_s}")
        if self.measurement_profile != DEFAULT_MEASUREMENT_PROFILE:
            raise InputError("a burst is measured by our definitions only (profile 'default')")
