"""Plain TCP forwarding from the bridge's address to the API server on loopback.

The API server binds 127.0.0.1 only (nothing of the test cluster listens beyond loopback); a pod's
network namespace cannot reach the host's loopback, so this forwarder listens on the bridge address
(gateway:port, reachable from pods and from this host only) and copies bytes both ways. TLS passes
through untouched: the serving certificate names the gateway address.
"""

from __future__ import annotations

import contextlib
import socket
import threading


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


class TcpForwarder:
    """listen (host, port) -> connect target; `close()` stops accepting (open streams finish)."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.create_server(listen, reuse_port=False)
        self.address = self.sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._serve, name="kwt-apiproxy", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        client.close()
        upstream.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=5)
