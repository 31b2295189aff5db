"""Running the simulator: on a background thread (tests, benchmarks) or as the process (CLI).

One job: the event loop around :class:`~speedmatrix.sim.server.SimServer` (uvloop where
importable; ``SPEEDMATRIX_SIM_LOOP=asyncio`` picks the standard loop), binding the port and
the I/O-lag probe, and shutting down cleanly.

In-process use: ``run_in_thread(profile, port=0, api_key=None, time_scale=1.0, faults=None)``
is a context manager yielding the base URL (a ``str`` with ``.server``, the ``SimServer``, and
``.call(fn)`` to run ``fn(server)`` on the server's loop thread).
``serve`` runs until SIGTERM / SIGINT and prints vLLM-like start-up lines to stderr.

In its own process: ``run_in_process(profile, time_scale=1.0)`` is a context manager yielding
the base URL (``.proc``: the ``Popen``) of ``python -m speedmatrix sim serve``, ready once
``/health`` answers and stopped by its process group. Tests and benchmarks whose client must
not share a GIL or an event loop with the server (the load generator's accuracy, the CLI
beside a server) use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web

from speedmatrix.errors import InputError
from speedmatrix.settings import settings
from speedmatrix.sim.faults import Faults
from speedmatrix.sim.profile import Profile, load_profile
from speedmatrix.sim.server import SimServer


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where importable; SPEEDMATRIX_SIM_LOOP=asyncio picks the standard loop."""
    if settings().sim_loop == "asyncio":
        return asyncio.new_event_loop()
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


async def _start(server: SimServer, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    sockets = site._server.sockets if site._server else []
    bound = sockets[0].getsockname()[1] if sockets else port
    await server.lag.listen(host, bound)
    return runner, bound


class SimHandle(str):
    """The base URL, with the server attached for tests (``.server``, ``.call``)."""

    server: SimServer
    loop: asyncio.AbstractEventLoop

    def call(self, fn: Callable[[SimServer], Any], timeout: float = 10.0) -> Any:
        """Run fn(server) on the server's loop thread and return its result."""

        async def run() -> Any:
            self.server.sync()
            return fn(self.server)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)


@contextlib.contextmanager
def run_in_thread(
    profile: Profile | str | dict[str, Any],
    port: int = 0,
    api_key: str | None = None,
    time_scale: float = 1.0,
    faults: Faults | dict[str, Any] | None = None,
    host: str = "127.0.0.1",
    keep_finished: int = 2_000,
) -> Iterator[SimHandle]:
    """Serve the simulator on a background thread; yields its base URL (http://host:port).

    `keep_finished`: how many finished requests keep their ground truth (oldest dropped).
    """
    server = SimServer(
        load_profile(profile),
        api_key=api_key,
        time_scale=time_scale,
        faults=faults,
        keep_finished=keep_finished,
    )
    loop = _new_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}
    stop = asyncio.Event()

    def target() -> None:
        asyncio.set_event_loop(loop)
        try:
            runner, bound = loop.run_until_complete(_start(server, host, port))
        except BaseException as exc:
            state["error"] = exc
            ready.set()
            return
        state["port"] = bound
        ready.set()
        try:
            loop.run_until_complete(stop.wait())
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    thread = threading.Thread(target=target, name="speedmatrix-sim", daemon=True)
    thread.start()
    ready.wait(30)
    if "error" in state:
        raise state["error"]
    handle = SimHandle(f"http://{host}:{state['port']}")
    handle.server = server
    handle.loop = loop
    try:
        yield handle
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


class SimProcess(str):
    """The base URL of a simulator in its own process, with that process (``.proc``)."""

    proc: subprocess.Popen[bytes]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def run_in_process(
    profile: str | os.PathLike[str],
    time_scale: float = 1.0,
    host: str = "127.0.0.1",
    start_timeout_s: float = 60.0,
) -> Iterator[SimProcess]:
    """`speedmatrix sim serve` in a process (and session) of its own; yields its base URL once
    ``/health`` answers. Stopped by its process group (SIGTERM, then SIGKILL after 10 s), so
    nothing it started outlives the block. A process that exits before it answers raises at
    once with the end of its stderr, not after the time-out.
    """
    port = _free_port(host)
    argv = [sys.executable, "-m", "speedmatrix", "sim", "serve", "--profile", str(profile),
            "--host", host, "--port", str(port), "--time-scale", str(time_scale)]  # fmt: skip
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        url = SimProcess(f"http://{host}:{port}")
        url.proc = proc
        try:
            deadline = time.monotonic() + start_timeout_s
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    err.seek(0)
                    tail = err.read().decode(errors="replace")[-2000:]
                    why = f"exited {proc.returncode}" if proc.poll() is not None else "timed out"
                    raise RuntimeError(f"the simulator did not start ({why}):\n{tail}")
                time.sleep(0.1)
            yield url
        finally:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the group (the server's own clean shutdown), SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def serve(
    profile: Profile,
    host: str,
    port: int,
    *,
    api_key: str | None = None,
    time_scale: float = 1.0,
    faults: Faults | dict[str, Any] | None = None,
) -> int:
    """Run until SIGTERM / SIGINT; prints vLLM-like start-up lines (KV cache size) to stderr."""
    server = SimServer(profile, api_key=api_key, time_scale=time_scale, faults=faults)
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    stop = asyncio.Event()

    async def main() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            runner, bound = await _start(server, host, port)
        except OSError as exc:  # port in use, bad address: a one-line CLI error
            raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        import gc

        gc.freeze()  # start-up objects never need collecting: keeps full collections short
        p = profile
        log = sys.stderr
        print(f"INFO speedmatrix sim {p.name}: serving {p.served_model_name}", file=log)
        print(f"INFO GPU KV cache size: {p.kv_cache_tokens:,} tokens", file=log)
        print(
            f"INFO Maximum concurrency for {p.max_model_len:,} tokens per request: "
            f"{p.kv_cache_tokens / p.max_model_len:.2f}x",
            file=log,
        )
        print(f"INFO time scale {time_scale:g} (simulated seconds per wall second)", file=log)
        print(f"INFO Uvicorn running on http://{host}:{bound} (Press CTRL+C to quit)", file=log)
        print("INFO Application startup complete.", file=log, flush=True)
        await stop.wait()
        print("INFO Shutting down", file=log, flush=True)
        await runner.cleanup()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return 0
