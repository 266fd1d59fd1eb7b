"""Hub downloads the agent can end, against loopback servers: one that never answers (stalled) and a
port nobody listens on (failed)."""

import socket
import threading

import pytest

from keepwarm_runtime.agent.download import DownloadFailed, DownloadStalled, download


@pytest.fixture
def silent_hub():
    """A server that accepts connections and never sends a byte (a hung Hub or proxy)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_stalled_download_is_stopped(silent_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", silent_hub)
    with pytest.raises(DownloadStalled, match=r"org/model@main made no progress for 1\.5 s"):
        download("org/model", "main", str(tmp_path), "hf_token", stall_s=1.5)


def test_an_unreachable_hub_fails_with_its_error(tmp_path, monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed again below: nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(DownloadFailed, match="snapshot folder"):
        download("org/model", "main", str(tmp_path), None, stall_s=30)
