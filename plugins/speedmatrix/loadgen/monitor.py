"""How busy the load generator itself is (docs/measurement.md rule 8).

The event loop's lag (how late a 10 ms sleep wakes up) and the process's CPU time over the
window. A lagging loop stamps chunks late and inflates time-between-tokens; a cell measured by
a saturated client is marked invalid instead of being reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from .stats import percentile


class ClientMonitor:
    def __init__(self, tick_s: float = 0.01) -> None:
        self.tick_s = tick_s
        self.lags: list[float] = []
        self._recording = False
        self._cpu0 = 0.0
        self._wall0 = 0.0
        self.cpu_s: float | None = None
        self.wall_s: float | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        tick = self.tick_s
        clock = time.perf_counter
        while True:
            t = clock()
            await asyncio.sleep(tick)
            if self._recording:
                self.lags.append(clock() - t - tick)

    def begin_window(self) -> None:
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()
        self._recording = True

    def end_window(self) -> None:
        if not self._recording:
            return
        self._recording = False
        self.cpu_s = time.process_time() - self._cpu0
        self.wall_s = time.perf_counter() - self._wall0

    async def stop(self) -> None:
        self.end_window()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def cpu_pct(self) -> float | None:
        if not self.cpu_s or not self.wall_s:
            return None
        return 100.0 * self.cpu_s / self.wall_s

    def lag_ms(self, q: float) -> float | None:
        p = percentile(self.lags, q)
        return None if p is None else max(0.0, p) * 1000.0

    @property
    def longest_stall_s(self) -> float:
        """The longest single stall in the window: one late wake-up of the sampling sleep."""
        return max(self.lags, default=0.0)

    @property
    def lag_p99_ms(self) -> float | None:
        return self.lag_ms(99.0)

    def saturation(self, max_loop_lag_ms: float, max_cpu_pct: float) -> list[str]:
        """Why the client was the bottleneck in the window (rule 8), for every profile's cells.

        p90 lag, not p99: a saturated loop is late most of the time, whereas a p99 spike is
        the OS scheduling something else once (the p99 is still recorded for analysts)."""
        out = []
        lag = self.lag_ms(90.0)
        if lag is not None and lag > max_loop_lag_ms:
            out.append(f"client saturated: event-loop lag p90 {lag:.1f} ms")
        cpu = self.cpu_pct
        if cpu is not None and cpu > max_cpu_pct:
            out.append(f"client saturated: {cpu:.0f}% CPU")
        return out
