"""A real S3-compatible server on loopback for the tests: moto's standalone server.

Started as a subprocess (``python -m moto.server``) on 127.0.0.1 on a free port, like the sshd
fixture, never moto's in-process mock: the warehouse's writers are other processes (landing
workers, Celery workers) and talk HTTP to it as they would to S3 or MinIO, including the
conditional ``PUT`` (``If-None-Match: *``) that Delta commits rely on. The fixtures in
tests/conftest.py start it once per session and give each test a bucket of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

CREDENTIALS = {
    # moto accepts any; these name nothing real
    "AWS_ACCESS_KEY_ID": "speedmatrix-test",
    "AWS_SECRET_ACCESS_KEY": "speedmatrix-test-secret",
    "AWS_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    log: Path
    pid: int = 0
    """The server's process id, also its process group's (it is started in a session of its own)."""

    def env(self) -> dict[str, str]:
        """The standard AWS environment every S3 client (and the warehouse) reads."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}

    def new_bucket(self) -> str:
        """A fresh bucket (a unique name): a test's warehouse never sees another's objects."""
        name = f"wh-{uuid.uuid4().hex[:16]}"
        reply = requests.put(f"{self.endpoint}/{name}", timeout=30)
        reply.raise_for_status()
        return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_s3_server(timeout_s: float = 60.0) -> Iterator[S3Server]:
    """moto's server on a free loopback port until the block ends; waits until it answers."""
    port = _free_port()
    log = Path(tempfile.mkdtemp(prefix="speedmatrix-moto-")) / "moto.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {proc.returncode}: {log.read_text()}")
            try:
                if requests.get(f"{endpoint}/", timeout=2).status_code < 500:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto server did not answer on {endpoint} in {timeout_s} s")
            time.sleep(0.1)  # polling for the server to answer, not a fixed wait
        yield S3Server(endpoint, log, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # anything it started, in its group
            os.killpg(proc.pid, signal.SIGKILL)
