"""How late the simulator's event loop runs: timer, queue and I/O lag.

One job: measuring the server's own event loop, so a benchmark can tell the simulator's
lateness from the client's (reported in ``/sim/state``; see :class:`LagMonitor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any


class _LagProbe(asyncio.DatagramProtocol):
    """Receives stamped datagrams: 8 bytes, the sender's CLOCK_MONOTONIC in ns, big-endian."""

    def __init__(self, sink: deque[float]):
        self.sink = sink

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if len(data) == 8 and addr[0] in ("127.0.0.1", "::1"):
            sent = int.from_bytes(data, "big")
            self.sink.append(max(0, time.monotonic_ns() - sent) / 1e9)


class LagMonitor:
    """Event-loop lag, three ways; keeps the last 20,000 samples of each.

    - timer lag: how late a 5 ms sleep wakes. libuv keeps its clock and its timeouts in whole
      milliseconds, so a timer fires up to ~1 ms early or late of the time asked for even on
      an idle loop (an idle uvloop's 5 ms sleeps here: -0.9 to +1.6 ms): this figure has a
      floor near 1 ms at p99 that no work of the simulator's is in.
    - queue lag: how long a callback made ready now waits to run (``sleep(0)`` round trip):
      the work already queued ahead of it, i.e. how long the loop is blocked.
    - I/O lag: how long an event from outside waits for the loop, which is what a client
      sees: another process sends a datagram stamped with CLOCK_MONOTONIC to UDP
      ``<host>:<port>`` (the HTTP port's number; benchmarks/sim_bench.py does, every 5 ms) and
      the loop's read callback takes the difference (same clock, nanoseconds). No samples
      when nobody sends.
    All are wall clock: on a machine whose CPUs are busy with other processes they include the
    time the process waited to be scheduled.
    """

    def __init__(self, period_s: float = 0.005):
        self.period = period_s
        self.samples: deque[float] = deque(maxlen=20_000)
        self.queue: deque[float] = deque(maxlen=20_000)
        self.io: deque[float] = deque(maxlen=20_000)
        self._task: asyncio.Task | None = None
        self._probe: asyncio.DatagramTransport | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def listen(self, host: str, port: int) -> None:
        """Open the I/O-lag probe's UDP socket; a port that cannot be bound means no probe."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            self._probe, _ = await loop.create_datagram_endpoint(
                lambda: _LagProbe(self.io), local_addr=(host, port)
            )

    async def _run(self) -> None:
        clock = time.perf_counter  # uvloop's loop.time() only has millisecond resolution
        while True:
            t = clock()
            await asyncio.sleep(self.period)
            t1 = clock()
            self.samples.append(max(0.0, t1 - t - self.period))
            await asyncio.sleep(0)
            self.queue.append(clock() - t1)

    def stop(self) -> None:
        if self._task:
            self._task.cancel()
        if self._probe is not None:
            self._probe.close()

    def reset(self) -> None:
        self.samples.clear()
        self.queue.clear()
        self.io.clear()

    @staticmethod
    def _summary(values: deque[float]) -> dict[str, float | int | None]:
        s = sorted(values)
        if not s:
            return {"samples": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}

        def q(p: float) -> float:
            return s[min(len(s) - 1, int(p * len(s)))] * 1000.0

        return {"samples": len(s), "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": s[-1] * 1000}

    def summary(self) -> dict[str, float | int | None]:
        return self._summary(self.samples)

    def queue_summary(self) -> dict[str, float | int | None]:
        return self._summary(self.queue)

    def io_summary(self) -> dict[str, float | int | None]:
        return self._summary(self.io)
