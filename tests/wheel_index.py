"""A loopback stand-in for vLLM's per-commit PEP 503 wheel index, for the tests of
provisioning and of upstream.wheels (no network)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Route = Callable[[str], tuple[int, str]]
"""path -> (HTTP status, body)."""


def wheel_link(sha: str, variant: str = "cu130") -> str:
    """A page body listing one vLLM wheel of `sha`, as the index lists it."""
    return (
        f'<a href="vllm-0.33.0.dev1+g{sha[:9]}.{variant}-cp38-abi3-manylinux_2_28_x86_64.whl">w</a>'
    )


@contextmanager
def serve_index(route: Route) -> Iterator[str]:
    """Serve `route` on 127.0.0.1 (GET with the body, HEAD without); yield the base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self._answer(body=True)

        def do_HEAD(self):
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            code, text = route(self.path)
            data = text.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
