"""A real HTTP server on loopback that plays the remote end of ``audio_url`` fetches, attackers included.

Paths: ``/audio`` (the payload), ``/same-origin`` (redirect to /audio), ``/other-origin`` (redirect to
the same port under the name ``localhost``: another host to an allow-list of ``127.0.0.1``),
``/loop`` (redirects to itself), ``/big`` (declares a size over any small cap), ``/undeclared`` (no
Content-Length, streams until close), ``/slow`` (headers, a few bytes, then the rest only once released),
``/missing`` (404). ``hits`` counts requests per path, so a test can prove a refused target was never
contacted.
"""

from __future__ import annotations

import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SLOW_HOLD_S = 60.0  # upper bound on how long /slow holds a connection when never released


class MediaServer:
    def __init__(self, payload: bytes, big_bytes: int = 1 << 20) -> None:
        self.payload, self.big_bytes = payload, big_bytes
        self.hits: Counter[str] = Counter()
        self.release = threading.Event()  # lets /slow finish
        self.slow_started = threading.Event()  # /slow has sent its headers
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> MediaServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


def _handler(media: MediaServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            media.hits[path] += 1
            route = {
                "/audio": self._audio,
                "/same-origin": lambda: self._redirect("/audio"),
                "/other-origin": lambda: self._redirect(media.url("/audio", host="localhost")),
                "/loop": lambda: self._redirect("/loop"),
                "/big": self._big,
                "/undeclared": self._undeclared,
                "/slow": self._slow,
            }.get(path)
            if route is None:
                self.send_error(404)
                return
            try:
                route()
            except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: refused
                self.close_connection = True

        def _audio(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "audio/wav")
            self.send_header("Content-Length", str(len(media.payload)))
            self.end_headers()
            self.wfile.write(media.payload)

        def _redirect(self, location: str) -> None:
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _big(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(media.big_bytes))
            self.end_headers()
            self.wfile.write(b"\0" * media.big_bytes)

        def _undeclared(self) -> None:  # HTTP/1.0: the body runs until the connection closes
            self.send_response(200)
            self.end_headers()
            for _ in range(media.big_bytes // 4096 + 1):
                self.wfile.write(b"\0" * 4096)
            self.close_connection = True

        def _slow(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(media.payload)))
            self.end_headers()
            self.wfile.write(media.payload[:10])
            self.wfile.flush()
            media.slow_started.set()
            if media.release.wait(SLOW_HOLD_S):
                self.wfile.write(media.payload[10:])

    return Handler
