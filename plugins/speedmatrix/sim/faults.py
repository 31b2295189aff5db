"""Faults the simulator injects on request, so the load generator's failure paths can be tested.

Set them in a profile (a ``faults:`` mapping), with ``run_in_thread(..., faults=...)`` (a
``Faults`` or a dict), on the command line (``--faults JSON``), or at run time with
``POST /sim/faults`` (JSON; replaces the current set; ``GET /sim/faults`` shows it).

"Every Nth" counts completion requests (``/v1/completions`` and ``/v1/chat/completions``)
from 1 in arrival order; 0 turns a fault off, 1 hits every request.

- ``http_500_every``: the request is answered ``500`` with a vLLM-shaped error body
  (``{"error": {"message", "type": "InternalServerError", "param", "code": 500}}``).
- ``disconnect_every`` / ``disconnect_after_tokens``: a streamed request has its connection
  dropped by the server after that many output tokens were written (no final chunk, no
  ``[DONE]``, no terminating HTTP chunk); the engine aborts the request, as vLLM would.
- ``short_output_every`` / ``short_output_tokens``: the request stops after that many tokens
  although ``max_tokens``/``min_tokens`` asked for more, with ``finish_reason: "length"`` and a
  consistent usage (the silent shortening a load generator must catch by counting).
- ``repetition_every``: the request's text repeats one word (a repetition loop).
- ``echo_every``: the request's text is its own prompt, word for word from its start (a
  model that copies its prompt: what a speculative decoder accepts almost for free).
- ``max_running``: at most this many requests run; the rest queue in the engine, so
  ``vllm:num_requests_waiting`` rises (a server that queues during a window).
- ``metrics_error`` / ``metrics_error_reads``: ``GET /metrics`` answers that HTTP status
  (500: a server whose metrics read failed; 404: a server without ``/metrics``) for the next
  ``metrics_error_reads`` reads after the faults were set (0: every read). The counter starts
  again at each ``POST /sim/faults``, so a test can fail a few reads mid-cell.
- ``slow_steps_pct``: every engine step from now on takes that many percent longer (a host or
  a build that gets slower mid-cell: a trend inside a window, the case an adaptive window must
  not stop early on).
- ``engine_dead``: ``/health`` answers 503, new completion requests get 500 (EngineDeadError)
  and open streams are dropped, as when vLLM's engine core dies.

Preemption is not a switch: give the profile fewer KV blocks than the load needs and the
scheduler preempts by itself (``vllm:num_preemptions_total`` rises).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from speedmatrix.errors import InputError


@dataclass
class Faults:
    http_500_every: int = 0
    disconnect_every: int = 0
    disconnect_after_tokens: int = 8
    short_output_every: int = 0
    short_output_tokens: int = 4
    repetition_every: int = 0
    echo_every: int = 0
    max_running: int | None = None
    metrics_error: int | None = None
    metrics_error_reads: int = 0
    slow_steps_pct: int = 0
    engine_dead: bool = False

    @classmethod
    def coerce(cls, value: Faults | dict[str, Any] | None) -> Faults:
        if value is None:
            return cls()
        if isinstance(value, Faults):
            return value
        if not isinstance(value, dict):
            raise InputError(f"faults must be a mapping, not {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise InputError(f"unknown faults {sorted(unknown)}; known: {sorted(known)}")
        out = cls(**value)
        for f in fields(cls):
            v = getattr(out, f.name)
            if f.name == "engine_dead":
                if not isinstance(v, bool):
                    raise InputError("faults.engine_dead must be true or false")
            elif v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise InputError(f"faults.{f.name} must be a non-negative integer")
        if out.metrics_error is not None and not 400 <= out.metrics_error <= 599:
            raise InputError("faults.metrics_error must be an HTTP error status (400-599)")
        return out

    def hits(self, every: int, index: int) -> bool:
        """Whether the index-th completion request (from 1) is one of every Nth."""
        return every > 0 and index % every == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
